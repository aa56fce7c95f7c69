"""The detokenizer process: token ids in, UTF-8-safe text deltas out.

Control replies from the scheduler pass through unchanged, so the tokenizer manager has
one inbound queue and sees every message in the scheduler's order.
"""
from __future__ import annotations

import logging
import traceback

from radixlm.config import ServerArgs
from radixlm.ipc import PortArgs, Receiver, Sender
from radixlm.messages import BatchTextOut, BatchTokenOut, DetokParams, ReqTextOutput, ShutdownReq
from radixlm.srt.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class DetokenizerManager:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, IncrementalDetokenizer] = {}

    def handle(self, batch: BatchTokenOut) -> BatchTextOut:
        out = []
        for o in batch.outputs:
            det = self.states.get(o.rid)
            if det is None:
                p = o.detok or DetokParams()
                det = IncrementalDetokenizer(self.tokenizer, list(p.stop), p.skip_special_tokens,
                                             p.no_stop_trim, p.spaces_between_special_tokens,
                                             list(p.stop_regex))
                self.states[o.rid] = det
            finished = o.finish_reason is not None
            # no tokenizer (skip_tokenizer_init): ids pass through, there is no text
            text = det.add(o.new_token_ids, finished=finished) if self.tokenizer is not None else ""
            if finished:
                del self.states[o.rid]
            out.append(ReqTextOutput(o, text))
        return BatchTextOut(out)


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
