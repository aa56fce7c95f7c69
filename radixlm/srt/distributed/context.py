"""What a model needs to know about tensor parallelism: its shard and the collectives."""
from __future__ import annotations

from dataclasses import dataclass

from radixlm.config import ModelConfig
from radixlm.srt.distributed.comm import SingleRank, TPComm
from radixlm.srt.distributed.layout import TPLayout


@dataclass(frozen=True)
class TPContext:
    layout: TPLayout
    comm: TPComm

    @property
    def rank(self) -> int:
        return self.layout.tp_rank

    @property
    def size(self) -> int:
        return self.layout.tp_size

    @staticmethod
    def single(cfg: ModelConfig) -> "TPContext":
        return TPContext(TPLayout.single(cfg), SingleRank())
