"""The native CPU kernels (radixlm/kernels/cpu) against plain-torch formulations."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels.cpu import ops

pytestmark = [pytest.mark.skipif(not ops.available(), reason="native CPU kernels could not be built"),
              pytest.mark.usefixtures("kernel_isa")]

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def reference_decode(q, k_buf, v_buf, indptr, indices, scale):
    b, hq, d = q.shape
    grp = hq // k_buf.shape[1]
    outs, lses = [], []
    for i in range(b):
        slots = indices[indptr[i]:indptr[i + 1]]
        k = k_buf[slots].float().repeat_interleave(grp, 1)  # [L, Hq, D]
        v = v_buf[slots].float().repeat_interleave(grp, 1)
        s = torch.einsum("hd,thd->ht", q[i].float(), k) * scale
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (4, 4, 64), (9, 3, 64), (8, 1, 128), (16, 2, 128), (6, 2, 96)])
@pytest.mark.parametrize("lens", [[1], [17], [1, 2, 31, 16, 33], [700], [5, 1000, 3]])
def test_decode_attention_matches_reference(dtype, heads, kv_heads, dim, lens):
    g = torch.Generator().manual_seed(len(lens) * 1000 + heads * 10 + dim)
    slots = 3000
    k_buf = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v_buf = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    indices = torch.randint(1, slots, (int(indptr[-1]),), generator=g)
    # q as a strided view of a fused qkv row, as the model hands it over
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, dim, generator=g).to(dtype)
    q = qkv[:, :heads]
    lse = torch.empty(len(lens), heads)
    out = ops.decode_attention(q, k_buf, v_buf, indptr, indices, dim ** -0.5, lse=lse)
    ref, ref_lse = reference_decode(q, k_buf, v_buf, indptr, indices, dim ** -0.5)
    assert out is not None and out.dtype == dtype
    assert torch.allclose(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_decode_attention_rejects_what_it_cannot_do():
    q = torch.randn(2, 20, 64)
    kv = torch.randn(10, 1, 64)
    indptr = torch.tensor([0, 1, 2])
    idx = torch.tensor([1, 2])
    assert ops.decode_attention(q, kv, kv, indptr, idx, 0.1) is None  # 20 query heads per KV head
    assert ops.decode_attention(q.half(), kv.half(), kv.half(), indptr, idx, 0.1) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33])
def test_add_rmsnorm(dtype, rows):
    x, r, w = torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype), torch.randn(576).to(dtype)
    res = r.clone()
    out = ops.add_rmsnorm(x, res, w, 1e-5)
    s = x + r
    assert torch.equal(res, s)  # the residual stream is updated in place, rounded like torch's add
    ref = F.rms_norm(s.float(), (576,), w.float(), 1e-5)
    assert torch.allclose(out.float(), ref, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    plain = ops.add_rmsnorm(x, None, w, 1e-5)
    assert torch.allclose(plain.float(), F.rms_norm(x.float(), (576,), w.float(), 1e-5),
                          atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 37])  # 37: a row that ends inside a 16-lane vector
def test_silu_mul(dtype, inter):
    gu = torch.randn(7, 2 * inter).to(dtype)
    gu[0, :6] = torch.tensor([-100.0, -30.0, 0.0, 30.0, 100.0, -0.5])  # e^-g past and near the float range
    gate, up = gu.float().chunk(2, -1)
    assert torch.allclose(ops.silu_mul(gu).float(), F.silu(gate) * up, atol=TOL[dtype] * 2, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_row_tail(dtype):
    """A hidden size that ends inside a vector: the masked lanes neither count in the mean
    square nor write past the residual's last row."""
    x, r, w = torch.randn(3, 50).to(dtype), torch.randn(3, 50).to(dtype), torch.randn(50).to(dtype)
    buf = torch.randn(3 * 50 + 16).to(dtype)
    buf[:150] = r.flatten()
    after = buf[150:].clone()
    res = buf[:150].view(3, 50)
    out = ops.add_rmsnorm(x, res, w, 1e-5)
    s = x + r
    assert torch.equal(res, s)
    assert torch.equal(buf[150:], after)
    assert torch.allclose(out.float(), F.rms_norm(s.float(), (50,), w.float(), 1e-5), atol=TOL[dtype] * 4,
                          rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_inplace_matches_torch_rotation(dtype):
    from radixlm.srt.layers.rotary import RotaryEmbedding, apply_rotary

    rot = RotaryEmbedding(64, 512, 10000.0)
    positions = torch.tensor([0, 5, 511, 3, 200])
    qkv = torch.randn(5, 7, 64).to(dtype)
    want = apply_rotary(qkv[:, :5].float(), *rot.cos_sin(positions, torch.float32))
    cos, sin = rot._cos_sin(positions.device, torch.float32, 512)
    x = qkv.clone()
    assert ops.rope_inplace(x[:, :5], positions, cos, sin)
    assert torch.allclose(x[:, :5].float(), want, atol=TOL[dtype] * 2, rtol=TOL[dtype])
    assert torch.equal(x[:, 5:], qkv[:, 5:])  # heads past the view untouched


def test_store_kv_writes_rows_at_slots():
    k_buf, v_buf = torch.zeros(10, 2, 4), torch.zeros(10, 2, 4)
    kv = torch.randn(3, 6, 4)
    loc = torch.tensor([7, 2, 9])
    assert ops.store_kv(kv[:, 2:4], kv[:, 4:], k_buf, v_buf, loc)
    assert torch.equal(k_buf[loc], kv[:, 2:4]) and torch.equal(v_buf[loc], kv[:, 4:])
    assert k_buf[[0, 1, 3, 4, 5, 6, 8]].abs().sum() == 0


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 17), (32, 49152), (5, 100000)])
def test_argmax_rows_matches_torch(rows, vocab):
    g = torch.Generator().manual_seed(rows + vocab)
    wide = torch.randn(rows, vocab + 3, generator=g)
    x = wide[:, :vocab]  # rows with a stride, as the sampler's vocab slice of padded logits
    if rows >= 3 and vocab > 10:
        x[0, :] = 2.0  # ties: the first index wins
        x[1, 9] = float("inf")
        x[2, 7] = float("nan")  # NaN counts as the largest value, the first one wins
        x[2, 3] = float("nan")
    got = ops.argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert ops.argmax_rows(x.double()) is None and ops.argmax_rows(torch.empty(2, 0)) is None
