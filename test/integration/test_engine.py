"""The offline Engine end to end on a tiny random Llama (fast) against Hugging Face."""
from __future__ import annotations

import gc
import os

import pytest
import torch

from radixlm import Engine
from test.support.engine_checks import assert_kv_conserved
from test.support.sched_policy import fifo_permitted, task_policies


@pytest.fixture(scope="module", params=["overlap", "normal"])
def engine(tiny_llama_dir, request):
    # every generation test runs with the overlap scheduler on and off: outputs must agree
    eng = Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=8192,
                 chunked_prefill_size=64, debug_check_integrity=True,
                 disable_overlap_schedule=request.param == "normal",
                 enable_overlap_schedule=request.param == "overlap")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _conserved(request):
    yield
    if "engine" in request.fixturenames:
        assert_kv_conserved(request.getfixturevalue("engine"))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[1, 5, 9, 100, 2000, 31], list(range(300, 340)), [7] * 3 + [8] * 20, [40000, 12, 13]]


def test_greedy_ids_match_hf_in_a_batch(engine, hf_model):
    outs = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                              "ignore_eos": True})
    for p, o in zip(PROMPTS, outs):
        assert o["output_ids"] == hf_greedy(hf_model, p, 12)
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        assert o["meta_info"]["prompt_tokens"] == len(p)


def test_chunked_prefill_equals_unchunked(tiny_llama_dir, engine, hf_model):
    prompt = [(i * 37) % 5000 + 3 for i in range(200)]  # > chunk size 64
    chunked = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                "ignore_eos": True})
    with Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                chunked_prefill_size=-1) as whole:
        unchunked = whole.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                     "ignore_eos": True})
    assert chunked["output_ids"] == unchunked["output_ids"] == hf_greedy(hf_model, prompt, 8)


def test_prefix_reuse_is_reported(engine):
    engine.flush_cache()
    shared = [(i * 13) % 9000 + 5 for i in range(120)]
    first = engine.generate(input_ids=shared + [1, 2], sampling_params={"max_new_tokens": 2})
    steps_before = engine.get_server_info()["num_prefill_tokens"]
    second = engine.generate(input_ids=shared + [3, 4], sampling_params={"max_new_tokens": 2})
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= 120
    assert engine.get_server_info()["num_prefill_tokens"] - steps_before == 2


def test_text_prompt_stream_and_stop_strings(engine):
    prompt = "Hello there, how are you"
    full = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    chunks = list(engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
                                  stream=True))
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    text = full["text"]
    if len(text) >= 6:
        stop = text[3:6]
        cut = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True,
                                       "stop": stop})
        assert cut["text"] == text[:text.index(stop)]
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        kept = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True,
                                        "stop": stop, "no_stop_trim": True})
        assert kept["text"] == text[:text.index(stop) + len(stop)]


def test_n_children_and_seeded_sampling(engine):
    engine.flush_cache()
    params = {"max_new_tokens": 6, "temperature": 1.0, "n": 3, "seed": 42, "ignore_eos": True}
    a = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    b = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    assert len(a) == 3 and [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
    assert len({tuple(x["output_ids"]) for x in a}) > 1  # children differ
    # the children share the prompt through the cache: only the first computed it
    assert sorted(x["meta_info"]["cached_tokens"] for x in a)[1:] == [len(PROMPTS[0]) - 1] * 2


def test_logprobs_match_hf(engine, hf_model):
    prompt = PROMPTS[1]
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                            "ignore_eos": True},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    meta = out["meta_info"]
    seq = prompt + out["output_ids"]
    with torch.inference_mode():
        logits = hf_model(torch.tensor([seq])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    out_lp = [lp for lp, _, _ in meta["output_token_logprobs"]]
    want = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]
    assert out_lp == pytest.approx(want, abs=1e-4)
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(prompt) and inp[0][0] is None
    assert [lp for lp, _, _ in inp[1:]] == pytest.approx([ref[i - 1, prompt[i]].item()
                                                          for i in range(1, len(prompt))], abs=1e-4)
    top = meta["output_top_logprobs"][0]
    assert len(top) == 3 and top[0][1] == out["output_ids"][0]


def test_token_ids_logprob_and_sglang_fields(engine, hf_model):
    """SGLang's GenerateReqInput keywords: token_ids_logprob at every prompt position (across
    prefill chunks of 64) and output position against Hugging Face, the unsupported ones at
    their neutral values, refused by name otherwise."""
    prompt, asked = list(range(300, 450)), [5, 300, 301, 40000]
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                            "ignore_eos": True},
                          return_logprob=True, logprob_start_len=0, token_ids_logprob=asked, extra_key="tenant",
                          return_routed_experts=False, priority=0, lora_path=None, data_parallel_rank=0)
    meta = out["meta_info"]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt + out["output_ids"]])).logits[0].float(), -1)
    inputs, outputs = meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"]
    assert inputs[0] is None and len(inputs) == len(prompt) and len(outputs) == 4
    got = [e for p in inputs[1:] for e in p] + [e for o in outputs for e in o]
    want = [ref[pos, asked].tolist() for pos in range(len(prompt) + 3)]
    assert [t for _, t, _ in got] == asked * (len(prompt) + 3)
    assert [lp for lp, _, _ in got] == pytest.approx([x for row in want for x in row], abs=1e-4)
    assert meta["output_top_logprobs"] == []  # none asked for
    with pytest.raises(ValueError, match="return_routed_experts=True is not supported"):
        engine.generate(input_ids=prompt[:3], return_routed_experts=True)
    with pytest.raises(ValueError, match="retrun_logprob: unknown field"):
        engine.generate(input_ids=prompt[:3], retrun_logprob=True)


def test_input_logprobs_from_start_survive_a_cached_prefix(engine, hf_model):
    """A 7-token prompt, logprob_start_len=1, its first token cached: every input
    logprob from token 1 is returned and equals Hugging Face's."""
    prompt = [4321, 17, 230, 5, 901, 44, 3]
    engine.generate(input_ids=prompt[:1] + [77], sampling_params={"max_new_tokens": 1})  # caches prompt[:1]
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=1)
    inp = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt[1:]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    assert [lp for lp, _, _ in inp] == pytest.approx([ref[i - 1, prompt[i]].item() for i in range(1, 7)],
                                                     abs=1e-4)


@pytest.mark.parametrize("bad", [
    {"prompt": ""},
    {"input_ids": []},
    {"input_ids": list(range(5000))},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
    {"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}},
    {"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}},
    {"input_ids": [1, 2, 10**9]},
    # these once crashed the scheduler or hung the detokenizer
    {"input_ids": [1, 2], "sampling_params": {"seed": 1.5}},
    {"input_ids": [1, 2], "sampling_params": {"seed": "abc"}},
    {"input_ids": [1, 2], "sampling_params": {"skip_special_tokens": "no"}},
    {"input_ids": [1, 2], "sampling_params": {"logit_bias": {"1": 3.5e38}, "temperature": 1.0}},
    {"input_ids": [1, 2], "sampling_params": {"top_k": "5"}},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}},
    {"input_ids": [1, 2], "sampling_params": {"n": 1000}},
])
def test_bad_input_raises_value_error_and_engine_keeps_serving(engine, bad):
    with pytest.raises(ValueError):
        engine.generate(**bad)
    ok = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert len(ok["output_ids"]) == 3


def test_edge_values_the_sampler_honours(engine):
    out = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=[
        {"max_new_tokens": 3, "ignore_eos": True, "top_p": 1e-300, "temperature": 1.0},
        {"max_new_tokens": 3, "ignore_eos": True, "logit_bias": {"11": 100.0}, "temperature": None}])
    greedy = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "ignore_eos": True,
                                                                    "temperature": 0})
    assert out[0]["output_ids"] == greedy["output_ids"]  # a vanishing nucleus keeps the top token
    assert out[1]["output_ids"] == [11, 11, 11]


def test_server_info_and_progress_bar(engine, capsys):
    outs = engine.generate(input_ids=[[i + 10, i + 11] for i in range(20)],
                           sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert len(outs) == 20
    assert "generate" in capsys.readouterr().err  # tqdm bar for a long batch
    info = engine.get_server_info()
    assert set(info["memory"]) == {"capacity", "free", "evictable", "protected"}
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    # the scheduler froze its start-up heap (the model) and counts every collection since
    assert info["gc"]["frozen_objects"] > 10_000
    assert len(info["gc"]["collections"]) == len(info["gc"]["pause_max_s"]) == 3
    assert gc.get_freeze_count() == 0  # never in the process that embeds the Engine


def thread_stat_field(pid: int, field: int) -> set[int]:
    """Field `field` (1-based, proc(5)) of /proc/PID/task/*/stat for every thread of a process."""
    values = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            values.add(int(f.read().rsplit(")", 1)[1].split()[field - 3]))
    return values


def thread_nices(pid: int) -> set[int]:
    """The niceness of every thread of a process (Linux keeps it per thread)."""
    return thread_stat_field(pid, 19)


def thread_policies(pid: int) -> set[int]:
    return set(task_policies(pid).values())


def test_the_scheduler_keeps_the_launchers_priority_by_default(engine):
    own = os.getpriority(os.PRIO_PROCESS, 0)
    for proc in engine.procs.procs.values():
        assert thread_nices(proc.pid) == {own}
        assert thread_policies(proc.pid) == {os.SCHED_OTHER}
    assert os.sched_getscheduler(engine._thread.native_id) == os.SCHED_OTHER


def test_disable_radix_cache(tiny_llama_dir):
    with Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=2048,
                disable_radix_cache=True, debug_check_integrity=True, scheduler_nice=5,
                scheduler_policy="idle") as eng:
        own = os.getpriority(os.PRIO_PROCESS, 0)
        scheduler, detokenizer = eng.procs.procs["scheduler"].pid, eng.procs.procs["detokenizer"].pid
        assert thread_nices(scheduler) == {min(19, own + 5)}  # the forward's threads too
        assert thread_policies(scheduler) == {os.SCHED_IDLE}
        assert thread_nices(detokenizer) == {own} and thread_policies(detokenizer) == {os.SCHED_OTHER}
        # the loop that answers callers never preempts the thread that hands it an abort
        assert os.sched_getscheduler(eng._thread.native_id) == os.SCHED_BATCH
        a = eng.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 4, "temperature": 0})
        b = eng.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert a["output_ids"] == b["output_ids"]
        assert b["meta_info"]["cached_tokens"] == 0
        assert eng.get_server_info()["memory"]["free"] == 2048


def test_a_fifo_policy_makes_only_the_loop_thread_real_time(tiny_llama_dir):
    if not fifo_permitted():
        pytest.skip("SCHED_FIFO needs CAP_SYS_NICE or RLIMIT_RTPRIO here")
    with Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=2048, scheduler_policy="fifo") as eng:
        for proc in eng.procs.procs.values():  # the forward and the detokenizer stay normal
            assert thread_policies(proc.pid) == {os.SCHED_OTHER}
        a = eng.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert len(a["output_ids"]) == 4
        # every thread the loop started meanwhile (executor, ZMQ I/O) is normal
        policies = task_policies(os.getpid())
        assert policies.pop(eng._thread.native_id) == os.SCHED_FIFO
        assert set(policies.values()) == {os.SCHED_OTHER}


def test_page_size_4_gives_the_same_greedy_output(tiny_llama_dir, engine):
    prompt = [(i * 29) % 7000 + 11 for i in range(45)]
    want = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 7, "temperature": 0,
                                                             "ignore_eos": True})["output_ids"]
    with Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=1024, page_size=4,
                chunked_prefill_size=16, debug_check_integrity=True) as paged:
        a = paged.generate(input_ids=prompt, sampling_params={"max_new_tokens": 7, "temperature": 0,
                                                             "ignore_eos": True})
        b = paged.generate(input_ids=prompt + [5], sampling_params={"max_new_tokens": 2})
        assert a["output_ids"] == want
        assert b["meta_info"]["cached_tokens"] == 44  # page-aligned share of the 45-token prompt
        paged.check_integrity()


def test_cli_generate(tiny_llama_dir):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "radixlm", "generate", "Hello", "--model-path", tiny_llama_dir,
                          "--dtype", "float32", "--max-new-tokens", "4", "--max-total-tokens", "512", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json
    result = json.loads(out.stdout)
    assert result["meta_info"]["completion_tokens"] <= 4 and result["meta_info"]["prompt_tokens"] > 1


def test_parent_death_leaves_no_orphans_or_ipc_files(tiny_llama_dir, tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    script = tmp_path / "victim.py"
    script.write_text(
        "import json, os, sys\n"
        "from radixlm import Engine\n"
        f"e = Engine(model_path={tiny_llama_dir!r}, dtype='float32', max_total_tokens=512)\n"
        "print(json.dumps({'ipc': e.procs.ports.dir, 'children': [p.pid for p in e.procs.procs.values()]}), flush=True)\n"
        "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = json.loads(proc.stdout.readline())
    assert os.path.isdir(info["ipc"])
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up in the parent
    proc.wait()

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    deadline = time.time() + 60  # a hang detector: children exit at once, a busy machine is slow
    while time.time() < deadline and (any(alive(p) for p in info["children"]) or os.path.isdir(info["ipc"])):
        time.sleep(0.1)
    assert not any(alive(p) for p in info["children"]), "orphaned child processes"
    assert not os.path.isdir(info["ipc"]), "stale IPC dir"
