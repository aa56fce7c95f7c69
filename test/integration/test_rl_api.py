"""The RL rollout API through the Engine: weight updates vs Hugging Face, versions, logprobs,
partial rollouts, memory hand-back."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from radixlm import Engine

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 17, 300, 4000, 12], list(range(1000, 1030)), [42] * 7 + [7, 8, 9]]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    eng = Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=8192, debug_check_integrity=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def _hf_greedy(model, prompt, n):
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _hf_logprobs(model, seq):
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)


def _perturbed(hf, seed):
    g = torch.Generator().manual_seed(seed)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
             "model.layers.0.self_attn.k_proj.weight", "lm_head.weight", "model.norm.weight"]
    sd = hf.state_dict()
    return {n: sd[n] + 0.3 * torch.randn(sd[n].shape, generator=g) for n in names}


def test_update_from_tensor_matches_hf_and_bumps_version(engine, hf):
    before = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 8, **GREEDY},
                             return_logprob=True)
    v0 = before[0]["meta_info"]["weight_version"]
    new = _perturbed(hf, 1)
    res = engine.update_weights_from_tensor(new)
    assert res["num_tensors"] == len(new) and res["weight_version"] != v0
    hf.load_state_dict(new, strict=False)
    after = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 8, **GREEDY},
                            return_logprob=True)
    for p, o in zip(PROMPTS, after):
        assert o["meta_info"]["weight_version"] == res["weight_version"]
        assert o["output_ids"] == _hf_greedy(hf, p, 8)
        ref = _hf_logprobs(hf, p + o["output_ids"])
        want = [ref[len(p) - 1 + i, t].item() for i, t in enumerate(o["output_ids"])]
        assert [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] == pytest.approx(want, abs=1e-4)
        assert o["meta_info"]["cached_tokens"] == 0  # no KV of the old weights is served
    assert any(a["output_ids"] != b["output_ids"] for a, b in zip(before, after))
    got = engine.get_weights_by_name("model.layers.0.self_attn.k_proj.weight", truncate_size=3)
    assert torch.allclose(torch.tensor(got), new["model.layers.0.self_attn.k_proj.weight"][:3])


def test_bad_update_leaves_weights_unchanged(engine):
    name = "model.layers.1.mlp.up_proj.weight"
    before = engine.get_weights_by_name(name, 2)
    ok = torch.zeros(torch.tensor(engine.get_weights_by_name(name, 10**6)).shape)
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.update_weights_from_tensor([(name, ok), ("model.norm.weight", torch.ones(3))])
    with pytest.raises(ValueError, match="unknown weight"):
        engine.update_weights_from_tensor([(name, ok), ("model.nope.weight", torch.ones(3))])
    with pytest.raises(ValueError, match="floating"):
        engine.update_weights_from_tensor([(name, ok.long())])
    assert engine.get_weights_by_name(name, 2) == before


def test_sampled_logprobs_match_reference(engine, hf):
    p = PROMPTS[1]
    out = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 6, "temperature": 1.0, "seed": 3},
                          return_logprob=True, top_logprobs_num=2)
    ref = _hf_logprobs(hf, p + out["output_ids"])  # hf carries the same (perturbed) weights now
    want = [ref[len(p) - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]
    assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(want, abs=1e-4)


def test_request_in_flight_during_update_runs_on_one_version(engine, hf):
    chunks = []
    stream = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 60, **GREEDY}, stream=True)
    chunks.append(next(stream))
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", engine.update_weights_from_tensor(
        _perturbed(hf, 2), weight_version="v-two")))
    t.start()
    deadline = time.monotonic() + 120
    while engine.get_server_info()["front_end"]["writers_waiting"] != 1:
        assert time.monotonic() < deadline, "the update never came to wait"
        time.sleep(0.01)
    assert "r" not in result  # the update waits for the running request (the open stream)
    chunks.extend(stream)
    t.join(30)
    assert result["r"]["weight_version"] == "v-two"
    versions = {c["meta_info"]["weight_version"] for c in chunks}
    assert len(versions) == 1 and "v-two" not in versions
    assert sum(len(c["output_ids"]) for c in chunks) == 60
    assert engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})["meta_info"][
        "weight_version"] == "v-two"
    hf.load_state_dict(_perturbed(hf, 2), strict=False)  # keep the reference in step with the engine


def test_partial_rollouts_resume_from_cache(engine):
    prompts = [[(i * 7 + j * 13) % 40000 + 3 for j in range(12 + i % 5)] for i in range(64)]
    params = {"max_new_tokens": 150, **GREEDY}
    full = engine.generate(input_ids=prompts, sampling_params=params)
    assert engine.flush_cache()

    async def rollout():
        tasks = [asyncio.ensure_future(engine.async_generate(input_ids=p, sampling_params=params)) for p in prompts]
        await asyncio.sleep(0.4)
        engine.abort_request(abort_all=True)
        return await asyncio.gather(*tasks)
    partial = asyncio.run(rollout())
    assert any(o["meta_info"]["finish_reason"]["type"] == "abort" for o in partial)
    resumed_prompts, rest = [], []
    for p, o in zip(prompts, partial):
        resumed_prompts.append(p + o["output_ids"])
        rest.append({"max_new_tokens": 150 - len(o["output_ids"]), **GREEDY})
    resumed = engine.generate(input_ids=resumed_prompts, sampling_params=rest)
    for f, p, o, r in zip(full, prompts, partial, resumed):
        assert o["output_ids"] + r["output_ids"] == f["output_ids"]
        if o["output_ids"]:
            assert r["meta_info"]["cached_tokens"] >= len(p) + len(o["output_ids"]) - 1


def test_release_and_resume_memory(engine):
    before = engine.get_server_info()["kv_pool_bytes"]
    ref = engine.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": 5, **GREEDY})
    engine.release_memory_occupation()
    assert engine.get_server_info()["kv_pool_bytes"] == 0
    with pytest.raises(ValueError, match="release"):
        engine.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": 5})
    engine.resume_memory_occupation()
    assert engine.get_server_info()["kv_pool_bytes"] == before
    again = engine.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": 5, **GREEDY})
    assert again["output_ids"] == ref["output_ids"]
    assert again["meta_info"]["cached_tokens"] == 0  # the pool came back empty


def test_update_from_disk_and_namespaced_cache(engine, hf, tmp_path):
    new = _perturbed(hf, 5)
    hf.load_state_dict(new, strict=False)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    import os
    import shutil
    for f in os.listdir(engine.server_args.model_path):
        if "token" in f or f.endswith(".jinja"):
            shutil.copy(os.path.join(engine.server_args.model_path, f), tmp_path)
    warm = engine.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 2})
    res = engine.update_weights_from_disk(str(tmp_path), flush_cache=False)
    out = engine.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 8, **GREEDY})
    assert out["meta_info"]["weight_version"] == res["weight_version"] != warm["meta_info"]["weight_version"]
    assert out["meta_info"]["cached_tokens"] == 0  # same prompt, but old-version KV is not shared
    assert out["output_ids"] == _hf_greedy(hf, PROMPTS[1], 8)
    with pytest.raises(ValueError):
        engine.update_weights_from_disk(str(tmp_path / "missing"))
