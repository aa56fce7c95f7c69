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
    from radixlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from radixlm.radix_cache.prefix_cache import DeviceKV
    from radixlm.scheduler.cache_manager import CacheManager, build_prefix_cache
    from radixlm.scheduler.scheduler import Scheduler
    from radixlm.srt.constrained.xgrammar_backend import create_grammar_backend
    from radixlm.srt.model_runner.runner import ModelRunner
    from radixlm.srt.weights.loader import load_tokenizer

    runner = ModelRunner(args.runner_config())
    tokenizer = load_tokenizer(args.tokenizer_path or runner.model_path)
    sizes = runner.sizes
    # HiCache mirrors every slot-indexed tensor (K, V and, for an int8 pool, their scales), so a
    # copy moves a slot's whole KV; a callable, since memory release/resume swaps the tensors.
    prefix = build_prefix_cache(args.prefix_cache_config(), DeviceKV(sizes.max_total_tokens, runner.kv_pool.slot_buffers))
    cache = CacheManager(prefix, ReqToTokenPool.over(runner.req_to_token),
                         TokenToKVPoolAllocator(sizes.max_total_tokens))
    config = args.scheduler_config(max_running_requests=sizes.max_running_requests,
                                   chunked_prefill_size=sizes.chunked_prefill_size, device=runner.device)
    scheduler = Scheduler(config, runner, cache, tokenizer=tokenizer, send_output=send_output,
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
