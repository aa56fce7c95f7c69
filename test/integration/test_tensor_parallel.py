"""Tensor parallelism through the Engine with gloo (real rank processes, one thread each) on a
tiny model shaped like SmolLM2's attention (9 query heads over 3 KV heads: at tp 2 the groups
split 6+3 / 2+1, unevenly).

Token identity with tp 1 in float32: the split changes only the summation order of the two
row-parallel all-reduces per layer (the vocabulary-parallel embedding is exact, and every rank
samples from the same gathered logits), so logprobs move by ~1e-6; the test checks that the
reference's greedy choices are never that close to a tie (`assert_clear_margins`), which makes
token identity a property of the model, not luck."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from radixlm import Engine
from test.support.engine_checks import assert_idle_and_empty, random_prompt
from test.support.tp_checks import (ARGS, GREEDY, assert_clear_margins, assert_same, check_dead_rank,
                                    check_greedy_identical, check_storm, check_trainer_broadcast,
                                    perturbed_weights, start_trainer)


@pytest.fixture(scope="module")
def tp1(tiny_llama_tp_dir):
    eng = Engine(model_path=tiny_llama_tp_dir, tp_size=1, **ARGS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tp2(tiny_llama_tp_dir):
    # overlap on: the forward thread's collectives (model group) run beside the scheduler
    # thread's (control group)
    eng = Engine(model_path=tiny_llama_tp_dir, tp_size=2, enable_overlap_schedule=True, **ARGS)
    yield eng
    eng.shutdown()


def test_layout_and_capacity(tp2):
    info = tp2.get_server_info()
    assert info["tp_size"] == 2 and info["max_total_num_tokens"] == ARGS["max_total_tokens"] and info["overlap"]
    tp2.check_integrity()  # every rank checks its own pools and tree; any rank's failure is raised


def test_greedy_identical_to_tp1(tp1, tp2):
    check_greedy_identical(tp1, tp2)


def test_structured_output_identical_to_tp1(tp1, tp2):
    """Grammar requests leave the queue only once compiled on every rank; each rank masks and
    advances its own matcher the same way."""
    pytest.importorskip("xgrammar")
    from test.support.structured import REGEXES, SCHEMA
    params = [{"regex": REGEXES[1], "max_new_tokens": 16, "temperature": 0},
              {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 80, "temperature": 0}]
    prompts = [random_prompt(30, 9), random_prompt(31, 40)]
    ref, got = tp1.generate(input_ids=prompts, sampling_params=params), tp2.generate(input_ids=prompts,
                                                                                     sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    json.loads(got[1]["text"])
    assert tp2.get_server_info()["num_grammar_queue_reqs"] == 0


def test_sampling_keeps_ranks_in_step(tp1, tp2):
    """Sampled tokens come from the same generator state and the same gathered logits on every
    rank, so the ranks never diverge (a diverged batch would stop the engine: the runner
    compares every batch's signature across ranks)."""
    params = {"max_new_tokens": 20, "temperature": 1.0, "top_p": 0.9, "n": 2, "ignore_eos": True}
    outs = tp2.generate(input_ids=[random_prompt(7, 20), random_prompt(8, 5)], sampling_params=params)
    assert len(outs) == 4 and all(len(o["output_ids"]) == 20 for o in outs)
    assert_idle_and_empty(tp2)


def test_timeouts_and_memory_release_on_every_rank(tp2):
    """A per-request timeout is decided on rank 0's clock, so every rank ends the request at the
    same step; memory release and resume run on every rank."""
    out = tp2.generate(input_ids=random_prompt(12, 10), sampling_params={"max_new_tokens": 1500, **GREEDY},
                       timeout=0.5)
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and fr["status_code"] == 503 and out["output_ids"]
    assert_idle_and_empty(tp2)
    tp2.release_memory_occupation()
    tp2.resume_memory_occupation()
    assert len(tp2.generate(input_ids=random_prompt(13, 5), sampling_params={"max_new_tokens": 4})["output_ids"]) <= 4
    assert_idle_and_empty(tp2)


def test_abort_and_retraction_storm(tp1, tp2):
    check_storm(tp1, tp2)


def test_trainer_broadcast_reaches_every_rank(tp1, tp2, tiny_llama_tp_dir, tmp_path):
    check_trainer_broadcast(tp1, tp2, tiny_llama_tp_dir, tmp_path)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_paused_update_under_tp(tp2, tiny_llama_tp_dir, mode):
    """Pause (retract / in_place) -> update -> continue at tp 2, as on one rank
    (docs/cancel_chain.md): the update applies at once while paused, every rank moves the
    paused requests the same way, and meta_info says which weights made which tokens."""
    import threading
    n, prompt = 120, random_prompt(70 if mode == "retract" else 71, 12)
    old = tp2.get_weight_version()
    chunks: list[dict] = []
    stream = tp2.generate(input_ids=prompt, sampling_params={"max_new_tokens": n, **GREEDY}, stream=True)
    reader = threading.Thread(target=lambda: chunks.extend(stream), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while len(chunks) < 3:
        assert time.monotonic() < deadline, "no tokens"
        time.sleep(0.005)
    tp2.pause_generation(mode)
    try:
        res = tp2.update_weights_from_tensor(perturbed_weights(tiny_llama_tp_dir, 3), weight_version=f"tp-{mode}")
    finally:
        tp2.continue_generation()
    reader.join(120)
    assert not reader.is_alive()
    meta = chunks[-1]["meta_info"]
    ids = [t for c in chunks for t in c["output_ids"]]
    assert res["weight_version"] == f"tp-{mode}" and meta["finish_reason"]["type"] == "length" and len(ids) == n
    (v0, s0), (v1, k) = meta["weight_versions"]
    assert (v0, s0, v1) == (old, 0, f"tp-{mode}") and 3 <= k < n
    if mode == "retract":  # recomputed under the new weights, on every rank alike
        assert meta["num_retractions"] >= 1
        redo = tp2.generate(input_ids=prompt + ids[:k], sampling_params={"max_new_tokens": n - k, **GREEDY})
        assert redo["output_ids"] == ids[k:]
    tp2.update_weights_from_disk(tiny_llama_tp_dir)  # the checkpoint again, for the tests after this one
    assert_idle_and_empty(tp2)


def test_a_dead_rank_takes_the_engine_down(tp2):
    check_dead_rank(tp2)


def test_http_weight_sync_and_rank_death(tiny_llama_tp_dir, tmp_path):
    """`serve --tp-size 2`: SGLang's weight-sync routes with a trainer process, the gathered
    getter and a 400 for a malformed request; then a killed rank makes the server exit non-zero
    naming the rank, with its children and IPC directory gone."""
    import httpx

    from test.support.server import ServerProcess
    srv = ServerProcess(tiny_llama_tp_dir, str(tmp_path / "server.log"), "--tp-size", "2")
    trainer = None
    try:
        srv.wait_ready()
        http = httpx.Client(base_url=srv.base, timeout=120.0)
        prompt = random_prompt(70, 30)

        def generate() -> dict:
            r = http.post("/generate", json={"input_ids": prompt, "return_logprob": True,
                                             "sampling_params": {"max_new_tokens": 8, **GREEDY}})
            assert r.status_code == 200, r.text
            return r.json()

        before = generate()
        new = perturbed_weights(tiny_llama_tp_dir, 3)
        trainer, port = start_trainer([list(new.items())], 3, "wug_http", tmp_path)
        r = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": port,
                                                          "rank_offset": 1, "world_size": 3,
                                                          "group_name": "wug_http", "backend": "gloo"})
        assert r.status_code == 200 and r.json()["success"], r.text
        bad = http.post("/update_weights_from_distributed", json={"names": ["model.norm.weight"], "dtypes": [],
                                                                  "shapes": [[144]], "group_name": "wug_http"})
        assert bad.status_code == 400 and "same length" in bad.text
        r = http.post("/update_weights_from_distributed", json={
            "names": list(new), "dtypes": ["float32"] * len(new), "shapes": [list(t.shape) for t in new.values()],
            "group_name": "wug_http", "weight_version": "step-1"})
        assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == "step-1", r.text
        assert trainer.wait(60) == 0
        after = generate()
        assert after["meta_info"]["weight_version"] == "step-1" and after["meta_info"]["cached_tokens"] == 0
        moved = [abs(a[0] - b[0]) for a, b in zip(after["meta_info"]["output_token_logprobs"],
                                                  before["meta_info"]["output_token_logprobs"])]
        assert after["output_ids"] != before["output_ids"] or max(moved) > 0.01
        got = http.post("/get_weights_by_name", json={"name": "model.embed_tokens.weight", "truncate_size": 2})
        torch.testing.assert_close(torch.tensor(got.json()), new["model.embed_tokens.weight"][:2], atol=1e-6, rtol=0)
        assert http.post("/destroy_weights_update_group", json={"group_name": "wug_http"}).json()["success"]

        os.kill(srv.runtime["child_pids"]["scheduler_tp1"], signal.SIGKILL)
        assert srv.proc.wait(30) != 0
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        srv.stop()  # asserts: every child gone, IPC dir removed
    assert "scheduler_tp1 process (tensor-parallel rank 1) exited unexpectedly" in srv.log()


@pytest.mark.slow
def test_default_model_at_tp2(default_model_path):
    """SmolLM2-135M (GGUF, 9 query heads over 3 KV heads, tied embeddings) at tp 2: each rank
    reads its shards of the dequantized GGUF, and greedy float32 tokens equal tp 1's."""
    prompts = [random_prompt(80, 12), random_prompt(81, 40)]
    kw = dict(input_ids=prompts, sampling_params={"max_new_tokens": 16, **GREEDY}, return_logprob=True,
              top_logprobs_num=2)
    outs = {}
    for tp in (1, 2):
        with Engine(model_path=default_model_path, dtype="float32", max_total_tokens=2048, tp_size=tp) as eng:
            outs[tp] = eng.generate(**kw)
    for a, b in zip(outs[1], outs[2]):
        assert_clear_margins(a)
        assert_same(a, b)
