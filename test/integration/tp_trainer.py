"""A trainer process for the weight-sync tests: `python -m test.integration.tp_trainer INIT_METHOD
WORLD_SIZE GROUP_NAME ROUNDS_FILE [BACKEND DEVICE]`. It joins the weight update group as rank 0
(gloo on the CPU by default; nccl with a cuda:N device) and, for each round in ROUNDS_FILE
(torch.save of a list of [(name, tensor), ...]), broadcasts the round's tensors in order,
printing "round N sent"; then leaves the group."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from radixlm.srt.distributed.weight_sync import broadcast_weights, init_custom_process_group


def main() -> None:
    init_method, world_size, group_name, rounds_file = sys.argv[1:5]
    backend, device = (sys.argv[5:7] + ["gloo", "cpu"][len(sys.argv[5:7]):])
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    rounds = torch.load(rounds_file, weights_only=True)
    group = init_custom_process_group(backend, init_method, int(world_size), 0, group_name)
    print("joined", flush=True)
    for i, named in enumerate(rounds):
        broadcast_weights(group, [(n, t.to(device)) for n, t in named])
        print(f"round {i} sent", flush=True)
    dist.destroy_process_group(group)


if __name__ == "__main__":
    main()
