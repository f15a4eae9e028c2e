"""What every converter input looks like: full Hugging Face-named tensors, fetched one at a time.

An HF directory, a Meta ``consolidated.*.pth`` release and our own checkpoints (any TP/PP/ZeRO) all implement
:class:`TensorSource`. ``get`` may return views into memory-mapped files; ``release`` drops every mapping and
cache, and converters call it after each parameter, so resident memory stays at about one parameter however
large the model is.
"""

from __future__ import annotations

from typing import Protocol

import torch

from llama_megatron.config import ModelConfig
from llama_megatron.errors import CheckpointError
from llama_megatron.model.param_layout import ParamLayout

# Tensors some released HF checkpoints carry that hold no weights (recomputed from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class TensorSource(Protocol):
    def names(self) -> set[str]:
        """HF names of the tensors this source holds."""

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of ``name`` without reading its data."""

    def get(self, name: str) -> torch.Tensor:
        """The full tensor (possibly a view into a mapped file, valid until :meth:`release`)."""

    def get_parts(self, name: str) -> list[torch.Tensor]:
        """Tensors whose concatenation along dim 0 is ``get(name)``: lets writers stream without a copy."""

    def release(self) -> None:
        """Drop open files, mappings and caches."""


def check_source(source: TensorSource, config: ModelConfig, where: str) -> None:
    """Every tensor the config needs is present with the right shape, and nothing the config cannot place."""
    expected = ParamLayout(config).hf_shapes()
    present = source.names()
    missing = [name for name in expected if name not in present]
    if missing:
        raise CheckpointError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing in all); "
                              "does the model config match the weights?")
    for name, shape in expected.items():
        got = tuple(source.info(name)[0])
        if got != shape:
            raise CheckpointError(f"{where}: {name} has shape {got}, the model config implies {shape}")
    allowed = set(expected) | ({"lm_head.weight"} if config.tie_word_embeddings else set())
    unknown = sorted(n for n in present - allowed if not n.endswith(IGNORED_SUFFIXES))
    if unknown:
        raise CheckpointError(f"{where}: {len(unknown)} tensors the model config does not describe, e.g. "
                              f"{unknown[0]} (check num_hidden_layers, biases, tie_word_embeddings)")
