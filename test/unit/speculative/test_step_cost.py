"""The measured verify-step cost model: interpolation, the ratios the adaptive rule reads, and
its start-up measurement on a real (tiny) runner."""
from __future__ import annotations

import pytest

from radixlm.speculative.adaptive import AcceptanceTracker, AdaptiveConfig, best_draft_length
from radixlm.speculative.step_cost import StepCost, linear_cost_ratios, priced_ratios
from radixlm.srt.model_runner.step_timing import measure_step_cost, step_cost_points


def test_time_interpolates_and_extrapolates():
    c = StepCost((1, 4, 8), (0.010, 0.013, 0.021))
    assert c.time(1) == 0.010 and c.time(4) == 0.013
    assert c.time(2) == pytest.approx(0.011)
    assert c.time(6) == pytest.approx(0.017)
    assert c.time(12) == pytest.approx(0.029)  # the last segment's slope (2 ms per token)
    assert c.time(0) == 0.010


def test_a_dip_is_noise_and_bad_points_are_refused():
    c = StepCost((1, 2, 3), (0.010, 0.009, 0.012))
    assert c.seconds == (0.010, 0.010, 0.012)
    for tokens, secs in (((1,), (0.1,)), ((2, 3), (0.1, 0.2)), ((1, 3, 3), (0.1, 0.2, 0.3)), ((1, 2), (0.1, 0.0))):
        with pytest.raises(ValueError):
            StepCost(tokens, secs)


def test_ratios_are_batch_relative():
    # memory-bound up to 4 tokens, then 1 ms per token
    c = StepCost((1, 4, 16, 64), (0.010, 0.010, 0.022, 0.070))
    one = c.ratios(1, 8)
    assert one[0] == 1.0 and one[3] == 1.0  # 4 rows cost what 1 does
    assert one[8] == pytest.approx(c.time(9) / 0.010)
    big = c.ratios(16, 2)
    assert big == pytest.approx((1.0, 0.038 / 0.022, 0.054 / 0.022))


def test_a_step_is_never_priced_below_the_line():
    cheap = StepCost((1, 64), (0.050, 0.060))  # a forward that barely grows (float32 at batch 32)
    assert priced_ratios(cheap, 0.2, 1, 4) == linear_cost_ratios(0.2, 4)
    steep = StepCost((1, 2, 9), (0.020, 0.030, 0.100))  # one that grows faster than the line
    got = priced_ratios(steep, 0.07, 1, 8)
    assert got == steep.ratios(1, 8) and got[1] == pytest.approx(1.5)
    mixed = StepCost((1, 4, 9), (0.010, 0.010, 0.030))
    assert priced_ratios(mixed, 0.07, 1, 8)[:4] == linear_cost_ratios(0.07, 3)
    assert priced_ratios(mixed, 0.07, 1, 8)[8] == pytest.approx(3.0)


def test_draft_length_reads_a_cost_sequence_like_the_line():
    for a in (0.3, 0.6, 0.9):
        for cost in (0.02, 0.2, 0.7):
            assert best_draft_length(a, linear_cost_ratios(cost, 8), 8) == best_draft_length(a, cost, 8)
    # a sequence shorter than max_k + 1 caps the draft; a free first few tokens draft them
    assert best_draft_length(0.99, (1.0, 1.0, 1.0), 8) == 2
    flat_then_steep = StepCost((1, 4, 9), (0.010, 0.010, 0.030)).ratios(1, 8)
    assert best_draft_length(0.7, flat_then_steep, 8) == 3
    assert best_draft_length(0.7, 0.07, 8) > 3  # what the unmeasured line would draft
    t = AcceptanceTracker()
    assert t.may_draft(8, flat_then_steep, AdaptiveConfig()) and t.draft_length(4, 8, flat_then_steep,
                                                                                AdaptiveConfig()) == 3


def test_measured_on_the_tiny_runner(tiny_llama_dir):
    from radixlm.config import ServerArgs
    from radixlm.srt.model_runner.runner import ModelRunner

    args = ServerArgs.from_kwargs(model_path=tiny_llama_dir, dtype="float32", attention_backend="cpu",
                                  max_total_tokens=1024)
    runner = ModelRunner(args.runner_config())
    cost = measure_step_cost(runner, 6, repeats=1)
    assert cost is not None and cost.tokens == step_cost_points(6) == (1, 2, 3, 4, 5, 6, 7, 16, 32, 64)
    assert all(s > 0 for s in cost.seconds) and list(cost.seconds) == sorted(cost.seconds)
    assert int(runner.req_to_token[0].abs().sum()) == 0  # its request row is left as found
    small = ServerArgs.from_kwargs(model_path=tiny_llama_dir, dtype="float32", attention_backend="cpu",
                                   max_total_tokens=60)
    assert measure_step_cost(ModelRunner(small.runner_config()), 6) is None  # no room to time 64 tokens
