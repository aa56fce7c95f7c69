"""The command line's parts that need no engine: served names, generation-config defaults, the
batch file format, resume, the token progress estimate, --help, preflight checks and the
first-use notices."""
from __future__ import annotations

import json
import socket

import pytest
import torch

from radixlm.srt.cli.batch_format import BadLine, parse_line, read_resume_state
from radixlm.srt.cli.main import build_parser
from radixlm.srt.cli.preflight import UserError, check_model_path, check_port_free
from radixlm.srt.progress import TokenProgress
from radixlm.srt.served_name import default_served_model_name, model_name_aliases
from radixlm.srt.weights.generation_config import (eos_token_ids, model_sampling_defaults,
                                                   with_sampling_defaults)


# ---------------------------------------------------------------------------- served name
@pytest.mark.parametrize("path, name", [
    ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("/m/Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
    ("/m/qwen2-0_5b-instruct-q8_0.gguf", "qwen2-0_5b-instruct"),
    ("/m/model.IQ3_XXS.gguf", "model"),
    ("/m/phi-2.F16.gguf", "phi-2"),
    ("/m/Q4_0.gguf", "Q4_0"),  # nothing would be left: the stem stays
    ("/m/tiny-model.gguf", "tiny-model"),
    ("/models/TinyLlama-Chat/", "TinyLlama-Chat"),
    ("/hub/models--Qwen--Qwen2-0.5B/snapshots/0123456789abcdef", "Qwen/Qwen2-0.5B"),
])
def test_default_served_model_name(path, name):
    assert default_served_model_name(path) == name


def test_the_file_names_stay_aliases():
    path = "/m/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model_name_aliases(path, "chat") == {"chat", "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1",
                                                "SmolLM2-135M-Instruct.Q4_1.gguf", path}


# ---------------------------------------------------------------------------- generation config
def test_sampling_defaults_fill_only_what_a_request_leaves_unset(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": None, "do_sample": True, "eos_token_id": [2, 7],
         "max_length": 99}))
    defaults = model_sampling_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.9}
    assert with_sampling_defaults(None, defaults) == defaults
    asked = {"temperature": 0, "top_p": None, "max_new_tokens": 5}
    assert with_sampling_defaults(asked, defaults) == {"temperature": 0, "top_p": 0.9, "max_new_tokens": 5}
    assert asked["top_p"] is None  # not changed in place
    assert with_sampling_defaults([{}, {"top_p": 0.5}], defaults) == [defaults, {"temperature": 0.6, "top_p": 0.5}]
    assert eos_token_ids({"eos_token_id": [2, 7]}) == [2, 7] and eos_token_ids({"eos_token_id": 3}) == [3]


def test_a_default_no_request_could_use_is_dropped(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_p": 0.8}))
    assert model_sampling_defaults(str(tmp_path)) == {"top_p": 0.8}


def test_a_gguf_file_or_a_broken_config_has_no_defaults(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_sampling_defaults(str(gguf)) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert model_sampling_defaults(str(tmp_path)) == {}


# ---------------------------------------------------------------------------- batch format
def _line(**kw) -> str:
    base = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    return json.dumps({**base, **kw})


@pytest.mark.parametrize("raw, custom_id, words", [
    ("{oops", None, "line 3: malformed JSON"),
    ("[1, 2]", None, "expected a JSON object"),
    (_line(custom_id=5), None, "custom_id must be a non-empty string"),
    (_line(method="GET"), "a", "method must be POST"),
    (_line(url="/v1/embeddings"), "a", "url '/v1/embeddings' is not supported"),
    (_line(body=[1]), "a", "body must be a JSON object"),
    (_line(body={"prompt": "x", "stream": True}), "a", "stream is not supported"),
])
def test_bad_lines_name_their_custom_id_when_they_have_one(raw, custom_id, words):
    with pytest.raises(BadLine) as e:
        parse_line(3, raw)
    assert e.value.custom_id == custom_id and words in e.value.message


def test_a_lines_token_bound():
    assert parse_line(1, _line()).max_new_tokens() == 16  # the completions API's default
    assert parse_line(1, _line(body={"prompt": ["x", "y"], "max_tokens": 5, "n": 2})).max_new_tokens() == 20
    chat = {"messages": [], "max_completion_tokens": 7}
    assert parse_line(1, _line(url="/v1/chat/completions", body=chat)).max_new_tokens() == 7
    assert parse_line(1, _line(url="/v1/chat/completions", body={"messages": []})).max_new_tokens() is None


def test_resume_reads_the_answered_ids_and_cuts_a_half_written_line(tmp_path):
    out = tmp_path / "out.jsonl"
    whole = [{"custom_id": "a", "error": None}, {"custom_id": None, "error": {}}, {"custom_id": "b", "error": {}}]
    text = "".join(json.dumps(r) + "\n" for r in whole)
    out.write_text(text + '{"custom_id": "c", "resp')
    state = read_resume_state(str(out))
    assert state.done_ids == {"a", "b"} and state.unnamed_errors == 1
    assert out.read_text() == text
    assert read_resume_state(str(tmp_path / "absent.jsonl")).done_ids == set()


# ---------------------------------------------------------------------------- progress
def test_the_progress_estimate_follows_tokens_not_requests():
    count = [0]
    bar = TokenProgress([100] * 10, lambda: count[0], disable=True)
    assert bar.expected_remaining() == 1000  # nothing finished: the limits
    count[0] = 30
    bar.finish(0, 10)
    bar.finish(1, 10)
    # 8 running requests expected to end like the finished ones (10 each); 10 of theirs are out
    assert bar.expected_remaining() == 8 * 10 - 10
    unknown = TokenProgress([None, 50], lambda: count[0], disable=True)
    assert unknown.expected_remaining() is None  # no made-up ETA
    unknown.finish(1, 20)
    assert unknown.expected_remaining() == 20
    assert unknown.add(None) == 2 and unknown.expected_remaining() == 40
    bar.close()
    unknown.close()


# ---------------------------------------------------------------------------- --help
def _help(*argv: str) -> str:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    return sub[argv[0]].format_help()


def test_generate_help_lists_its_own_options_with_defaults():
    text = " ".join(_help("generate").split())
    for flag in ("--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop", "--chat, --no-chat",
                 "--stream", "--model-path", "--dtype"):
        assert flag in text
    assert "(default: 128)" in text and "generation_config.json, else 1.0" in text
    assert "radixlm serve --help" in text
    for server_only in ("--port", "--api-key", "--max-payload-size", "--hicache-ratio", "--retraction-policy"):
        assert server_only not in text


def test_engine_options_stay_accepted_offline():
    ns = build_parser().parse_args(["generate", "hi", "--chunked-prefill-size", "64", "--no-chat", "--stop", "a",
                                    "--stop", "b"])
    assert ns.chunked_prefill_size == 64 and ns.chat is False and ns.stop == ["a", "b"] and ns.temperature is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--port", "1"])


def test_dtype_help_says_what_auto_picks(monkeypatch):
    import radixlm.srt.weights.loader as loader

    assert "AVX512-BF16" in " ".join(_help("serve").split())
    monkeypatch.setattr(loader, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert loader.resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_flags", lambda: {"avx512f"})
    assert loader.resolve_dtype("auto", "cpu") == torch.float32


# ---------------------------------------------------------------------------- preflight
def test_a_port_in_use_is_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # closed: free again


def test_model_path_mistakes(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        check_model_path(str(tmp_path / "absent.gguf"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model at all")
    with pytest.raises(UserError, match="is not a GGUF file"):
        check_model_path(str(garbage))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UserError, match="architecture 'GPT2LMHeadModel' is not supported"):
        check_model_path(str(tmp_path))


# ---------------------------------------------------------------------------- first-use notices
def test_compiling_the_kernels_says_so(tmp_path, capsys):
    from radixlm.kernels.cpu import build

    build._build("true", tmp_path / "lib.so")  # `true` accepts any arguments: no real compile
    assert "radixlm: compiling the native CPU kernels" in capsys.readouterr().err


def test_dequantizing_a_gguf_says_so_once(tmp_path, monkeypatch, capsys):
    import radixlm.srt.weights.loader as loader

    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "iter_gguf_weights", lambda path, cfg: iter([("w", torch.ones(2))]))
    model = tmp_path / "m.Q4_0.gguf"
    model.write_bytes(b"GGUF")
    first = loader._gguf_weights_cache(str(model), None)
    assert "radixlm: dequantizing m.Q4_0.gguf" in capsys.readouterr().err
    assert loader._gguf_weights_cache(str(model), None) == first
    assert capsys.readouterr().err == ""  # cached: nothing to wait for
