"""Attention in plain PyTorch (scaled_dot_product_attention) over the paged KV pool.

EXTEND: one SDPA call per request. A request without cached prefix attends over the
K/V it was just given (causal); one with a prefix gathers its whole KV row through
req_to_token and uses an explicit mask, because SDPA's is_causal aligns the triangle
to the top-left corner, which is wrong when keys outnumber queries.

DECODE: requests are sorted by length and split into a few groups (see
plan_decode_groups); each group gathers its KV rows into one padded [n, L_max] block
and masks the padding. One group for everything wastes work on padding when lengths
differ a lot; one group per request pays the per-call overhead B times per layer. A
group is two batched GEMMs over the token-major gathered K/V with a block-diagonal
query (see _decode_group); a single request uses SDPA. When every request of the batch
starts with the same KV slots (a radix-shared prefix), that prefix is gathered once and
attended to with per-KV-head GEMMs over all n*G query rows (see _decode_shared).

SLIDING-WINDOW and SOFT-CAPPED layers (Gemma 2/3) attend per request over only the keys in
their window (masked.py), in both modes.

Gathers go into a reused workspace: fresh multi-MB allocations are returned to the OS
on free and page-faulted back in on every layer, which measured 2-3x slower for fp32
at B=32, L=1024 on the 2-core VM.

An int8 KV pool (--kv-cache-dtype int8) is read through kv_pool.gather_kv, which
dequantizes to the model dtype (the workspace is skipped: the dequantized block is a
fresh tensor anyway). Every read goes through the pool, including the K/V of the
tokens being extended, so attention always sees the stored (quantized) values and a
request's output does not depend on whether its prefix was cached or its prompt chunked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.srt.model_runner.attention.base import ATTENTION_BACKENDS, AttentionBackend
from radixlm.srt.model_runner.attention.masked import attend_masked
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
    _bias: dict = None  # dtype -> additive mask [n, 1, L_max] (0 / -inf), built on first use

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The padding mask as an additive bias, built once per forward and shared by all layers."""
        if self.mask is None:
            return None
        if self._bias is None:
            self._bias = {}
        b = self._bias.get(dtype)
        if b is None:
            b = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            b = b.masked_fill_(~self.mask, float("-inf")).view(self.n, 1, self.max_len)
            self._bias[dtype] = b
        return b


@dataclass
class _DecodeMetadata:
    groups: list[_DecodeGroup]
    # KV slots [P] that every request of the batch has as its first P keys (a shared radix
    # prefix: system prompt, few-shot examples, n>1 samples). None when there is none worth
    # sharing; then the groups cover whole sequences, else only the keys after P.
    shared_index: torch.Tensor | None = None


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
        # Decode batches whose requests all start with the same >= this many KV slots attend
        # to that prefix with one dense GEMM instead of gathering it once per request.
        self.min_shared_prefix = 64
        # ... and extend batches over such a prefix run the same way while tokens x keys
        # stays below this (the [tokens, H, keys] score block is materialised) and every
        # token's keys past the shared prefix, gathered per token, stay below the second
        # bound: 1,024 tokens of long prompts chunked over a 609-token shared prefix gathered
        # 1,024 x 640 K/V rows per layer (3.4 s per forward, against ~0.2 s through SDPA).
        self.max_extend_as_decode_keys = 1 << 21
        self.max_extend_as_decode_suffix_keys = 1 << 16

    # ---- metadata: built once per forward, shared by every layer ----
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.mode == ForwardMode.DECODE:
            fb.attn_metadata = self._decode_metadata(fb)
        else:
            fb.attn_metadata = self._extend_metadata(fb)

    @staticmethod
    def _pool_rows(fb: ForwardBatch, positions: list[int] | None = None) -> torch.Tensor:
        """The pool rows of the batch's requests (or of those at batch `positions`) as an index
        into req_to_token, on the table's device. The runner keeps the table on the host and
        the batch's vectors on the compute device: the rows come from the batch's host copy,
        so the device is never waited for."""
        rows = fb.req_pool_indices_cpu
        if positions is not None:
            rows = [rows[i] for i in positions]
        return torch.tensor(rows, dtype=torch.int64, device=fb.req_to_token.device)

    def _shared_prefix_len(self, fb: ForwardBatch, limit: int) -> int:
        """Length (<= limit) of the KV-slot prefix common to every request of the batch, or
        0 if below min_shared_prefix. The radix cache hands requests with a common token
        prefix the very same slots, so comparing slot ids finds it."""
        if fb.batch_size < 2 or fb.req_to_token.device.type != "cpu":
            return 0  # a device table would need a sync here; not worth it
        if limit < self.min_shared_prefix:
            return 0
        p = self._common_slots(fb, limit)
        return p if p >= self.min_shared_prefix else 0

    def _common_slots(self, fb: ForwardBatch, limit: int) -> int:
        """How many leading slots (<= limit) all of the batch's rows of the host table share."""
        table = fb.req_to_token[:, :limit].index_select(0, self._pool_rows(fb))
        same = (table == table[:1]).all(0)
        # Leading run of True; argmin finds the first False (0 if the run covers all).
        return limit if bool(same.all()) else int(same.to(torch.int8).argmin())

    def _shared_metadata(self, fb: ForwardBatch, shared: int, positions: list[int] | None,
                         lens: list[int]) -> _DecodeMetadata:
        """Single-query attention rows (row r: the request at batch position positions[r], or
        r when None, keys [0, lens[r])) whose first `shared` keys are common: one group over
        the suffixes + the shared slots."""
        device = fb.req_pool_indices.device
        suffix = [n - shared for n in lens]
        max_len = max(suffix)
        pool_rows = self._pool_rows(fb, positions)
        kv_index = fb.req_to_token[:, shared:shared + max_len].index_select(0, pool_rows).to(device)
        mask = None
        if min(suffix) != max_len:
            lens_t = torch.tensor(suffix, dtype=torch.int64, device=device)
            valid = torch.arange(max_len, device=device)[None, :] < lens_t[:, None]
            kv_index = kv_index.masked_fill(~valid, 0)  # slot 0 is finite (see _decode_metadata)
            mask = valid.view(-1, 1, 1, max_len)
        row0 = fb.req_to_token[fb.req_pool_indices_cpu[0]]
        group = _DecodeGroup(None, kv_index.reshape(-1), len(lens), max_len, mask)
        return _DecodeMetadata([group], row0[:shared].to(device, copy=True))

    def _decode_metadata(self, fb: ForwardBatch) -> _DecodeMetadata:
        lens = fb.seq_lens_cpu
        # Each request's newest slot is its own: the shared part is shorter than every row.
        shared = self._shared_prefix_len(fb, min(lens) - 1)
        if shared:
            return self._shared_metadata(fb, shared, None, lens)
        plan = plan_decode_groups(lens, self.call_cost_keys, self.max_group_keys) if len(lens) > 1 else []
        if len(plan) <= 1:
            plan = [list(range(len(lens)))]  # one group: keep batch order, no q/out shuffling
        device = fb.req_pool_indices.device
        groups: list[_DecodeGroup] = []
        for members in plan:
            g_lens = [lens[i] for i in members]
            max_len = max(g_lens)
            rows = None if len(plan) == 1 else torch.tensor(members, dtype=torch.int64, device=device)
            pool_rows = self._pool_rows(fb, None if rows is None else members)
            kv_index = fb.req_to_token[:, :max_len].index_select(0, pool_rows).to(device)
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

    def _extend_metadata(self, fb: ForwardBatch) -> _ExtendMetadata | _DecodeMetadata:
        prefixes = fb.extend_prefix_lens_cpu
        if prefixes and min(prefixes) >= self.min_shared_prefix:
            # Requests extending a common cached prefix (n samples / shared system prompt):
            # every new token is a single-query row over [0, its position], so the whole
            # batch runs as one shared-prefix decode instead of one SDPA per request.
            tokens = fb.num_tokens
            longest = max(p + e for p, e in zip(prefixes, fb.extend_seq_lens_cpu))
            if tokens * longest <= self.max_extend_as_decode_keys:
                shared = self._shared_prefix_len(fb, min(prefixes))
                if shared and tokens * (longest - shared) <= self.max_extend_as_decode_suffix_keys:
                    lens: list[int] = []
                    owner: list[int] = []
                    for i, (p, e) in enumerate(zip(prefixes, fb.extend_seq_lens_cpu)):
                        lens.extend(range(p + 1, p + e + 1))
                        owner.extend([i] * e)
                    return self._shared_metadata(fb, shared, owner, lens)
        reqs: list[_ExtendReq] = []
        rows = fb.req_pool_indices_cpu
        start = 0
        device = fb.input_ids.device
        for row, prefix, ext in zip(rows, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            kv_index = mask = None
            if prefix > 0:
                seq_len = prefix + ext
                kv_index = fb.req_to_token[row, :seq_len].to(device)
                q_pos = torch.arange(prefix, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            reqs.append(_ExtendReq(start, ext, prefix, kv_index, mask))
            start += ext
        return _ExtendMetadata(reqs)

    # ---- compute ----
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        if window is not None or softcap is not None:
            return self._attend_masked(q, layer_id, fb, scale, window, softcap)
        meta = fb.attn_metadata
        if meta is None:  # caller skipped init_forward_metadata
            self.init_forward_metadata(fb)
            meta = fb.attn_metadata
        if isinstance(meta, _DecodeMetadata):
            if meta.shared_index is not None:
                return self._decode_shared(q, layer_id, meta, scale)
            return self._decode(q, layer_id, meta, scale)
        if self.kv_pool.quantized and any(r.kv_index is None and r.q_len for r in meta.reqs):
            # Attend to what was stored, not to the unrounded K/V (see module docstring): a
            # cached prefix or a later chunk reads these tokens back quantized as well.
            # (Requests with a prefix gather everything from the pool already.)
            k = self.kv_pool.gather_kv(layer_id, fb.out_cache_loc, 0)
            v = self.kv_pool.gather_kv(layer_id, fb.out_cache_loc, 1)
        return self._extend(q, k, v, layer_id, meta, scale)

    def _attend_masked(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch, scale: float,
                       window: int | None, softcap: float | None) -> torch.Tensor:
        """A sliding-window or soft-capped layer, per request over the keys it can see (masked.py);
        the new tokens' K/V are read back from the pool like the prefix's."""
        k_buf, v_buf = self.kv_pool.get_kv(layer_id)

        def gather(index: torch.Tensor, which: int) -> torch.Tensor:
            if self.kv_pool.quantized:
                return self.kv_pool.gather_kv(layer_id, index, which)
            return (k_buf if which == 0 else v_buf).index_select(0, index)

        return attend_masked(q, fb, gather, self.group, scale, window, softcap)

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
                ks = self._gather_kv(layer_id, k_buf, r.kv_index, 0).transpose(0, 1)[None]  # [1, Hkv, S, D]
                vs = self._gather_kv(layer_id, v_buf, r.kv_index, 1).transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks.to(q.dtype), vs.to(q.dtype), attn_mask=r.mask,
                                                   scale=scale, enable_gqa=gqa)
            out[r.q_start:r.q_start + r.q_len] = o[0].transpose(0, 1)
        return out

    def _gather_kv(self, layer_id: int, buf: torch.Tensor, index: torch.Tensor, which: int) -> torch.Tensor:
        """K (which=0) or V (which=1) of slots `index`, [n, Hkv, D] in the compute dtype: a
        workspace gather from `buf` for a float pool, the pool's dequantizing gather for int8."""
        if self.kv_pool.quantized:
            return self.kv_pool.gather_kv(layer_id, index, which)
        return self._gather(buf, index, which)

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
        out = None if len(meta.groups) == 1 and meta.groups[0].rows is None else torch.empty_like(q)
        for g in meta.groups:
            ks = self._gather_kv(layer_id, k_buf, g.kv_index, 0)  # [n*L, Hkv, D], token-major as gathered
            vs = self._gather_kv(layer_id, v_buf, g.kv_index, 1)
            qg = q if g.rows is None else q.index_select(0, g.rows)
            o = self._decode_group(qg, ks, vs, g, scale)
            if out is None:
                return o
            out.index_copy_(0, g.rows, o)
        return out

    def _block_diag_q(self, q: torch.Tensor, n: int) -> torch.Tensor:
        """[n, H, D] -> [n, H, Hkv*D], query head h's vector placed in its KV head's block
        (zeros elsewhere), so a product with token-major keys [L, Hkv*D] scores each query
        head against its own KV head only. qz[b, kvh, j, kvh, :] = q[b, kvh*G + j, :]."""
        hkv, d, grp = self.num_kv_heads, self.head_dim, self.group
        if hkv == 1:
            return q.reshape(n, self.num_heads, d)
        qz = q.new_zeros(n, hkv, grp, hkv, d)
        qz.diagonal(0, 1, 3).copy_(q.view(n, hkv, grp, d).permute(0, 2, 3, 1))
        return qz.view(n, self.num_heads, hkv * d)

    def _take_diag(self, o: torch.Tensor, n: int) -> torch.Tensor:
        """[n, H, Hkv*D] products with token-major values -> [n, H, D] (each head's own block)."""
        hkv, d, grp = self.num_kv_heads, self.head_dim, self.group
        if hkv == 1:
            return o
        return o.view(n, hkv, grp, hkv, d).diagonal(0, 1, 3).permute(0, 3, 1, 2).reshape(n, self.num_heads, d)

    def _decode_shared(self, q: torch.Tensor, layer_id: int, meta: _DecodeMetadata,
                       scale: float) -> torch.Tensor:
        """Decode with a prefix shared by the whole batch (cascade-style): the prefix K/V are
        gathered once and scored for all n*G query rows of each KV head in one GEMM; the short
        per-request suffixes go through the batched path. Softmax runs over the concatenated
        scores, so this is exact attention (no log-sum-exp merging needed)."""
        k_buf, v_buf = self.kv_pool.get_kv(layer_id)
        g = meta.groups[0]
        n, p = g.n, meta.shared_index.numel()
        hkv, d, grp, h = self.num_kv_heads, self.head_dim, self.group, self.num_heads
        # Prefix K/V head-major [Hkv, P, D]: per-head GEMMs with M = n*G rows, no wasted
        # off-diagonal FLOPs (the prefix is the bulk of the keys here).
        kp = self.kv_pool.gather_kv(layer_id, meta.shared_index, 0).transpose(0, 1).contiguous()
        vp = self.kv_pool.gather_kv(layer_id, meta.shared_index, 1).transpose(0, 1).contiguous()
        ks = self._gather_kv(layer_id, k_buf, g.kv_index, 0).view(n, g.max_len, hkv * d)
        vs = self._gather_kv(layer_id, v_buf, g.kv_index, 1).view(n, g.max_len, hkv * d)
        qh = q.view(n, hkv, grp, d).transpose(0, 1).reshape(hkv, n * grp, d)
        scores = torch.empty(n, h, p + g.max_len, dtype=q.dtype, device=q.device)
        sp = torch.bmm(qh, kp.transpose(1, 2))  # [Hkv, n*G, P]
        scores[:, :, :p].view(n, hkv, grp, p).copy_(sp.view(hkv, n, grp, p).transpose(0, 1))
        qz = self._block_diag_q(q, n)  # suffixes: short, batched per request
        ss = torch.bmm(qz, ks.transpose(1, 2))  # [n, H, Ls]
        bias = g.additive_mask(q.dtype)
        if bias is not None:
            ss.add_(bias)  # 0 / -inf, so adding before the scale is the same
        scores[:, :, p:] = ss
        probs = torch.softmax(scores.mul_(scale), dim=-1, dtype=torch.float32).to(q.dtype)
        pp = probs[:, :, :p].reshape(n, hkv, grp, p).transpose(0, 1).reshape(hkv, n * grp, p)
        op = torch.bmm(pp, vp).view(hkv, n, grp, d).transpose(0, 1).reshape(n, h, d)
        return op.add_(self._take_diag(torch.bmm(probs[:, :, p:], vs), n))

    def _decode_group(self, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, g: _DecodeGroup,
                      scale: float) -> torch.Tensor:
        """Attention of n single-token queries over their gathered K/V, as two batched GEMMs.

        The gathered K/V are [n, L, Hkv*D] (token-major); making them head-major for SDPA
        costs a strided read per head, measured ~2x slower than this. Instead every query
        head is laid out against *all* KV heads with zeros outside its own KV head's block
        (a block-diagonal query), so one bmm over the contiguous [L, Hkv*D] rows gives the
        scores and one bmm gives the outputs; the off-diagonal blocks are Hkv-times wasted
        FLOPs on tiny GEMMs, cheaper than the layout change.
        """
        hkv, d, grp = self.num_kv_heads, self.head_dim, self.group
        n, L, h = g.n, g.max_len, self.num_heads
        if n == 1:
            # One request: each bf16 bmm costs ~20 us of oneDNN set-up on tiny shapes, so
            # SDPA's single fused call wins (measured 26 us vs 2 x 21 us at L=200).
            kt = ks.view(1, L, hkv, d).transpose(1, 2)
            vt = vs.view(1, L, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q.view(1, hkv, grp, d), kt, vt, attn_mask=g.mask, scale=scale)
            return o.reshape(1, h, d)
        k = ks.view(n, L, hkv * d)
        v = vs.view(n, L, hkv * d)
        qz = self._block_diag_q(q, n)
        bias = g.additive_mask(q.dtype)
        if bias is None:
            scores = torch.bmm(qz, k.transpose(1, 2)).mul_(scale)
        else:
            scores = torch.baddbmm(bias, qz, k.transpose(1, 2), alpha=scale)  # [n, H, L]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self._take_diag(torch.bmm(probs, v), n)  # [n, H, Hkv*D] -> [n, H, D]
