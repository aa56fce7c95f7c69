"""A GrammarBackend stand-in for scheduler tests (no tokenizer, no xgrammar).

A grammar is the text "mod=M,len=L": every token must be a multiple of M, and the grammar is
complete after L tokens. Text starting with "bad" fails to compile. Compiles can be held
back with `gate` to test the grammar queue while a compile is pending.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from test.support.fake_runner import FakeRunner


@dataclass(frozen=True)
class FakeGrammar:
    mod: int
    length: int

    @staticmethod
    def parse(spec: str) -> "FakeGrammar":
        fields = dict(part.split("=") for part in spec.split(","))
        return FakeGrammar(int(fields["mod"]), int(fields["len"]))

    def constrain(self, token: int, vocab: int) -> int:
        """The nearest allowed token at or above `token` (wrapping to 0)."""
        t = token + (-token % self.mod)
        return t if t < vocab else 0


class FakeMatcher:
    def __init__(self, grammar: FakeGrammar) -> None:
        self.grammar = grammar
        self.accepted: list[int] = []

    @property
    def terminated(self) -> bool:
        return len(self.accepted) >= self.grammar.length

    def constrain(self, token: int, vocab: int) -> int:
        return self.grammar.constrain(token, vocab)

    def accept(self, token: int) -> bool:
        if self.terminated or token % self.grammar.mod:
            return False
        self.accepted.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens <= len(self.accepted)
        del self.accepted[len(self.accepted) - num_tokens:]

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Bit t of the row set for every multiple t of mod (speculative drafts are cut on it)."""
        import torch
        allowed = torch.zeros(bitmask.shape[1] * 32, dtype=torch.bool)
        allowed[::self.grammar.mod] = True
        bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32)
        words = bits.sum(1)
        bitmask[row] = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class FakeGrammarBackend:
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.compiles: Counter[tuple[str, str]] = Counter()
        self.started: Counter[tuple[str, str]] = Counter()

    def compile(self, kind: str, spec: str) -> FakeGrammar:
        self.started[(kind, spec)] += 1
        assert self.gate.wait(30), "gate never opened"
        self.compiles[(kind, spec)] += 1
        if spec.startswith("bad"):
            raise ValueError(f"cannot parse {spec!r}")
        return FakeGrammar.parse(spec)

    def new_matcher(self, compiled: FakeGrammar) -> FakeMatcher:
        return FakeMatcher(compiled)


def constrained_reference(prompt: list[int], spec: str, max_new: int,
                          vocab: int = 97) -> tuple[list[int], str]:
    """Output ids and finish type of a constrained request on the FakeRunner."""
    g = FakeGrammar.parse(spec)
    seq, out = list(prompt), []
    while len(out) < min(max_new, g.length):
        t = g.constrain(FakeRunner.next_token(seq, vocab), vocab)
        out.append(t)
        seq.append(t)
    # at the last token allowed by both, max_new_tokens is checked first
    return out, "stop" if g.length < max_new else "length"
