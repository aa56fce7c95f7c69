"""A rank's shards, read and written: the loader reads exactly the rank's part of each tensor
from safetensors, the weight updater cuts full tensors to it (and reports the full shape), and
the getter's parts reassemble into the whole tensor (KV heads replicated or not)."""
from __future__ import annotations

import pytest
import torch

from radixlm.srt.distributed.context import TPContext
from radixlm.srt.distributed.layout import TPLayout
from radixlm.srt.distributed.weight_parts import assemble
from radixlm.srt.model_runner.weight_updater import WeightUpdater
from radixlm.srt.models.registry import build_model
from radixlm.srt.weights.safetensors_loader import iter_safetensors_file, take_shards
from test.unit.distributed.test_sharded_model import _config, _weights


def _rank_model(cfg, weights, tp_size, rank):
    layout = TPLayout.build(cfg, tp_size, rank)
    model = build_model(cfg, torch.float32, "cpu", TPContext(layout, None))  # no forward: no collectives
    model.load_weights(take_shards(weights.items(), layout.shard))
    return model, layout


def test_safetensors_slices_equal_cut_tensors(tmp_path):
    from safetensors.torch import save_file
    cfg = _config(9, 3, tied=False, bias=True)
    weights = _weights(cfg, 1)
    path = str(tmp_path / "model.safetensors")
    save_file(weights, path)
    for rank in range(3):
        shard_of = TPLayout.build(cfg, 3, rank).shard
        read = dict(iter_safetensors_file(path, shard_of))
        cut = dict(take_shards(weights.items(), shard_of))
        assert read.keys() == cut.keys()
        assert all(torch.equal(read[n], cut[n]) for n in read)
        assert ("model.layers.0.self_attn.o_proj.bias" in read) == (rank == 0)


@pytest.mark.parametrize("heads,kv,tp", [(9, 3, 2), (9, 3, 4), (4, 1, 2)])
def test_getter_parts_reassemble(heads, kv, tp):
    cfg = _config(heads, kv, tied=False, bias=True)
    weights = _weights(cfg, 2)
    models = [_rank_model(cfg, weights, tp, r)[0] for r in range(tp)]
    for name, full in weights.items():
        for rows in (1, 5, 10**6):
            parts = [WeightUpdater(m).get_part(name, rows) for m in models]
            assert torch.equal(assemble(parts), full[:rows]), (name, rows)


def test_updater_cuts_full_tensors_and_names_the_full_shape():
    cfg = _config(9, 3)
    weights = _weights(cfg, 3)
    model, layout = _rank_model(cfg, weights, 2, 1)
    name = "model.layers.1.self_attn.k_proj.weight"
    new = torch.randn(weights[name].shape)
    assert WeightUpdater(model).update([(name, new)]) == 1
    got = WeightUpdater(model).get_part(name, 10**6)[1]
    assert torch.equal(got, new[layout.kv_heads.start * 8:layout.kv_heads.stop * 8])
    with pytest.raises(ValueError, match=r"the model has \(24, 72\)"):  # 3 KV heads x 8, not the rank's 8 rows
        WeightUpdater(model).update([(name, torch.zeros(8, 72))])
