"""Rope scalings yarn, dynamic and longrope against transformers: the frequencies against its
own rope init functions (bit for bit), and tiny Llama models with each scaling, at positions
past the original length, against its model (test/support/family_checks.py)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from radixlm.srt.layers.rope_scaling import RopeAngles
from radixlm.srt.weights.loader import load_model_config
from test.support.family_checks import HFReference, check_decode_logits, check_greedy, check_logits
from test.support.tiny_models import TINY_DENSE_SHAPE, save_tiny_model

HEAD_DIM, THETA = 16, 10000.0
SHORT = [1.0 + 0.15 * i for i in range(HEAD_DIM // 2)]
LONG = [1.0 + 0.9 * i for i in range(HEAD_DIM // 2)]
# name -> (max_position_embeddings, rope_parameters); the original lengths are small, so that
# short prompts and 32 new tokens run past them.
SCALINGS = {
    "yarn": (64, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn_mscale": (64, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 8, "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 1.0, "truncate": False}),
    "dynamic": (16, {"rope_type": "dynamic", "factor": 4.0}),
    "longrope": (64, {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                      "original_max_position_embeddings": 16}),
}


def _hf_config(name: str):
    from transformers import LlamaConfig

    max_pos, params = SCALINGS[name]
    return LlamaConfig(**dict(TINY_DENSE_SHAPE, max_position_embeddings=max_pos),
                       rope_parameters={**params, "rope_theta": THETA})


@pytest.mark.parametrize("name", SCALINGS)
def test_angles_equal_transformers_rope_init(name):
    """Position p's angles are p x the frequencies transformers computes for a forward whose
    last position is p (the static types: the same frequencies at every p)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _hf_config(name)
    max_pos, params = SCALINGS[name]
    ours = RopeAngles(HEAD_DIM, THETA, dict(params), max_pos)
    init = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    angles = ours.angles(80)
    _, attention = init(cfg)
    assert ours.attention == attention
    for p in range(80):
        if params["rope_type"] == "dynamic" and p >= max_pos:
            inv, _ = init(cfg, seq_len=torch.tensor(p + 1))  # transformers' decode-time recompute
        elif params["rope_type"] == "longrope" and p >= params["original_max_position_embeddings"]:
            inv, _ = init(cfg, seq_len=p + 1)
        else:
            inv, _ = init(cfg)
        assert torch.equal(angles[p], float(p) * inv), f"position {p}"


@pytest.fixture(scope="module")
def scaled_dirs(tmp_path_factory, smollm2_tokenizer) -> dict[str, str]:
    from transformers import LlamaForCausalLM

    return {name: save_tiny_model(LlamaForCausalLM, _hf_config(name), tmp_path_factory.mktemp(name),
                                  smollm2_tokenizer, seed=7 + i) for i, name in enumerate(SCALINGS)}


def test_config_carries_the_scaling(scaled_dirs):
    yarn = load_model_config(scaled_dirs["yarn"])
    assert yarn.rope_scaling["rope_type"] == "yarn" and yarn.context_len == 64  # 16 x 4
    dynamic = load_model_config(scaled_dirs["dynamic"])
    assert dynamic.rope_scaling == {"rope_type": "dynamic", "factor": 4.0} and dynamic.context_len == 64
    longrope = load_model_config(scaled_dirs["longrope"])
    assert longrope.rope_scaling["short_factor"] == SHORT and longrope.context_len == 64


@pytest.mark.parametrize("name", ["yarn", "yarn_mscale"])
def test_yarn_matches_transformers_past_the_original_length(scaled_dirs, name):
    """Static scaling: prompts of 5, 19 and 40 tokens (original length 16), logits and greedy."""
    ref = HFReference(scaled_dirs[name])
    check_logits(scaled_dirs[name], reference=ref)
    # the 40-token prompt and its 32 new tokens run past the served context (64): raise it
    check_greedy(scaled_dirs[name], "plain", reference=ref, server_kw={"context_length": 128})
    check_greedy(scaled_dirs[name], "chunked", reference=ref, server_kw={"context_length": 128})


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_length_dependent_scaling_matches_generate_across_the_limit(scaled_dirs, name):
    """Prompts inside the limit (16), then 32 tokens past it: every decode step's logits and the
    greedy tokens are transformers' generate's (each new position rotated as the newest token of
    its forward, the cached keys as they were), through the model and through the engine."""
    ref = HFReference(scaled_dirs[name])
    # Shorter than the limit: transformers' dynamic rope keeps the frequencies of the longest
    # sequence it has seen and resets them only for a forward shorter than the limit, so a
    # prompt of exactly 16 tokens would start from the previous generation's.
    prompts = [ref.clear_prompt(n, seed=n) for n in (4, 11, 15)]
    # one HF forward over a whole sequence (check_logits' reference) rotates as generate does
    # only while the sequence stays inside the limit
    check_logits(scaled_dirs[name], prompts[:2], reference=ref)
    check_decode_logits(scaled_dirs[name], prompts, reference=ref)
    for variant in ("plain", "cached_prefix"):
        check_greedy(scaled_dirs[name], variant, prompts, reference=ref)


def test_a_long_prompt_differs_from_one_hf_forward_as_documented(scaled_dirs):
    """Past the limit, one HF forward rotates every position with the long factors; radixlm keeps
    the short ones below the limit (so that a cached key never changes): the logits of the
    positions below the limit then agree, those past it do not."""
    path = scaled_dirs["longrope"]
    ref = HFReference(path)
    ids = ref.clear_prompt(30, seed=3)
    from test.support.family_checks import load_radixlm
    from test.support.model_harness import ModelHarness

    h = ModelHarness(load_radixlm(path))
    got = h.extend([h.new_request()], [ids])[0]
    short = ref.logits(ids[:16])
    torch.testing.assert_close(got[:16], short, atol=1e-4, rtol=0)
    assert (got[16:] - ref.logits(ids)[16:]).abs().max() > 1e-3


def _edited_copy(model_dir: str, dest, **changes) -> str:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    dest.mkdir()
    (dest / "config.json").write_text(json.dumps(dict(cfg, **changes)))
    return str(dest)


@pytest.mark.parametrize("what", ["rope", "architecture"])
def test_an_unsupported_model_is_one_line_naming_the_supported(tmp_path, tiny_llama_dir, what):
    """From the config, in the Engine (before any process starts) and on the command line
    (one line on stderr, exit code 2)."""
    import subprocess
    import sys

    from radixlm import Engine

    if what == "rope":
        d = _edited_copy(tiny_llama_dir, tmp_path / "m", rope_parameters={"rope_type": "mrope", "rope_theta": 1e4})
        said = "rope scaling type 'mrope' is not supported (supported: default, linear, llama3, yarn, dynamic, longrope)"
    else:
        d = _edited_copy(tiny_llama_dir, tmp_path / "m", architectures=["GPT2LMHeadModel"])
        said = "architecture 'GPT2LMHeadModel' is not supported (supported: "
    with pytest.raises(ValueError) as e:
        load_model_config(d)
    assert "\n" not in str(e.value) and said in str(e.value)
    if what == "architecture":
        assert "LlamaForCausalLM, " in str(e.value) and "Phi3ForCausalLM" in str(e.value)
    with pytest.raises(ValueError, match="is not supported"):
        Engine(model_path=d, dtype="float32")
    cli = subprocess.run([sys.executable, "-m", "radixlm", "generate", "hi", "--model-path", d], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 2 and cli.stdout == ""
    assert cli.stderr.strip().count("\n") == 0 and said in cli.stderr


def test_older_config_spellings():
    """`rope_scaling` with `type` (and Phi-3's early `su`), the top-level original length taking
    precedence, as transformers reads them."""
    from radixlm.srt.layers.rope_scaling import hf_rope_scaling

    scaling, partial = hf_rope_scaling({"rope_scaling": {"type": "su", "short_factor": SHORT, "long_factor": LONG,
                                                         "original_max_position_embeddings": 8},
                                        "original_max_position_embeddings": 16, "max_position_embeddings": 64,
                                        "partial_rotary_factor": 0.5})
    assert scaling == {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                       "original_max_position_embeddings": 16} and partial == 0.5
    assert hf_rope_scaling({"rope_scaling": {"type": "yarn", "factor": 2.0}, "max_position_embeddings": 32})[0] == \
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
    assert hf_rope_scaling({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}) == (None, 1.0)
