"""The scheduler process: owns the model runner, pools and radix tree; runs the loop.

With tensor parallelism there is one such process per rank, each with the same scheduler
(SGLang's design): rank 0 alone receives requests and control messages, broadcasts them with
its clock at the top of every iteration, and alone sends outputs and replies; every rank
applies the same messages in the same order and so takes the same decisions (see
docs/tensor_parallel.md for what else has to agree).
"""
from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Sequence
from typing import Any

from radixlm.config import ServerArgs
from radixlm.ipc import PortArgs, Receiver, Sender
from radixlm.messages import RpcReply, RpcReq, ShutdownReq
from radixlm.srt.distributed.comm import ControlChannel
from radixlm.srt.distributed.process_group import TPGroup
from radixlm.srt.scheduler_inbox import SchedulerInbox

logger = logging.getLogger(__name__)

# How long an idle loop blocks waiting for a message before looking again.
IDLE_POLL_MS = 50


class TPRankSync:
    """Rank 0's clock as broadcast with the current iteration's messages, and agreement on
    thread-timed completions (the RankSync of tensor-parallel ranks, rank_sync.py)."""

    def __init__(self, control: ControlChannel) -> None:
        self.control = control
        self.time = time.perf_counter()

    def exchange(self, msgs: list[object]) -> list[object]:
        """Top of an iteration: rank 0's messages and clock to every rank (the clock is kept)."""
        got, self.time = self.control.broadcast((msgs, time.perf_counter()))
        return list(got)

    def now(self) -> float:
        return self.time

    def agree_done(self, counts: list[int]) -> list[int]:
        return self.control.min_ints(counts)


def build_scheduler(args: ServerArgs, send_output, tp: TPGroup | None = None, *, ranks: Any = None,
                    inbox: Any = None, hooks: Sequence[Any] = ()):
    """Model runner + prefix cache + cache manager + the features, then the scheduler they are
    handed to (with `tp`, those of one tensor-parallel rank). `inbox`: overlap on one rank reads
    it while a forward runs; `hooks`: more step hooks (the process's server_info entries)."""
    from radixlm.feature_rules import check_runtime_features
    from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from radixlm.radix_cache.prefix_cache import DeviceKV
    from radixlm.rank_sync import LOCAL_RANK
    from radixlm.scheduler.cache_manager import CacheManager, build_prefix_cache
    from radixlm.scheduler.scheduler import Scheduler
    from radixlm.srt.constrained.xgrammar_backend import create_grammar_backend
    from radixlm.srt.model_runner.runner import ModelRunner
    from radixlm.srt.weights.loader import load_tokenizer

    runner = ModelRunner(args.runner_config(), tp)
    # without one (skip_tokenizer_init) stop strings and grammars are refused at validation
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer_path or runner.model_path)
    # Tensor-parallel ranks share rank 0's clock and ack thread-timed work (HiCache copies,
    # grammar compiles) only once it is done on every rank.
    if ranks is None:
        ranks = TPRankSync(tp.control) if tp is not None and tp.size > 1 else LOCAL_RANK
    sizes = runner.sizes
    # HiCache mirrors every slot-indexed tensor (K, V and, for an int8 pool, their scales), so a
    # copy moves a slot's whole KV; a callable, since memory release/resume swaps the tensors.
    prefix = build_prefix_cache(args.prefix_cache_config(),
                                DeviceKV(sizes.max_total_tokens, runner.kv_pool.slot_buffers, ranks=ranks))
    cache = CacheManager(prefix, ReqToTokenPool.over(runner.req_to_token),
                         TokenToKVPoolAllocator(sizes.max_total_tokens))
    config = args.scheduler_config(max_running_requests=sizes.max_running_requests,
                                   chunked_prefill_size=sizes.chunked_prefill_size, device=runner.device,
                                   chunk_cost_keys=sizes.chunk_cost_keys)
    check_runtime_features(speculative=config.speculative is not None,
                           attention_backend=runner.attention_backend_name, overlap=config.overlap)
    speculation = None
    if config.speculative is not None:  # priced by what a verify step costs here
        from radixlm.scheduler.speculation import Speculation
        from radixlm.srt.model_runner.step_timing import measure_step_cost
        speculation = Speculation(config.speculative, cache, runner.max_context_len, runner.vocab_size,
                                  step_cost=measure_step_cost(runner, config.speculative.num_draft_tokens))
    transfer = None
    if args.disaggregation_mode != "null":
        from radixlm.disaggregation.build import build_transfer
        transfer = build_transfer(args.disaggregation_mode, host=args.host,
                                  bootstrap_port=args.disaggregation_bootstrap_port,
                                  backend=args.disaggregation_transfer_backend,
                                  timeout_s=args.disaggregation_transfer_timeout,
                                  kv_buffers=runner.kv_pool.slot_buffers)
    scheduler = Scheduler(config, runner, cache, tokenizer=tokenizer, send_output=send_output,
                          grammar_backend=create_grammar_backend(tokenizer, runner.vocab_size, runner.eos_token_ids),
                          ranks=ranks, speculation=speculation, transfer=transfer, hooks=hooks, inbox=inbox)
    return scheduler, runner


def run_scheduler_process(args: ServerArgs, ports: PortArgs, ready, tp_rank: int = 0) -> None:
    """Set-up common to children (parent-death handling, logging) is done by child.py. Rank 0
    talks to the other processes; the other ranks only to rank 0, through torch.distributed."""
    import zmq

    from radixlm.rank_sync import LOCAL_RANK
    from radixlm.scheduler.port import InfoHook
    from radixlm.srt.gc_watch import GCWatch, freeze_startup_heap
    ctx = zmq.Context()
    inbox = to_detok = None
    try:
        tp = None
        if args.tp_size > 1:
            from radixlm.srt.distributed.process_group import init_tp_group
            from radixlm.srt.model_runner.runner import resolve_device
            tp = init_tp_group(tp_rank, args.tp_size, ports.tp_init_method, resolve_device(args.device),
                               args.dist_timeout)
        if tp_rank == 0:
            inbox = SchedulerInbox(Receiver(ctx, ports.scheduler_input))
            to_detok = Sender(ctx, ports.detokenizer_input)
        ranks = TPRankSync(tp.control) if tp is not None and tp.size > 1 else LOCAL_RANK
        watch = GCWatch(args.gc_warning_threshold_secs)  # installed once start-up is done
        scheduler, runner = build_scheduler(
            args, to_detok.send if to_detok else (lambda out: None), tp, ranks=ranks,
            # ranks could not agree on when a message arrived: only a single rank watches its inbox
            inbox=inbox if tp is None or tp.size == 1 else None,
            hooks=[InfoHook(lambda: {"gc": watch.stats()})])
        # the model and everything start-up built leave the collector's reach (gc_watch.py)
        freeze_startup_heap()
        watch.install()
        ready.send({"status": "ready", "pid": os.getpid(), "tp_rank": tp_rank,
                    "model_path": runner.model_path, "vocab_size": runner.vocab_size,
                    "max_context_len": runner.max_context_len,
                    "max_total_tokens": runner.sizes.max_total_tokens,
                    "eos_token_ids": list(runner.eos_token_ids)})
    except Exception as e:  # report, don't hang the launcher
        ready.error(e)
        return
    try:
        event_loop(scheduler, inbox, to_detok, tp.control if tp is not None else ControlChannel(),
                   ranks if isinstance(ranks, TPRankSync) else None)
    except Exception:
        logger.error("scheduler%s crashed:\n%s", f" (TP rank {tp_rank})" if tp is not None else "",
                     traceback.format_exc())
        raise
    finally:
        if inbox is not None:
            inbox.close()
        ctx.destroy(linger=0)


def event_loop(scheduler, receiver: SchedulerInbox | None, to_detok: Sender | None,
               control: ControlChannel | None = None, ranks: TPRankSync | None = None) -> None:
    """receiver/to_detok: rank 0's inbox and output socket (None on the other ranks). With more than one rank,
    each iteration starts with rank 0's broadcast of the messages it received and its clock;
    an idle rank 0 waits for its inbox at most IDLE_POLL_MS, so the others hear from it at
    least that often."""
    control = control or ControlChannel()
    while True:
        msgs = receiver.take_all() if receiver is not None else []
        if ranks is not None:  # tensor parallelism: rank 0's messages and clock
            msgs = ranks.exchange(msgs)
        for msg in msgs:
            if isinstance(msg, ShutdownReq):
                return
            handle_message(scheduler, msg, to_detok, control)
        if not scheduler.step() and receiver is not None:
            _wait(receiver, scheduler)


def _wait(receiver: SchedulerInbox, scheduler) -> None:
    """Idle: block until a message (or, with disaggregation, a peer's message) or IDLE_POLL_MS."""
    if receiver.has_queued():
        return
    extra = scheduler.transfer.wait_sockets() if scheduler.transfer is not None else []
    if not extra:
        receiver.wait(IDLE_POLL_MS)
        return
    import zmq
    poller = zmq.Poller()
    for sock in (receiver.sock, *extra):
        poller.register(sock, zmq.POLLIN)
    poller.poll(IDLE_POLL_MS)


def handle_message(scheduler, msg, to_detok: Sender | None, control: ControlChannel | None = None) -> None:
    """An RPC is answered once, by rank 0, with the lowest rank's error if any rank failed."""
    if isinstance(msg, RpcReq):
        result, error = None, None
        try:
            result = scheduler.handle(msg)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        errors = [e for e in (control.all_gather(error) if control is not None else [error]) if e is not None]
        if to_detok is not None:
            to_detok.send(RpcReply(msg.call_id, None if errors else result, errors[0] if errors else None))
        return
    try:
        scheduler.handle(msg)
    except Exception:
        # One bad message must not take the server down with it.
        logger.error("failed to handle %s:\n%s", type(msg).__name__, traceback.format_exc())
