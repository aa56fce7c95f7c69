"""--kv-cache-dtype int8 end to end on the tiny random Llama, per CPU attention backend:
the Engine (real processes) generates, reports the setting, reuses cached prefixes with
identical greedy output, aborts cleanly, and sizes the pool for int8; HiCache copies the
int8 values and their scales byte for byte (checked slot by slot on an in-process scheduler)
and gives the same outputs as a run without it.

Greedy outputs are compared only between int8 runs: the int8 cache changes the logits a
little, and the tiny random model's top-1 margins are too thin to promise equality with a
float cache (benchmark/micro/logits_check.py measures that on the real model)."""
from __future__ import annotations

import pytest
import torch

from radixlm import Engine
from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool
from test.support.engine_checks import (abort_stream_after_three_chunks, assert_idle_and_empty, assert_kv_conserved,
                                random_prompt, run_multiturn)

BACKENDS = ["torch_native", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_ops.available(), reason="native CPU kernels could not be built"))]
GREEDY = {"temperature": 0, "ignore_eos": True}
CAPACITY = 4096
# tiny Llama (test/conftest.py): 2 layers, 2 KV heads, head_dim 64 / 4 = 16
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


@pytest.fixture(scope="module", params=BACKENDS)
def engine(tiny_llama_dir, request):
    eng = Engine(model_path=tiny_llama_dir, dtype="float32", kv_cache_dtype="int8",
                 attention_backend=request.param, max_total_tokens=CAPACITY, chunked_prefill_size=64,
                 debug_check_integrity=True)
    eng.backend = request.param
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def _check_after(request):
    yield
    if "engine" in request.fixturenames:
        assert_kv_conserved(request.getfixturevalue("engine"))


def test_server_info_reports_int8(engine):
    info = engine.get_server_info()
    assert info["kv_cache_dtype"] == "int8"
    assert info["attention_backend"] == engine.backend
    assert info["max_total_num_tokens"] == CAPACITY
    per_token = MHATokenToKVPool.bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, torch.float32, "int8")
    assert per_token == 2 * LAYERS * KV_HEADS * (HEAD_DIM + 4)
    assert info["kv_pool_bytes"] == (CAPACITY + 1) * per_token


def test_batch_greedy_generates_the_requested_lengths(engine):
    prompts = [[1, 5, 9, 100, 2000, 31], random_prompt(1, 40), [7] * 3 + [8] * 20, random_prompt(2, 150)]
    lens = [12, 5, 20, 9]
    outs = engine.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": n, **GREEDY} for n in lens])
    for p, n, o in zip(prompts, lens, outs):
        assert len(o["output_ids"]) == n
        assert all(0 <= t < 49152 for t in o["output_ids"])
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert o["meta_info"]["prompt_tokens"] == len(p)
    # the same batch again: deterministic
    again = engine.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": n, **GREEDY} for n in lens])
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]


def test_prefix_cache_hit_gives_identical_greedy_output(engine):
    engine.flush_cache()
    prompt = random_prompt(3, 150)  # > the 64-token prefill chunk
    first = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 16, **GREEDY})
    second = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 16, **GREEDY})
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= 140
    assert second["output_ids"] == first["output_ids"]
    # a longer prompt through the same prefix: the continuation of the cached one is reused
    longer = engine.generate(input_ids=prompt + first["output_ids"][:8],
                             sampling_params={"max_new_tokens": 8, **GREEDY})
    assert longer["meta_info"]["cached_tokens"] >= 150
    assert longer["output_ids"] == first["output_ids"][8:16]


def test_abort_running_request(engine):
    # its KV went to the tree: the same request again reuses it and agrees token for token
    abort_stream_after_three_chunks(engine, random_prompt(4, 20), "victim")
    assert_idle_and_empty(engine)


def test_int8_pool_holds_more_tokens_in_the_same_memory(tiny_llama_dir):
    from radixlm.hicache.host_pool import available_ram_bytes
    auto_bytes = MHATokenToKVPool.bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, torch.float32)
    # a fraction giving ~4000 float32 tokens: far below the CPU cap of 65536 for both
    frac = 4000 * auto_bytes / available_ram_bytes()
    totals = {}
    for kv in ("auto", "int8"):
        with Engine(model_path=tiny_llama_dir, dtype="float32", kv_cache_dtype=kv, mem_fraction_static=frac,
                    attention_backend="torch_native") as eng:
            info = eng.get_server_info()
            assert info["kv_cache_dtype"] == kv
            totals[kv] = info["max_total_num_tokens"]
    ratio = auto_bytes / MHATokenToKVPool.bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, torch.float32, "int8")
    assert ratio == pytest.approx(3.2)  # 4 bytes x 16 against 16 + 4
    # free RAM moves a little between the two start-ups
    assert totals["int8"] > 0.8 * ratio * totals["auto"], totals


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_backends_are_refused_before_the_pool_is_allocated(tiny_llama_dir, backend):
    from radixlm.config import ServerArgs
    from radixlm.srt.model_runner.runner import ModelRunner
    args = ServerArgs.from_kwargs(model_path=tiny_llama_dir, dtype="float32", device="cpu", kv_cache_dtype="int8",
                                  attention_backend=backend, max_total_tokens=64)
    with pytest.raises(ValueError, match="cpu and torch_native"):
        ModelRunner(args.runner_config())


# ---------------------------------------------------------------- HiCache
def _slot_values(bufs: list[torch.Tensor], slot: int) -> list[torch.Tensor]:
    return [b[slot].clone() for b in bufs]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # NaN-safe for the float32 scales


def _paths(tree):
    """(node, token ids from the root to the node's end) for every non-root node."""
    out, stack = [], [(tree.root, [])]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            p = path + list(child.key.token_ids)
            out.append((child, p))
            stack.append((child, p))
    return out


def _check_mirrors(tree, device: list[torch.Tensor], host: list[torch.Tensor]) -> int:
    """Every node with settled copies in both tiers: the same bytes in every buffer."""
    n = 0
    for node in tree.iter_nodes():
        if node is tree.root or node.value is None or node.host_value is None:
            continue
        if tree.host_pending(node) or tree.device_pending(node):
            continue
        for d, h in zip(device, host):
            assert _same_bytes(d[node.value], h[node.host_value]), f"{node!r}: host copy differs"
        n += len(node.key)
    return n


@pytest.mark.parametrize("backend", BACKENDS)
def test_hicache_backup_and_load_back_restore_int8_values_and_scales(tiny_llama_dir, backend):
    from radixlm.config import ServerArgs
    from radixlm.messages import TokenizedGenerateReq
    from radixlm.sampling_params import SamplingParams
    from radixlm.srt.scheduler_process import build_scheduler

    outputs: dict[str, list[int]] = {}

    def collect(batch) -> None:
        for o in batch.outputs:
            outputs.setdefault(o.rid, []).extend(o.new_token_ids)

    args = ServerArgs.from_kwargs(model_path=tiny_llama_dir, dtype="float32", kv_cache_dtype="int8",
                                  attention_backend=backend, max_total_tokens=256, chunked_prefill_size=64,
                                  enable_hierarchical_cache=True, debug_check_integrity=True,
                                  disable_overlap_schedule=True)
    sched, runner = build_scheduler(args, collect)
    tree = sched.cache.prefix
    kv = runner.kv_pool
    device, host = kv.slot_buffers(), tree.host_pool.buffers
    assert len(device) == len(host) == 4 * LAYERS  # K, V and their scales, per layer
    assert [b.dtype for b in host] == [b.dtype for b in device]
    assert host[0].dtype == torch.int8 and host[-1].dtype == torch.float32
    try:
        def run(rid: str, ids: list[int], n: int) -> list[int]:
            sp = SamplingParams.from_dict({"max_new_tokens": n, **GREEDY})
            sched.add_request(TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=sp))
            sched.run_until_idle()
            tree.drain()  # every host copy landed and acked
            sched.check_integrity()
            return outputs[rid]

        prompt = random_prompt(5, 120)
        first = run("a", prompt, 8)
        assert _check_mirrors(tree, device, host) >= 120  # backed up (write_through) byte for byte
        # what every token of the cached sequence holds now, keyed by its path from the root
        saved = {}
        for node, path in _paths(tree):
            start = len(path) - len(node.key)
            for j in range(len(node.key)):
                saved[tuple(path[:start + j + 1])] = _slot_values(device, int(node.value[j]))
        sched.cache.evict(sched.cache.capacity)  # everything host-only now
        assert all(n.value is None for n, _ in _paths(tree))
        for b in device:  # poison every device slot: only a load can bring the KV back
            if b.dtype == torch.int8:
                b[1:] = 99
            else:
                b[1:] = float("nan")
        before = sched.get_info()["hicache"]["loaded_back_tokens_total"]
        again = run("b", prompt, 8)
        loaded = sched.get_info()["hicache"]["loaded_back_tokens_total"] - before
        assert loaded >= 100
        assert again == first
        # The first `loaded` tokens came back from the host; the rest (the last prompt token,
        # the outputs) were computed again, in float rounding that may differ from the first
        # run's, and the revived nodes took those slots.
        checked = 0
        for node, path in _paths(tree):
            if node.value is None:
                continue
            start = len(path) - len(node.key)
            for j in range(len(node.key)):
                want = saved.get(tuple(path[:start + j + 1]))
                if want is None or start + j >= loaded:
                    continue
                got = _slot_values(device, int(node.value[j]))
                assert all(_same_bytes(w, g) for w, g in zip(want, got)), f"token {start + j} of {node!r}"
                checked += 1
        assert checked == loaded
    finally:
        tree.drain()
        tree.controller.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_hicache_engine_outputs_equal_a_run_without_it(tiny_llama_dir, backend):
    kw = {"kv_cache_dtype": "int8", "attention_backend": backend, "max_total_tokens": 160}
    ref, _ = run_multiturn(tiny_llama_dir, 3, 3, **kw)
    outs, info = run_multiturn(tiny_llama_dir, 3, 3, enable_hierarchical_cache=True, **kw)
    assert outs == ref
    assert info["kv_cache_dtype"] == "int8"
    hc = info["hicache"]
    assert hc["backed_up_tokens_total"] > 0 and hc["loaded_back_tokens_total"] > 0
    mem = info["memory"]
    assert mem["protected"] == 0 and mem["free"] + mem["evictable"] == mem["capacity"]
