"""The caller's view of a request: outputs folded into its ReqState, and the result dicts
(`text`, `output_ids`, `meta_info`) the Engine and the native HTTP routes return."""
from __future__ import annotations

import logging
import time

from radixlm.srt.request_table import ReqState

logger = logging.getLogger(__name__)


def absorb(st: ReqState, metrics=None) -> dict:
    """Fold pending outputs into the state; return the delta they carried."""
    text, ids, lps, tops = "", [], [], []
    for o in st.pending:
        out = o.out
        text += o.new_text
        ids.extend(out.new_token_ids)
        lps.extend(out.output_token_logprobs)
        tops.extend(out.output_top_logprobs)
        st.cached_tokens = out.cached_tokens
        st.prompt_tokens = out.prompt_tokens  # a session's turn: its history + its input
        st.num_retractions = out.num_retractions
        if out.spec_verify_ct is not None:
            st.spec = (out.spec_verify_ct, out.spec_draft_tokens, out.spec_accepted_tokens)
        if out.input_token_logprobs is not None and st.input_token_logprobs is None:
            st.input_token_logprobs = out.input_token_logprobs
            st.input_top_logprobs = out.input_top_logprobs
        if out.finish_reason is not None:
            st.finish_reason = out.finish_reason
            if metrics is not None:
                metrics.on_finish(st, out)
            _log_finish(st, out)
    st.pending.clear()
    st.text += text
    st.output_ids.extend(ids)
    st.output_token_logprobs.extend(lps)
    st.output_top_logprobs.extend(tops)
    return {"text": text, "output_ids": ids, "lps": lps, "tops": tops}


def _log_finish(st: ReqState, out) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        reason = out.finish_reason or {}
        why = reason.get("type", "?") + (f" {reason['message']!r}" if reason.get("message") else "")
        logger.debug("request %s finished (%s): %d prompt tokens (%d cached), %d completion tokens, %.3f s",
                     st.rid, why, out.prompt_tokens, out.cached_tokens, out.completion_tokens,
                     time.perf_counter() - st.start)


def spec_meta(verify_ct: int, drafted: int, accepted: int) -> dict:
    """SGLang's speculative meta_info: tokens emitted per verify step (the target's own one
    included) and the share of draft tokens accepted."""
    return {"spec_verify_ct": verify_ct,
            "spec_accept_length": round(1 + accepted / verify_ct, 4) if verify_ct else 0.0,
            "spec_accept_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted}


def _with_text(tokenizer, pairs, with_text: bool):
    if pairs is None:
        return None
    with_text = with_text and tokenizer is not None
    return [(lp, tok, tokenizer.decode([tok]) if with_text else None) for lp, tok in pairs]


def result(st: ReqState, tokenizer, with_text: bool, full: bool, delta: dict | None = None,
           weight_version: str = "0") -> dict:
    """The whole result (`full`) or one streamed chunk (`delta` from absorb)."""
    segments = [list(s) for s in st.weight_versions] or [[weight_version, 0]]
    meta = {"id": st.rid, "finish_reason": st.finish_reason, "prompt_tokens": st.prompt_tokens,
            "completion_tokens": len(st.output_ids), "cached_tokens": st.cached_tokens,
            "num_retractions": st.num_retractions, "weight_version": segments[-1][0],
            "weight_versions": segments, "e2e_latency": time.perf_counter() - st.start}
    if st.spec is not None:
        meta.update(spec_meta(*st.spec))
    lps = st.output_token_logprobs if full else delta["lps"]
    tops = st.output_top_logprobs if full else delta["tops"]
    if st.output_token_logprobs or st.input_token_logprobs is not None:
        k, in_tops = st.top_logprobs_num, st.input_top_logprobs or []
        meta["output_token_logprobs"] = _with_text(tokenizer, lps, with_text)
        meta["input_token_logprobs"] = _with_text(tokenizer, st.input_token_logprobs or [], with_text)
        if st.token_ids_logprob:  # each list: the top k, then the asked ids' entries
            meta["output_token_ids_logprobs"] = [_with_text(tokenizer, t[k:], with_text) for t in tops]
            meta["input_token_ids_logprobs"] = [None if t is None else _with_text(tokenizer, t[k:], with_text)
                                                for t in in_tops]
            if k == 0:  # the top lists were kept for the asked ids only
                tops, in_tops = [], []
        meta["output_top_logprobs"] = [_with_text(tokenizer, t if t is None else t[:k], with_text) for t in tops]
        meta["input_top_logprobs"] = [_with_text(tokenizer, t if t is None else t[:k], with_text) for t in in_tops]
    out = {"text": st.text if full else delta["text"],
           "output_ids": list(st.output_ids) if full else delta["output_ids"], "meta_info": meta}
    if tokenizer is None:  # --skip-tokenizer-init: ids only, as SGLang answers
        del out["text"]
    return out


def early_abort_results(rids: list[str], n_hints: dict[str, int], reasons: dict[str, dict],
                        weight_version: str) -> list[dict]:
    """Results of a call aborted in full before its prompts were tokenized."""
    out = []
    for rid in rids:
        n = n_hints.get(rid, 1)
        for name in ([rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]):
            out.append({"text": "", "output_ids": [],
                        "meta_info": {"id": name, "finish_reason": reasons[rid], "prompt_tokens": 0,
                                      "completion_tokens": 0, "cached_tokens": 0, "num_retractions": 0,
                                      "weight_version": weight_version,
                                      "weight_versions": [[weight_version, 0]], "e2e_latency": 0.0}})
    return out
