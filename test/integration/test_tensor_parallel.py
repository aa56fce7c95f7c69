"""Tensor parallelism through the Engine with gloo (real rank processes, one thread each) on a
tiny model shaped like SmolLM2's attention (9 query heads over 3 KV heads: at tp 2 the groups
split 6+3 / 2+1, unevenly).

Token identity with tp 1 in float32: the split changes only the summation order of the two
row-parallel all-reduces per layer (the vocabulary-parallel embedding is exact, and every rank
samples from the same gathered logits), so logprobs move by ~1e-6; the test checks that the
reference's greedy choices are never that close to a tie (`_assert_clear_margins`), which makes
token identity a property of the model, not luck."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from radixlm import Engine
from test.engine_checks import assert_idle_and_empty, check_storm_outcomes, random_prompt, run_storm

GREEDY = {"temperature": 0, "ignore_eos": True}
# A small pool (retractions in the storm), small chunks (chunked prefill), a host KV tier
# (HiCache: its copies are acked only once done on every rank), integrity after every step.
ARGS = dict(dtype="float32", max_total_tokens=900, max_running_requests=24, chunked_prefill_size=32,
            schedule_conservativeness=0.05, enable_hierarchical_cache=True, debug_check_integrity=True)
LOGPROB_TOL = 1e-4


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


def _assert_clear_margins(result: dict, min_gap: float = 1e-3) -> None:
    """Every greedy step of the reference beats the runner-up by far more than TP's rounding."""
    for step in result["meta_info"]["output_top_logprobs"]:
        (best, _, _), (second, _, _) = step[0], step[1]
        assert best - second > min_gap, f"near-tie in the reference ({best} vs {second}): pick other prompts"


def _same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    ma, mb = a["meta_info"], b["meta_info"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        la = [lp for lp, _, _ in ma.get(key) or [] if lp is not None]
        lb = [lp for lp, _, _ in mb.get(key) or [] if lp is not None]
        assert la == pytest.approx(lb, abs=LOGPROB_TOL)
    for ta, tb in zip(ma.get("output_top_logprobs") or [], mb.get("output_top_logprobs") or []):
        assert [t for _, t, _ in ta] == [t for _, t, _ in tb]


def test_layout_and_capacity(tp2):
    info = tp2.get_server_info()
    assert info["tp_size"] == 2 and info["max_total_num_tokens"] == ARGS["max_total_tokens"] and info["overlap"]
    tp2.check_integrity()  # every rank checks its own pools and tree; any rank's failure is raised


def test_greedy_identical_to_tp1(tp1, tp2):
    check_greedy_identical(tp1, tp2)


def check_greedy_identical(tp1: Engine, tp2: Engine) -> None:
    """Prefill, chunked prefill (prompts past 32 tokens), decode, logprobs (prompt and output,
    top 3), n > 1 and streaming: the same tokens as tp 1."""
    prompts = [random_prompt(1, 7), random_prompt(2, 95), random_prompt(3, 33), random_prompt(4, 64)]
    kw = dict(input_ids=prompts, sampling_params={"max_new_tokens": 24, **GREEDY}, return_logprob=True,
              logprob_start_len=0, top_logprobs_num=3)
    ref, got = tp1.generate(**kw), tp2.generate(**kw)
    for a, b in zip(ref, got):
        _assert_clear_margins(a)
        _same(a, b)
        assert len(b["meta_info"]["input_token_logprobs"]) == len(a["meta_info"]["input_token_logprobs"])
    family = dict(input_ids=prompts[1], sampling_params={"max_new_tokens": 12, "n": 3, **GREEDY})
    fam1, fam2 = tp1.generate(**family), tp2.generate(**family)
    assert [o["output_ids"] for o in fam2] == [o["output_ids"] for o in fam1] == [got[1]["output_ids"][:12]] * 3
    chunks = list(tp2.generate(input_ids=prompts[3], sampling_params={"max_new_tokens": 24, **GREEDY},
                               stream=True))
    assert [t for c in chunks for t in c["output_ids"]] == ref[3]["output_ids"]
    again = tp2.generate(input_ids=prompts[1], sampling_params={"max_new_tokens": 24, **GREEDY})
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == ref[1]["output_ids"]


def test_structured_output_identical_to_tp1(tp1, tp2):
    """Grammar requests leave the queue only once compiled on every rank; each rank masks and
    advances its own matcher the same way."""
    pytest.importorskip("xgrammar")
    from test.integration.test_structured_engine import REGEXES, SCHEMA
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


def check_storm(tp1: Engine, tp2: Engine) -> None:
    """Requests on a small pool (retractions, HiCache backing up and loading back), random
    aborts, pauses (in_place, retract) and an abort_all, with integrity checked after every step
    on every rank: survivors equal the undisturbed tp 1 run, aborted requests a prefix of it."""
    rng = random.Random(5)
    specs = [(f"s{i}", random_prompt(200 + i % 20, rng.randrange(5, 40)), rng.randrange(10, 60),
              3 if i % 11 == 0 else 1) for i in range(40)]
    ref_outs = tp1.generate(input_ids=[p for _, p, _, _ in specs],
                            sampling_params=[{"max_new_tokens": n, "temperature": 0} for _, _, n, _ in specs])
    reference = {rid: o["output_ids"] for (rid, _, _, _), o in zip(specs, ref_outs)}

    async def one(rid, prompt, n, fam):
        res = await tp2.async_generate(input_ids=prompt, rid=rid,
                                       sampling_params={"max_new_tokens": n, "temperature": 0, "n": fam})
        return [(r["meta_info"]["id"], r["output_ids"], r["meta_info"]) for r in (res if fam > 1 else [res])]

    async def chaos():
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + 120  # the pool overflows once enough requests decode
        while (await loop.run_in_executor(None, tp2.get_server_info))["num_retractions"] == 0:
            assert time.monotonic() < deadline, "the pool was meant to be small enough to force retractions"
            await asyncio.sleep(0.02)
        for k in range(16):
            await asyncio.sleep(rng.random() * 0.1)
            if k in (4, 8):
                await loop.run_in_executor(None, tp2.pause_generation, "retract" if k == 8 else "in_place")
                await asyncio.sleep(0.1)
                await loop.run_in_executor(None, tp2.continue_generation)
            else:
                tp2.abort_request(rng.choice(specs)[0])
        tp2.abort_request(abort_all=True)

    results = run_storm(one, specs, chaos)
    aborted = check_storm_outcomes(results, reference, sum(f for *_, f in specs))
    assert aborted > 0 and len(results) - aborted > 0
    assert tp2.get_server_info()["hicache"]["backed_up_tokens_total"] > 0  # acks agreed across ranks
    assert_idle_and_empty(tp2)


def _perturbed(model_dir: str, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    full = load_file(os.path.join(model_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight", "model.norm.weight"]
    return {n: full[n] + 0.05 * torch.randn(full[n].shape, generator=g) for n in names}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_trainer(rounds: list, world_size: int, group: str, tmp_path, backend: str = "gloo",
                   device: str = "cpu") -> tuple[subprocess.Popen, int]:
    path = tmp_path / f"{group}.pt"
    torch.save(rounds, path)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "test.integration.tp_trainer", f"tcp://127.0.0.1:{port}",
                             str(world_size), group, str(path), backend, device], stdout=subprocess.PIPE, text=True)
    return proc, port


def test_trainer_broadcast_reaches_every_rank(tp1, tp2, tiny_llama_tp_dir, tmp_path):
    check_trainer_broadcast(tp1, tp2, tiny_llama_tp_dir, tmp_path)


def check_trainer_broadcast(tp1: Engine, tp2: Engine, model_dir: str, tmp_path, backend: str = "gloo",
                            device: str = "cpu") -> None:
    """A trainer process joins the engine's ranks in a gloo group and broadcasts new weights;
    each rank keeps its shard. The next generation is the tp 1 engine's after the same update
    (through update_weights_from_tensor), the old prefix cache is not reused, the getter
    gathers the shards, and a bad broadcast changes nothing (the trainer still completes).
    Then update_weights_from_tensor and update_weights_from_disk under TP."""
    prompt = random_prompt(60, 40)
    params = {"max_new_tokens": 16, **GREEDY}
    before = tp2.generate(input_ids=prompt, sampling_params=params, return_logprob=True)
    assert tp2.generate(input_ids=prompt, sampling_params=params)["meta_info"]["cached_tokens"] > 0
    new = _perturbed(model_dir, 1)
    bad = {"model.layers.0.self_attn.v_proj.weight": torch.zeros(3, 3),
           "model.layers.1.input_layernorm.weight": torch.ones(144)}
    trainer, port = _start_trainer([list(new.items()), list(bad.items())], 3, "wug", tmp_path, backend, device)
    try:
        joined = tp2.init_weights_update_group("127.0.0.1", port, 1, 3, "wug", backend)
        assert joined["success"]
        tp2.pause_generation("abort")  # the RL sequence: pause, update, continue
        res = tp2.update_weights_from_distributed(list(new), [str(t.dtype) for t in new.values()],
                                                  [list(t.shape) for t in new.values()], group_name="wug")
        tp2.continue_generation()
        assert res["num_tensors"] == len(new) and res["weight_version"] != before["meta_info"]["weight_version"]
        tp1.update_weights_from_tensor(new)
        after1, after2 = (e.generate(input_ids=prompt, sampling_params=params, return_logprob=True)
                          for e in (tp1, tp2))
        _same(after1, after2)
        moved = [abs(a[0] - b[0]) for a, b in zip(after2["meta_info"]["output_token_logprobs"],
                                                  before["meta_info"]["output_token_logprobs"])]
        assert after2["output_ids"] != before["output_ids"] or max(moved) > 0.01, "the new weights did not arrive"
        assert after2["meta_info"]["cached_tokens"] == 0  # KV of the old weights is never served
        assert after2["meta_info"]["weight_version"] == res["weight_version"]
        for name, tensor in new.items():  # split on dim 0, dim 1, and replicated: gathered whole
            got = torch.tensor(tp2.get_weights_by_name(name, truncate_size=5))
            torch.testing.assert_close(got, tensor[:5], atol=1e-6, rtol=0)
        norm = tp2.get_weights_by_name("model.layers.1.input_layernorm.weight", 10**6)
        with pytest.raises(ValueError, match="shape mismatch"):
            tp2.update_weights_from_distributed(list(bad), ["float32"] * 2, [[3, 3], [144]], group_name="wug")
        assert tp2.get_weights_by_name("model.layers.1.input_layernorm.weight", 10**6) == norm  # all or nothing
        assert trainer.wait(60) == 0, "the trainer must never be left in a broadcast"
        tp2.destroy_weights_update_group("wug")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    # update_weights_from_tensor under TP: full tensors in, each rank keeps its shard
    more = _perturbed(model_dir, 2)
    for eng in (tp1, tp2):
        eng.update_weights_from_tensor(more)
    assert tp2.generate(input_ids=prompt, sampling_params=params)["output_ids"] == \
        tp1.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    # update_weights_from_disk: each rank reads its shards of the original checkpoint again
    for eng in (tp1, tp2):
        eng.update_weights_from_disk(model_dir)
    restored = tp2.generate(input_ids=prompt, sampling_params=params, return_logprob=True)
    _same(restored, before)
    assert restored["meta_info"]["cached_tokens"] == 0
    # an error on one rank only (rank 0 would hold o_proj's bias, which this model lacks) is every rank's
    with pytest.raises(ValueError, match="unknown weight"):
        tp2.get_weights_by_name("model.layers.0.self_attn.o_proj.bias")
    with pytest.raises(ValueError, match="no weight update group"):
        tp2.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[144]], group_name="wug")
    assert_idle_and_empty(tp2)


def test_a_dead_rank_takes_the_engine_down(tp2):
    check_dead_rank(tp2)


def check_dead_rank(tp2: Engine) -> None:
    """Rank 1 killed mid-stream: the caller gets a 500 abort naming the rank, rank 0 stops too
    (it does not wait for its peer), and new requests are refused. Runs last: it kills tp2."""
    stream = tp2.generate(input_ids=random_prompt(9, 10), sampling_params={"max_new_tokens": 1500, **GREEDY},
                          stream=True)
    next(stream)
    os.kill(tp2.procs.procs["scheduler_tp1"].pid, signal.SIGKILL)
    final = list(stream)[-1]["meta_info"]["finish_reason"]
    assert final["type"] == "abort" and final["status_code"] == 500
    assert "tensor-parallel rank 1" in final["message"]
    deadline = time.monotonic() + 10
    while tp2.procs.procs["scheduler"].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tp2.procs.procs["scheduler"].poll() is not None, "rank 0 outlived its peer"
    with pytest.raises(RuntimeError, match="down"):
        tp2.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})


def test_http_weight_sync_and_rank_death(tiny_llama_tp_dir, tmp_path):
    """`serve --tp-size 2`: SGLang's weight-sync routes with a trainer process, the gathered
    getter and a 400 for a malformed request; then a killed rank makes the server exit non-zero
    naming the rank, with its children and IPC directory gone."""
    import httpx

    from test.integration.test_http_server import ServerProcess
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
        new = _perturbed(tiny_llama_tp_dir, 3)
        trainer, port = _start_trainer([list(new.items())], 3, "wug_http", tmp_path)
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
        _assert_clear_margins(a)
        _same(a, b)
