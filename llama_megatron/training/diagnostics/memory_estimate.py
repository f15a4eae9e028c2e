"""Per-rank memory of a training run, from its configs alone: model states and activations per pipeline stage.

Model states follow what DeepSpeed 0.19.8 allocates (deepspeed_memory.py; checked against real engines in
tests/test_training_estimate.py):

* ZeRO-1/2 and BF16_Optimizer flatten every parameter group into one buffer padded to a multiple of
  2 x DP (``nccl_start_alignment_factor``); the parameters become views of it and each DP rank owns 1/DP of it
  as an fp32 master copy with Adam's exp_avg and exp_avg_sq.
* ZeRO-3 splits every parameter into ceil(numel / DP) elements per rank; parameters with at most
  ``stage3_param_persistence_threshold`` elements also stay whole (padded to a multiple of DP) on every rank
  after the first forward.
* ZeRO-0 runs the torch optimizer on the parameters themselves (fp32), or on an fp32 copy (bf16/fp16).

Beside them, DeepSpeed's own communication buffers (deepspeed_memory.zero_buffers, row ``ZeRO buffers``), sized by
its config and not by the model: a buffer of ``reduce_bucket_size`` elements is allocated whole however few gradients fill it
(5e8 by default: 2 GB in fp32 next to a model of a few MB).

Activations count the tensors autograd saves for backward in this repository's layers, for the kernels the run
would use on a GPU (``kernels``: ``auto`` = the fast kernels): the reference kernels (SDPA with K/V repeated for
GQA, the fp32 softmax of the full logits kept for the loss's backward) or the fast ones (K/V not repeated, fused
norms and SwiGLU, the chunked loss keeping only its input's and weight's gradients).

Context parallelism divides every token-sized activation by CP (a rank holds s / CP tokens; after the Ulysses
all-to-all its attention holds all s tokens for 1/CP of the heads, the same bytes) except the full-length position
ids; it adds the attention output in both layouts (before and after the all-to-all back), K/V repeated for the
all-to-all when the KV heads do not split over CP, and ZeRO partitions over DP x CP.

A mixture-of-experts layer holds the router and its EP rank's experts; under ZeRO the experts form parameter groups
of their own, partitioned over their expert-data-parallel group (DP x CP / EP ranks). Its activations assume
balanced routing (each rank's experts receive, on average, the k x tokens assignments its tokens make): the router's
fp32 probabilities, the experts' inputs (what the all-to-all delivers), their SwiGLU intermediates and outputs.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

from llama_megatron.config import ModelConfig
from llama_megatron.errors import ConfigError
from llama_megatron.model.kernels import kernel_choice
from llama_megatron.model.lora_layout import (
    LoraConfig,
    adapter_layout,
)
from llama_megatron.model.param_layout import ParamLayout
from llama_megatron.model.tp_slicing import shard_shape
from llama_megatron.parallel.pipeline_stages import StagePlacement, split_layers
from llama_megatron.training.config import BatchConfig, TrainingConfig
from llama_megatron.training.diagnostics.activation_bytes import (
    activations,
    deferred_weight_grad_bytes,
    fp8_transient_bytes,
)
from llama_megatron.training.diagnostics.deepspeed_memory import (
    ELEMENT_BYTES,
    model_states,
    optimizer_wrapper,
    zero_buffers,
)
from llama_megatron.training.diagnostics.pipeline_held import held_peak
from llama_megatron.training.engine.deepspeed_config import precision, zero_stage
from llama_megatron.training.objectives import objective_of


@dataclass
class StageEstimate:
    """Bytes on one rank of pipeline stage ``stage`` (every TP and DP rank of a stage is alike)."""

    stage: int
    decoder_layers: int
    parameters: int
    gradients: int
    optimizer: int
    activations_per_micro_batch: int
    in_flight: int
    recompute: int  # one recomputed span's activations, alive during its backward (once per stage)
    logits: int
    # a split schedule's (zb-h1) weight-gradient work queued between a micro batch's B and W (the linears' inputs
    # and output gradients), and how many micro batches' worth the stage holds at its peak next to ``in_flight``
    # (0 under 1F1B)
    deferred_per_micro_batch: int = 0
    deferred_micro_batches: int = 0
    # virtual stages: the peak of what the rank's chunks hold (each chunk's micro batches in flight and W pending,
    # at their own sizes); ``in_flight`` and ``deferred_micro_batches`` then count chunk passes at that peak, and the
    # per-micro-batch sizes are one micro batch through all the rank's chunks
    held_bytes: int | None = None
    cpu_parameters: int = 0
    cpu_gradients: int = 0
    cpu_optimizer: int = 0
    # ``checkpoint.async_save``: the host copy of what the stage's first DP rank saves (the module's weights and its
    # optimizer partition; the other DP ranks hold their optimizer partition only), kept between saves
    async_save_host: int = 0
    # ``fp8``: the float8 copies of one linear's GEMM operands and their scales, made and dropped per GEMM (the
    # largest linear's; nothing float8 is kept between passes: the casts are made again in backward)
    fp8_transient: int = 0
    # DeepSpeed's communication buffers (deepspeed_memory.zero_buffers): ZeRO-1/2/3's gradient reduce buckets, and under
    # ZeRO-3 the parameters all-gathered and kept (or prefetched) at the forward's end; ``trained_elements`` is what the
    # gradients of the rank need of a bucket (every trained element of the stage on this rank, before partitioning)
    reduce_buckets: int = 0
    gathered_parameters: int = 0
    bucket_elements: int = 0
    trained_elements: int = 0
    # online RL: the rollout's decoding (KV cache, prompt pass, a step's logits), held beside the model states while
    # no training pass holds activations (training/objectives.py)
    rollout: int = 0
    # the reference policy's weights an objective holds beside the policy's (GRPO with beta > 0, full fine-tuning):
    # this rank's share, as it holds the policy's
    reference: int = 0

    @property
    def activations(self) -> int:
        held = self.held_bytes
        if held is None:
            held = (self.activations_per_micro_batch * self.in_flight
                    + self.deferred_per_micro_batch * self.deferred_micro_batches)
        return held + self.recompute

    @property
    def buffers(self) -> int:
        return self.reduce_buckets + self.gathered_parameters

    @property
    def gpu_total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.buffers + self.reference
                + max(self.activations + self.logits + self.fp8_transient, self.rollout))

    @property
    def cpu_total(self) -> int:
        return self.cpu_parameters + self.cpu_gradients + self.cpu_optimizer + self.async_save_host


@dataclass
class Estimate:
    world_size: int
    data_parallel: int
    context: int
    zero: int
    precision: str
    optimizer_wrapper: str
    micro_batch_size: int
    micro_batches: int
    kernels: str = "reference"
    schedule: str = "1f1b"  # pipeline.schedule
    virtual_stages: int = 1  # pipeline.virtual_stages (chunks per rank)
    stages: list[StageEstimate] = field(default_factory=list)

    @property
    def peak_gpu(self) -> int:
        return max(s.gpu_total for s in self.stages)


@dataclass
class _Layer:
    """One entry of the model's layer list (see llama_megatron/model/llama.py) with its per-TP-rank sizes."""

    kind: str  # EmbeddingPipe, DecoderLayerPipe, FinalNormPipe, LMHeadPipe
    params: list[tuple[int, bool]]  # (numel, decayed: a matrix, not a norm or bias) per parameter of the model
    adapters: list[tuple[int, bool]]  # the same for the LoRA adapters on it and the modules to save, which train
    frozen: bool  # a LoRA run: the model's own parameters do not train (but the modules to save, in ``adapters``)
    experts: list[tuple[int, bool]] = field(default_factory=list)  # this EP rank's experts, with expert parallelism
    expert_adapters: list[tuple[int, bool]] = field(default_factory=list)  # their LoRA adapters

    @property
    def model_numels(self) -> list[int]:
        """Elements of each of the model's own parameters on this rank, its experts included."""
        return [n for n, _ in self.params + self.experts]

    def states_params(self) -> list[tuple[int, bool, bool, bool]]:
        """(numel, decayed, trains, an expert's under expert parallelism) of every parameter the engine holds."""
        return ([(n, d, not self.frozen, False) for n, d in self.params]
                + [(n, d, not self.frozen, True) for n, d in self.experts]
                + [(n, d, True, False) for n, d in self.adapters]
                + [(n, d, True, True) for n, d in self.expert_adapters])


_LAYERS_SEEN: dict[tuple, tuple[ModelConfig, LoraConfig | None, list[_Layer]]] = {}


def _layers(model: ModelConfig, padded_vocab: int, tp: int, lora: LoraConfig | None = None,
            ep: int = 1) -> list[_Layer]:
    """:func:`_layer_list`, kept for the last model asked about (the planner asks for it once per layout)."""
    key = (id(model), padded_vocab, tp, id(lora), ep)
    seen = _LAYERS_SEEN.get(key)
    if seen is None or seen[0] is not model or seen[1] is not lora:
        if len(_LAYERS_SEEN) > 64:
            _LAYERS_SEEN.clear()
        seen = _LAYERS_SEEN[key] = (model, lora, _layer_list(model, padded_vocab, tp, lora, ep))
    return seen[2]


def _layer_list(model: ModelConfig, padded_vocab: int, tp: int, lora: LoraConfig | None = None,
                ep: int = 1) -> list[_Layer]:
    """The pipeline layer list with each layer's per-TP-rank parameters (an MoE model's per EP rank: every EP rank
    holds as many experts), from the parameter layout table (and the adapter table of a LoRA run)."""
    n = model.num_hidden_layers
    head = "EmbeddingPipe" if model.tie_word_embeddings else "LMHeadPipe"
    kinds = ["EmbeddingPipe"] + ["DecoderLayerPipe"] * n + ["FinalNormPipe", head]
    trained = adapter_layout(model, lora).held_by(0, ep) if lora else []
    saved = {spec.module_name for spec in trained}  # a LoRA run's modules to save: base rows that train
    tables = [[s for s in ParamLayout(model).held_by(0, ep) if s.module_name not in saved], trained]
    # per table, [everything but this EP rank's experts, its experts (EP > 1)], each a list per layer
    params = [[[[] for _ in kinds] for _ in range(2)] for _ in tables]
    for table, (rows, experts) in zip(tables, params):
        for spec in table:
            shape = shard_shape(spec, model, tp, padded_vocab)
            held = experts if spec.expert is not None and ep > 1 else rows
            for index in spec.layers:  # a tied table sits on both end layers
                held[index].append((math.prod(shape), len(shape) >= 2))  # matrices are weight-decayed
    (own, experts), (adapters, expert_adapters) = params
    return [_Layer(kind, layer_own, layer_adapters, lora is not None, layer_experts, layer_expert_adapters)
            for kind, layer_own, layer_adapters, layer_experts, layer_expert_adapters
            in zip(kinds, own, adapters, experts, expert_adapters)]


def _stage_bounds(layers: list[_Layer], pp: int, method: str) -> list[int]:
    """DeepSpeed PipelineModule's own partitioning of the layer list over ``pp`` stages."""
    method = method.lower()
    if method == "uniform":
        return _partition(("uniform", len(layers)), pp)
    if method == "parameters":
        return _partition(tuple(sum(layer.model_numels) for layer in layers), pp)
    if method.startswith("type:"):
        pattern = re.compile(method[5:], re.IGNORECASE)
        return _partition(tuple(1 if pattern.search(layer.kind) else 0 for layer in layers), pp)
    raise ConfigError(f"pipeline.partition_method {method!r}: estimate knows uniform, parameters and type:REGEX")


@functools.lru_cache(maxsize=1024)
def _partition(weights: tuple, parts: int) -> list[int]:
    """DeepSpeed's partition_uniform (``("uniform", items)``) or partition_balanced (the layers' weights), kept: the
    planner asks for the same split of one model many times."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    if weights and weights[0] == "uniform":
        return partition_uniform(num_items=weights[1], num_parts=parts)
    return partition_balanced(weights=list(weights), num_parts=parts)


def _virtual_stage_bounds(config: TrainingConfig, layers: list[_Layer], placement: StagePlacement) -> list[int]:
    """Where each virtual stage's layers start and end in the layer list (one stage: all of them)."""
    pipe = config.pipeline
    if config.parallel.pipeline == 1:
        return [0, len(layers)]
    if pipe.stage_layers is None:
        return _stage_bounds(layers, placement.stages, pipe.partition_method)
    return split_layers([layer.kind == "DecoderLayerPipe" for layer in layers], placement.stages, pipe.stage_layers)


def virtual_stages(config: TrainingConfig) -> tuple[list[list[_Layer]], StagePlacement]:
    pp = config.parallel.pipeline
    layers = _layers(config.model, config.local_shapes.padded_vocab_size, config.parallel.tensor,
                     ep=config.parallel.expert)
    placement = config.pipeline.placement(pp) or StagePlacement(pp)
    bounds = _virtual_stage_bounds(config, layers, placement)
    return [layers[bounds[s]:bounds[s + 1]] for s in range(placement.stages)], placement


def stage_layer_kinds(config: TrainingConfig) -> list[list[str]]:
    """The layer kinds of each virtual stage, in stage order (what the planner costs pass by pass)."""
    return [[layer.kind for layer in stage] for stage in virtual_stages(config)[0]]


def rank_parameter_counts(config: TrainingConfig) -> list[int]:
    """Elements of the model each pipeline rank holds per TP rank (its EP rank's experts), before ZeRO."""
    stages, placement = virtual_stages(config)
    counts = []
    for rank in range(config.parallel.pipeline):
        chunks = [stages[placement.stage(rank, c)] for c in range(placement.chunks)]
        if config.parallel.pipeline == 1 and config.model.tie_word_embeddings:
            chunks[0] = chunks[0][:-1]
        counts.append(sum(sum(layer.model_numels) for layer in _distinct_tables(chunks)))
    return counts


def estimate(config: TrainingConfig, ds: dict, world_size: int, micro_batch_size: int | None = None) -> Estimate:
    """Per-stage bytes of one rank; ``ds`` is the built DeepSpeed config (build_deepspeed_config)."""
    par = config.parallel
    tp, pp = par.tensor, par.pipeline
    par.check_world_size(world_size)
    dp = config.data_parallel_size(world_size)
    partitions = dp * par.context  # ZeRO partitions over DeepSpeed's data-parallel group, DP x CP
    b = micro_batch_size or config.batch.micro_batch_size
    batch = BatchConfig(b, config.batch.global_batch_size)
    if batch.global_batch_size % (b * dp):
        raise ConfigError(f"batch.global_batch_size {batch.global_batch_size} is not divisible by "
                          f"micro batch {b} x data parallel {dp}")
    micro_batches = batch.accumulation_steps(dp)
    prec = precision(ds)
    e = ELEMENT_BYTES[prec]
    wrapper = optimizer_wrapper(ds, pp)
    layers = _layers(config.model, config.local_shapes.padded_vocab_size, tp, config.lora, par.expert)
    kernels = kernel_choice(config.kernels, "cuda")  # a GPU's kernels: what the estimate is for
    fast = kernels != "reference"
    pipe = config.pipeline
    placement = pipe.placement(pp) or StagePlacement(pp)  # 1f1b: DeepSpeed's blocks, one per rank
    bounds = _virtual_stage_bounds(config, layers, placement)
    result = Estimate(world_size, dp, par.context, zero_stage(ds), prec, wrapper, b, micro_batches, kernels,
                      pipe.schedule, placement.chunks)
    known: dict[tuple[str, ...], tuple] = {}
    rows = b * config.rows_per_sample  # a padded preference pair is two sequences
    for rank in range(pp):
        chunks = [layers[bounds[s]:bounds[s + 1]] for s in (placement.stage(rank, c) for c in range(placement.chunks))]
        if pp == 1 and config.model.tie_word_embeddings:
            chunks[0] = chunks[0][:-1]  # one shared table in a single-stage model
        # a tied table held twice by one rank (the V's first and last stages) is one parameter
        params = [p for layer in _distinct_tables(chunks) for p in layer.states_params()]
        kinds = [[layer.kind for layer in chunk] for chunk in chunks]
        # ranks whose chunks hold the same layers hold the same activations: counted once per kind of chunk
        for k in map(tuple, kinds):
            if k not in known:
                known[k] = (activations(config, list(k), rows, e, pp > 1, fast),
                            deferred_weight_grad_bytes(config, list(k), rows, e, fast))
        per_chunk = [known[tuple(k)][0] for k in kinds]
        saved = [a for a, _, _ in per_chunk]
        deferred = [known[tuple(k)][1] for k in kinds]
        held, in_flight, pending = held_peak(pipe.schedule, pp, rank, micro_batches, saved, deferred)
        states = model_states(params, ds, wrapper, partitions, e, par.expert)
        buffers = zero_buffers(params, ds, wrapper, partitions, e, pp)
        result.stages.append(StageEstimate(
            stage=rank, decoder_layers=sum(k.count("DecoderLayerPipe") for k in kinds),
            activations_per_micro_batch=sum(saved), in_flight=in_flight,
            recompute=max(r for _, r, _ in per_chunk), logits=max(lg for _, _, lg in per_chunk),
            deferred_per_micro_batch=sum(deferred), deferred_micro_batches=pending,
            held_bytes=held if placement.chunks > 1 else None, **states,
            async_save_host=_saved_bytes(params, states, wrapper, e, config.lora is not None)
            if config.checkpoint.async_save else 0,
            fp8_transient=fp8_transient_bytes(config, b * config.rows_per_sample) if config.fp8 else 0,
            reduce_buckets=buffers.reduce_buckets, gathered_parameters=buffers.gathered_parameters,
            bucket_elements=buffers.bucket_elements, trained_elements=sum(n for n, _, t, _ in params if t),
            rollout=objective_of(config).rollout_bytes(config, sum(k.count("DecoderLayerPipe") for k in kinds), e),
            reference=states["parameters"] if objective_of(config).holds_reference_weights(config) else 0))
    return result



def _saved_bytes(params: list[tuple[int, bool, bool, bool]], states: dict[str, int], wrapper: str, e: int,
                 lora: bool) -> int:
    """What DeepSpeed's save writes from a stage's first DP rank: the module's weights in the run's precision (a
    LoRA run's adapters only; none under ZeRO-3, whose weights live in the optimizer's fp32 partitions) and this
    rank's optimizer state as ``model_states`` counts it (fp32 master partition and Adam's moments, or Adam's alone on
    fp32 weights at ZeRO-0)."""
    module = 0 if wrapper == "zero3" else e * sum(n for n, _, trains, _ in params if trains or not lora)
    return module + states["optimizer"] + states["cpu_optimizer"]


def _distinct_tables(chunks: list[list[_Layer]]) -> list[_Layer]:
    """The layers of a rank's chunks, a tied embedding table counted once (ZB-V's rank 0 holds both ends)."""
    layers = [layer for chunk in chunks for layer in chunk]
    if layers and layers[0].kind == "EmbeddingPipe" and layers[-1].kind == "EmbeddingPipe" and len(layers) > 1:
        return layers[:-1]
    return layers


def construction_bytes(config: TrainingConfig, ds: dict, world_size: int) -> int:
    """Host (or device) bytes one rank holds while its model is built and filled, before the engine: whole, every
    parameter of its stage in fp32; under ZeRO-3 with ``distributed.zero3_init``, its 1/(DP x CP) slice of each in
    the run's precision (``zero.Init`` converts as it partitions). Filling goes one tensor at a time: plus the
    largest full HF tensor drawn or read (fp32), and under ``zero.Init`` its TP shard as well. A whole model's
    parameters are allocated untouched and their pages first written by the fill, so there the shard is the
    parameter's own memory (measured: ``benchmarks/zero3_init_memory.py``)."""
    par = config.parallel
    layers = _layers(config.model, config.local_shapes.padded_vocab_size, par.tensor, ep=par.expert)
    bounds = [0, len(layers)] if par.pipeline == 1 else _stage_bounds(layers, par.pipeline,
                                                                      config.pipeline.partition_method)
    largest_full = max(math.prod(shape) for spec in ParamLayout(config.model) for shape in spec.hf_shapes)
    largest_shard = max(n for layer in layers for n in layer.model_numels)
    partitions = config.data_parallel_size(world_size) * par.context
    partitioned = zero_stage(ds) == 3 and config.distributed.zero3_init
    transient = 4 * (largest_full + (largest_shard if partitioned else 0))
    worst = 0
    for stage in range(par.pipeline):
        numels = [n for layer in layers[bounds[stage]:bounds[stage + 1]] for n in layer.model_numels]
        if par.pipeline == 1 and config.model.tie_word_embeddings:
            numels = [n for layer in layers[:-1] for n in layer.model_numels]
        if partitioned:
            held = sum(math.ceil(n / partitions) for n in numels) * ELEMENT_BYTES[precision(ds)]
        else:
            held = sum(numels) * 4
        worst = max(worst, held + transient)
    return worst


def largest_micro_batch(config: TrainingConfig, ds: dict, world_size: int, gpu_bytes: int) -> int | None:
    """The largest micro batch dividing global_batch / DP (so the global batch stays) whose peak fits."""
    dp = config.data_parallel_size(world_size)
    per_rank = config.batch.global_batch_size // dp
    for b in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
        if estimate(config, ds, world_size, b).peak_gpu <= gpu_bytes:
            return b
    return None


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``512MiB``, ``1e9``: bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in units:
        raise ConfigError(f"--gpu-memory {text!r}: expected a size such as 80GiB or 40GB")
    try:
        return int(float(match.group(1)) * units[match.group(2).lower()])
    except ValueError:
        raise ConfigError(f"--gpu-memory {text!r}: expected a size such as 80GiB or 40GB") from None
