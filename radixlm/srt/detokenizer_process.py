"""The detokenizer process: token ids in, UTF-8-safe text deltas out.

Control replies from the scheduler pass through unchanged, so the tokenizer manager has
one inbound queue and sees every message in the scheduler's order.
"""
from __future__ import annotations

import dataclasses
import logging
import traceback

from radixlm.config import ServerArgs
from radixlm.ipc import PortArgs, Receiver, Sender
from radixlm.messages import BatchTextOut, BatchTokenOut, DetokParams, ReqTextOutput, ShutdownReq
from radixlm.srt.detokenizer import IncrementalDetokenizer, for_params

logger = logging.getLogger(__name__)


class DetokenizerManager:
    """Per-request incremental detokenizers. A request whose detokenization raises is ended
    alone (a 500 abort, `failed=True`): the rest of the batch is delivered as usual."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, IncrementalDetokenizer] = {}
        # requests ended here whose scheduler side has not sent its terminal output yet
        self.failed: set[str] = set()

    def handle(self, batch: BatchTokenOut) -> BatchTextOut:
        out = []
        for o in batch.outputs:
            if o.rid in self.failed:  # already answered; drop until the scheduler's last word
                if o.finish_reason is not None:
                    self.failed.discard(o.rid)
                continue
            try:
                out.append(ReqTextOutput(o, self._text(o)))
            except Exception as e:  # noqa: BLE001 - one request's failure is that request's
                logger.error("detokenizing %s failed; ending it alone:\n%s", o.rid, traceback.format_exc())
                self.states.pop(o.rid, None)
                if o.finish_reason is None:
                    self.failed.add(o.rid)
                reason = {"type": "abort", "status_code": 500,
                          "message": f"internal error while detokenizing ({type(e).__name__}: {str(e)[:200]})"}
                out.append(ReqTextOutput(dataclasses.replace(o, finish_reason=reason), "", failed=True))
        return BatchTextOut(out)

    def _text(self, o) -> str:
        det = self.states.get(o.rid)
        if det is None:
            p = o.detok or DetokParams()
            det = for_params(self.tokenizer, p)
            self.states[o.rid] = det
        finished = o.finish_reason is not None
        if self.tokenizer is None:  # skip_tokenizer_init: ids pass through, there is no text
            text = ""
        elif det.text_at_end and not finished:
            # Nobody reads a non-streamed request's text before its end: decoding it every
            # step cost ~4% of a 32-request offline batch's throughput on 2 cores.
            det.hold(o.new_token_ids)
            text = ""
        else:
            text = det.add(o.new_token_ids, finished=finished)
        if finished:
            del self.states[o.rid]
        return text


def run_detokenizer_process(args: ServerArgs, ports: PortArgs, ready) -> None:
    """Set-up common to children (parent-death handling, logging) is done by child.py."""
    import zmq
    ctx = zmq.Context()
    try:
        from radixlm.srt.weights.loader import load_tokenizer, resolve_model_path
        receiver = Receiver(ctx, ports.detokenizer_input)
        to_tokenizer = Sender(ctx, ports.tokenizer_input)
        manager = DetokenizerManager(None if args.skip_tokenizer_init else
                                     load_tokenizer(args.tokenizer_path or resolve_model_path(args.model_path)))
        from radixlm.srt.gc_watch import GCWatch, freeze_startup_heap
        freeze_startup_heap()
        GCWatch(args.gc_warning_threshold_secs).install()
        ready.send({"status": "ready"})
    except Exception as e:
        ready.error(e)
        return
    try:
        while True:
            msg = receiver.recv()
            if isinstance(msg, ShutdownReq):
                return
            if isinstance(msg, BatchTokenOut):
                try:
                    msg = manager.handle(msg)
                except Exception:
                    logger.error("detokenization failed:\n%s", traceback.format_exc())
                    continue
            to_tokenizer.send(msg)
    finally:
        ctx.destroy(linger=0)
