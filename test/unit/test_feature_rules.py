"""feature_rules.py: every refused feature combination, from each caller, with its reason."""
from __future__ import annotations

import pytest

from radixlm.config import ServerArgs
from radixlm.feature_rules import (check_fleet_features, check_runtime_features, check_scheduler_features,
                                   check_transfer)


def test_server_args_refuse_disaggregation_with_tensor_parallelism():
    with pytest.raises(ValueError, match="disaggregation_mode prefill/decode runs with tp_size 1 for now"):
        ServerArgs.from_kwargs(disaggregation_mode="prefill", tp_size=2)
    ServerArgs.from_kwargs(disaggregation_mode="prefill")  # alone it is fine


def test_fleet_refuses_speculation_behind_the_gateway():
    with pytest.raises(ValueError, match=r"--speculative-algorithm with --dp-size > 1 is refused"):
        check_fleet_features(2, "ngram")
    check_fleet_features(2, None)
    check_fleet_features(1, "ngram")


def test_serve_says_why_in_one_line(capsys):
    from radixlm.__main__ import main

    assert main(["serve", "--dp-size", "2", "--speculative-algorithm", "ngram"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("radixlm: error: --speculative-algorithm with --dp-size > 1 is refused: ")


def test_runtime_refuses_speculation_off_the_cpu_backend_or_with_overlap():
    with pytest.raises(ValueError, match="needs the cpu attention backend, this runner uses 'torch_native'"):
        check_runtime_features(speculative=True, attention_backend="torch_native", overlap=False)
    with pytest.raises(ValueError, match="speculative decoding refuses overlap scheduling"):
        check_runtime_features(speculative=True, attention_backend="cpu", overlap=True)
    check_runtime_features(speculative=False, attention_backend="torch_native", overlap=True)
    with pytest.raises(ValueError, match="refuses overlap"):
        check_scheduler_features(speculative=True, overlap=True)


def test_transfer_needs_a_known_mode_and_backend():
    with pytest.raises(ValueError, match=r"unknown disaggregation transfer backend 'rdma'; have \('tcp',\)"):
        check_transfer("decode", "rdma")
    with pytest.raises(ValueError, match="disaggregation mode must be one of"):
        check_transfer("both", "tcp")
    check_transfer("null", "rdma")  # nothing is built: the backend does not matter
    from radixlm.disaggregation.build import build_transfer

    assert build_transfer("null", host="127.0.0.1", bootstrap_port=0, backend="tcp", timeout_s=1.0,
                          kv_buffers=lambda: []) is None
