"""Virtual pipeline stages: which chunks of the layer list a pipeline rank holds (``pipeline.virtual_stages``).

With p ranks and v chunks per rank the layer list is cut into p x v virtual stages, run in order. Two placements:

- ``loop`` (Megatron's interleaved 1F1B; 1F1B and ZB-H1 are its v = 1 case): chunk c of rank r holds virtual stage
  c p + r, so the stages go round the ranks v times and the last one sits on rank p - 1;
- ``v`` (ZB-V, v = 2): rank r holds stages r and 2p - 1 - r, down the ranks and back up, so the embedding and the
  head both sit on rank 0 and the turn at rank p - 1 passes a micro batch from its chunk 0 to its chunk 1 without a
  send.

The model (which layers to build), the schedules (who sends to whom) and the engine all ask this one object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StagePlacement:
    ranks: int  # pipeline-parallel degree p
    chunks: int = 1  # virtual stages per rank v
    shape: str = "loop"  # "loop" or "v"

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.chunks < 1:
            raise ValueError(f"a placement needs ranks and chunks >= 1, got {self.ranks} x {self.chunks}")
        if self.shape not in ("loop", "v"):
            raise ValueError(f"placement shape {self.shape!r}: choose loop or v")
        if self.shape == "v" and self.chunks != 2:
            raise ValueError(f"a V placement has 2 chunks per rank, got {self.chunks}")

    @property
    def stages(self) -> int:
        """Virtual stages in all: p x v."""
        return self.ranks * self.chunks

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage chunk ``chunk`` of ``rank`` holds."""
        if self.shape == "v" and chunk == 1:
            return 2 * self.ranks - 1 - rank
        return chunk * self.ranks + rank

    def owner(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage ``stage``."""
        chunk, rank = divmod(stage, self.ranks)
        if self.shape == "v" and chunk == 1:
            return self.ranks - 1 - rank, 1
        return rank, chunk

    def holds(self, rank: int, stage: int) -> bool:
        return self.owner(stage)[0] == rank

    @property
    def loss_rank(self) -> int:
        """The rank holding the last virtual stage (the head and the loss)."""
        return self.owner(self.stages - 1)[0]


def stage_layers_rule(stage_layers: Sequence[int], stages: int, layers: int) -> str | None:
    """Why ``stage_layers`` cannot split ``layers`` decoder layers over ``stages`` virtual stages (None: it can)."""
    if len(stage_layers) != stages or sum(stage_layers) != layers or min(stage_layers) < 0:
        return (f"pipeline.stage_layers {list(stage_layers)}: {stages} counts (parallel.pipeline x "
                f"pipeline.virtual_stages) of decoder layers, each >= 0, adding up to {layers}")
    return None


def split_layers(decoder_flags: list[bool], stages: int, stage_layers: Sequence[int]) -> list[int]:
    """Boundaries (``stages`` + 1 indices into the layer list) of virtual stages holding ``stage_layers[s]``
    decoder layers each (``decoder_flags`` marks them; 0 allowed for a stage that holds only the embedding or the
    head). The other layers (embedding, final norm, head) go with their neighbours: the embedding with the first
    stage, the final norm and the head with the last."""
    decoders = [i for i, flag in enumerate(decoder_flags) if flag]
    why = stage_layers_rule(stage_layers, stages, len(decoders))
    if why is not None:
        raise ValueError(why)
    bounds, taken = [0], 0
    for count in stage_layers[:-1]:
        taken += count
        bounds.append(decoders[taken - 1] + 1 if taken else decoders[0])  # after the stage's last decoder layer
    bounds.append(len(decoder_flags))
    return bounds
