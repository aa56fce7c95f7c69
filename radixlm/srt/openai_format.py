"""Turning TokenizerManager results into OpenAI fields: finish reasons, logprobs, usage.

Logprob entries arrive as `(logprob, token_id, token_text)` triples (the tokenizer manager
is asked for the text); top-logprob lists are lists of such triples, one list per position.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

from radixlm.srt.openai_protocol import (ChatLogprobs, CompletionLogprobs, PromptTokensDetails, TokenLogprob,
                                          TopLogprob, UsageInfo)

Triple = Sequence[Any]  # (logprob, token_id, text)


def finish_reason_str(fr: dict | None) -> str | None:
    """OpenAI's finish_reason: "stop" (EOS, stop string or stop token), "length", "abort"."""
    if not fr:
        return None
    return {"stop": "stop", "length": "length"}.get(fr.get("type"), "abort")


def matched_stop(fr: dict | None) -> int | str | None:
    """SGLang's extra choice field: which stop token id or string ended the output."""
    if fr and fr.get("type") == "stop":
        return fr.get("matched")
    return None


# ---------------------------------------------------------------------------- token bytes
@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet: each byte is written as one printable
    character, so a byte-level BPE token string maps back to its exact bytes."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenBytes:
    """Exact UTF-8 bytes of a token. A token that holds part of a multi-byte character
    decodes to "\ufffd" as text, so `bytes` is the only faithful field (OpenAI's reason for it)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        got = self.cache.get(token_id)
        if got is None:
            got = self.cache[token_id] = self._compute(token_id, text)
        return got

    def _compute(self, token_id: int, text: str) -> list[int]:
        try:
            piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        except Exception:
            piece = None
        if isinstance(piece, str) and piece:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:  # sentencepiece byte-fallback token
                    return [int(piece[3:5], 16)]
                except ValueError:
                    pass
            dec = _byte_level_decoder()
            if all(ch in dec for ch in piece):
                return [dec[ch] for ch in piece]
        return list(text.encode("utf-8"))


# ---------------------------------------------------------------------------- logprobs
def chat_logprobs(entries: Sequence[Triple], tops: Sequence[Sequence[Triple] | None] | None,
                  top_n: int, token_bytes: TokenBytes) -> ChatLogprobs:
    content = []
    for i, (lp, tok, text) in enumerate(entries):
        text = text or ""
        alts = []
        top = tops[i] if tops is not None and i < len(tops) else None
        for alp, atok, atext in (top or [])[:top_n]:
            atext = atext or ""
            alts.append(TopLogprob(token=atext, logprob=float(alp), bytes=token_bytes(atok, atext)))
        content.append(TokenLogprob(token=text, logprob=float(lp), bytes=token_bytes(tok, text),
                                    top_logprobs=alts))
    return ChatLogprobs(content=content)


def completion_logprobs(entries: Sequence[Triple], tops: Sequence[Sequence[Triple] | None] | None,
                        offset: int) -> tuple[CompletionLogprobs, int]:
    """The legacy completions format; `offset` is the character offset of the first token in
    the returned text. Returns the logprobs and the offset after the last token."""
    out = CompletionLogprobs()
    for i, (lp, _tok, text) in enumerate(entries):
        text = text or ""
        out.tokens.append(text)
        out.token_logprobs.append(None if lp is None else float(lp))
        top = tops[i] if tops is not None and i < len(tops) else None
        # OpenAI (and vLLM): the `logprobs` most likely tokens plus always the sampled one, so
        # `logprobs: 0` gives {sampled: lp} and k gives up to k + 1 entries. Several token ids
        # may decode to the same text; the best logprob wins the key. The first prompt token
        # (echo) has no logprob and stays null.
        alts: dict[str, float] | None = None
        if lp is not None:
            alts = {}
            for alp, _atok, atext in top or []:
                key = atext or ""
                if key not in alts or alp > alts[key]:
                    alts[key] = float(alp)
            alts.setdefault(text, float(lp))
        out.top_logprobs.append(alts)
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def merge_completion_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


# ---------------------------------------------------------------------------- usage
def usage_from(metas: Sequence[dict], n: int) -> UsageInfo:
    """Usage of a request with len(metas) // n prompts and n choices each (prompt-major).
    The prompt is counted once per prompt, not once per choice (OpenAI's rule); its cached
    part is the least any choice got from the cache, i.e. what the first computation reused,
    so cached_tokens never exceeds prompt_tokens."""
    prompt = cached = 0
    for start in range(0, len(metas), n):
        group = metas[start:start + n]
        prompt += int(group[0].get("prompt_tokens", 0))
        cached += min(int(m.get("cached_tokens", 0) or 0) for m in group)
    completion = sum(int(m.get("completion_tokens", 0)) for m in metas)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
