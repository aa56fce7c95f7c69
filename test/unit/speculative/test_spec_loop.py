"""Drafter + verification in a decode loop over a toy model, without the scheduler: speculative
output equals non-speculative output token for token (greedy and seeded sampling, penalties,
min_new_tokens), with EOS and max_new_tokens landing inside accepted runs.

The toy model's next-token logits depend on the last two tokens only, so its text repeats and
the drafter finds copies: the runs are long enough to matter.
"""
from __future__ import annotations

import pytest
import torch

from radixlm.sampling_params import SamplingParams
from radixlm.speculative.acceptance import verify_drafts
from radixlm.speculative.drafter import NgramConfig, NgramDrafter
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow

V = 12
EOS = 11
TABLE = torch.randn(64, V, generator=torch.Generator().manual_seed(4)) * 3.0
TABLE[:, EOS] -= 2.0  # EOS is rare but does happen


def model(ctx: list[int]) -> torch.Tensor:
    return TABLE[(ctx[-1] * 7 + ctx[-2]) % 64]


def make_row(out: list[int], kw: dict) -> SamplingRow:
    params = SamplingParams.from_dict(kw)
    params.normalize()
    return SamplingRow(params, [], list(out), frozenset({EOS}))


def plain(prompt: list[int], kw: dict, max_new: int) -> list[int]:
    s, out = Sampler(V, seed=1), []
    while len(out) < max_new:
        (t,) = s.sample(model(prompt + out)[None], [make_row(out, kw)]).next_token_ids
        out.append(t)
        if t == EOS:
            break
    return out


def speculative(prompt: list[int], kw: dict, max_new: int, drafter: NgramDrafter,
                cap_drafts: bool = True) -> tuple[list[int], int, int, int]:
    """Returns the output, the verify steps, the accepted drafts, and how many steps' runs were
    cut short by a finish (EOS or max_new_tokens before the run's last token). cap_drafts=False
    drafts past max_new_tokens, so that the cut, not the drafter, enforces it."""
    s, out = Sampler(V, seed=2), []
    steps = accepted = cuts = 0
    while len(out) < max_new:
        ctx = prompt + out
        draft = drafter.propose(ctx, max_tokens=max_new - len(out) - 1 if cap_drafts else None).tokens
        logits = torch.stack([model(ctx + draft[:j]) for j in range(len(draft) + 1)])
        (v,) = verify_drafts(s, logits, [make_row(out, kw)], [draft])
        # The finish checks cut the run: EOS, then max_new_tokens.
        n = next((i + 1 for i, t in enumerate(v.tokens) if t == EOS), len(v.tokens))
        keep = min(n, max_new - len(out))
        cuts += keep < len(v.tokens)
        v = v.truncated(keep)
        assert v.kv_keep == len(v.tokens) <= len(draft) + 1
        out += v.tokens
        steps += 1
        accepted += min(v.num_accepted, len(v.tokens) - 1)
        if out[-1] == EOS:
            break
    drafter.on_finish(prompt, out)
    return out, steps, accepted, cuts


KINDS = [
    {"temperature": 0},
    {"temperature": 0, "frequency_penalty": 0.4, "repetition_penalty": 1.2},
    {"temperature": 0.8, "top_p": 0.9, "seed": 7},
    {"temperature": 1.0, "top_k": 4, "presence_penalty": 0.5, "seed": 11},
    {"temperature": 0.7, "min_p": 0.05, "min_new_tokens": 30, "seed": 3},
]


# Uncapped drafts (max_new_tokens enforced by the cut alone) for one greedy and one sampled kind.
CASES = [(kw, True) for kw in KINDS] + [(KINDS[0], False), (KINDS[2], False)]


@pytest.mark.parametrize(("kw", "cap_drafts"), CASES,
                         ids=[",".join(f"{k}={v}" for k, v in kw.items()) + ("" if cap else "-uncapped")
                              for kw, cap in CASES])
def test_speculative_equals_plain_decoding(kw, cap_drafts):
    drafter = NgramDrafter(NgramConfig(num_draft_tokens=5, min_match_window=1, max_match_window=4))
    total_steps = total_tokens = total_accepted = total_cuts = 0
    for p in range(6):
        prompt = [p % V, (3 * p + 1) % 11, (5 * p + 2) % 11]
        max_new = 20 + 9 * p
        want = plain(prompt, kw, max_new)
        got, steps, accepted, cuts = speculative(prompt, kw, max_new, drafter, cap_drafts)
        assert got == want, (p, kw)
        total_cuts += cuts
        total_steps += steps
        total_tokens += len(got)
        total_accepted += accepted
    # Drafts were accepted often enough that the identity covered long runs.
    assert total_accepted > total_tokens // 5 and total_steps < total_tokens
    if not cap_drafts:
        assert total_cuts > 0  # max_new_tokens (or EOS) landed inside an accepted run


def test_max_new_tokens_inside_an_accepted_run():
    # Greedy after a warm-up that put the same prompt's output in the index: every draft is
    # accepted, and the cut ends each run exactly at max_new_tokens.
    prompt = [0, 1, 2]  # greedy never meets EOS from here
    for max_new in (1, 2, 5, 9, 17):
        # A fresh index each time: a finished request's insert replaces the continuation of
        # the same n-grams, so the previous (shorter) run would shorten the drafts.
        drafter = NgramDrafter(NgramConfig(num_draft_tokens=8))
        speculative(prompt, {"temperature": 0}, 40, drafter)
        want = plain(prompt, {"temperature": 0}, max_new)
        got, steps, _, cuts = speculative(prompt, {"temperature": 0}, max_new, drafter, cap_drafts=False)
        assert got == want and len(got) == max_new
        assert steps == -(-max_new // 9) and cuts == (max_new % 9 != 0)
