"""What the scheduler refuses: a new request it cannot serve (400), and requests past a deadline
(503). Both are answered through the one stop path; nothing here touches KV."""
from __future__ import annotations

from radixlm.core import Req
from radixlm.scheduler.batch import ModelRunnerProtocol
from radixlm.scheduler.config import SchedulerConfig

__all__ = ["check_new_request", "deadline_passed"]


def check_new_request(req: Req, runner: ModelRunnerProtocol, kv_capacity: int,
                      grammar_available: bool) -> tuple[str, int] | None:
    """(message, status) when `req` cannot be served; else None, with its token limits clipped
    to the context window."""
    n = len(req.origin_input_ids)
    limit = min(runner.max_context_len, kv_capacity) - 1
    if n == 0:
        return "the prompt is empty", 400
    if n > limit:
        return f"the prompt has {n} tokens, more than the maximum of {limit}", 400
    if any(not 0 <= t < runner.vocab_size for t in req.origin_input_ids):
        return f"input token ids must be in [0, {runner.vocab_size})", 400
    sp = req.sampling_params
    if sp.grammar is not None and not grammar_available:
        return "structured output (json_schema, regex, ebnf) is not available: xgrammar is not installed", 400
    # Generation may not run past the context window.
    sp.max_new_tokens = min(sp.max_new_tokens, runner.max_context_len - n)
    sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
    return None


def deadline_passed(req: Req, now: float, waiting: bool, config: SchedulerConfig) -> str | None:
    """Why `req` (waiting, or running since admission) is past its own timeout or the server's
    waiting/running limit; None while it is not."""
    wait_limit, run_limit = config.request_waiting_timeout, config.request_running_timeout
    if req.timeout is not None and now - req.created_time > req.timeout:
        return f"request timed out after {req.timeout:g} s"
    if waiting and wait_limit is not None and now - req.created_time > wait_limit:
        return f"request waited longer than {wait_limit:g} s in the queue"
    if not waiting and run_limit is not None and req.admit_time is not None and now - req.admit_time > run_limit:
        return f"request ran longer than {run_limit:g} s"
    return None
