"""Greedy batches off a tied LM head in int8 or on radixlm's bf16 GEMM take their tokens from the LM head's GEMM itself
(LlamaForCausalLM.greedy_tokens, Sampler.sample_greedy_fused): the same tokens as argmax over
the logits, and only where nothing else needs the logits (logprobs, penalties, sampling,
grammars, prompt logprobs take the logits as before)."""
from __future__ import annotations

import pytest

from radixlm.config import ServerArgs
from radixlm.kernels.cpu import ops
from radixlm.messages import TokenizedGenerateReq
from radixlm.sampling_params import SamplingParams
from radixlm.srt.model_runner.sampler import Sampler
from test.support.engine_checks import random_prompt

needs_int8 = pytest.mark.skipif(not ops.int8_linear_available(), reason="needs the native int8 GEMM")


def _run(model_dir: str, dtype: str, fused: bool, monkeypatch, quantization: str | None = "w8a8_int8",
         overlap: bool = False):
    from radixlm.srt.scheduler_process import build_scheduler

    if not fused:
        monkeypatch.setattr(Sampler, "sample_greedy_fused", lambda self, hidden, rows, model: None)
    outs: dict[str, dict] = {}

    def collect(batch) -> None:
        for o in batch.outputs:
            d = outs.setdefault(o.rid, {"ids": [], "lps": []})
            d["ids"].extend(o.new_token_ids)
            d["lps"].extend(o.output_token_logprobs)

    args = ServerArgs.from_kwargs(model_path=model_dir, dtype=dtype, quantization=quantization, max_total_tokens=800,
                                  max_running_requests=4, chunked_prefill_size=32, debug_check_integrity=True,
                                  enable_overlap_schedule=overlap)
    sched, runner = build_scheduler(args, collect)
    try:
        # Greedy requests alone, then greedy ones beside one that asks for logprobs and one
        # with a repetition penalty: those batches need the logits.
        kinds = [{}, {}, {}, {}, {"logprob": True}, {"repetition_penalty": 1.3}, {}]
        for i, kind in enumerate(kinds):
            sp = SamplingParams.from_dict({"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True,
                                           **{k: v for k, v in kind.items() if k != "logprob"}})
            sched.add_request(TokenizedGenerateReq(rid=f"r{i}", input_ids=random_prompt(200 + i, 5 + 9 * i),
                                                   sampling_params=sp, return_logprob=bool(kind.get("logprob"))))
            if i == 3:
                sched.run_until_idle()
        sched.run_until_idle()
        sched.check_integrity()
    finally:
        monkeypatch.undo()
        if sched.worker is not None:
            sched.worker.shutdown()
    return outs, runner.sampler.stats


@needs_int8
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_greedy_tokens_are_the_logits_argmax(tiny_llama_tp_dir, dtype, monkeypatch):
    want, base = _run(tiny_llama_tp_dir, dtype, False, monkeypatch)
    got, stats = _run(tiny_llama_tp_dir, dtype, True, monkeypatch)
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in want.items()}
    assert [lp for lp, _ in got["r4"]["lps"]] == pytest.approx([lp for lp, _ in want["r4"]["lps"]], abs=1e-5)
    assert len(got) == 7 and all(len(v["ids"]) == 12 for v in got.values())
    assert base.fused_argmax_calls == 0
    # the first four requests' batches (prefills and decodes) are fused; those beside r4 or r5 are not
    assert 12 <= stats.fused_argmax_calls < stats.fast_path_calls < stats.calls
    assert stats.calls == base.calls and stats.fast_path_calls == base.fast_path_calls


@needs_int8
def test_fused_tokens_under_overlap_scheduling(tiny_llama_tp_dir, monkeypatch):
    # The forward thread launches batch N + 1 on placeholders for the tokens batch N samples:
    # fused ids feed them as the logits' argmax did.
    want, _ = _run(tiny_llama_tp_dir, "bfloat16", False, monkeypatch)
    got, stats = _run(tiny_llama_tp_dir, "bfloat16", True, monkeypatch, overlap=True)
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in want.items()}
    assert stats.fused_argmax_calls >= 12


@needs_int8
def test_an_untied_lm_head_computes_the_logits(tiny_llama_dir, monkeypatch):
    # Its logits are rounded to the model dtype first (Linear's output), which the fused
    # argmax does not do: it is not offered there.
    _, stats = _run(tiny_llama_dir, "bfloat16", True, monkeypatch)
    assert stats.fused_argmax_calls == 0 and stats.fast_path_calls > 0


def test_a_bf16_tied_head_gives_the_argmax_of_its_bf16_logits(tiny_llama_tp_dir, monkeypatch):
    want, base = _run(tiny_llama_tp_dir, "bfloat16", False, monkeypatch, quantization=None)
    got, stats = _run(tiny_llama_tp_dir, "bfloat16", True, monkeypatch, quantization=None)
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in want.items()}
    assert base.fused_argmax_calls == 0
    if ops.bf16_gemm_available() and not ops.bf16_gemm_amx():
        assert 12 <= stats.fused_argmax_calls < stats.fast_path_calls
    else:  # no bf16 GEMM here, or it runs on AMX tiles: the logits are computed
        assert stats.fused_argmax_calls == 0
