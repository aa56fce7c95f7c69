"""Tensor parallelism over torch.distributed (gloo on the CPU, NCCL on CUDA) and distributed
weight sync from a trainer; see docs/tensor_parallel.md."""
