"""Float Linear layers multiply through a packed copy of the weight (oneDNN's for bf16 on
CPUs with fast bf16, radixlm's AVX2 panels for float32/bf16 elsewhere): results must match
F.linear, and writing a weight by name (loader, RL weight updater) must drop the stale
packed copy."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.srt.layers.linear import Linear, pack_for
from radixlm.srt.model_runner.weight_updater import WeightUpdater
from radixlm.srt.models.registry import load_model
from radixlm.srt.weights.loader import load_model_config


def _packs(dtype: torch.dtype) -> bool:
    return pack_for(torch.zeros(16, 16, dtype=dtype)) is not None


DTYPES = [pytest.param(dt, marks=pytest.mark.skipif(not _packs(dt), reason=f"no packed {dt} linear on this CPU"))
          for dt in (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_matches_f_linear(dtype):
    lin = Linear(64, 96, bias=True, dtype=dtype)
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    for rows in (1, 7, 33):
        x = torch.randn(rows, 64, dtype=dtype)
        with torch.inference_mode():
            got = lin(x)
        assert lin._packed is not None
        torch.testing.assert_close(got.float(), F.linear(x, lin.weight, lin.bias).float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_update_refreshes_packed_copy(tiny_llama_dir, make_harness, dtype):
    cfg = load_model_config(tiny_llama_dir)
    model = load_model(tiny_llama_dir, cfg, dtype, "cpu")
    h = make_harness(model, dtype=dtype)
    before = h.extend([h.new_request()], [[1, 2, 3, 4]])[0]
    w = model.model.layers[0].mlp.gate_up_proj.weight
    new_gate = torch.randn(cfg.intermediate_size, cfg.hidden_size)
    WeightUpdater(model).update([("model.layers.0.mlp.gate_proj.weight", new_gate),
                                 ("model.embed_tokens.weight", torch.randn(cfg.vocab_size, cfg.hidden_size))])
    assert torch.equal(w[:cfg.intermediate_size].float(), new_gate.to(dtype).float())
    after = h.extend([h.new_request()], [[1, 2, 3, 4]])[0]
    # A fresh model with the same weights: the updated one must not use stale packs.
    fresh = load_model(tiny_llama_dir, cfg, dtype, "cpu")
    fresh.load_state_dict(model.state_dict())
    h2 = make_harness(fresh, dtype=dtype)
    ref = h2.extend([h2.new_request()], [[1, 2, 3, 4]])[0]
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, ref, atol=0, rtol=0)
