"""The scheduler process: owns the model runner, pools and radix tree; runs the loop."""
from __future__ import annotations

import logging
import os
import traceback

from radixlm.config import ServerArgs
from radixlm.ipc import PortArgs, Receiver, Sender
from radixlm.messages import RpcReply, RpcReq, ShutdownReq

logger = logging.getLogger(__name__)

# How long an idle loop blocks waiting for a message before looking again.
IDLE_POLL_MS = 50


def build_scheduler(args: ServerArgs, send_output):
    """Model runner + prefix cache + cache manager + scheduler, wired together."""
    from radixlm.radix_cache.base import create_prefix_cache
    from radixlm.scheduler.cache_manager import CacheManager
    from radixlm.scheduler.scheduler import Scheduler
    from radixlm.srt.constrained.xgrammar_backend import create_grammar_backend
    from radixlm.srt.model_runner.runner import ModelRunner
    from radixlm.srt.weights.loader import load_tokenizer

    runner = ModelRunner(args)
    # without one (skip_tokenizer_init) stop strings and grammars are refused at validation
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer_path or runner.model_path)
    sched_runner = runner
    if args.enable_hierarchical_cache:  # HiCache: host tier under the radix cache (radixlm/hicache)
        from radixlm.hicache import LoadFencedRunner, build_hiradix_cache
        kv = runner.kv_pool
        # Every slot-indexed tensor (K, V and, for an int8 pool, their scales) is mirrored, so
        # a copy moves a slot's whole KV; a callable, since release/resume swaps the tensors.
        tree = build_hiradix_cache(args, runner.req_to_token_pool, runner.allocator, kv.slot_buffers)
        sched_runner = LoadFencedRunner(runner, tree.controller)  # forwards wait for host->device loads
    else:
        tree = create_prefix_cache(runner.req_to_token_pool, runner.allocator, page_size=args.page_size,
                                   eviction_policy=args.radix_eviction_policy,
                                   disable_radix_cache=args.disable_radix_cache)
    cache = CacheManager(tree, runner.req_to_token_pool, runner.allocator, args.page_size)
    sizes = runner.sizes
    scheduler = Scheduler(args, sched_runner, cache, max_running_requests=sizes.max_running_requests,
                          chunked_prefill_size=sizes.chunked_prefill_size, tokenizer=tokenizer,
                          send_output=send_output,
                          grammar_backend=create_grammar_backend(tokenizer, runner.vocab_size, runner.eos_token_ids))
    return scheduler, runner


def run_scheduler_process(args: ServerArgs, ports: PortArgs, ready) -> None:
    """Set-up common to children (parent-death handling, logging) is done by child.py."""
    import zmq
    ctx = zmq.Context()
    try:
        receiver = Receiver(ctx, ports.scheduler_input)
        to_detok = Sender(ctx, ports.detokenizer_input)
        scheduler, runner = build_scheduler(args, to_detok.send)
        ready.send({"status": "ready", "pid": os.getpid(),
                    "model_path": runner.model_path, "vocab_size": runner.vocab_size,
                    "max_context_len": runner.max_context_len,
                    "max_total_tokens": runner.sizes.max_total_tokens,
                    "eos_token_ids": list(runner.eos_token_ids)})
    except Exception as e:  # report, don't hang the launcher
        ready.error(e)
        return
    try:
        event_loop(scheduler, receiver, to_detok)
    except Exception:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        raise
    finally:
        ctx.destroy(linger=0)


def event_loop(scheduler, receiver: Receiver, to_detok: Sender) -> None:
    while True:
        for msg in receiver.recv_all():
            if isinstance(msg, ShutdownReq):
                return
            handle_message(scheduler, msg, to_detok)
        if not scheduler.step():
            receiver.wait(IDLE_POLL_MS)


def handle_message(scheduler, msg, to_detok: Sender) -> None:
    if isinstance(msg, RpcReq):
        try:
            to_detok.send(RpcReply(msg.call_id, scheduler.handle(msg)))
        except Exception as e:
            to_detok.send(RpcReply(msg.call_id, None, f"{type(e).__name__}: {e}"))
        return
    try:
        scheduler.handle(msg)
    except Exception:
        # One bad message must not take the server down with it.
        logger.error("failed to handle %s:\n%s", type(msg).__name__, traceback.format_exc())
