"""Tensor parallelism on CUDA: the checks of test/integration/test_tensor_parallel.py with the
ranks on GPUs (overlap scheduling on, as it is by default on CUDA).

- `nccl`: one GPU per rank, NCCL between them (needs 2 GPUs);
- `gloo-shared-gpu`: both ranks on one GPU with gloo between them (RADIXLM_TP_BACKEND=gloo;
  NCCL refuses two ranks on one device), which runs the same per-rank CUDA model code and
  attention kernels on a machine with a single GPU.
The trainer broadcasts over gloo from the CPU into the ranks' GPU tensors; with 3 GPUs also
over NCCL from cuda:2. Skipped without CUDA (conftest.py).
"""
from __future__ import annotations

import os

import pytest
import torch

from radixlm import Engine
from test.integration.test_tensor_parallel import (ARGS, check_dead_rank, check_greedy_identical, check_storm,
                                                   check_trainer_broadcast)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
BACKENDS = [pytest.param("nccl", marks=pytest.mark.skipif(GPUS < 2, reason="NCCL tensor parallelism needs 2 GPUs")),
            pytest.param("gloo-shared-gpu", marks=pytest.mark.skipif(GPUS < 1, reason="needs a GPU"))]


@pytest.fixture(scope="module", params=BACKENDS)
def engines(request, tiny_llama_tp_dir):
    args = dict(ARGS, device="cuda")
    tp1 = Engine(model_path=tiny_llama_tp_dir, tp_size=1, **args)
    old = os.environ.get("RADIXLM_TP_BACKEND")
    if request.param == "gloo-shared-gpu":
        os.environ["RADIXLM_TP_BACKEND"] = "gloo"  # read by the rank processes at start-up
    try:
        tp2 = Engine(model_path=tiny_llama_tp_dir, tp_size=2, **args)
    finally:
        os.environ.pop("RADIXLM_TP_BACKEND", None)
        if old is not None:
            os.environ["RADIXLM_TP_BACKEND"] = old
    yield tp1, tp2, request.param
    tp1.shutdown()
    tp2.shutdown()


def test_greedy_identical_to_tp1(engines):
    tp1, tp2, _ = engines
    assert tp2.get_server_info()["overlap"]  # the forward thread issues the model's collectives
    check_greedy_identical(tp1, tp2)


def test_abort_and_retraction_storm(engines):
    tp1, tp2, _ = engines
    check_storm(tp1, tp2)


def test_trainer_broadcast_over_gloo_into_gpu_ranks(engines, tiny_llama_tp_dir, tmp_path):
    tp1, tp2, _ = engines
    check_trainer_broadcast(tp1, tp2, tiny_llama_tp_dir, tmp_path)


@pytest.mark.skipif(GPUS < 3, reason="an NCCL trainer needs a GPU of its own beside the two ranks'")
def test_trainer_broadcast_over_nccl(engines, tiny_llama_tp_dir, tmp_path):
    tp1, tp2, backend = engines
    if backend != "nccl":
        pytest.skip("the NCCL weight group is checked with NCCL ranks")
    check_trainer_broadcast(tp1, tp2, tiny_llama_tp_dir, tmp_path, backend="nccl", device="cuda:2")


def test_a_dead_rank_takes_the_engine_down(engines):
    check_dead_rank(engines[1])
