"""The model runner: owns the model, the KV pools and the sampler; runs one WorkerBatch.

Runtime sizes (KV capacity, request slots, chunk size) are resolved here because they
depend on the device and the model.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

import radixlm.envs as envs
from radixlm.config import ModelConfig
from radixlm.scheduler.batch import BatchResult, LaunchedForward, WorkerBatch
from radixlm.scheduler.overlap import fill_snapshots, resolve_placeholders, snapshot_values_needed
from radixlm.srt.constrained.bitmask import advance_matchers, build_vocab_mask
from radixlm.srt.distributed.context import TPContext
from radixlm.srt.distributed.layout import TPLayout
from radixlm.srt.distributed.process_group import TPGroup, threads_per_rank
from radixlm.srt.model_runner.attention.base import check_model_attention, create_attention_backend
from radixlm.srt.model_runner.config import RunnerConfig
from radixlm.srt.model_runner.device_tensor import device_tensor
from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.model_runner.kv_pool import MHATokenToKVPool, check_kv_cache_backend
from radixlm.srt.model_runner.launched import ForwardStream, LaunchedBatch
from radixlm.srt.model_runner.sampler import Sampler
from radixlm.srt.model_runner.verify import launch_verify, sampling_row

logger = logging.getLogger(__name__)

# A CPU KV pool beyond this many tokens only costs RAM: 135M-class models never fill it.
CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536
CPU_CHUNKED_PREFILL_SIZE = 1024
GPU_CHUNKED_PREFILL_SIZE = 8192


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return name


def _available_memory_bytes(device: str) -> int:
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    from radixlm.hicache.host_pool import available_ram_bytes
    return available_ram_bytes()


@dataclass(frozen=True)
class RuntimeSizes:
    max_total_tokens: int
    max_running_requests: int
    req_pool_size: int
    chunked_prefill_size: int | None
    max_context_len: int
    chunk_cost_keys: int | None = None  # ModelConfig.chunk_cost_keys


def resolve_sizes(args: RunnerConfig, cfg: ModelConfig, device: str, dtype: torch.dtype) -> RuntimeSizes:
    context = args.context_length or cfg.context_len
    if args.max_total_tokens is not None:
        total = args.max_total_tokens
    else:
        per_token = MHATokenToKVPool.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                     cfg.head_dim, dtype, args.kv_cache_dtype)
        total = int(_available_memory_bytes(device) * args.mem_fraction_static / per_token)
        if device == "cpu":
            total = min(total, CPU_DEFAULT_MAX_TOTAL_TOKENS)
    total = total // args.page_size * args.page_size
    max_running = args.max_running_requests or min(max(total // 2, 1), 256 if device == "cpu" else 1024)
    if args.chunked_prefill_size is None:
        chunk = CPU_CHUNKED_PREFILL_SIZE if device == "cpu" else GPU_CHUNKED_PREFILL_SIZE
    else:
        chunk = None if args.chunked_prefill_size == -1 else args.chunked_prefill_size
    # Retracted requests wait without a slot, so running + one chunked request is the most live.
    return RuntimeSizes(total, max_running, max_running + 2, chunk, context, cfg.chunk_cost_keys)


def default_attention_backend(device: str, kv_cache_dtype: str = "auto") -> str:
    if device == "cuda":
        if kv_cache_dtype == "int8":
            return "torch_native"  # the GPU kernels (triton, flashinfer) read float KV only
        import importlib.util
        if importlib.util.find_spec("triton") is not None and importlib.util.find_spec(
                "radixlm.srt.model_runner.attention.triton") is not None:
            return "triton"
        return "torch_native"
    from radixlm.kernels.cpu import ops as cpu_ops
    return "cpu" if device == "cpu" and cpu_ops.available() else "torch_native"


def batch_signature(batch: WorkerBatch) -> list[int]:
    """A few numbers that differ when two ranks' batches differ (tuples of ints hash the same in
    every process; strings would not)."""
    mask = (1 << 62) - 1
    return [len(batch.reqs), len(batch.input_ids), hash(tuple(batch.input_ids)) & mask,
            hash((int(batch.is_decode), tuple(batch.prefix_lens), tuple(batch.extend_lens), tuple(batch.sample))) & mask,
            int(batch.out_cache_loc.sum()) if batch.out_cache_loc.numel() else 0]


class ModelRunner:
    def __init__(self, args: RunnerConfig, tp: TPGroup | None = None) -> None:
        """With `tp`, this process is one tensor-parallel rank: it holds its shard of the model
        (srt/distributed/layout.py) and of every KV head group, and its forwards meet the
        other ranks' in collectives."""
        from radixlm.srt.layers.int8_linear import check_quantization
        from radixlm.srt.models.registry import build_model
        from radixlm.srt.weights.loader import (iter_weights, load_model_config, resolve_dtype,
                                                resolve_model_path)
        self.args = args
        self.tp = tp or TPGroup.single()
        self.device = resolve_device(args.device)
        self.model_path = resolve_model_path(args.model_path)
        self.model_config = load_model_config(self.model_path)
        self.dtype = resolve_dtype(args.dtype, self.device)
        if self.device == "cpu":  # ranks share the cores: each takes its part (RADIXLM_NUM_THREADS: per rank)
            torch.set_num_threads(threads_per_rank(self.tp.size, envs.num_threads(), torch.get_num_threads()))
        cfg = self.model_config
        self.layout = TPLayout.build(cfg, self.tp.size, self.tp.rank)
        local = self.layout.local_config(cfg)  # this rank's heads, MLP rows and vocabulary rows
        self.model = build_model(cfg, self.dtype, self.device, TPContext(self.layout, self.tp.comm))
        self.model.load_weights(iter_weights(self.model_path, cfg, self._shard_of))
        check_quantization(args.quantization, self.device)
        self.model.set_quantization(args.quantization)
        self.model.eval()
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.sizes = resolve_sizes(args, local, self.device, self.dtype)
        if self.tp.size > 1 and args.max_total_tokens is None:
            # Every rank must have the same KV capacity (each runs the same scheduler): the smallest.
            total = self.tp.control.min_ints([self.sizes.max_total_tokens])[0]
            self.sizes = resolve_sizes(args.replace(max_total_tokens=total), local, self.device, self.dtype)
        self.max_context_len = self.sizes.max_context_len
        backend = args.attention_backend
        if backend == "auto":
            backend = default_attention_backend(self.device, args.kv_cache_dtype)
        check_kv_cache_backend(args.kv_cache_dtype, backend)  # the backends check too; this spares allocating
        self.kv_pool = MHATokenToKVPool(self.sizes.max_total_tokens, cfg.num_hidden_layers,
                                        local.num_key_value_heads, cfg.head_dim, self.dtype, self.device,
                                        kv_cache_dtype=args.kv_cache_dtype)
        # Row r: the KV slots of the request in request slot r. The forwards read it; which rows
        # and slots are whose is the cache manager's (ReqToTokenPool.over(this), its allocator).
        self.req_to_token = torch.zeros((self.sizes.req_pool_size, self.max_context_len), dtype=torch.int64)
        self.attention_backend_name = backend
        self.attn = create_attention_backend(backend, self.kv_pool, local.num_attention_heads,
                                             local.num_key_value_heads, cfg.head_dim)
        check_model_attention(self.attn, backend, cfg)  # sliding windows, soft-capped scores
        self.sampler = Sampler(cfg.vocab_size, self.device, args.random_seed)
        self.stream = ForwardStream(self.device)
        self._weight_sync = None  # WeightSyncGroups, created by the first init_weights_update_group
        logger.info("model %s on %s (%s): KV capacity %d tokens (kv_cache_dtype %s), attention %s, TP rank %d/%d "
                    "(%d query / %d KV heads, %d threads)", self.model_path, self.device, self.dtype,
                    self.sizes.max_total_tokens, args.kv_cache_dtype, backend, self.tp.rank, self.tp.size,
                    local.num_attention_heads, local.num_key_value_heads, torch.get_num_threads())

    @property
    def _shard_of(self):
        """This rank's part of each Hugging Face tensor, for the loaders (None: all of it)."""
        return self.layout.shard if self.tp.size > 1 else None

    # ------------------------------------------------------------------ RL API
    def update_weights_from_tensor(self, named_tensors) -> int:
        return self._update_weights(named_tensors, sharded=False)

    def _update_weights(self, named_tensors, sharded: bool) -> int:
        """All or nothing on every rank: each checks its part, the ranks agree (any rank's error
        is raised on all), then each copies its part."""
        from radixlm.srt.model_runner.weight_updater import WeightUpdater
        updater = WeightUpdater(self.model)
        plan = self.tp.control.agreed(lambda: updater.plan(named_tensors, sharded))
        n = updater.apply(plan)
        self.model.prepare_quantized()  # re-derive the int8 copies of what was written
        return n

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> dict:
        from radixlm.srt.distributed.weight_sync import WeightSyncGroups
        if self._weight_sync is None:
            self._weight_sync = WeightSyncGroups(self.tp.rank, self.device, self.args.dist_timeout)
        sync = self._weight_sync
        message = self.tp.control.agreed(lambda: sync.init(master_address, master_port, rank_offset, world_size,
                                                            group_name, backend))
        return {"success": True, "message": message}

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str) -> int:
        """Receive every tensor the trainer broadcasts, keep this rank's shard of each, then
        apply them all (or, if any is bad, none: the first error is raised after the last
        broadcast, so the trainer never waits for a rank that gave up)."""
        from radixlm.srt.distributed.weight_sync import check_update_request
        from radixlm.srt.model_runner.weight_updater import WeightUpdater
        check_update_request(names, dtypes, shapes)
        sync = self._weight_sync
        if sync is None or group_name not in sync.groups:
            raise ValueError(f"no weight update group {group_name!r}; call init_weights_update_group first")
        updater = WeightUpdater(self.model)

        def receive_and_plan():
            plan, error = [], None
            for name, tensor in sync.receive(names, dtypes, shapes, group_name):
                if error is None:
                    try:
                        plan.extend(updater.plan([(name, tensor)]))
                    except ValueError as e:
                        error = e
            if error is not None:
                raise error
            return plan

        plan = self.tp.control.agreed(receive_and_plan)
        n = updater.apply(plan)
        self.model.prepare_quantized()
        return n

    def destroy_weights_update_group(self, group_name: str) -> dict:
        sync = self._weight_sync
        if sync is None:
            raise ValueError(f"no weight update group {group_name!r}")
        return {"success": True, "message": self.tp.control.agreed(lambda: sync.destroy(group_name))}

    def update_weights_from_disk(self, model_path: str) -> int:
        from radixlm.srt.weights.loader import iter_weights, load_model_config, resolve_model_path
        path = resolve_model_path(model_path)
        cfg = load_model_config(path)
        mine = self.model_config
        shape_fields = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                        "attention_bias")
        bad = [f for f in shape_fields if getattr(cfg, f) != getattr(mine, f)]
        if bad:
            raise ValueError(f"{model_path} does not match the loaded model: {', '.join(bad)} differ")
        n = self._update_weights(iter_weights(path, cfg, self._shard_of), sharded=True)
        self.model_path = path
        return n

    def get_weights_by_name(self, name: str, truncate_size: int = 100, max_elements: int | None = None) -> list:
        """The first `truncate_size` rows of the whole tensor; under TP gathered from the ranks."""
        from radixlm.srt.distributed.weight_parts import assemble
        from radixlm.srt.model_runner.weight_updater import WeightUpdater, check_response_size
        updater = WeightUpdater(self.model)
        if self.tp.size == 1:
            return updater.get(name, truncate_size, max_elements)
        part = self.tp.control.agreed(lambda: updater.get_part(name, truncate_size, max_elements))
        whole = assemble(self.tp.control.all_gather(part))
        check_response_size(name, truncate_size, whole.numel(), max_elements)
        return whole.float().tolist()

    def release_memory(self) -> None:
        """Free the KV pool; on a GPU also move the weights to host memory."""
        self.kv_pool.release()
        if self.device == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        if self.device == "cuda":
            self.model.to(self.device)
        self.kv_pool.allocate()

    def info(self) -> dict:
        return {"model_path": self.model_path, "dtype": str(self.dtype).replace("torch.", ""),
                "quantization": self.args.quantization, "kv_cache_dtype": self.args.kv_cache_dtype,
                "device": self.device, "attention_backend": self.attention_backend_name,
                "max_total_num_tokens": self.sizes.max_total_tokens,
                "max_running_requests": self.sizes.max_running_requests,
                "chunked_prefill_size": self.sizes.chunked_prefill_size,
                "context_length": self.max_context_len, "vocab_size": self.vocab_size,
                "kv_pool_bytes": self.kv_pool.allocated_bytes, "tp_size": self.tp.size,
                "threads_per_rank": torch.get_num_threads()}

    # ------------------------------------------------------------------------
    def forward(self, batch: WorkerBatch) -> BatchResult:
        """Run one batch to its host result."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: WorkerBatch, prev: LaunchedForward | None = None) -> LaunchedBatch:
        """Queue the forward and sampling of a batch on the forward stream; the host result
        comes from the returned batch's result() (see launched.py)."""
        with self.stream.scope():
            return self._launch(batch, prev)

    def _launch(self, batch: WorkerBatch, prev: LaunchedForward | None) -> LaunchedBatch:
        if self.tp.size > 1:  # ranks that scheduled differently would mix their batches: stop instead
            self.tp.comm.check_same(batch_signature(batch), "the batches launched")
        if batch.drafts is not None:  # a speculative step (verify.py)
            return launch_verify(self, batch)
        mode = ForwardMode.DECODE if batch.is_decode else ForwardMode.EXTEND
        fb = ForwardBatch.build(mode, batch.input_ids, batch.out_cache_loc,
                                [r.req_pool_idx for r in batch.reqs], batch.prefix_lens, batch.extend_lens,
                                self.req_to_token, self.device)
        if batch.placeholder_source is not None:
            assert prev is not None and id(prev.batch) == batch.placeholder_source, \
                "placeholders name a batch that did not run last"
            fb.input_ids = resolve_placeholders(fb.input_ids, prev.tokens)
            if fb.input_ids.device.type == "cpu":  # free to check here; on a GPU it would wait
                assert bool((fb.input_ids >= 0).all()), "placeholder for a row that sampled nothing"
            if snapshot_values_needed(batch):
                fill_snapshots(batch, prev.result().next_token_ids)
        # Rows whose logits are needed: each sampling request's last token, then the
        # positions whose next-token logprobs are prompt logprobs.
        ends: list[int] = []
        acc = 0
        for n in batch.extend_lens:
            acc += n
            ends.append(acc)
        sample_idx = [i for i, s in enumerate(batch.sample) if s]
        rows = [ends[i] - 1 for i in sample_idx]
        lp_slices: list[tuple[int, int, int]] = []  # (request, first row, count)
        for i, (lo, hi) in enumerate(batch.input_logprob_ranges or []):
            if hi > lo:
                start_tok = ends[i] - batch.extend_lens[i]
                lp_slices.append((i, len(rows), hi - lo))
                rows.extend(range(start_tok + lo, start_tok + hi))
        start = self.stream.mark()
        self.attn.init_forward_metadata(fb)
        # The model returns those rows only (hidden[i] is rows[i]'s), unless they are all.
        every = len(rows) == len(batch.input_ids) and rows == list(range(len(rows)))
        hidden = self.model.forward(fb, self.attn, None if every else device_tensor(rows, torch.int64, self.device))
        n = len(batch.reqs)
        ready: dict = {}
        sampled = None
        tokens = torch.full((n,), -1, dtype=torch.int64, device=hidden.device)
        srows = []
        for i in sample_idx:
            r = batch.reqs[i]
            # overlap: the live output list may grow while this batch runs; use the snapshot
            outs = batch.output_snapshots[i] if batch.output_snapshots is not None else r.output_ids
            srows.append(sampling_row(r, outs))
        # structured output: mask with each matcher, then advance it by the sampled token now,
        # before any later batch builds its mask (semantics §7)
        matchers = [batch.grammars[i] for i in sample_idx] if batch.grammars is not None else None
        if sample_idx and not lp_slices and not matchers:
            sampled = self.sampler.sample_greedy_fused(hidden, srows, self.model)
        if rows and sampled is None:
            logits = self.model.compute_logits(hidden)
        if sample_idx:
            if sampled is None:
                vocab_mask = build_vocab_mask(matchers, self.vocab_size, logits.device) if matchers else None
                sampled = self.sampler.sample_tensors(logits[:len(sample_idx)], srows, vocab_mask=vocab_mask)
            if len(sample_idx) == n:
                tokens = sampled.ids
            else:
                tokens.index_copy_(0, device_tensor(sample_idx, torch.int64, tokens.device), sampled.ids)
            if matchers:  # the host needs these tokens now: this waits for the forward
                status: list[str | None] = [None] * n
                batch.grammars_advanced = True
                for i, st in zip(sample_idx, advance_matchers(matchers, sampled.ids.tolist())):
                    status[i] = st
                ready["grammar_status"] = status
        if lp_slices:  # prompt logprobs are read on the host at once (prefill only, rare)
            in_lps: list[list[float] | None] = [None] * n
            in_tops: list[list[list[tuple[float, int]]] | None] = [None] * n
            for i, first, count in lp_slices:
                targets = device_tensor(batch.input_logprob_targets[i], torch.int64, logits.device)
                in_lps[i], in_tops[i] = self.sampler.logprobs_of(logits[first:first + count], targets,
                                                                 batch.reqs[i].top_logprobs_num,
                                                                 batch.reqs[i].token_ids_logprob)
            ready["input_logprobs"], ready["input_top_logprobs"] = in_lps, in_tops
        end = self.stream.mark()
        host = sampled.map(self.stream.to_host) if sampled is not None else None
        return LaunchedBatch(batch, tokens, sample_idx, host, self.stream.copy_done_event(), start, end,
                             self.stream, ready)
