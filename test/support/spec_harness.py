"""Speculative decoding in tests: an in-process scheduler over the real model runner (tiny
model, cpu attention backend), and the between-step invariant of draft slots."""
from __future__ import annotations

from dataclasses import dataclass, field

from radixlm.config import ServerArgs
from radixlm.messages import BatchTokenOut, ReqOutput, TokenizedGenerateReq
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.requests import HOLDS_KV
from radixlm.scheduler.scheduler import Scheduler

from test.support.scheduler_harness import Harness, make_harness

SPEC = {"speculative_algorithm": "ngram", "disable_overlap_schedule": True}


def assert_no_draft_slots(s: Scheduler) -> None:
    """Between steps no request holds a slot beyond its committed KV (no draft outlives its step)."""
    for req in s.requests.find(lambda r: r.req_pool_idx is not None, *HOLDS_KV):
        assert req.kv_allocated_len == req.kv_committed_len, (
            f"{req.rid}: kv_allocated_len {req.kv_allocated_len} != kv_committed_len {req.kv_committed_len}")


def make_spec_harness(**kw) -> Harness:
    """The fake-runner harness with n-gram speculation on (overlap off, as it must be)."""
    return make_harness(speculative_algorithm="ngram", disable_overlap_schedule=True, enable_overlap_schedule=False,
                        **kw)


def run_checked(h: Harness, max_steps: int = 100_000) -> None:
    """h.run() with the draft-slot invariant after every step too."""
    for _ in range(max_steps):
        if not h.scheduler.step():
            return
        h.scheduler.check_integrity()
        assert_no_draft_slots(h.scheduler)
    raise AssertionError("scheduler did not become idle")


@dataclass
class InProcess:
    """A scheduler + real runner in this process (no front end): outputs per rid."""

    scheduler: Scheduler
    outputs: dict[str, list[ReqOutput]] = field(default_factory=dict)

    def on_output(self, batch: BatchTokenOut) -> None:
        for o in batch.outputs:
            self.outputs.setdefault(o.rid, []).append(o)

    def submit(self, rid: str, prompt: list[int], return_logprob: bool = False, top_logprobs_num: int = 0,
               **sp) -> str:
        self.scheduler.add_request(TokenizedGenerateReq(
            rid=rid, input_ids=list(prompt), sampling_params=SamplingParams.from_dict(sp),
            return_logprob=return_logprob, top_logprobs_num=top_logprobs_num))
        return rid

    def run(self, max_steps: int = 100_000) -> None:
        s = self.scheduler
        for _ in range(max_steps):
            if not s.step():
                return
            s.check_integrity()
            assert_no_draft_slots(s)
        raise AssertionError("scheduler did not become idle")

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def logprobs(self, rid: str) -> list:
        return [x for o in self.outputs[rid] for x in o.output_token_logprobs]

    def top_logprobs(self, rid: str) -> list:
        return [x for o in self.outputs[rid] for x in o.output_top_logprobs]

    def final(self, rid: str) -> ReqOutput:
        last = self.outputs[rid][-1]
        assert last.finish_reason is not None and sum(o.finish_reason is not None for o in self.outputs[rid]) == 1
        return last


def in_process(model_dir: str, **kw) -> InProcess:
    from radixlm.srt.scheduler_process import build_scheduler

    args = ServerArgs.from_kwargs(model_path=model_dir, dtype="float32", attention_backend="cpu",
                                  **{"max_total_tokens": 4096, **kw})  # run() checks integrity
    h = InProcess(None)  # type: ignore[arg-type]
    h.scheduler, _ = build_scheduler(args, h.on_output)
    return h
