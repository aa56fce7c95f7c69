"""On CUDA: the overlap scheduler's forward stream and copy-done event.

- launch() returns while the GPU is still busy: the forward of batch N and of batch N+1
  (whose inputs name N's rows) are both queued behind a sleep on the forward stream before
  either has run, and their results equal a synchronous run's;
- the forward runs on the runner's own stream, not the default one, and launching a decode
  batch makes no host-device synchronization at all (torch's sync debug mode);
- through the Engine, greedy outputs with overlap on and off are identical, and the
  scheduler reports the GPU's idle share between forwards.

Skipped without CUDA (conftest.py).
"""
from __future__ import annotations

import pytest
import torch

from radixlm.config import ServerArgs
from test.support.engine_checks import random_prompt
from test.support.overlap_batches import decode_batch, free_reqs, make_req, prefill_batch


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    from radixlm.srt.model_runner.runner import ModelRunner
    return ModelRunner(ServerArgs.from_kwargs(model_path=tiny_llama_dir, device="cuda", dtype="float32",
                                              max_total_tokens=2048, max_running_requests=8).runner_config())


def _free(runner, reqs, n_extra: int) -> None:
    free_reqs(runner, reqs, n_extra)


def _reqs(runner):
    params = [{}, {"return_logprob": True, "top_logprobs_num": 3}, {"temperature": 0.9, "seed": 11}]
    return [make_req(f"r{i}", random_prompt(60 + i, 12 + 5 * i), runner, **p) for i, p in enumerate(params)]


def test_launch_returns_before_the_gpu_has_run_the_batch(runner):
    assert runner.stream.cuda and runner.stream.stream != torch.cuda.default_stream()
    reqs = _reqs(runner)
    first = prefill_batch(runner, reqs)
    want1 = runner.launch(first).result()
    want2 = runner.launch(decode_batch(runner, reqs, tokens=want1.next_token_ids)).result()
    _free(runner, reqs, 1)

    reqs = _reqs(runner)
    first = prefill_batch(runner, reqs)
    with torch.cuda.stream(runner.stream.stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of both forwards
    l1 = runner.launch(first)
    l2 = runner.launch(decode_batch(runner, reqs, source=first), l1)
    assert isinstance(l1.copy_done, torch.cuda.Event)
    assert not l1.copy_done.query() and not l2.copy_done.query()  # the host did not wait for either
    got1, got2 = l1.result(), l2.result()
    _free(runner, reqs, 1)
    assert got1.next_token_ids == want1.next_token_ids
    assert got2.next_token_ids == want2.next_token_ids
    assert got2.logprobs == pytest.approx(want2.logprobs, abs=1e-4)
    start, end = l2.span()
    assert end > start > l1.span()[0]


def test_decode_launch_never_makes_the_host_wait(runner):
    """With torch's sync debug mode set to error, launching a decode batch whose inputs are
    placeholders (greedy, logprobs, temperature + seed) raises on any host-device wait."""
    if runner.attention_backend_name != "triton":
        pytest.skip("torch_native reads lengths on the host; the triton backend is the async one")
    reqs = _reqs(runner)
    first = prefill_batch(runner, reqs)
    l1 = runner.launch(first)
    batch = decode_batch(runner, reqs, source=first)
    torch.cuda.set_sync_debug_mode("error")
    try:
        l2 = runner.launch(batch, l1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(t is not None for t in l2.result().next_token_ids)
    _free(runner, reqs, 1)


def test_engine_overlap_on_and_off_agree_on_cuda(tiny_llama_dir):
    from radixlm import Engine

    prompts = [random_prompt(200 + i, 8 + 7 * i) for i in range(12)]
    sp = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for mode in ("on", "off"):
        eng = Engine(model_path=tiny_llama_dir, device="cuda", dtype="float32", chunked_prefill_size=32,
                     enable_overlap_schedule=mode == "on", disable_overlap_schedule=mode == "off")
        try:
            outs[mode] = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
            info = eng.get_server_info()
            assert info["overlap"] == (mode == "on")
            assert 0.0 <= info["forward_idle_fraction"] < 1.0
        finally:
            eng.shutdown()
    assert outs["on"] == outs["off"]
