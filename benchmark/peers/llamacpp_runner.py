"""llama.cpp peer (llama-cpp-python's low-level API): runs inside its own venv (never imports
radixlm), driven by benchmark/common.run_peer.

    <llamacpp-venv>/bin/python benchmark/peers/llamacpp_runner.py SPEC.json RESULT.json

SPEC: {"mode": "generate" | "latency", "model": GGUF file,
       "prompts": [[ids...], ...] (generate) | "prompt": [ids...] (latency),
       "output_len": N, "max_num_seqs": 32, "shared_prefix_len": 0, "repeats": 5, "threads": 2}

The high-level `Llama` class decodes one sequence at a time, so this drives `llama_decode`
directly with a multi-sequence `llama_batch`: all prompts are prefilled in batches of up to
n_batch tokens, then every decode step carries one token of each of up to max_num_seqs live
sequences. Greedy is an argmax over the returned logits, so EOS never stops a sequence: each
produces exactly output_len tokens. With shared_prefix_len > 0 (the prefix-sharing workload)
the prefix is prefilled once in sequence 0 and its KV cells are shared with the other
sequences (llama_memory_seq_cp on a unified KV cache); only each prompt's suffix is prefilled.
"""
from __future__ import annotations

import ctypes
import os
import time

import numpy as np
from peer_io import latency_fields, read_spec, spec_prompts, throughput_fields, time_first_and_full, write_result

_QUIET = None


def main() -> None:
    spec, out_path = read_spec()
    import llama_cpp as L

    mode = spec["mode"]
    prompts = spec_prompts(spec)
    output_len = spec["output_len"]
    max_seqs = min(spec.get("max_num_seqs", 32), len(prompts))
    shared = spec.get("shared_prefix_len", 0) if mode == "generate" else 0
    threads = spec.get("threads", os.cpu_count() or 1)
    n_batch = spec.get("n_batch", 2048)

    if not spec.get("verbose"):
        global _QUIET  # the callback must outlive every llama.cpp call
        _QUIET = L.llama_log_callback(lambda level, text, user: None)
        L.llama_log_set(_QUIET, ctypes.c_void_p(0))
    L.llama_backend_init()
    t0 = time.perf_counter()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(spec["model"].encode(), mparams)
    if not model:
        raise SystemExit(f"llama.cpp could not load {spec['model']}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    # KV: every live sequence holds its prompt + output; with a shared prefix the prefix once
    per_seq = max(map(len, prompts)) + output_len
    n_ctx = (shared + max_seqs * (per_seq - shared)) if shared else max_seqs * per_seq
    cparams = L.llama_context_default_params()
    cparams.n_ctx = -(-n_ctx // 256) * 256 + 256
    cparams.n_batch = n_batch
    cparams.n_ubatch = min(512, n_batch)
    cparams.n_seq_max = max_seqs
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    # a unified KV cache lets sequences share the prefix's cells; without a shared prefix each
    # sequence gets its own stream (attention then reads only its own cells)
    cparams.kv_unified = bool(shared)
    if "flash_attn_type" in spec:  # llama.cpp's default is auto (on for CPU)
        cparams.flash_attn_type = spec["flash_attn_type"]
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit("llama.cpp could not create a context")
    mem = L.llama_get_memory(ctx)
    load_s = time.perf_counter() - t0
    batch = L.llama_batch_init(max(n_batch, max_seqs), 0, max_seqs)

    def decode(entries: list[tuple[int, int, list[int], bool]]) -> None:
        """entries: (token, pos, seq_ids, wants_logits); one llama_decode call."""
        batch.n_tokens = len(entries)
        for i, (tok, pos, seqs, out) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = len(seqs)
            for j, s in enumerate(seqs):
                batch.seq_id[i][j] = s
            batch.logits[i] = out
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc} (batch of {len(entries)} tokens)")

    def argmax_rows(n_rows: int) -> list[int]:
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_rows, n_vocab))
        return logits.argmax(axis=1).tolist()

    def prefill(items: list[tuple[int, list[int], int]]) -> dict[int, int]:
        """items: (seq, tokens, start pos); returns seq -> first generated token."""
        flat = [(tok, start + k, [seq], k == len(toks) - 1)
                for seq, toks, start in items for k, tok in enumerate(toks)]
        first: dict[int, int] = {}
        for s in range(0, len(flat), n_batch):
            chunk = flat[s:s + n_batch]
            decode(chunk)
            owners = [e[2][0] for e in chunk if e[3]]
            if owners:
                for seq, tok in zip(owners, argmax_rows(len(owners))):
                    first[seq] = tok
        return first

    def generate(ps: list[list[int]], n: int, shared: int = 0) -> tuple[list[list[int]], dict]:
        """Greedy, exactly n tokens each, up to max_seqs sequences per decode step."""
        outputs: list[list[int]] = [[] for _ in ps]
        steps = 0
        for w in range(0, len(ps), max_seqs):
            wave = list(range(w, min(w + max_seqs, len(ps))))
            L.llama_memory_clear(mem, True)
            if shared:
                prefix = ps[wave[0]][:shared]
                assert all(ps[i][:shared] == prefix and len(ps[i]) > shared for i in wave)
                decode_prefix = [(tok, k, [0], False) for k, tok in enumerate(prefix)]
                for s in range(0, len(decode_prefix), n_batch):
                    decode(decode_prefix[s:s + n_batch])
                for slot in range(1, len(wave)):
                    L.llama_memory_seq_cp(mem, 0, slot, -1, -1)
                first = prefill([(slot, ps[i][shared:], shared) for slot, i in enumerate(wave)])
            else:
                first = prefill([(slot, ps[i], 0) for slot, i in enumerate(wave)])
            pos = {slot: len(ps[i]) for slot, i in enumerate(wave)}
            for slot, i in enumerate(wave):
                outputs[i].append(first[slot])
            for _ in range(n - 1):
                decode([(outputs[i][-1], pos[slot], [slot], True) for slot, i in enumerate(wave)])
                steps += 1
                for (slot, i), tok in zip(enumerate(wave), argmax_rows(len(wave))):
                    outputs[i].append(tok)
                    pos[slot] += 1
        return outputs, {"decode_steps": steps}

    # warm-up
    generate([prompts[0][:16]], 4)
    common = {"engine": "llama.cpp", "version": getattr(L, "__version__", None), "load_s": round(load_s, 2),
              "dtype": "Q4_1 (GGUF weights as shipped)", "threads": threads, "n_ctx": cparams.n_ctx,
              "kv_unified": bool(cparams.kv_unified), "flash_attn_type": cparams.flash_attn_type,
              "batching": f"low-level llama_decode, up to {max_seqs} sequences per decode step",
              "max_num_seqs": max_seqs, "prefix_reuse": bool(shared),
              "system_info": L.llama_print_system_info().decode(errors="replace").strip()}
    if mode == "generate":
        t0 = time.perf_counter()
        outputs, info = generate(prompts, output_len, shared)
        wall = time.perf_counter() - t0
        result = {**common, **info, **throughput_fields(prompts, sum(map(len, outputs)), wall),
                  "shared_prefix_tokens_computed_once": shared or None, "outputs": outputs}
    else:
        ttft, full = time_first_and_full(lambda n: len(generate(prompts, n)[0][0]), output_len,
                                         spec.get("repeats", 5))
        result = {**common, **latency_fields(ttft, full, output_len)}
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    write_result(result, out_path)


if __name__ == "__main__":
    main()
