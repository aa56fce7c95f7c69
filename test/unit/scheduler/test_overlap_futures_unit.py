"""The pieces of overlap's device-side futures: placeholder resolution, snapshot filling,
the forward timer's spans, and a launched batch's one-time, thread-safe result."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from radixlm.core import Req
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.batch import WorkerBatch
from radixlm.scheduler.overlap import (ForwardTimer, fill_snapshots, placeholder, resolve_placeholders,
                                       snapshot_values_needed)
from radixlm.srt.model_runner.launched import ForwardStream, LaunchedBatch
from radixlm.srt.model_runner.sampling_batch import SampleTensors


def test_resolve_placeholders_reads_the_named_rows():
    tokens = torch.tensor([50, -1, 70, 80])
    ids = torch.tensor([placeholder(3), 5, placeholder(0), placeholder(2), 0])
    assert resolve_placeholders(ids, tokens).tolist() == [80, 5, 50, 70, 0]
    # a placeholder naming a row that sampled nothing resolves to -1 (the runner's check sees it)
    assert resolve_placeholders(torch.tensor([placeholder(1)]), tokens).tolist() == [-1]


def _batch(params: list[dict], snaps: list[list[int]]) -> WorkerBatch:
    reqs = [Req(rid=str(i), origin_input_ids=[1, 2], sampling_params=SamplingParams.from_dict(p))
            for i, p in enumerate(params)]
    n = len(reqs)
    return WorkerBatch(mode="decode", reqs=reqs, input_ids=[s[-1] for s in snaps], out_cache_loc=torch.zeros(n),
                       prefix_lens=[2] * n, extend_lens=[1] * n, sample=[True] * n, output_snapshots=snaps)


def test_snapshot_values_are_needed_only_for_penalty_rows_with_a_placeholder():
    assert not snapshot_values_needed(_batch([{}, {"temperature": 0.5, "seed": 1}],
                                             [[4, placeholder(0)], [placeholder(1)]]))
    assert not snapshot_values_needed(_batch([{"repetition_penalty": 1.2}], [[4, 9]]))
    b = _batch([{}, {"presence_penalty": 0.3}], [[placeholder(1)], [7, placeholder(0)]])
    assert snapshot_values_needed(b)
    fill_snapshots(b, [11, 22])
    assert b.output_snapshots == [[22], [7, 11]]
    with pytest.raises(AssertionError, match="sampled nothing"):
        fill_snapshots(_batch([{}], [[placeholder(0)]]), [None])


class _Spans:
    def __init__(self, start: float, end: float) -> None:
        self._span = (start, end)

    def span(self):
        return self._span


def test_forward_timer_counts_gaps_between_spans_as_idle():
    t = ForwardTimer()
    for s, e in ((10.0, 10.5), (10.6, 11.0), (11.0, 11.4), (14.0, 14.5)):  # the 2.6 s gap is "no work"
        t.add(_Spans(s, e))
    assert t.busy_s == pytest.approx(1.8) and t.idle_s == pytest.approx(0.1)
    assert t.idle_fraction() == pytest.approx(0.1 / 1.9)


class _SlowEvent:
    def __init__(self) -> None:
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1
        time.sleep(0.05)


def test_launched_result_is_built_once_whoever_asks_first():
    req = Req(rid="a", origin_input_ids=[1], sampling_params=SamplingParams.from_dict({}))
    batch = WorkerBatch(mode="decode", reqs=[req, req], input_ids=[1, 2], out_cache_loc=torch.zeros(2),
                        prefix_lens=[1, 1], extend_lens=[1, 1], sample=[False, True])
    ev = _SlowEvent()
    sampled = SampleTensors(torch.tensor([9]), [0], torch.tensor([-0.5]), torch.tensor([[-0.5, -1.0]]),
                            torch.tensor([[9, 3]]), [1])
    launched = LaunchedBatch(batch, torch.tensor([-1, 9]), [1], sampled, ev, 1.0, 2.0, ForwardStream("cpu"))
    results = []
    threads = [threading.Thread(target=lambda: results.append(launched.result())) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert ev.syncs == 1 and all(r is results[0] for r in results)
    r = results[0]
    assert r.next_token_ids == [None, 9] and r.logprobs == [None, -0.5] and r.top_logprobs == [None, [(-0.5, 9)]]
    assert r.input_logprobs == [None, None] and r.grammar_status is None
    assert launched.span() == (1.0, 2.0)
