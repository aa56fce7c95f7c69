#!/usr/bin/env bash
# Every benchmark of the README's results table, with the peers in the same invocation, writing
# benchmark/results/<workload>_<cpu kind>.json (a newer run replaces the older file of its workload
# and kind of CPU: `{cpu}` in --out is zen4, zen3, amx, ...), then the README table and the plot. Run it on a quiet machine (check
# `uptime`: the 2-core VM's numbers are meaningless under other load) from the repository root:
#
#     bash benchmark/run_all.sh            # everything (~1.5-3 h on 2 cores, most of it the peers)
#     bash benchmark/run_all.sh quick      # roofline, step components, offline 32 x 128 without peers
#
# Peers live in their own venvs (benchmark/peers/README.md); a missing one is reported in the
# JSON and the rest still run. Each command is one line so that a failed one can be rerun alone.
set -uo pipefail
cd "$(dirname "$0")/.."
R=benchmark/results
P="--peer vllm,llamacpp"
mkdir -p "$R/profiles"
run() { echo "== $*" >&2; uptime >&2; "$@" || echo "FAILED: $*" >&2; }

# the machine's limits and each decode-step component against them (docs/performance.md)
run python benchmark/micro/roofline.py --out $R/roofline_{cpu}.json
for mode in "bf16:" "fp32:--dtype float32" "w8a8:--quantization w8a8_int8" "w8a8_kvint8:--quantization w8a8_int8 --kv-cache-dtype int8"; do
  tag=${mode%%:*}; flags=${mode#*:}
  for b in 32 1; do
    run python benchmark/micro/step_components.py --batch $b --ctx 200 --dtype bfloat16 $flags --out $R/profiles/components_b${b}_ctx200_${tag}_{cpu}.json
  done
done
[ "${1:-}" = quick ] && { run python benchmark/offline_throughput.py --num-prompts 32 --output-len 128 --repeats 3 --dtype bfloat16 --logits-check; exit 0; }

# 32 x 128 at equal precision (bf16 vs vLLM bf16) and with w8a8, quality next to speed
run python benchmark/offline_throughput.py --num-prompts 32 --output-len 128 --repeats 3 --dtype bfloat16 --logits-check --peer vllm --interleave 5 --out $R/offline_32x128_bf16_{cpu}.json
run python benchmark/offline_throughput.py --num-prompts 32 --output-len 128 --repeats 3 --dtype bfloat16 --quantization w8a8_int8 --logits-check $P --out $R/offline_32x128_w8a8_{cpu}.json
run python benchmark/offline_throughput.py --num-prompts 32 --output-len 128 --repeats 3 --dtype float32 --logits-check --out $R/offline_32x128_fp32_{cpu}.json

# prefill: 2k, 8k single prompts and 8 concurrent 2k prompts; decode ITL while an 8k prompt prefills
run python benchmark/prefill.py --repeats 3 --dtype bfloat16 $P --out $R/prefill_bf16_{cpu}.json
run python benchmark/prefill.py --repeats 3 --dtype bfloat16 --quantization w8a8_int8 $P --out $R/prefill_w8a8_{cpu}.json
run python benchmark/prefill_interference.py --streams 16 --long-len 8000 --peer vllm --out $R/prefill_interference_bf16_{cpu}.json --dtype bfloat16
run python benchmark/prefill_interference.py --streams 16 --long-len 8000 --out $R/prefill_interference_w8a8_{cpu}.json --dtype bfloat16 --quantization w8a8_int8

# long generations with the int8 KV cache (attention's achieved bandwidth: the step components at ctx 1000)
run python benchmark/offline_throughput.py --num-prompts 32 --output-len 1024 --dtype bfloat16 --quantization w8a8_int8 --kv-cache-dtype int8 --logits-check $P --out $R/offline_32x1024_w8a8_kvint8_{cpu}.json
run python benchmark/offline_throughput.py --num-prompts 32 --output-len 1024 --dtype bfloat16 --quantization w8a8_int8 --kv-cache-dtype auto --out $R/offline_32x1024_w8a8_{cpu}.json
run python benchmark/micro/step_components.py --batch 32 --ctx 1000 --dtype bfloat16 --quantization w8a8_int8 --kv-cache-dtype int8 --out $R/profiles/components_b32_ctx1000_w8a8_kvint8_{cpu}.json
run python benchmark/micro/step_components.py --batch 32 --ctx 1000 --dtype bfloat16 --quantization w8a8_int8 --out $R/profiles/components_b32_ctx1000_w8a8_{cpu}.json

# the serving curve to 256 concurrent streams (KV bytes per token per dtype: roofline.json)
# (twice as many prompts as streams, 16 at least: two waves at each level, ~5 min for radixlm)
run python benchmark/serving.py --launch --dataset chat --num-prompts 16,32,64,128,256,512 --output-len 128 --max-concurrency 1,8,32,64,128,256 --peer vllm --out $R/serving_curve_bf16_{cpu}.json --dtype bfloat16
run python benchmark/serving.py --launch --dataset chat --num-prompts 16,32,64,128,256,512 --output-len 128 --max-concurrency 1,8,32,64,128,256 --out $R/serving_curve_w8a8_kvint8_{cpu}.json --dtype bfloat16 --quantization w8a8_int8 --kv-cache-dtype int8

# single stream and the earlier workloads
run python benchmark/latency.py --prompt-len 42 --output-len 128 --repeats 5 --dtype bfloat16 $P --out $R/latency_bf16_{cpu}.json
run python benchmark/latency.py --prompt-len 42 --output-len 128 --repeats 5 --dtype bfloat16 --quantization w8a8_int8 $P --out $R/latency_w8a8_{cpu}.json
run python benchmark/prefix_sharing.py --num-requests 32 --prefix-len 609 --output-len 32 --repeats 3 --dtype bfloat16 --quantization w8a8_int8 $P --out $R/prefix_sharing_w8a8_{cpu}.json
run python benchmark/report.py   # the README's table, and the plot where matplotlib is installed
