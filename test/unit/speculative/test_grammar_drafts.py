"""Grammar rows: drafts cut at the grammar, a mask per verified position, matcher unchanged."""
from __future__ import annotations

import pytest
import torch

from radixlm.sampling_params import SamplingParams
from radixlm.speculative.acceptance import verify_drafts
from radixlm.speculative.grammar_drafts import constrain_draft, constrain_drafts
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow
from radixlm.srt.model_runner.sampling_batch import VocabMask

V = 10
STOP = 9


class IncreasingMatcher:
    """Toy grammar: each token larger than the one before; STOP (allowed after anything) ends it."""

    def __init__(self) -> None:
        self.history: list[int] = []

    @property
    def terminated(self) -> bool:
        return bool(self.history) and self.history[-1] == STOP

    def allowed(self) -> set[int]:
        last = self.history[-1] if self.history else -1
        return {t for t in range(V) if t > last} | {STOP}

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        word = 0
        for t in self.allowed():
            word |= 1 << t
        bitmask[row, 0] = word

    def accept(self, token: int) -> bool:
        if self.terminated or token not in self.allowed():
            return False
        self.history.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens <= len(self.history)
        del self.history[len(self.history) - num_tokens:]


def allowed_of(bitmask: torch.Tensor, row: int) -> set[int]:
    word = int(bitmask[row, 0]) & 0xFFFFFFFF
    return {t for t in range(V) if word >> t & 1}


def test_draft_cut_at_the_first_rejected_token_and_matcher_restored():
    m = IncreasingMatcher()
    m.accept(0)
    bm = torch.zeros((5, 1), dtype=torch.int32)
    assert constrain_draft(m, [1, 3, 2, 5], bm, 1) == 2
    assert m.history == [0]  # rolled back
    assert [allowed_of(bm, r) for r in (1, 2, 3)] == [set(range(1, 10)), set(range(2, 10)), set(range(4, 10))]
    assert constrain_draft(m, [], bm, 0) == 0 and allowed_of(bm, 0) == set(range(1, 10))
    assert constrain_draft(m, [0], bm, 0) == 0  # rejected at once
    # A stop token ends the draft before it: no mask exists after termination.
    assert constrain_draft(m, [4, STOP, 5], bm, 0) == 1 and m.history == [0]


def test_batch_layout_follows_the_cut_drafts():
    term = IncreasingMatcher()
    term.accept(STOP)
    g = constrain_drafts([None, IncreasingMatcher(), term], [[5, 6], [1, 3, 2], [1]], V)
    assert g.drafts == [[5, 6], [1, 3], []]
    assert g.bitmask is not None and g.bitmask.shape == (3 + 3 + 1, 1)
    assert g.rows == [3, 4, 5]
    assert all(int(g.bitmask[r, 0]) == -1 for r in (0, 1, 2, 6))  # unconstrained rows
    assert [allowed_of(g.bitmask, r) for r in (3, 4, 5)] == [set(range(10)), set(range(2, 10)), set(range(4, 10))]
    plain = constrain_drafts([None, None], [[1], []], V)
    assert plain.bitmask is None and plain.rows == [] and plain.drafts == [[1], []]
    with pytest.raises(ValueError):
        constrain_drafts([None], [[1], [2]], V)


def test_verified_tokens_obey_the_grammar():
    # The model prefers token 2 everywhere; the grammar, after a 2, wants increasing tokens.
    # The draft [3, 4, 1] is cut to [3, 4]; position 2's token is the best allowed one (> 4).
    m = IncreasingMatcher()
    m.accept(2)
    g = constrain_drafts([m], [[3, 4, 1]], V)
    logits = torch.zeros(3, V)
    logits[:, 2] = 5.0
    logits[:, 3] = 4.0
    logits[:, 4] = 3.0
    logits[:, 7] = 2.0
    params = SamplingParams.from_dict({"temperature": 0})
    params.normalize()
    rows = [SamplingRow(params, [], [], frozenset())]
    (v,) = verify_drafts(Sampler(V), logits, rows, g.drafts, VocabMask(g.bitmask, g.rows))
    assert v.tokens == [3, 4, 7] and v.num_accepted == 2
    assert m.history == [2]  # the scheduler accepts the emitted tokens afterwards


def test_with_a_real_xgrammar_matcher():
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo(["a", "b", "c", "ab", "</s>"], stop_token_ids=[4])
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_regex("(ab)+c")

    class Adapter:  # radixlm's XGrammarMatcher plus rollback
        def __init__(self) -> None:
            self.m = xgr.GrammarMatcher(compiled)

        @property
        def terminated(self) -> bool:
            return bool(self.m.is_terminated())

        def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
            self.m.fill_next_token_bitmask(bitmask, row)

        def accept(self, token: int) -> bool:
            return bool(self.m.accept_token(token))

        def rollback(self, num_tokens: int) -> None:
            self.m.rollback(num_tokens)

    m = Adapter()
    bm = torch.zeros((7, 1), dtype=torch.int32)
    # a b ab c are allowed, the stop token would terminate: cut before it.
    assert constrain_draft(m, [0, 1, 3, 2, 4], bm, 0) == 4
    bits = [int(bm[r, 0]) & 0b11111 for r in range(5)]
    assert bits[0] == 0b01001 and bits[1] == 0b00010 and bits[4] == 0b10000
    fresh = torch.zeros((1, 1), dtype=torch.int32)
    m.fill_bitmask(fresh, 0)
    assert int(fresh[0, 0]) == int(bm[0, 0])  # back at the start
    assert constrain_draft(m, [1], bm, 0) == 0  # "b" cannot start
