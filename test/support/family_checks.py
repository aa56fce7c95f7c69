"""radixlm against transformers on a tiny random-weight model of one family, in float32.

Given a directory saved by `transformers` (config.json + safetensors + tokenizer, see
test/support/tiny_models.py), the checks are:
- `check_logits`: every position's logits over a batch of prompts of different lengths, then a
  second extend on top of a cached first part, then one decode step, against HF's forward
  (model + KV pool + attention backend, test/support/model_harness.py), within `LOGITS_ATOL`;
- `check_greedy(variant)`: 32-token greedy continuations identical to HF `generate`, through a
  real scheduler over the real model runner (in process, `check_integrity` after every step) or,
  for "tp2", through an `Engine` of two gloo ranks (each checking integrity after every step):
    plain          one prefill batch, then decode;
    cached_prefix  after the prompts, requests sharing each one's first two thirds (cached_tokens > 0);
    chunked        prefill in chunks of `CHUNK` tokens;
    retract        every request retracted mid-decode (a `pause("retract")`), then resumed;
    tp2            --tp-size 2, prompts then prefix-sharing requests.
`check_family(model_dir)` runs them all. HF's greedy choices are asserted to be clear of ties
(`MIN_MARGIN`), so identical tokens are a property of the model, not luck. A per-family test
parametrises over `VARIANTS`; `reference_dir` lets a test compare a deliberately wrong model
against the right reference and see the checks fail."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from radixlm.config import ServerArgs
from radixlm.messages import BatchTokenOut, ReqOutput, TokenizedGenerateReq
from radixlm.sampling_params import SamplingParams
from test.support.model_harness import ModelHarness

GREEDY_TOKENS = 32
# float32 on both sides: only the summation order differs (~4e-7 on the tiny Llama's logits,
# which are ~1 in size).
LOGITS_ATOL = 1e-4
# Every greedy step of the reference beats its runner-up by this much, over 100x the deviation
# above: a tie-free prompt's tokens must then be identical (HFReference picks such prompts).
MIN_MARGIN = 1e-4
PROMPT_LENS = (5, 19, 40)
CHUNK = 8
VARIANTS = ("plain", "cached_prefix", "chunked", "retract", "tp2")
_ids = itertools.count()


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


class HFReference:
    """transformers' model of a directory: logits, and greedy continuations (eos disabled) whose
    every step beats its runner-up by MIN_MARGIN."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          local_files_only=True).eval()
        self.vocab = int(self.model.config.vocab_size)
        self._runs: dict[tuple[tuple[int, ...], int], tuple[list[int], float, int]] = {}

    def logits(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(torch.tensor([ids])).logits[0].float()

    def _run(self, ids: list[int], n: int) -> tuple[list[int], float, int]:
        """(tokens, smallest top-1 - top-2 gap, the step where it is)."""
        key = (tuple(ids), n)
        if key not in self._runs:
            from transformers import GenerationConfig

            cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                                   pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            with torch.inference_mode():
                out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          generation_config=cfg)
            gaps = [float(t[0] - t[1]) for t in (s[0].float().topk(2).values for s in out.scores)]
            step = min(range(len(gaps)), key=gaps.__getitem__)
            self._runs[key] = (out.sequences[0, len(ids):].tolist(), gaps[step], step)
        return self._runs[key]

    def greedy(self, ids: list[int], n: int = GREEDY_TOKENS) -> list[int]:
        tokens, gap, step = self._run(ids, n)
        assert gap > MIN_MARGIN, f"near-tie in the reference at step {step} (gap {gap:.2g}): pick other prompts"
        return tokens

    def clear_prompt(self, n_tokens: int, seed: int, head: list[int] | tuple[int, ...] = (), n: int = GREEDY_TOKENS,
                     tries: int = 32) -> list[int]:
        """`head` + random tokens, `n_tokens` in all: the first of `tries` candidates whose
        greedy continuation has no near-tie."""
        for k in range(tries):
            ids = list(head) + random_prompt(self.vocab, n_tokens - len(head), seed * 1000 + k)
            if self._run(ids, n)[1] > MIN_MARGIN:
                return ids
        raise AssertionError(f"no prompt of {n_tokens} tokens without a near-tie in {tries} tries")

    def prompts(self, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
        """One tie-free prompt per length."""
        return [self.clear_prompt(n, seed + i) for i, n in enumerate(lens)]

    def prefix_sharing(self, prompts: list[list[int]], seed: int = 50) -> list[list[int]]:
        """Per prompt, a tie-free one of the same length sharing its first two thirds (>= 1 token)."""
        return [self.clear_prompt(len(p), seed + i, head=p[:max(1, 2 * len(p) // 3)])
                for i, p in enumerate(prompts)]


def load_radixlm(model_dir: str):
    from radixlm.srt.models.registry import load_model
    from radixlm.srt.weights.loader import load_model_config

    return load_model(model_dir, load_model_config(model_dir), torch.float32, "cpu")


def check_logits(model_dir: str, prompts: list[list[int]] | None = None, reference: HFReference | None = None,
                 atol: float = LOGITS_ATOL, backend: str = "torch_native") -> None:
    """Prefill of every prompt in one batch, a two-part extend (the second part on top of the
    first's KV, beside a fresh request) and one decode step, each against HF's logits."""
    ours = load_radixlm(model_dir)
    ref = reference or HFReference(model_dir)
    prompts = prompts or ref.prompts()
    h = ModelHarness(ours, backend=backend)
    rows = [h.new_request() for _ in prompts]
    for ids, got in zip(prompts, h.extend(rows, prompts)):
        torch.testing.assert_close(got, ref.logits(ids), atol=atol, rtol=0, msg=lambda m: f"prefill: {m}")
    nxt = [int(ref.logits(p)[-1].argmax()) for p in prompts]
    for ids, t, got in zip(prompts, nxt, h.decode(rows, nxt)):
        torch.testing.assert_close(got, ref.logits(ids + [t])[-1], atol=atol, rtol=0, msg=lambda m: f"decode: {m}")
    h2 = ModelHarness(ours, backend=backend)
    rows = [h2.new_request() for _ in prompts]
    cuts = [max(1, len(p) // 2) for p in prompts]
    h2.extend(rows, [p[:c] for p, c in zip(prompts, cuts)])
    fresh = h2.new_request()
    got = h2.extend(rows + [fresh], [p[c:] for p, c in zip(prompts, cuts)] + [prompts[-1]])
    for ids, c, lg in zip(prompts, cuts, got):
        torch.testing.assert_close(lg, ref.logits(ids)[c:], atol=atol, rtol=0, msg=lambda m: f"cached extend: {m}")
    torch.testing.assert_close(got[-1], ref.logits(prompts[-1]), atol=atol, rtol=0)


@dataclass
class SchedulerDriver:
    """A real scheduler over the real model runner, pools and radix tree, in this process, stepped
    by hand with `check_integrity` after every step."""
    model_dir: str
    server_kw: dict = field(default_factory=dict)
    outputs: dict[str, list[ReqOutput]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from radixlm.srt.scheduler_process import build_scheduler

        kw = dict(model_path=self.model_dir, dtype="float32", max_total_tokens=4096, skip_tokenizer_init=True,
                  debug_check_integrity=True)
        args = ServerArgs.from_kwargs(**(kw | self.server_kw))
        self.scheduler, self.runner = build_scheduler(args, self._on_output)

    def _on_output(self, batch: BatchTokenOut) -> None:
        for o in batch.outputs:
            self.outputs.setdefault(o.rid, []).append(o)

    def submit(self, prompt: list[int], n: int = GREEDY_TOKENS) -> str:
        rid = f"f{next(_ids)}"
        params = SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        self.scheduler.add_request(TokenizedGenerateReq(rid=rid, input_ids=list(prompt), sampling_params=params,
                                                        stream=True))
        return rid

    def step(self) -> bool:
        busy = self.scheduler.step()
        self.scheduler.check_integrity()
        return busy

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.step() and self.scheduler.is_idle():
                return
        raise AssertionError("the scheduler did not become idle")

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_token_ids]

    def final(self, rid: str) -> ReqOutput:
        last = self.outputs[rid][-1]
        assert last.finish_reason is not None, f"{rid} did not finish"
        return last

    def assert_conserved(self) -> None:
        s = self.scheduler
        assert s.is_idle()
        s.check_integrity()
        c = s.cache
        assert c.protected() == 0 and c.available() + c.evictable() == c.capacity


def _greedy_in_process(model_dir: str, variant: str, prompts: list[list[int]], ref: HFReference, n: int,
                       chunk: int) -> None:
    kw = {"chunked_prefill_size": chunk} if variant == "chunked" else {}
    if variant == "chunked":
        assert max(map(len, prompts)) > 2 * chunk, "no prompt long enough to take several chunks"
    d = SchedulerDriver(model_dir, kw)
    rids = [d.submit(p, n) for p in prompts]
    if variant == "retract":
        # Mid-decode: every request holds KV and some output; all go back to waiting at once.
        while min(len(d.tokens(r)) for r in rids) < 4:
            assert d.step(), "the scheduler went idle before the requests decoded"
        d.scheduler.pause("retract")
        d.scheduler.check_integrity()
        assert not d.scheduler.live_reqs(), "a request kept its KV through the retraction"
        d.scheduler.resume()
    d.run()
    for rid, p in zip(rids, prompts):
        assert d.tokens(rid) == ref.greedy(p, n), f"{variant}: prompt of {len(p)} tokens"
        assert d.final(rid).finish_reason["type"] == "length"
        if variant == "retract":
            assert d.final(rid).num_retractions >= 1
    if variant == "cached_prefix":
        for p in ref.prefix_sharing(prompts):
            rid = d.submit(p, n)
            d.run()
            assert d.final(rid).cached_tokens > 0, "the shared prefix was not reused"
            assert d.tokens(rid) == ref.greedy(p, n), f"cached prefix: prompt of {len(p)} tokens"
    d.assert_conserved()


def _greedy_tp2(model_dir: str, prompts: list[list[int]], ref: HFReference, n: int, chunk: int) -> None:
    from radixlm import Engine

    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=model_dir, tp_size=2, dtype="float32", max_total_tokens=4096,
                chunked_prefill_size=chunk, skip_tokenizer_init=True, debug_check_integrity=True) as eng:
        assert eng.get_server_info()["tp_size"] == 2
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        for p, o in zip(prompts, outs):
            assert o["output_ids"] == ref.greedy(p, n), f"tp2: prompt of {len(p)} tokens"
        for p in ref.prefix_sharing(prompts):
            o = eng.generate(input_ids=p, sampling_params=params)
            assert o["meta_info"]["cached_tokens"] > 0
            assert o["output_ids"] == ref.greedy(p, n), f"tp2 cached prefix: prompt of {len(p)} tokens"
        eng.check_integrity()
        assert eng.flush_cache(timeout=30)


def check_greedy(model_dir: str, variant: str, prompts: list[list[int]] | None = None,
                 reference: HFReference | None = None, n: int = GREEDY_TOKENS, chunk: int = CHUNK) -> None:
    """`n` greedy tokens per prompt through the engine path `variant` (one of VARIANTS), identical
    to HF's."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    ref = reference or HFReference(model_dir)
    prompts = prompts or ref.prompts()
    if variant == "tp2":
        _greedy_tp2(model_dir, prompts, ref, n, chunk)
    else:
        _greedy_in_process(model_dir, variant, prompts, ref, n, chunk)


def check_family(model_dir: str, variants: tuple[str, ...] = VARIANTS, prompts: list[list[int]] | None = None,
                 reference_dir: str | None = None, atol: float = LOGITS_ATOL) -> None:
    """Logits, then every greedy variant; the reference is HF's model of `reference_dir`
    (default: the same directory)."""
    ref = HFReference(reference_dir or model_dir)
    check_logits(model_dir, prompts, ref, atol)
    for v in variants:
        check_greedy(model_dir, v, prompts, ref)
