"""Turn the last-position logits of a batch into next tokens (and, if asked, logprobs).

Pipeline per call, each stage applied only to the rows that need it:

    logit_bias -> repetition -> frequency/presence -> min_new_tokens mask     (penalties.py)
    greedy rows: argmax of the processed logits
    random rows: temperature -> top_k -> top_p -> min_p -> inverse-CDF draw
                 (over the sorted top-k list when top_k is small, else the whole vocab)

A batch that is all greedy with nothing altering the logits takes a fast path: one argmax
over the raw logits (`stats.fast_path_calls` counts it). Without logprobs either, the runner
first asks `sample_greedy_fused` for the argmax straight from the LM head's GEMM, where the
model can give it (`stats.fused_argmax_calls`): the logits are then never written.

Random draws take one uniform u per row and pick the first token whose cumulative
probability exceeds u (over the tokens the filters left). A request with `params.seed`
gets its u from a generator keyed by (seed, output index), and every step before the
draw works on its own row only, so its tokens do not depend on which other requests
share the batch, on its row position, or on being retracted and recomputed. Unseeded
requests draw from the sampler's own generator (seeded at construction).

Logprobs are the model's: log_softmax of the *raw* logits, before bias, penalties,
temperature and filtering. This is what vLLM returns by default and what HF's
compute_transition_scores gives at temperature 1; it describes the model, not the sampler.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.sampling_params import SamplingParams
from radixlm.srt.constrained.bitmask import apply_vocab_mask
from radixlm.srt.model_runner.device_tensor import device_tensor, to_device
from radixlm.srt.model_runner.penalties import apply_logit_bias, apply_penalties, mask_stop_tokens
from radixlm.srt.model_runner.sampling_batch import (BatchPlan, SampleOutput, SampleTensors, SamplingRow,
                                                     VocabMask, build_stop_ids)

__all__ = ["Sampler", "SamplerStats", "SamplingRow", "SampleOutput", "SampleTensors", "build_stop_ids", "mix_seed"]

_MASK64 = (1 << 64) - 1
# Rows of prompt logits turned into log_softmax at a time: bounds the temporary to
# chunk * V floats (1024 * 49152 * 4 B = 192 MiB) however long the prompt is.
_LOGPROB_CHUNK = 1024
# top_p first sorts only this many most likely tokens (see _top_p_threshold).
_TOP_P_PREFIX = 256
# Rows with top_k up to this are filtered and drawn on their top-k list (_draw_top_k).
_SMALL_TOP_K = 1024
# Block size of the two-level CDF of _inverse_cdf_draw.
_CDF_BLOCK = 256


def mix_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed for (request seed, output index) (splitmix64 finalizer).

    Mixing, rather than seed + index, keeps request seeds 5 and 6 from sharing streams
    shifted by one token.
    """
    z = (seed * 0x9E3779B97F4A7C15 + index + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & ((1 << 63) - 1)


@dataclass
class SamplerStats:
    """Counters tests and benchmarks use to check which paths ran."""

    calls: int = 0
    fast_path_calls: int = 0
    fused_argmax_calls: int = 0  # fast-path calls whose argmax came from the LM head itself
    top_k_rows: int = 0
    top_p_rows: int = 0
    top_p_full_sort_rows: int = 0  # top_p rows whose nucleus needed a full-vocab sort
    min_p_rows: int = 0
    seeded_rows: int = 0


def _index(idx: list[int], device: torch.device) -> torch.Tensor:
    return device_tensor(idx, torch.int64, device)


def _rows_of(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """x[idx] (a copy), or x itself when idx is every row: the common all-rows case copies nothing."""
    if len(idx) == x.shape[0]:
        return x
    return x.index_select(0, _index(idx, x.device))


def _mask_below(x: torch.Tensor, idx: list[int], thr: torch.Tensor) -> None:
    """Set logits below thr[j] to -inf in row idx[j] of x (in place)."""
    if len(idx) != x.shape[0]:
        full = torch.full((x.shape[0],), float("-inf"), dtype=x.dtype, device=x.device)
        full[_index(idx, x.device)] = thr
        thr = full
    x.masked_fill_(x < thr.unsqueeze(1), float("-inf"))


def _top_k_threshold(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Per row, the k-th largest logit. Thresholding keeps ties with it (more than k tokens
    only when logits tie exactly, where any choice among them would be arbitrary)."""
    vals = x.topk(max(ks), dim=-1).values  # sorted, descending
    k = device_tensor(ks, torch.int64, x.device).unsqueeze(1)
    return vals.gather(1, k - 1).squeeze(1)


def _top_p_threshold(x: torch.Tensor, ps: list[float]) -> tuple[torch.Tensor, int]:
    """Per row, the smallest logit of the nucleus: the shortest prefix of tokens by
    descending probability whose mass reaches top_p. Returns it and the rows fully sorted.

    A token is in the nucleus when the mass strictly before it is below top_p, so the most
    likely token always is. The nucleus usually lies within the top few hundred tokens, so
    the first try sorts only the top _TOP_P_PREFIX (torch.topk); rows whose nucleus might
    reach past that (the whole prefix kept) are redone with a full sort.
    """
    top_p = device_tensor(ps, torch.float32, x.device)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)

    def nucleus_floor(vals: torch.Tensor, p: torch.Tensor,
                      lse_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # vals: each row's logits sorted descending (a prefix or all of them).
        probs = (vals - lse_).exp_()
        before = probs.cumsum(dim=-1) - probs
        # >= 1 even when top_p rounds to 0 in float32 (1e-300): the most likely token stays
        n_keep = (before < p.unsqueeze(1)).sum(dim=-1).clamp_(min=1)
        floor = vals.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
        return floor, n_keep

    if x.device.type == "cuda":
        # Finding the rows to redo would make the host wait for the device (nonzero), which
        # stalls an overlapped launch; a GPU sorts every row fully at little cost instead.
        floor, _ = nucleus_floor(x.sort(dim=-1, descending=True).values, top_p, lse)
        return floor, x.shape[0]
    k = min(_TOP_P_PREFIX, x.shape[1])
    floor, n_keep = nucleus_floor(x.topk(k, dim=-1).values, top_p, lse)
    if k == x.shape[1]:
        return floor, 0
    redo = (n_keep >= k).nonzero().squeeze(1)
    if redo.numel() == 0:
        return floor, 0
    sub = x.index_select(0, redo)
    full_floor, _ = nucleus_floor(sub.sort(dim=-1, descending=True).values, top_p[redo], lse[redo])
    floor[redo] = full_floor
    return floor, int(redo.numel())


def _inverse_cdf_draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(x) (-inf entries excluded), by inverse CDF with u.

    One uniform per row instead of V noise values (Gumbel-max) is much cheaper on CPU.
    The CDF is two-level, so no [R, V] float64 tensor is made: float64 cumsum over the sums
    of blocks of _CDF_BLOCK weights picks the block, then a float64 cumsum inside that one
    block picks the token. float64 keeps tail tokens of a 49k vocab at their probability.
    Each search target is kept strictly below its total, so a token of zero weight (filtered,
    or padding past V) can never be chosen, whatever the rounding.
    """
    r, v = x.shape
    bs = _CDF_BLOCK
    nb = -(-v // bs)
    # Padding columns hold -inf, hence weight 0, so the blocks are a plain view.
    w = torch.full((r, nb * bs), float("-inf"), dtype=torch.float32, device=x.device)
    torch.sub(x, x.amax(dim=-1, keepdim=True), out=w[:, :v])
    wb = w.exp_().view(r, nb, bs)

    block_cdf = wb.sum(dim=-1).to(torch.float64).cumsum(dim=-1)  # [r, nb]
    target = _below(u.unsqueeze(1) * block_cdf[:, -1:], block_cdf[:, -1:])
    # [r, 1]; its block weight > 0 (the clamp only matters for a NaN total, see _valid_or_argmax)
    blk = torch.searchsorted(block_cdf, target, right=True).clamp_(max=nb - 1)
    lo = torch.where(blk > 0, block_cdf.gather(1, (blk - 1).clamp_(min=0)), torch.zeros_like(target))
    hi = block_cdf.gather(1, blk)

    block = wb.gather(1, blk.unsqueeze(2).expand(r, 1, bs)).squeeze(1)  # [r, bs] weights
    inner = block.cumsum(dim=-1, dtype=torch.float64)
    inner_total = inner[:, -1:]
    # Where target falls within [lo, hi), rescaled onto the block's own float64 total.
    frac = ((target - lo) / (hi - lo)).clamp_(0.0, 1.0)
    pos = torch.searchsorted(inner, _below(frac * inner_total, inner_total), right=True)
    ids = (blk * bs + pos).squeeze(1).clamp_(max=v - 1)
    return _valid_or_argmax(ids, x, block_cdf[:, -1])


def _valid_or_argmax(ids: torch.Tensor, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """A row whose weights do not sum to a positive finite number (all -inf, NaN or +inf
    logits: nothing a validated request produces, but a sampler must not index out of
    bounds on it) takes the argmax instead of a draw."""
    valid = torch.isfinite(total) & (total > 0)
    if x.device.type == "cpu":  # no device to wait for: fix only the rows that need it
        if bool(valid.all()):
            return ids
        bad = (~valid).nonzero().squeeze(1)
        ids[bad] = x.index_select(0, bad).nan_to_num(nan=float("-inf")).argmax(dim=-1)
        return ids
    return torch.where(valid, ids, x.nan_to_num(nan=float("-inf")).argmax(dim=-1))


def _below(a: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """min(a, largest float64 below total): a search target that cannot reach the total."""
    return torch.minimum(a, torch.nextafter(total, torch.zeros_like(total)))


class Sampler:
    """Per-batch sampler. `device` must be the device of the logits it is given (its
    generator for unseeded rows lives there); `seed` seeds that generator."""

    def __init__(self, vocab_size: int, device: str | torch.device = "cpu", seed: int = 0):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        # Re-seeded for every seeded row (CPU: see _uniforms); one object avoids creating
        # a generator per row.
        self._row_gen = torch.Generator()
        self.stats = SamplerStats()

    # ------------------------------------------------------------------ public
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               vocab_mask: VocabMask | None = None) -> SampleOutput:
        """Next token of each row of `logits` ([B, >= vocab_size], float32 or bf16); rows of
        `vocab_mask` draw only among the tokens their grammar allows (logprobs stay raw)."""
        return self.sample_tensors(logits, rows, vocab_mask).to_output()

    def sample_tensors(self, logits: torch.Tensor, rows: list[SamplingRow],
                       vocab_mask: VocabMask | None = None) -> SampleTensors:
        """sample() with the result left on the logits' device, for a caller that copies it
        to the host asynchronously (overlap scheduling on a GPU). Greedy rows without logit
        processing never wait for the device here; top_p and grammar rows may."""
        self.stats.calls += 1
        b = len(rows)
        if logits.dim() != 2 or logits.shape[0] != b or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not fit {b} rows "
                             f"of vocab {self.vocab_size}")
        if b == 0:
            return SampleTensors(torch.empty(0, dtype=torch.int64, device=logits.device))
        # Columns past vocab_size (a padded lm_head) must never be sampled.
        raw = logits[:, : self.vocab_size]
        plan = BatchPlan.build(rows, vocab_mask)

        if plan.fast_path:
            self.stats.fast_path_calls += 1
            ids_t = _argmax(raw)
        else:
            ids_t = self._sample_slow(raw, rows, plan, vocab_mask)
        return self._chosen_logprobs(raw, ids_t, rows, plan.logprob)

    def sample_greedy_fused(self, hidden: torch.Tensor, rows: list[SamplingRow], model) -> SampleTensors | None:
        """sample_tensors(model.compute_logits(hidden), rows) for a batch that needs nothing of
        the logits but their argmax (the fast path, no logprobs), from the model's
        `greedy_tokens` (the LM head's GEMM keeps each row's best column instead of writing
        the logits). None when the batch needs more or the model cannot: compute the logits."""
        plan = BatchPlan.build(rows)
        if not plan.fast_path or plan.logprob:
            return None
        greedy = getattr(model, "greedy_tokens", None)
        ids = greedy(hidden, self.vocab_size) if greedy is not None else None
        if ids is None:
            return None
        self.stats.calls += 1
        self.stats.fast_path_calls += 1
        self.stats.fused_argmax_calls += 1
        return SampleTensors(ids)

    def logprobs_of(self, logits: torch.Tensor, token_ids: torch.Tensor | list[int], top_k: int,
                    asked: tuple[int, ...] = ()) -> tuple[list[float], list[list[tuple[float, int]]]]:
        """Raw logprob of token_ids[i] under logits[i], and the top_k (logprob, id) per row
        followed by the (logprob, id) of each id in `asked` (token_ids_logprob).

        For input (prompt) logprobs: row i holds the logits that predicted token_ids[i].
        Top lists are empty when top_k <= 0 and nothing is asked. Computed in chunks of rows so
        a long prompt does not materialize its whole [n, V] log_softmax at once.
        """
        n = logits.shape[0]
        tok = torch.as_tensor(token_ids, dtype=torch.int64, device=logits.device).view(-1)
        if tok.numel() != n:
            raise ValueError(f"{n} logit rows but {tok.numel()} token ids")
        k = min(top_k, self.vocab_size)
        out_lp: list[float] = []
        out_top: list[list[tuple[float, int]]] = []
        for s in range(0, n, _LOGPROB_CHUNK):
            lsm = torch.log_softmax(logits[s:s + _LOGPROB_CHUNK, : self.vocab_size].float(), dim=-1)
            out_lp.extend(lsm.gather(1, tok[s:s + _LOGPROB_CHUNK, None]).squeeze(1).tolist())
            if k > 0:
                vals, inds = lsm.topk(k, dim=-1)
                chunk = [list(zip(v, i)) for v, i in zip(vals.tolist(), inds.tolist())]
            else:
                chunk = [[] for _ in range(lsm.shape[0])]
            if asked:
                ids = list(asked)
                for row, v in zip(chunk, lsm[:, ids].tolist()):
                    row.extend(zip(v, ids))
            out_top.extend(chunk)
        return out_lp, out_top

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow],
                       plan: BatchPlan | None = None, vocab_mask: VocabMask | None = None) -> torch.Tensor:
        """float32 copy of logits[:, :vocab_size] after bias, penalties, the min_new mask and
        the grammar mask.

        This is what greedy rows take the argmax of (temperature and the filters cannot
        change an argmax); exposed for tests and debugging.
        """
        if plan is None:
            plan = BatchPlan.build(rows, vocab_mask)
        # Own contiguous float32 copy: the caller's logits stay untouched for the logprobs,
        # and the penalties index the flattened view.
        x = torch.empty((logits.shape[0], self.vocab_size), dtype=torch.float32, device=logits.device)
        x.copy_(logits[:, : self.vocab_size])
        if plan.bias:
            apply_logit_bias(x, rows, plan.bias)
        if plan.penalty:
            apply_penalties(x, rows, plan.penalty)
        if plan.min_new:
            mask_stop_tokens(x, rows, plan.min_new)
        if plan.grammar and vocab_mask is not None:
            apply_vocab_mask(x, vocab_mask)
            if plan.min_new:
                self._grammar_over_min_new(x, logits, rows, plan, vocab_mask)
        return x

    def _grammar_over_min_new(self, x: torch.Tensor, logits: torch.Tensor, rows: list[SamplingRow],
                              plan: BatchPlan, vocab_mask: VocabMask) -> None:
        """A grammar that allows only a stop token while min_new_tokens still masks it leaves
        no token at all: the grammar wins (such a row is redone without the min_new mask)."""
        both = sorted(set(plan.grammar) & set(plan.min_new))
        if not both:
            return
        dead = torch.isneginf(x[both]).all(dim=-1).tolist()
        for i, is_dead in zip(both, dead):
            if is_dead:
                redo = VocabMask(vocab_mask.bitmask[i:i + 1], [0])
                row = x[i:i + 1]
                row.copy_(logits[i:i + 1, : self.vocab_size])
                if rows[i].needs_bias:
                    apply_logit_bias(row, [rows[i]], [0])
                if rows[i].needs_penalty:
                    apply_penalties(row, [rows[i]], [0])
                apply_vocab_mask(row, redo)

    # ------------------------------------------------------------------ internals
    def _sample_slow(self, raw: torch.Tensor, rows: list[SamplingRow], plan: BatchPlan,
                     vocab_mask: VocabMask | None = None) -> torch.Tensor:
        # Without bias/penalties/mask the raw logits are read as they are: the temperature
        # division below makes the sampler's own float32 copy, saving a pass over [B, V].
        x = self.process_logits(raw, rows, plan, vocab_mask) if plan.modifies_logits else raw

        if not plan.random:
            return _argmax(x)
        if not plan.greedy:
            return self._sample_random(x, rows)
        ids = torch.empty(len(rows), dtype=torch.int64, device=x.device)
        g = _index(plan.greedy, x.device)
        r = _index(plan.random, x.device)
        ids[g] = x.index_select(0, g).argmax(dim=-1)
        ids[r] = self._sample_random(x.index_select(0, r), [rows[i] for i in plan.random])
        return ids

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Draw one token per row of logits ([R, V], any float dtype; not modified).

        Rows with a small top_k are drawn from their top-k list alone (_draw_top_k), the
        rest over the whole vocabulary (_draw_full). Which way a row goes depends only on
        its own params, so a seeded row draws the same token in any batch.
        """
        dev = logits.device
        params = [r.params for r in rows]
        temps = device_tensor([p.temperature for p in params], torch.float32, dev)
        x = logits.float() / temps.unsqueeze(1)  # a new tensor: the filters below edit it in place
        u = self._uniforms(rows, dev)
        # top_k <= 0 also means "all" for params that skipped normalize().
        small = min(_SMALL_TOP_K, logits.shape[1] - 1)  # top_k >= V filters nothing
        small_k = [i for i, p in enumerate(params) if 0 < p.top_k <= small]
        if len(small_k) == len(rows):
            return self._draw_top_k(x, params, u)
        if not small_k:
            return self._draw_full(x, params, u)
        rest = [i for i, p in enumerate(params) if not 0 < p.top_k <= small]
        ids = torch.empty(len(rows), dtype=torch.int64, device=dev)
        for part, draw in ((small_k, self._draw_top_k), (rest, self._draw_full)):
            index = _index(part, dev)
            ids[index] = draw(x.index_select(0, index), [params[i] for i in part], u[index])
        return ids

    def _draw_top_k(self, x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
        """Rows with 0 < top_k <= _SMALL_TOP_K: filter and draw on the sorted top-k lists.

        One topk replaces every full-vocab pass after the temperature: top_p needs no sort
        (the list is sorted) and the CDF spans k entries, not V. The k is by rank (exactly
        k tokens), top_p and min_p as in _draw_full.
        """
        dev = x.device
        self.stats.top_k_rows += len(params)
        ks = device_tensor([p.top_k for p in params], torch.int64, dev).unsqueeze(1)
        vals, idx = x.topk(max(p.top_k for p in params), dim=-1)
        vals.masked_fill_(torch.arange(vals.shape[1], device=dev) >= ks, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            self.stats.top_p_rows += sum(p.top_p < 1.0 for p in params)
            # inf for rows without top_p: rounding of the cumsum must not drop their tail.
            top_p = device_tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params],
                                  torch.float32, dev).unsqueeze(1)
            probs = (vals - torch.logsumexp(vals, dim=-1, keepdim=True)).exp_()
            outside = probs.cumsum(dim=-1) - probs >= top_p
            outside[:, 0] = False  # the most likely token is always in the nucleus (top_p -> 0)
            vals.masked_fill_(outside, float("-inf"))
        if any(p.min_p > 0.0 for p in params):
            self.stats.min_p_rows += sum(p.min_p > 0.0 for p in params)
            log_min_p = device_tensor([math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params],
                                      torch.float32, dev).unsqueeze(1)
            vals.masked_fill_(vals < vals[:, :1] + log_min_p, float("-inf"))
        return idx.gather(1, _inverse_cdf_draw(vals, u).unsqueeze(1)).squeeze(1)

    def _draw_full(self, x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
        """Filter and draw over the whole vocabulary (x: [R, V] float32, edited in place).

        Each filter turns into one logit threshold per row (-inf: row not filtered), and
        is applied before the next one is computed: top_p is the nucleus of the top_k
        distribution, as in HF / vLLM. min_p needs no such care (it is relative to the
        max, which every filter keeps), so it shares top_p's masking pass.
        """
        dev = x.device
        vocab = x.shape[1]
        k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
        if k_rows:
            self.stats.top_k_rows += len(k_rows)
            thr_k = _top_k_threshold(_rows_of(x, k_rows), [params[i].top_k for i in k_rows])
            _mask_below(x, k_rows, thr_k)
        p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        m_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
        if p_rows or m_rows:
            thr = torch.full((len(params),), float("-inf"), dtype=torch.float32, device=dev)
            if p_rows:
                self.stats.top_p_rows += len(p_rows)
                t, full_sorts = _top_p_threshold(_rows_of(x, p_rows), [params[i].top_p for i in p_rows])
                self.stats.top_p_full_sort_rows += full_sorts
                thr[_index(p_rows, dev)] = t
            if m_rows:
                self.stats.min_p_rows += len(m_rows)
                t = _rows_of(x, m_rows).amax(dim=-1) + device_tensor(
                    [math.log(params[i].min_p) for i in m_rows], torch.float32, dev)
                idx = _index(m_rows, dev)
                thr[idx] = torch.maximum(thr[idx], t)
            x.masked_fill_(x < thr.unsqueeze(1), float("-inf"))
        return _inverse_cdf_draw(x, u)

    def _uniforms(self, rows: list[SamplingRow], dev: torch.device) -> torch.Tensor:
        """One U[0, 1) float64 per row: seeded rows from (seed, output index), the rest from
        self.generator.

        Seeded draws come from a CPU generator whatever the device: one number per row is
        cheap there, and it makes a seeded request's stream the same on every device.
        """
        seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
        if not seeded:
            return torch.rand(len(rows), dtype=torch.float64, device=dev, generator=self.generator)
        self.stats.seeded_rows += len(seeded)
        u = torch.empty(len(rows), dtype=torch.float64, device=dev)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            u[_index(unseeded, dev)] = torch.rand(len(unseeded), dtype=torch.float64, device=dev,
                                                  generator=self.generator)
        vals = []
        for i in seeded:
            r = rows[i]
            self._row_gen.manual_seed(mix_seed(r.params.seed, len(r.output_ids)))
            vals.append(torch.rand(1, dtype=torch.float64, generator=self._row_gen))
        u[_index(seeded, dev)] = to_device(torch.cat(vals), dev)
        return u

    def _chosen_logprobs(self, raw: torch.Tensor, ids_t: torch.Tensor, rows: list[SamplingRow],
                         idx: list[int]) -> SampleTensors:
        if not idx:
            return SampleTensors(ids_t)
        # Only the rows that asked pay for the log_softmax.
        b = len(rows)
        index = _index(idx, raw.device)
        sub = raw if len(idx) == b else raw.index_select(0, index)
        lsm = torch.log_softmax(sub.float(), dim=-1)
        chosen = ids_t if len(idx) == b else ids_t.index_select(0, index)
        out = SampleTensors(ids_t, list(idx), lsm.gather(1, chosen.unsqueeze(1)).squeeze(1),
                            top_nums=[rows[i].top_logprobs_num for i in idx])
        kmax = min(max(out.top_nums), self.vocab_size)
        if kmax > 0:
            out.top_values, out.top_ids = lsm.topk(kmax, dim=-1)
        asked = [rows[i].token_ids_logprob for i in idx]
        if any(asked):
            out.asked_nums = [len(a) for a in asked]
            width = max(out.asked_nums)
            padded = [list(a) + [0] * (width - len(a)) for a in asked]
            out.asked_ids = torch.tensor(padded, dtype=torch.int64).to(raw.device, non_blocking=True)
            out.asked_values = lsm.gather(1, out.asked_ids)
        return out


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), natively on CPU (~6x faster than torch's for a decode batch)."""
    native = cpu_ops.argmax_rows(x) if x.device.type == "cpu" else None
    return native if native is not None else x.argmax(dim=-1)
