"""Speculative decoding with the real model runner (tiny random Llama, float32, cpu attention
backend): greedy and seeded outputs and their logprobs equal plain decoding token for token,
finishes inside accepted runs, sampled outputs keep the target distribution, and through the
Engine: n > 1, meta_info / server info counters, and an abort storm with retractions."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from radixlm import Engine
from radixlm.kernels.cpu import ops as cpu_ops
from test.support.engine_checks import assert_idle_and_empty, check_storm_outcomes, random_prompt, run_storm
from test.support.spec_harness import SPEC, in_process

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="speculation needs the cpu attention backend")
GREEDY = {"temperature": 0, "ignore_eos": True}


def _spec(h) -> dict:
    return {k: v for k, v in h.scheduler.get_info().items() if k.startswith("spec")}


def _workload() -> list[list[int]]:
    out = []
    for i in range(6):
        seg = random_prompt(40 + i, 10)
        out.append(seg * 3 if i % 2 == 0 else random_prompt(50 + i, 30))  # repeating / not
    return out


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return in_process(tiny_llama_dir, disable_overlap_schedule=True)


@pytest.fixture(scope="module")
def spec(tiny_llama_dir):
    h = in_process(tiny_llama_dir, **SPEC)
    # Price drafts by the fixed line, not by forward times measured at start-up: those follow
    # the machine's load, and on a busy one drafting fell to a third (the counts below failed).
    h.scheduler.speculation.step_cost = None
    return h


def _run_both(plain, spec, reqs: list[tuple[str, list[int], dict]]) -> None:
    for h in (plain, spec):
        for rid, prompt, kw in reqs:
            h.submit(rid, prompt, **kw)
        h.run()


def test_greedy_tokens_and_logprobs_equal_plain_decoding(plain, spec):
    prompts = _workload()
    lp = {"return_logprob": True, "top_logprobs_num": 3}
    # twice: the second round drafts from the index of the first (as n > 1 samples do)
    reqs = [(f"g{r}-{i}", p, {"max_new_tokens": 24 + 5 * i, **GREEDY, **lp})
            for r in range(2) for i, p in enumerate(prompts)]
    _run_both(plain, spec, reqs[:len(prompts)])
    _run_both(plain, spec, reqs[len(prompts):])
    for rid, _, _ in reqs:
        assert spec.tokens(rid) == plain.tokens(rid), rid
        assert spec.logprobs(rid) == plain.logprobs(rid), rid
        assert spec.top_logprobs(rid) == plain.top_logprobs(rid), rid
    s = _spec(spec)
    assert s["spec_accepted_tokens"] > 100 and s["spec_draft_tokens"] > s["spec_accepted_tokens"]
    second = [spec.final(f"g1-{i}") for i in range(len(prompts))]
    assert all(o.spec_verify_ct < o.completion_tokens // 2 for o in second)


def test_seeded_sampling_equals_plain_decoding(plain, spec):
    prompts = _workload()
    kinds = [{"temperature": 0.8, "top_p": 0.9, "seed": 7}, {"temperature": 1.0, "top_k": 20, "seed": 3,
                                                              "frequency_penalty": 0.3, "min_p": 0.01}]
    reqs = [(f"s{r}-{i}", p, {"max_new_tokens": 16, "ignore_eos": True, **kinds[i % 2]})
            for r in range(2) for i, p in enumerate(prompts[:4])]
    _run_both(plain, spec, reqs[:len(reqs) // 2])
    _run_both(plain, spec, reqs[len(reqs) // 2:])
    assert sum(spec.final(rid).spec_accepted_tokens for rid, _, _ in reqs) > 10
    for rid, _, _ in reqs:
        assert spec.tokens(rid) == plain.tokens(rid), rid


def test_stop_string_and_max_new_tokens_inside_accepted_runs(plain, spec, smollm2_tokenizer):
    p = _workload()[1]
    _run_both(plain, spec, [("warm", p, {"max_new_tokens": 40, **GREEDY})])
    ref = plain.tokens("warm")
    cuts = _spec(spec)["spec_cut_runs"]
    # stop strings ending at several places, so that some land inside an accepted run
    reqs = [(f"stop{j}", p, {"max_new_tokens": 40, "stop": [smollm2_tokenizer.decode(ref[j:j + 2])], **GREEDY})
            for j in (13, 17, 22, 27)]
    reqs += [(f"len{n}", p, {"max_new_tokens": n, **GREEDY}) for n in (1, 3, 11, 26)]
    _run_both(plain, spec, reqs)
    for rid, _, _ in reqs:
        assert spec.tokens(rid) == plain.tokens(rid), rid
        assert spec.final(rid).finish_reason == plain.final(rid).finish_reason
    assert all(spec.final(f"stop{j}").finish_reason["type"] == "stop" for j in (13, 17, 22, 27))
    assert _spec(spec)["spec_cut_runs"] > cuts  # a stop string landed inside an accepted run


def test_grammar_rows_draft_within_xgrammar(plain, spec):
    """A regex that repeats itself: the grammar row drafts from its own context, its drafts are
    checked against the xgrammar matcher (rolled back after), and the output equals plain
    constrained decoding."""
    p = _workload()[3]
    reqs = [(f"re{i}", p, {"regex": r"(the cat sat on the mat\. ){3}(and then it slept\. ){3}",
                           "max_new_tokens": 60, "temperature": 0}) for i in range(2)]
    _run_both(plain, spec, reqs[:1])
    _run_both(plain, spec, reqs[1:])
    for rid, _, _ in reqs:
        assert spec.tokens(rid) == plain.tokens(rid), rid
        assert spec.final(rid).finish_reason == plain.final(rid).finish_reason
    assert spec.final("re1").spec_accepted_tokens > 5


# ---------------------------------------------------------------- the output distribution
V8 = 8
PROMPT8 = [1, 2, 3, 1, 2, 3, 1, 2]  # the prompt lookup drafts "3 1 2 ..." from the start
N8 = 320
# chi-square(7) quantile at p = 1e-6: a correct sampler fails a fixed-seed run essentially never
CHI2_CRIT = 40.5


@pytest.fixture(scope="module")
def tiny_v8_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from test.conftest import TINY_SHAPE
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(**dict(TINY_SHAPE, vocab_size=V8), rope_theta=10000.0)).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked enough that drafts are often right, often wrong
    path = tmp_path_factory.mktemp("tiny_v8")
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path), model


def _exact_marginals(model, depth: int) -> list[torch.Tensor]:
    """P(output token j) for j < depth, by enumerating every earlier output (V8^j prefixes)."""
    prefixes, weights = [[]], torch.ones(1, dtype=torch.float64)
    out = []
    with torch.no_grad():
        for _ in range(depth):
            ids = torch.tensor([PROMPT8 + q for q in prefixes])
            probs = torch.softmax(model(ids).logits[:, -1].double(), -1)  # [P, V]
            joint = weights[:, None] * probs
            out.append(joint.sum(0))
            prefixes = [q + [t] for q in prefixes for t in range(V8)]
            weights = joint.reshape(-1)
    return out


def test_sampled_outputs_keep_the_target_distribution(tiny_v8_dir):
    path, model = tiny_v8_dir
    h = in_process(path, skip_tokenizer_init=True, max_running_requests=16, random_seed=11, **SPEC)
    # The law is under test, not the price: with the layers as one native call a forward of this
    # two-layer model is nearly all per-token work, so the start-up timing says drafts never pay
    # and none were made (CI failed on that). Price them by the fixed line, as `spec` does.
    h.scheduler.speculation.step_cost = None
    for i in range(N8):
        h.submit(f"q{i}", PROMPT8, max_new_tokens=4, temperature=1.0, ignore_eos=True)
    h.run()
    s = _spec(h)
    # drafts both accepted and rejected often enough to test the law of each path
    assert s["spec_accepted_tokens"] > 30 and s["spec_draft_tokens"] - s["spec_accepted_tokens"] > 30
    exact = _exact_marginals(model, 4)
    for j in range(1, 4):  # token 0 comes from the prefill; 1..3 from verify steps
        counts = torch.bincount(torch.tensor([h.tokens(f"q{i}")[j] for i in range(N8)]), minlength=V8).double()
        expected = exact[j] * N8
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < CHI2_CRIT, (j, chi2, counts.tolist(), expected.tolist())


# ---------------------------------------------------------------- through the Engine
@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    eng = Engine(model_path=tiny_llama_dir, dtype="float32", attention_backend="cpu", max_total_tokens=900,
                 max_running_requests=16, chunked_prefill_size=32, schedule_conservativeness=0.05,
                 debug_check_integrity=True, speculative_algorithm="ngram", speculative_num_draft_tokens=6)
    yield eng
    eng.shutdown()


def test_engine_n_samples_meta_info_and_server_info(engine, plain):
    p = _workload()[0]
    plain.submit("ref", p, max_new_tokens=30, **GREEDY)
    plain.run()
    outs = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 30, "n": 3, **GREEDY})
    assert [o["output_ids"] for o in outs] == [plain.tokens("ref")] * 3
    metas = [o["meta_info"] for o in outs]
    assert all(m["spec_verify_ct"] >= 1 and 1.0 <= m["spec_accept_length"] for m in metas)
    again = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 30, **GREEDY})
    assert again["output_ids"] == plain.tokens("ref")
    assert again["meta_info"]["spec_accept_length"] > 3 and again["meta_info"]["spec_accept_rate"] > 0.5
    info = engine.get_server_info()
    assert info["speculative_algorithm"] == "ngram" and info["spec_accepted_tokens"] > 0
    assert 0 < info["spec_accept_rate"] <= 1
    assert info["spec_step_cost"]["tokens"] == [1, 2, 3, 4, 5, 6, 7, 16, 32, 64]  # measured at start-up
    assert all(ms > 0 for ms in info["spec_step_cost"]["ms"])
    assert_idle_and_empty(engine)


def test_engine_abort_storm_with_speculation(engine, tiny_llama_dir):
    rng = random.Random(5)
    base = _workload()
    specs = [(f"q{i}", base[i % len(base)] + random_prompt(200 + i, i % 4), rng.randrange(10, 60))
             for i in range(60)]
    ref = in_process(tiny_llama_dir, disable_overlap_schedule=True, max_total_tokens=20000)
    for rid, p, n in specs:
        ref.submit(rid, p, max_new_tokens=n, temperature=0)
    ref.run()
    reference = {rid: ref.tokens(rid) for rid, _, _ in specs}

    async def one(rid, prompt, n):
        params = {"max_new_tokens": n, "temperature": 0}
        if rng.random() < 0.5:
            chunks = [c async for c in await engine.async_generate(input_ids=prompt, sampling_params=params,
                                                                   rid=rid, stream=True)]
            return [(rid, [t for c in chunks for t in c["output_ids"]], chunks[-1]["meta_info"])]
        r = await engine.async_generate(input_ids=prompt, sampling_params=params, rid=rid)
        return [(rid, r["output_ids"], r["meta_info"])]

    async def chaos():
        for k in range(30):
            await asyncio.sleep(rng.random() * 0.05)
            if k == 20:
                engine.abort_request(abort_all=True)
            else:
                engine.abort_request(rng.choice(specs)[0])

    results = run_storm(one, specs, chaos)
    check_storm_outcomes(results, reference, len(specs))
    info = engine.get_server_info()
    assert info["spec_accepted_tokens"] > 0
    assert_idle_and_empty(engine)
