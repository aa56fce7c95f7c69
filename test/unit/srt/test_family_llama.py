"""The family checks (test/support/family_checks.py) on the tiny Llama: logits and 32-token
greedy continuations against transformers through every engine path, and proof that the checks
fail on a model that is slightly wrong."""
from __future__ import annotations

import pytest

from test.support.family_checks import VARIANTS, HFReference, check_greedy, check_logits
from test.support.tiny_models import perturbed_copy


@pytest.fixture(scope="module")
def llama_ref(tiny_llama_dir) -> HFReference:
    return HFReference(tiny_llama_dir)


def test_logits_match_transformers(tiny_llama_dir, llama_ref):
    check_logits(tiny_llama_dir, reference=llama_ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_matches_transformers(tiny_llama_dir, llama_ref, variant):
    check_greedy(tiny_llama_dir, variant, reference=llama_ref)


def test_the_checks_fail_on_a_perturbed_weight(tiny_llama_dir, llama_ref, tmp_path):
    """One tensor of layer 1 moved by noise of 0.05 (its entries are ~0.02): the logits check and
    the greedy check against the unperturbed reference both fail."""
    wrong = perturbed_copy(tiny_llama_dir, tmp_path / "wrong", "model.layers.1.self_attn.v_proj.weight")
    with pytest.raises(AssertionError, match="prefill"):
        check_logits(wrong, reference=llama_ref)
    with pytest.raises(AssertionError, match="plain"):
        check_greedy(wrong, "plain", reference=llama_ref)
