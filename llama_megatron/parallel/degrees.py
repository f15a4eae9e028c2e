"""The parallel degrees, in one object: :class:`ParallelConfig` (the JSON's ``parallel`` section) is validated here
once, against the model and against the world size, and derives once what one rank holds of the model
(:class:`LocalShapes`) and the data-parallel size. The process groups (parallel/context.py) are built from it;
every layer, the converters, the memory estimate and the planner read it rather than the raw numbers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from llama_megatron.config import ModelConfig
from llama_megatron.errors import ConfigError


@dataclass
class ParallelConfig:
    """Degrees of parallelism; world = data x context x pipeline x tensor.

    ``context`` (context parallelism, DeepSpeed-Ulysses) cuts every sample's sequence into ``context`` shards and
    gives attention, through an all-to-all, the whole sequence for 1/context of each TP rank's heads. The KV heads
    of a TP rank need not divide by it: they are repeated until they do (:func:`kv_head_repeats`).
    """

    tensor: int = 1  # tensor-parallel degree (TP)
    pipeline: int = 1  # pipeline-parallel degree (PP)
    # context-parallel degree (CP, DeepSpeed-Ulysses): every sample's sequence cut into this many shards
    context: int = 1
    expert: int = 1  # expert parallelism: the MoE experts split over this many ranks of the data axis
    # sequence parallelism: norms and residuals on sequence shards of the TP group
    sequence_parallel: bool = False
    make_vocab_size_divisible_by: int = 128  # the vocabulary is padded to a multiple of this x TP

    def check_degrees(self) -> None:
        """What holds whatever the model: positive integer degrees, sequence parallelism within a TP group."""
        for name in ("tensor", "pipeline", "context", "expert", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.sequence_parallel and self.tensor == 1:
            raise ConfigError("sequence_parallel needs tensor parallel degree > 1")

    def validate(self, model: ModelConfig) -> None:
        self.check_degrees()
        tp = self.tensor
        if model.num_attention_heads % tp:
            raise ConfigError(
                f"tensor parallel degree {tp} does not divide num_attention_heads {model.num_attention_heads}"
            )
        if model.num_key_value_heads % tp:
            raise ConfigError(
                f"tensor parallel degree {tp} does not divide num_key_value_heads {model.num_key_value_heads}"
            )
        moe = model.family.moe
        widths = [model.family.dense_width_key]
        widths += [] if moe is None else [moe.width_key] + [moe.shared_width_key] * moe.shared_expert
        widths = list(dict.fromkeys(widths))
        for name in widths:  # every expert is split over TP as the dense MLP is
            if getattr(model, name) % tp:
                raise ConfigError(f"tensor parallel degree {tp} does not divide {name} {getattr(model, name)}")
        if self.pipeline > model.num_hidden_layers:
            raise ConfigError(
                f"pipeline degree {self.pipeline} exceeds num_hidden_layers {model.num_hidden_layers}"
            )
        if self.expert > 1 and not model.family.moe:
            raise ConfigError(f"parallel.expert {self.expert} needs a mixture-of-experts model (the "
                              f"{model.model_type} family has no experts)")
        if model.family.moe and model.num_local_experts % self.expert:
            raise ConfigError(f"expert parallel degree {self.expert} does not divide num_local_experts "
                              f"{model.num_local_experts}")
        heads_per_rank = self.local_shapes(model).heads
        if heads_per_rank % self.context:
            raise ConfigError(
                f"context parallel degree {self.context} does not divide the {heads_per_rank} attention heads per "
                f"tensor-parallel rank (num_attention_heads {model.num_attention_heads} / tensor {tp})"
            )

    def local_shapes(self, model: ModelConfig) -> LocalShapes:
        """What one rank holds of ``model`` under these degrees (the divisibility is :meth:`validate`'s)."""
        return LocalShapes.of(model, self.tensor, self.padded_vocab_size(model.vocab_size), self.context,
                              self.expert)

    def check_seq_length(self, seq_length: int) -> None:
        """Every context rank holds an equal sequence shard, cut again over TP under sequence parallelism."""
        cp, tp = self.context, self.tensor
        sp = tp if self.sequence_parallel else 1
        if seq_length % (cp * sp) == 0:
            return
        if cp == 1:
            raise ConfigError(f"sequence_parallel needs seq_length {seq_length} divisible by tensor {tp}")
        if sp == 1:
            raise ConfigError(f"context parallel degree {cp} needs seq_length {seq_length} divisible by {cp}")
        raise ConfigError(f"context parallelism with sequence_parallel needs seq_length {seq_length} divisible by "
                          f"context x tensor = {cp} x {tp}")

    def check_world_size(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world size must be a positive integer, got {world_size}")
        model_parallel = self.tensor * self.pipeline * self.context
        if world_size % model_parallel:
            layout = f"tensor x pipeline = {self.tensor} x {self.pipeline}"
            if self.context > 1:
                layout = f"tensor x pipeline x context = {self.tensor} x {self.pipeline} x {self.context}"
            raise ConfigError(f"world size {world_size} is not divisible by {layout}")
        data_axis = world_size // (self.tensor * self.pipeline)
        if data_axis % self.expert:
            raise ConfigError(f"expert parallel degree {self.expert} does not divide the data axis (data x "
                              f"context = {data_axis} ranks), which the experts are split over")

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tensor * self.pipeline * self.context)

    def padded_vocab_size(self, vocab_size: int) -> int:
        return padded_vocab_size(vocab_size, self.make_vocab_size_divisible_by, self.tensor)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown parallel config keys: {', '.join(sorted(unknown))}")
        return cls(**data)


@dataclass(frozen=True)
class LocalShapes:
    """One tensor-parallel rank's share of the model, derived here once for every reader (model layers, generation's
    cache, LoRA, conversion's slicing, the memory estimate): head counts, MLP rows, vocabulary rows and the K/V
    repeats of context parallelism. The degrees themselves are :class:`ParallelConfig`'s, validated once."""

    tensor: int
    padded_vocab_size: int | None  # None where only the heads and rows are asked for (conversion's slicing)
    heads: int  # query heads per TP rank
    kv_heads: int  # KV heads (GQA groups) per TP rank
    intermediate: int  # MLP rows per TP rank (gate and up each)
    kv_repeats: int = 1  # copies of each KV head before the context-parallel all-to-all
    experts: int = 0  # MoE experts per expert-parallel rank (0: a dense model)
    expert: int = 1  # the expert-parallel degree they are split over
    expert_intermediate: int = 0  # a routed expert's rows per TP rank (gate and up each)
    shared_intermediate: int = 0  # the shared expert's rows per TP rank (Qwen2-MoE, Llama 4; 0: none)

    @property
    def vocab_rows(self) -> int:
        if self.padded_vocab_size is None:
            raise ValueError("these local shapes were derived without the padded vocabulary")
        return self.padded_vocab_size // self.tensor

    @classmethod
    def of(cls, model: ModelConfig, tensor: int, padded_vocab_size: int | None = None,
           context: int = 1, expert: int = 1) -> LocalShapes:
        kv_heads = model.num_key_value_heads // tensor
        return cls(tensor, padded_vocab_size, model.num_attention_heads // tensor, kv_heads,
                   model.dense_intermediate_size // tensor, kv_head_repeats(kv_heads, context),
                   model.num_local_experts // expert, expert, model.expert_intermediate_size // tensor,
                   model.shared_intermediate_size // tensor)

    def expert_ids(self, ep_rank: int) -> range:
        """The global ids of the experts expert-parallel rank ``ep_rank`` holds (a contiguous block)."""
        return range(ep_rank * self.experts, (ep_rank + 1) * self.experts)


def kv_head_repeats(kv_heads_per_rank: int, context: int) -> int:
    """How often each KV head of a TP rank is repeated before the context-parallel all-to-all (GQA strategy).

    Ulysses hands context rank c the c-th of ``context`` equal blocks of its TP rank's query heads, which belong to
    whole KV groups only when the KV heads split evenly too. Otherwise every KV head is repeated r = context /
    gcd(kv, context) times (adjacent copies, as Megatron-Core does): kv x r divides by the context degree, and r
    divides the query heads per KV group (since context divides kv x group size), so each context rank receives
    exactly the K/V of its query heads. Attention with repeated K/V heads equals GQA; only the all-to-all of k and v
    grows by r.
    """
    return context // math.gcd(kv_heads_per_rank, context)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round up to a multiple of ``divisible_by * tp`` so every TP shard is equal."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
