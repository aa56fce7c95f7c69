"""Attention in plain PyTorch (scaled_dot_product_attention) over the paged KV pool.

EXTEND: one SDPA call per request. A request without cached prefix attends over the
K/V it was just given (causal); one with a prefix gathers its whole KV row through
req_to_token and uses an explicit mask, because SDPA's is_causal aligns the triangle
to the top-left corner, which is wrong when keys outnumber queries.

DECODE: requests are sorted by length and split into a few groups (see
plan_decode_groups); each group gathers its KV rows into one padded [n, L_max] block
and masks the padding. One group for everything wastes work on padding when lengths
differ a lot; one group per request pays the per-call overhead B times per layer. The
G = num_heads / num_kv_heads query heads sharing a KV head are folded into SDPA's
query-length axis ([n, Hkv, G, D] against [n, Hkv, L, D]), so K/V are never repeated.

Gathers go into a reused workspace: fresh multi-MB allocations are returned to the OS
on free and page-faulted back in on every layer, which measured 2-3x slower for fp32
at B=32, L=1024 on the 2-core VM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.srt.model_runner.attention.base import ATTENTION_BACKENDS, AttentionBackend
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _ExtendReq:
    q_start: int
    q_len: int
    prefix_len: int
    kv_index: torch.Tensor | None  # [seq_len] slots, None when prefix_len == 0
    mask: torch.Tensor | None  # [q_len, seq_len] bool (True = attend), None when prefix_len == 0


@dataclass
class _ExtendMetadata:
    reqs: list[_ExtendReq]


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None  # batch positions of the group's requests; None = whole batch in order
    kv_index: torch.Tensor  # [n * L_max] slots, row-major (padding columns point at slot 0)
    n: int
    max_len: int
    mask: torch.Tensor | None  # [n, 1, 1, L_max] bool (True = attend); None when all lengths equal


@dataclass
class _DecodeMetadata:
    groups: list[_DecodeGroup]


def plan_decode_groups(seq_lens: list[int], call_cost_keys: float,
                       max_group_keys: int = 1 << 62) -> list[list[int]]:
    """Split a decode batch into groups of batch positions, minimising the estimated cost

        sum over groups of  call_cost_keys + len(group) * max(seq_len in group)

    i.e. padded attention work plus a fixed per-group overhead expressed in keys. Groups
    are contiguous runs of the length-sorted batch (optimal for this cost), found by an
    O(B^2) dynamic program over plain ints; B <= a few hundred, run once per forward.
    """
    if max(seq_lens) * len(seq_lens) <= max_group_keys and \
            max(seq_lens) * len(seq_lens) - sum(seq_lens) <= call_cost_keys:
        return [list(range(len(seq_lens)))]  # padding costs less than a second call
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    lens = [seq_lens[i] for i in order]
    n = len(lens)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sorted requests
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        top = lens[j - 1]  # the longest request of any group ending at j
        for i in range(j - 1, -1, -1):
            c = best[i] + call_cost_keys + (j - i) * top
            if c < best[j]:
                best[j], cut[j] = c, i
            if call_cost_keys + (j - i) * top > best[j] + 1:  # larger groups only cost more
                break
            if (j - i + 1) * top > max_group_keys:  # the next larger group would be too big
                break
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


@ATTENTION_BACKENDS.register("torch_native")
class TorchNativeAttention(AttentionBackend):
    def __init__(self, kv_pool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(kv_pool, num_heads, num_kv_heads, head_dim)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.group = num_heads // num_kv_heads
        # Fixed cost of one decode attention call (SDPA + gathers), in units of "one key
        # of one request"; measured ~50-100 us vs ~0.2 us per key on a 2-core CPU.
        self.call_cost_keys = 256.0
        # Cap on n * L_max of one group: beyond ~L2-sized gathers SDPA re-reads K/V from
        # memory, so several cache-sized groups beat one big one (fp32 B=64, L=1024: 1.4x).
        self.max_group_keys = 4096
        # Gathers larger than this allocate fresh memory instead of growing the workspace.
        self.workspace_max_bytes = 256 << 20
        self._workspace: list[torch.Tensor | None] = [None, None]

    # ---- metadata: built once per forward, shared by every layer ----
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.mode == ForwardMode.DECODE:
            fb.attn_metadata = self._decode_metadata(fb)
        else:
            fb.attn_metadata = self._extend_metadata(fb)

    def _decode_metadata(self, fb: ForwardBatch) -> _DecodeMetadata:
        lens = fb.seq_lens_cpu
        plan = plan_decode_groups(lens, self.call_cost_keys, self.max_group_keys) if len(lens) > 1 else []
        if len(plan) <= 1:
            plan = [list(range(len(lens)))]  # one group: keep batch order, no q/out shuffling
        device = fb.req_pool_indices.device
        groups: list[_DecodeGroup] = []
        for members in plan:
            g_lens = [lens[i] for i in members]
            max_len = max(g_lens)
            rows = None if len(plan) == 1 else torch.tensor(members, dtype=torch.int64, device=device)
            pool_rows = fb.req_pool_indices if rows is None else fb.req_pool_indices.index_select(0, rows)
            kv_index = fb.req_to_token.index_select(0, pool_rows)[:, :max_len]
            mask = None
            if min(g_lens) != max_len:
                lens_t = torch.tensor(g_lens, dtype=torch.int64, device=device)
                valid = torch.arange(max_len, device=device)[None, :] < lens_t[:, None]
                # Padding columns read slot 0 rather than whatever stale slot the table
                # holds: a never-written slot may hold NaN, and masked softmax weights
                # are 0, but 0 * NaN is NaN in P @ V.
                kv_index = kv_index.masked_fill(~valid, 0)
                mask = valid.view(-1, 1, 1, max_len)
            groups.append(_DecodeGroup(rows, kv_index.reshape(-1), len(members), max_len, mask))
        return _DecodeMetadata(groups)

    def _extend_metadata(self, fb: ForwardBatch) -> _ExtendMetadata:
        reqs: list[_ExtendReq] = []
        rows = fb.req_pool_indices.tolist()
        start = 0
        device = fb.input_ids.device
        for row, prefix, ext in zip(rows, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            kv_index = mask = None
            if prefix > 0:
                seq_len = prefix + ext
                kv_index = fb.req_to_token[row, :seq_len]
                q_pos = torch.arange(prefix, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            reqs.append(_ExtendReq(start, ext, prefix, kv_index, mask))
            start += ext
        return _ExtendMetadata(reqs)

    # ---- compute ----
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch, scale: float) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        meta = fb.attn_metadata
        if meta is None:  # caller skipped init_forward_metadata
            self.init_forward_metadata(fb)
            meta = fb.attn_metadata
        if isinstance(meta, _DecodeMetadata):
            return self._decode(q, layer_id, meta, scale)
        return self._extend(q, k, v, layer_id, meta, scale)

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: _ExtendMetadata, scale: float) -> torch.Tensor:
        k_buf, v_buf = self.kv_pool.get_kv(layer_id)
        out = torch.empty_like(q)
        gqa = self.group > 1
        for r in meta.reqs:
            if r.q_len == 0:
                continue
            # 4-D inputs: CPU SDPA only takes its flash kernel for [B, H, L, D]; 3-D inputs
            # fall back to the math path, measured 5x slower at L=2048.
            qs = q[r.q_start:r.q_start + r.q_len].transpose(0, 1)[None]  # [1, H, L, D]
            if r.kv_index is None:
                # No prefix: the fresh K/V are exactly this request's whole KV.
                ks = k[r.q_start:r.q_start + r.q_len].transpose(0, 1)[None]
                vs = v[r.q_start:r.q_start + r.q_len].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks.to(q.dtype), vs.to(q.dtype), is_causal=True,
                                                   scale=scale, enable_gqa=gqa)
            else:
                ks = self._gather(k_buf, r.kv_index, 0).transpose(0, 1)[None]  # [1, Hkv, S, D]
                vs = self._gather(v_buf, r.kv_index, 1).transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks.to(q.dtype), vs.to(q.dtype), attn_mask=r.mask,
                                                   scale=scale, enable_gqa=gqa)
            out[r.q_start:r.q_start + r.q_len] = o[0].transpose(0, 1)
        return out

    def _gather(self, buf: torch.Tensor, index: torch.Tensor, slot: int) -> torch.Tensor:
        """buf[index] written into a reused workspace (see module docstring)."""
        need = index.numel() * buf.shape[1] * buf.shape[2]
        if need * buf.element_size() > self.workspace_max_bytes:
            return buf.index_select(0, index)
        ws = self._workspace[slot]
        if ws is None or ws.numel() < need or ws.dtype != buf.dtype or ws.device != buf.device:
            # 25% headroom: decode lengths grow by one token per step.
            ws = torch.empty(min(need + need // 4, self.workspace_max_bytes // buf.element_size()),
                             dtype=buf.dtype, device=buf.device)
            self._workspace[slot] = ws
        out = ws[:need].view(index.numel(), buf.shape[1], buf.shape[2])
        return torch.index_select(buf, 0, index, out=out)

    def _decode(self, q: torch.Tensor, layer_id: int, meta: _DecodeMetadata, scale: float) -> torch.Tensor:
        k_buf, v_buf = self.kv_pool.get_kv(layer_id)
        hkv, d = self.num_kv_heads, self.head_dim
        out = None if len(meta.groups) == 1 and meta.groups[0].rows is None else torch.empty_like(q)
        for g in meta.groups:
            # [n*L, Hkv, D] -> [n, Hkv, L, D]
            ks = self._gather(k_buf, g.kv_index, 0).view(g.n, g.max_len, hkv, d).transpose(1, 2)
            vs = self._gather(v_buf, g.kv_index, 1).view(g.n, g.max_len, hkv, d).transpose(1, 2)
            qg = q if g.rows is None else q.index_select(0, g.rows)
            # query head h = kv_head * G + g (HF's repeat_kv layout)
            o = F.scaled_dot_product_attention(qg.view(g.n, hkv, self.group, d), ks.to(q.dtype),
                                               vs.to(q.dtype), attn_mask=g.mask, scale=scale)
            o = o.reshape(g.n, self.num_heads, d)
            if out is None:
                return o
            out.index_copy_(0, g.rows, o)
        return out
