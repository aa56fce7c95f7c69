"""The served model name, the model's sampling defaults and what /get_model_info shows, over
HTTP; the same defaults in the Engine; `radixlm generate` against transformers' greedy output."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
import torch

import test.support.server as server_support
from test.support.server import ServerProcess

GEN_CONFIG = {"temperature": 0.7, "top_k": 1, "eos_token_id": [2]}  # top_k 1: greedy unless a request says not
NAME = "TinyLlama-Chat"
USER, ADMIN = "user-key", "admin-key"


def _checkpoint(src: str, dst) -> str:
    """The tiny checkpoint under a model-like directory name, with a generation config."""
    path = shutil.copytree(src, dst / NAME)
    cfg_path = os.path.join(path, "generation_config.json")
    cfg = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}
    with open(cfg_path, "w") as f:
        json.dump({**cfg, **GEN_CONFIG}, f)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir, tmp_path_factory) -> str:
    return _checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("named"))


class KeyedServer(ServerProcess):
    def info(self) -> dict:
        return httpx.get(self.base + "/get_server_info", timeout=10.0, headers=_auth(ADMIN)).json()


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("named_server") / "server.log")
    with pytest.MonkeyPatch.context() as mp:  # no --served-model-name: the default name is under test
        mp.setattr(server_support, "SERVER_ARGS", ("--dtype", "float32", "--max-total-tokens", "4096"))
        srv = KeyedServer(checkpoint, log, "--api-key", USER, "--admin-api-key", ADMIN, "--log-level", "debug")
    try:
        srv.wait_ready()
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def _chat(server, model: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "ignore_eos": True,
            **kw}
    return httpx.post(server.base + "/v1/chat/completions", json=body, headers=_auth(USER), timeout=120)


def test_the_model_is_served_under_its_name_and_the_old_names(server, checkpoint):
    models = httpx.get(server.base + "/v1/models", headers=_auth(USER), timeout=10).json()
    assert [m["id"] for m in models["data"]] == [NAME]
    for name in (NAME, checkpoint):
        r = _chat(server, name)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == NAME
    r = _chat(server, "SmolLM2-135M-Instruct")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_requests_take_the_generation_configs_defaults(server):
    greedy = _chat(server, NAME, temperature=0).json()["choices"][0]["message"]["content"]
    assert _chat(server, NAME).json()["choices"][0]["message"]["content"] == greedy  # top_k 1 from the model
    sampled = [_chat(server, NAME, top_k=-1, seed=s).json()["choices"][0]["message"]["content"] for s in (1, 2)]
    assert greedy not in sampled  # the request's own top_k wins


def test_model_info_shows_paths_to_admins_only(server, checkpoint):
    user = httpx.get(server.base + "/get_model_info", headers=_auth(USER), timeout=10).json()
    admin = httpx.get(server.base + "/get_model_info", headers=_auth(ADMIN), timeout=10).json()
    assert "model_path" not in user and "tokenizer_path" not in user
    assert admin["model_path"] == checkpoint and admin["tokenizer_path"] == checkpoint
    assert user["served_model_name"] == admin["served_model_name"] == NAME
    assert user["default_sampling_params"] == {"temperature": 0.7, "top_k": 1}


def test_a_finished_request_is_logged_at_debug(server):
    r = httpx.post(server.base + "/generate", headers=_auth(USER), timeout=120,
                   json={"text": "log me", "rid": "logged-request", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
    lines = [x for x in server.log().splitlines() if "request logged-request finished" in x]
    assert len(lines) == 1, server.log()[-3000:]
    assert "finished (length): 2 prompt tokens (0 cached), 2 completion tokens" in lines[0]


def test_the_engine_takes_the_same_defaults(checkpoint):
    from radixlm.srt.engine import Engine

    params = {"max_new_tokens": 6, "ignore_eos": True}
    with Engine(model_path=checkpoint, dtype="float32", max_total_tokens=4096) as engine:
        greedy = engine.generate("defaults", {**params, "temperature": 0})["output_ids"]
        assert engine.generate("defaults", params)["output_ids"] == greedy
        assert engine.generate("defaults", {**params, "top_k": -1, "seed": 3})["output_ids"] != greedy
        # a batch long enough for the progress bar: every result as without it
        outs = engine.generate(["defaults"] * 16, params)
        assert [o["output_ids"] for o in outs] == [greedy] * 16


def test_generate_command_matches_transformers_greedy(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The capital of France is"
    proc = subprocess.run([sys.executable, "-m", "radixlm", "generate", prompt, "--model-path", tiny_llama_dir,
                           "--dtype", "float32", "--no-chat", "--temperature", "0", "--max-new-tokens", "5",
                           "--json"], capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    want = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None)[0, ids.shape[1]:].tolist()
    assert out["output_ids"][:len(want)] == want[:len(out["output_ids"])]
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) <= 5
    streamed = subprocess.run([sys.executable, "-m", "radixlm", "generate", prompt, "--model-path", tiny_llama_dir,
                               "--dtype", "float32", "--no-chat", "--temperature", "0", "--max-new-tokens", "5",
                               "--stream"], capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                              timeout=600)
    assert streamed.returncode == 0 and streamed.stdout == out["text"] + "\n", streamed.stderr


@pytest.mark.slow
def test_the_default_gguf_is_served_as_its_model_name(default_model_path, tmp_path):
    """The README's first request: `radixlm serve` on the default GGUF, asked for
    "SmolLM2-135M-Instruct" (and by its older file-stem name)."""
    if os.path.basename(default_model_path) != "SmolLM2-135M-Instruct.Q4_1.gguf":
        pytest.skip("another model than the default GGUF")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_support, "SERVER_ARGS", ())
        srv = ServerProcess(default_model_path, str(tmp_path / "server.log"))
    try:
        srv.wait_ready(timeout=600)
        models = httpx.get(srv.base + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
        for name in ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1"):
            r = httpx.post(srv.base + "/v1/chat/completions", timeout=300,
                           json={"model": name, "messages": [{"role": "user", "content": "Say hi"}],
                                 "max_tokens": 8})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "SmolLM2-135M-Instruct" and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        if srv.proc.poll() is None:
            srv.stop()
