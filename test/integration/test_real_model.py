"""The real default model (SmolLM2-135M-Instruct GGUF) against Hugging Face transformers.

Both sides run float32 on the same dequantized weights, so greedy ids must agree exactly.
"""
from __future__ import annotations

import os

import pytest
import torch

from radixlm import Engine

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain what a prefix cache is in one sentence.",
    "Give me a synonym for happy.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def real_engine(default_model_path):
    eng = Engine(model_path=default_model_path, dtype="float32", max_total_tokens=16384,
                 debug_check_integrity=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_real(default_model_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(default_model_path),
                                                gguf_file=os.path.basename(default_model_path),
                                                torch_dtype=torch.float32).eval()


def _chat_ids(tokenizer, q: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                        add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_greedy_chat_outputs_match_hf(real_engine, hf_real):
    prompts = [_chat_ids(real_engine.tokenizer, q) for q in QUESTIONS]
    outs = real_engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 32, "temperature": 0})
    mismatches = []
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            n = len(o["output_ids"])
            ref = hf_real.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   max_new_tokens=n, do_sample=False, pad_token_id=2)[0, len(p):].tolist()
            if ref != o["output_ids"]:
                mismatches.append((real_engine.tokenizer.decode(p[-12:]), o["text"], ref))
    assert not mismatches, mismatches
    first = outs[0]
    assert "Paris" in first["text"]
    assert first["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}


def test_last_position_logits_match_hf(real_engine, hf_real, default_model_path):
    from radixlm.config import ServerArgs
    from radixlm.srt.model_runner.forward_batch import ForwardBatch, ForwardMode
    from radixlm.srt.model_runner.runner import ModelRunner
    from test.support.overlap_batches import pools

    runner = ModelRunner(ServerArgs(model_path=default_model_path, dtype="float32", max_total_tokens=1024).runner_config())
    ids = _chat_ids(real_engine.tokenizer, QUESTIONS[0])
    rows, alloc = pools(runner)
    slot = rows.alloc()
    loc = alloc.alloc(len(ids))
    try:
        rows.req_to_token[slot, :len(ids)] = loc
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, loc, [slot], [0], [len(ids)], rows.req_to_token)
        with torch.inference_mode():
            runner.attn.init_forward_metadata(fb)
            hidden = runner.model.forward(fb, runner.attn)
            ours = runner.model.compute_logits(hidden[-1:]).float()[0]
            ref = hf_real(torch.tensor([ids])).logits[0, -1].float()
    finally:
        alloc.free(loc)
        rows.free(slot)
    assert (ours - ref).abs().max().item() < 2e-3 * ref.abs().max().item()
    assert ours.argmax().item() == ref.argmax().item()
