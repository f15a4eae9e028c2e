"""A ``PipelineModule`` whose rank holds several chunks of the layer list (virtual stages,
parallel/pipeline_stages.py), for the schedules of training/pipeline/schedules.py.

DeepSpeed's module holds one contiguous block per rank; this one builds the blocks of every virtual stage its
rank holds, each layer under its global index (``3.self_attn...``, as DeepSpeed names them), and runs one chunk per
call (``current_chunk``, set by the engine). Every file of a checkpoint keeps its global layer name
(``layer_03-model_00-model_states.pt``), so a checkpoint does not know which schedule wrote it; tied layers are
reduced among the ranks that hold them (one rank under a V placement: nothing to reduce).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

from deepspeed.pipe import PipelineModule

from llama_megatron.parallel.pipeline_stages import StagePlacement, split_layers


class ChunkedPipelineModule(PipelineModule):
    def __init__(self, *args, placement: StagePlacement, decoder_type: str = "DecoderLayerPipe",
                 stage_layers: Sequence[int] | None = None, **kwargs) -> None:
        self.placement, self._decoder_type, self._stage_layers = placement, decoder_type, stage_layers
        self.current_chunk = 0
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        """The bounds of the p x v virtual stages: DeepSpeed's ``partition_method`` over p x v parts (its own
        split at v = 1), or ``stage_layers`` decoder layers per virtual stage; this rank's chunks in chunk order."""
        if self._stage_layers is None:
            ranks, self.num_stages = self.num_stages, self.placement.stages
            try:
                super()._partition_layers(method)
            finally:
                self.num_stages = ranks
        else:
            flags = [getattr(getattr(spec, "typename", None), "__name__", None) == self._decoder_type
                     for spec in self._layer_specs]
            self.parts = split_layers(flags, self.placement.stages, self._stage_layers)
        rank = self._topo.get_coord(self.global_rank).pipe
        self.chunk_bounds = [(self.parts[s], self.parts[s + 1])
                             for s in (self.placement.stage(rank, c) for c in range(self.placement.chunks))]

    def _build(self) -> None:
        self.chunk_slices: list[slice] = []
        self.global_index: list[int] = []  # forward_funcs position -> layer index
        for start, stop in self.chunk_bounds:
            first = len(self.forward_funcs)
            self._set_bounds(start, stop)
            super()._build()
            self.chunk_slices.append(slice(first, len(self.forward_funcs)))
            self.global_index += range(start, stop)
        self._set_bounds(self.chunk_bounds[0][0], self.chunk_bounds[0][1])

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline rank holding layer ``layer_idx``."""
        for stage in range(self.placement.stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return self.placement.owner(stage)[0]
        raise RuntimeError(f"layer {layer_idx} is in no virtual stage ({self.parts})")

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        path = os.path.join(ckpt_dir, f"layer_{self.global_index[local_layer_idx]:02d}")
        rank_repr = self._grid._topo.get_rank_repr(rank=self.global_rank)
        return f"{path}{'-' + rank_repr if rank_repr else ''}-model_states.pt"

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        pattern = f"layer_{self.global_index[local_layer_idx]:02d}-*model_states.pt"
        return sorted(glob.glob(os.path.join(ckpt_dir, pattern)))

    def forward(self, forward_input):
        """Chunk ``current_chunk``'s layers; recomputed in windows of ``activation_checkpoint_interval`` layers
        from the chunk's first, as DeepSpeed's windows start at a stage's first layer."""
        funcs = self.forward_funcs[self.chunk_slices[self.current_chunk]]
        interval, x = self.activation_checkpoint_interval, forward_input
        if not interval:
            return _run(funcs)(x)
        for start in range(0, len(funcs), interval):
            window = funcs[start:start + interval]
            x = x if isinstance(x, tuple) else (x,)
            x = (self.activation_checkpoint_func(_run(window), *x) if self._is_checkpointable(window)
                 else _run(window)(*x))
        return x


def _run(funcs: list):
    def run(*inputs):
        x = inputs[0] if len(inputs) == 1 else inputs
        for func in funcs:
            x = func(x)
        return x
    return run
