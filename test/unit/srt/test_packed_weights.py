"""bf16 Linear layers multiply through a prepacked (oneDNN) copy of the weight: results
must match F.linear, and writing a weight by name (loader, RL weight updater) must drop
the stale packed copy."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.srt.layers.linear import Linear, mkldnn_pack_supported
from radixlm.srt.model_runner.weight_updater import WeightUpdater
from radixlm.srt.models.registry import load_model
from radixlm.srt.weights.loader import load_model_config

needs_pack = pytest.mark.skipif(not mkldnn_pack_supported(torch.bfloat16, "cpu"),
                                reason="no fast bf16 / oneDNN on this CPU")


@needs_pack
def test_packed_linear_matches_f_linear():
    lin = Linear(64, 96, bias=True, dtype=torch.bfloat16)
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    for rows in (1, 7, 33):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        with torch.inference_mode():
            got = lin(x)
        assert lin._packed is not None
        torch.testing.assert_close(got.float(), F.linear(x, lin.weight, lin.bias).float(), atol=2e-2, rtol=1e-2)


@needs_pack
def test_weight_update_refreshes_packed_copy(tiny_llama_dir, make_harness):
    cfg = load_model_config(tiny_llama_dir)
    model = load_model(tiny_llama_dir, cfg, torch.bfloat16, "cpu")
    h = make_harness(model, dtype=torch.bfloat16)
    before = h.extend([h.new_request()], [[1, 2, 3, 4]])[0]
    w = model.model.layers[0].mlp.gate_up_proj.weight
    new_gate = torch.randn(cfg.intermediate_size, cfg.hidden_size)
    WeightUpdater(model).update([("model.layers.0.mlp.gate_proj.weight", new_gate),
                                 ("model.embed_tokens.weight", torch.randn(cfg.vocab_size, cfg.hidden_size))])
    assert torch.equal(w[:cfg.intermediate_size].float(), new_gate.bfloat16().float())
    after = h.extend([h.new_request()], [[1, 2, 3, 4]])[0]
    # A fresh model with the same weights: the updated one must not use stale packs.
    fresh = load_model(tiny_llama_dir, cfg, torch.bfloat16, "cpu")
    fresh.load_state_dict(model.state_dict())
    h2 = make_harness(fresh, dtype=torch.bfloat16)
    ref = h2.extend([h2.new_request()], [[1, 2, 3, 4]])[0]
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, ref, atol=0, rtol=0)
