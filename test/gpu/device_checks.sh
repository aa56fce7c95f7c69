#!/usr/bin/env bash
# Everything a lent CUDA machine should run (the `device` tool), in stages that fit its calls:
#   source test/gpu/device_stage.sh; bash test/gpu/device_checks.sh [kernels|model|all|engine]
# Results under $OUT (default /tmp/radixlm_gpu):
#   env.txt               what the machine has (GPU, torch, triton, flashinfer, the model)
#   kernels               pytest of the Triton kernels and the backends vs torch_native on random
#                         shapes (no model needed) -> pytest_kernels.txt; attention timings at
#                         batch 1/32/128 -> bench_attention.json
#   model                 the rest of test/gpu (backends inside a model, the overlap forward stream
#                         and copy-done event, tensor parallelism) -> pytest_model.txt;
#                         benchmark/overlap.py -> overlap_cuda.json; the Engine with every backend,
#                         overlap on and off, greedy agreement and tok/s at batch 1/32/256 ->
#                         gpu_engine.json
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/radixlm_gpu}
WHAT=${1:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # benchmark/ scripts import radixlm
MODEL=${RADIXLM_TEST_MODEL_PATH:-}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    python3 - <<'PY'
import importlib.util, os
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for m in ("triton", "flashinfer", "transformers", "gguf", "zmq", "pydantic", "xgrammar"):
    spec = importlib.util.find_spec(m)
    ver = ""
    if spec is not None:
        try:
            ver = getattr(__import__(m), "__version__", "")
        except Exception as e:
            ver = f"import fails: {e}"
    print(m, spec is not None, ver)
try:
    from radixlm.srt.weights.loader import default_model_path
    print("default model", default_model_path())
except Exception as e:
    print("default model missing:", e, "| stand-in:", os.environ.get("RADIXLM_TEST_MODEL_PATH"))
PY
} 2>&1 | tee -a "$OUT/env.txt"

if [ "$WHAT" = kernels ] || [ "$WHAT" = all ]; then
    timeout 180 python3 -m pytest -q -rs -p no:cacheprovider test/gpu/test_cuda_backends.py \
        -k "kernels_match or kv_ops or backends_match" 2>&1 | tail -40 | tee "$OUT/pytest_kernels.txt"
    timeout 60 python3 -m test.gpu.bench_attention --iters 10 --json "$OUT/bench_attention.json" 2>&1 | tail -30
fi
if [ "$WHAT" = engine ]; then  # a second look after fixes: the Engine matrix first, then the model tests
    timeout 200 python3 benchmark/gpu_engine.py ${MODEL:+--model-path "$MODEL"} --output-len 64 \
        --out "$OUT/gpu_engine.json" 2>&1 | grep -v -E 'generate:|^ |^\{|^\}' | tail -30
    timeout 70 python3 -m pytest -q -rs -p no:cacheprovider test/gpu/test_cuda_backends.py -k real_model 2>&1 \
        | tail -30 | tee "$OUT/pytest_model.txt"
    timeout 50 python3 benchmark/overlap.py --device cuda ${MODEL:+--model-path "$MODEL"} --num 64 --output-len 64 \
        --out "$OUT/overlap_cuda.json" 2>&1 | tail -8
fi
if [ "$WHAT" = model ] || [ "$WHAT" = all ]; then
    timeout 200 python3 -m pytest -q -rs -p no:cacheprovider test/gpu \
        -k "not (kernels_match or kv_ops or backends_match)" 2>&1 | tail -60 | tee "$OUT/pytest_model.txt"
    timeout 60 python3 benchmark/overlap.py --device cuda ${MODEL:+--model-path "$MODEL"} --num 64 --output-len 64 \
        --out "$OUT/overlap_cuda.json" 2>&1 | grep -v '^ ' | tail -15
    timeout 240 python3 benchmark/gpu_engine.py ${MODEL:+--model-path "$MODEL"} --output-len 64 --out "$OUT/gpu_engine.json" \
        2>&1 | grep -v -E 'generate:|^ |^\{|^\}' | tail -30
fi
