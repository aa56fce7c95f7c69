"""The xgrammar implementation of the scheduler's GrammarBackend, and its matcher.

The tokenizer's vocabulary is analysed once (xgrammar's TokenizerInfo), lazily on the first
compile, so an engine that never sees a structured request pays nothing for it.
"""
from __future__ import annotations

import logging
import re
import threading
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "; the client needs the rest.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def xgrammar_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("xgrammar") is not None


class XGrammarMatcher:
    """One request's position in its grammar. Used only by the forward side, in batch order."""

    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens (speculative drafts checked against the grammar;
        matchers are created with unlimited rollback)."""
        self._m.rollback(num_tokens)

    def accept_string(self, text: str) -> bool:  # tests and debugging
        return bool(self._m.accept_string(text))


class XGrammarBackend:
    """Compiles json_schema / regex / ebnf for one tokenizer; thread-safe.

    JSON is generated compactly (`any_whitespace=False`, separators ", " and ": "): free
    whitespace lets small models wander into endless newlines, and compact output is cheaper.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = (),
                 max_threads: int = 2, any_whitespace: bool = False) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.max_threads = max_threads
        self.any_whitespace = any_whitespace
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None)
                # xgrammar caches too; ours (the grammar queue's) is keyed the same way
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
            return self._compiler

    def compile(self, kind: str, spec: str) -> Any:
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(spec, any_whitespace=self.any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "ebnf":
                return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(_clean(str(e))) from None
        raise ValueError(f"unknown grammar kind {kind!r}")

    def new_matcher(self, compiled: Any) -> XGrammarMatcher:
        import xgrammar as xgr
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))


def _clean(message: str) -> str:
    lines = [_CPP_PREFIX.sub("", line).strip() for line in message.strip().splitlines()]
    return " ".join(line for line in lines if line) or "compilation failed"


def create_grammar_backend(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> XGrammarBackend | None:
    """The backend for the scheduler, or None (structured requests then get a 400) when
    xgrammar is not installed or there is no tokenizer."""
    if tokenizer is None or not xgrammar_available():
        if tokenizer is not None:
            logger.warning("xgrammar is not installed: json_schema / regex / ebnf requests will be rejected")
        return None
    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
