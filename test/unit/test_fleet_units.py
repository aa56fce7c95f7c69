"""The fleet's pure pieces: the /generate allow-list for the gateway's fields, the load shape,
CPU splitting, replica command lines, the built-in dispatcher's routing, router options."""
from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from radixlm.config import ServerArgs
from radixlm.srt.fleet.dispatcher import BALANCE_SLACK, Dispatcher, routing_key
from radixlm.srt.fleet.launch import FleetOptions
from radixlm.srt.fleet.replicas import serve_argv, split_cpus
from radixlm.srt.http_worker_routes import load_snapshot
from radixlm.srt.generate_request import normalize_generate
from radixlm.srt.openai_protocol import GenerateRequest

# What smg 1.13 sent for `{"text": "hello", "sampling_params": {...}, "rid": "r1"}` (recorded).
SMG_BODY = {"text": "hello", "model": "unknown", "sampling_params": {"max_new_tokens": 4, "sampling_seed": 5},
            "return_text_in_logprobs": False, "stream": False, "log_metrics": True, "background": False,
            "no_logs": False, "return_bytes": False, "return_entropy": False, "rid": "r1"}


def test_generate_accepts_the_gateways_fields_and_drops_them():
    body = GenerateRequest.model_validate(SMG_BODY)
    kw = body.generate_kwargs()
    assert not {"model", "log_metrics", "no_logs"} & set(kw)
    assert kw["prompt"] == "hello" and kw["rid"] == "r1" and kw["sampling_params"]["seed"] == 5  # SGLang's name, resolved
    rest = {k: v for k, v in kw.items() if k not in ("prompt", "return_text_in_logprobs")}
    (item,), _ = normalize_generate(None, vocab_size=10, context_len=10, input_ids=[1], **rest)
    assert item.rid == "r1"


@pytest.mark.parametrize("field", ["background", "return_bytes", "return_entropy", "return_hidden_states"])
def test_unsupported_gateway_features_are_refused_by_name(field):
    kw = GenerateRequest.model_validate({**SMG_BODY, field: True}).generate_kwargs()
    kw = {k: v for k, v in kw.items() if k not in ("prompt", "return_text_in_logprobs")}
    with pytest.raises(ValueError, match=field):
        normalize_generate(None, vocab_size=10, context_len=10, input_ids=[1], **kw)


def test_other_unknown_fields_are_still_refused():
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate({**SMG_BODY, "sampling_param": {}})


def test_load_snapshot_in_sglang_shape():
    info = {"memory": {"capacity": 1000, "free": 600, "evictable": 100, "protected": 50}, "num_running_reqs": 3,
            "num_waiting_reqs": 2, "num_waiting_tokens": 40, "num_prefill_tokens": 300, "num_cached_tokens": 100,
            "max_running_requests": 8}
    s = load_snapshot(info, 12.5)
    assert s["num_used_tokens"] == 300 and s["token_usage"] == 0.3 and s["max_total_num_tokens"] == 1000
    assert s["num_total_tokens"] == 340 and s["num_total_reqs"] == 5 and s["cache_hit_rate"] == 0.25
    assert s["gen_throughput"] == 12.5 and s["max_running_requests"] == 8 and s["dp_rank"] == 0


def test_split_cpus():
    assert split_cpus(2, [0, 1]) == [[0], [1]]
    assert split_cpus(2, [4, 5, 6]) == [[4, 5], [6]]
    assert split_cpus(3, [0, 1]) == [[0], [1], [0]]  # fewer cores than replicas: shared
    assert split_cpus(1, [0, 1]) == [[0, 1]]


def test_replica_command_line_round_trips():
    args = ServerArgs.from_kwargs(model_path="/m", dtype="float32", max_total_tokens=4096, disable_radix_cache=True,
                                  mem_fraction_static=0.5, host="0.0.0.0", port=80)
    argv = serve_argv(args, "tiny", 1234)
    assert argv[1:4] == ["-m", "radixlm", "serve"]
    parser = argparse.ArgumentParser()
    parser.add_argument("--served-model-name")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv[4:])
    assert ServerArgs.from_cli_args(ns) == args.replace(host="127.0.0.1", port=1234)
    assert ns.served_model_name == "tiny"


def test_routing_keys():
    assert routing_key({"text": "a" * 1000}) == "a" * 256
    assert routing_key({"input_ids": [[1, 2], [3]]}) == routing_key({"prompt": [1, 2]}) == "1,2"
    assert routing_key({"prompt": ["first", "second"]}) == "first"
    msgs = [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "hi"}]
    assert routing_key({"messages": msgs}) == routing_key({"messages": msgs + [{"role": "user", "content": "x"}]})
    assert routing_key(None) is None and routing_key({}) is None


def test_dispatcher_keeps_a_prefix_on_one_replica_until_it_is_much_busier():
    d = Dispatcher(["http://a", "http://b", "http://c"])
    body = {"text": "shared system prompt " * 20 + "question 1"}
    i = d.pick(body)
    assert all(d.pick({"text": "shared system prompt " * 20 + f"question {k}"}) == i for k in range(10))
    d.inflight[i] = BALANCE_SLACK + 1
    assert d.pick(body) != i  # spills to the least busy replica
    rr = Dispatcher(["http://a", "http://b"], "round_robin")
    assert [rr.pick(body) for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError):
        Dispatcher(["http://a"], "cache_aware")


def test_fleet_options():
    assert FleetOptions(2, "builtin", "cache_aware").resolved_policy("builtin") == "prefix_hash"
    assert FleetOptions(2, "builtin", "round_robin").resolved_policy("builtin") == "round_robin"
    with pytest.raises(ValueError):
        FleetOptions(2, "builtin", "power_of_two").resolved_policy("builtin")
    with pytest.raises(ValueError):
        FleetOptions(2, "smg", "nope").resolved_policy("smg")
    assert FleetOptions(2, "builtin").resolved_router() == "builtin"
