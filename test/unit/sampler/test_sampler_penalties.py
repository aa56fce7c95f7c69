"""Logit processors, checked exactly on small hand-made logits."""
from __future__ import annotations

import math

import torch

from radixlm.sampling_params import SamplingParams
from radixlm.srt.model_runner.penalties import flat_keys
from radixlm.srt.model_runner.sampler import Sampler, SamplingRow, build_stop_ids

INF = math.inf
BASE = [2.0, -1.0, 0.5, -2.0, 1.0, 0.0]
PROMPT = [0, 1]
OUTPUT = [2, 2, 3]


def row(output_ids: list[int] | None = None, stop_ids: frozenset[int] = frozenset(), **kw) -> SamplingRow:
    return SamplingRow(SamplingParams.from_dict(kw), list(PROMPT),
                       list(OUTPUT if output_ids is None else output_ids), stop_ids)


def processed(*rows: SamplingRow) -> list[list[float]]:
    logits = torch.tensor([BASE] * len(rows))
    return Sampler(6).process_logits(logits, list(rows)).tolist()


def test_repetition_penalty_hf_semantics() -> None:
    # Seen in prompt or output: 0, 1, 2, 3. Positive divided, negative multiplied.
    assert processed(row(repetition_penalty=2.0)) == [[1.0, -2.0, 0.25, -4.0, 1.0, 0.0]]
    # Penalty < 1 encourages: positive multiplied up, negative shrunk toward 0.
    assert processed(row(repetition_penalty=0.5)) == [[4.0, -0.5, 1.0, -1.0, 1.0, 0.0]]


def test_frequency_and_presence_count_output_only() -> None:
    # Output counts: token 2 twice, token 3 once; prompt tokens 0, 1 untouched.
    assert processed(row(frequency_penalty=0.5)) == [[2.0, -1.0, -0.5, -2.5, 1.0, 0.0]]
    assert processed(row(presence_penalty=0.25)) == [[2.0, -1.0, 0.25, -2.25, 1.0, 0.0]]
    assert processed(row(frequency_penalty=-1.0)) == [[2.0, -1.0, 2.5, -1.0, 1.0, 0.0]]


def test_all_penalties_combined_in_order() -> None:
    got = processed(row(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25))
    assert got == [[1.0, -2.0, -1.0, -4.75, 1.0, 0.0]]


def test_logit_bias_applied_before_repetition() -> None:
    # Bias first: (2 - 1) / 2 = 0.5. (Repetition first would give 2 / 2 - 1 = 0.)
    got = processed(row(logit_bias={0: -1.0, 5: 3.0}, repetition_penalty=2.0))
    assert got == [[0.5, -2.0, 0.25, -4.0, 1.0, 3.0]]
    assert processed(row(logit_bias={"4": 10.0})) == [[2.0, -1.0, 0.5, -2.0, 11.0, 0.0]]


def test_penalties_only_touch_their_rows() -> None:
    got = processed(row(), row(repetition_penalty=2.0), row(logit_bias={1: 1.0}),
                    row(presence_penalty=1.0, output_ids=[5]))
    assert got[0] == BASE
    assert got[1] == [1.0, -2.0, 0.25, -4.0, 1.0, 0.0]
    assert got[2] == [2.0, 0.0, 0.5, -2.0, 1.0, 0.0]
    assert got[3] == [2.0, -1.0, 0.5, -2.0, 1.0, -1.0]


def test_min_new_tokens_masks_stop_ids_until_reached() -> None:
    stops = frozenset({0, 4})
    kw = dict(max_new_tokens=10, min_new_tokens=4, stop_ids=stops)
    assert processed(row([7, 7, 7], **kw)) == [[-INF, -1.0, 0.5, -2.0, -INF, 0.0]]
    # Output index 4 = min_new_tokens: stopping is allowed again.
    assert processed(row([7, 7, 7, 7], **kw)) == [BASE]
    # Greedy would pick 0 (logit 2.0); masked, it picks 4 ... masked too, so 2.
    s = Sampler(6)
    out = s.sample(torch.tensor([BASE]), [row([], temperature=0.0, **kw)])
    assert out.next_token_ids == [2]
    # Random sampling never draws a masked stop id.
    rows = [row([1], temperature=1.0, seed=i, **kw) for i in range(300)]
    out = s.sample(torch.tensor([BASE] * 300), rows)
    assert not set(out.next_token_ids) & stops


def test_build_stop_ids() -> None:
    p = SamplingParams.from_dict(dict(stop_token_ids=[7]))
    assert build_stop_ids(p, {2, 3}) == frozenset({2, 3, 7})
    p = SamplingParams.from_dict(dict(stop_token_ids=[7], ignore_eos=True))
    assert build_stop_ids(p, {2, 3}) == frozenset({7})


def test_flat_keys() -> None:
    k = flat_keys([0, 2, 1], [[1, 1, 3], [], [0, 9, -1, 2]], 4, torch.device("cpu"))
    assert k.tolist() == [1, 1, 3, 4, 6]
    assert flat_keys([0], [[]], 4, torch.device("cpu")).numel() == 0


def test_repetition_counts_each_token_once_across_prompt_and_output() -> None:
    r = SamplingRow(SamplingParams.from_dict(dict(repetition_penalty=2.0, frequency_penalty=1.0,
                                                  presence_penalty=0.5)),
                    [0, 0, 4], [0, 4, 4, 4], frozenset())
    got = Sampler(6).process_logits(torch.tensor([BASE]), [r]).tolist()
    # token 0: 2/2 - 1*1 - 0.5; token 4: 1/2 - 1*3 - 0.5.
    assert got == [[-0.5, -1.0, 0.5, -2.0, -3.0, 0.0]]


def test_greedy_with_repetition_penalty_changes_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    r = SamplingRow(SamplingParams.from_dict(dict(temperature=0.0, repetition_penalty=2.0)),
                    [5], [0], frozenset())
    s = Sampler(3)
    assert s.sample(logits, [r]).next_token_ids == [1]
    assert s.stats.fast_path_calls == 0
