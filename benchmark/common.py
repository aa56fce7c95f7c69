"""Shared helpers for the benchmark scripts: machine description, the HF peer, JSON output."""
from __future__ import annotations

import json
import os
import platform
import time


def machine_info() -> dict:
    """What the numbers were measured on (CPU model and flags that matter, cores, torch)."""
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "cpu": platform.processor()}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        flags = set()
        for line in text.splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
        info["isa"] = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"})
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    try:
        info["loadavg_at_start"] = os.getloadavg()[0]
    except OSError:
        pass
    return info


def load_hf(model_path: str):
    """transformers on the same GGUF (dequantised to float32, as HF does for GGUF)."""
    import torch
    from transformers import AutoModelForCausalLM
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                                 torch_dtype=torch.float32)
    model.eval()
    return model, round(time.perf_counter() - t0, 2)


def hf_generate(model, prompts: list[list[int]], output_len: int, batch_size: int) -> list[list[int]]:
    """Greedy, EOS ignored (min_new_tokens), left-padded batches."""
    import torch
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    outputs: list[list[int]] = []
    with torch.inference_mode():
        for s in range(0, len(prompts), batch_size):
            chunk = prompts[s:s + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
            outputs.extend(g[width:].tolist() for g in gen)
    return outputs


def emit(result: dict, out_path: str | None) -> None:
    """Print the JSON; with out_path also write it (with the machine description)."""
    result.setdefault("machine", machine_info())
    text = json.dumps(result, indent=2)
    print(text)
    if out_path:
        os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
        with open(out_path, "w") as f:
            f.write(text + "\n")
