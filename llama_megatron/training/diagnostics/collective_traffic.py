"""The bytes each collective of a training step moves, by the layout's formula: what ``plan``'s cost model times and
what ``profile`` sets beside the bytes its call graph counted.

A collective's bytes are those of its whole tensor on one rank: an all-reduce's tensor, an all-gather's output, a
reduce-scatter's input, an all-to-all's output (what arrives), a send's or a recv's tensor. Per micro batch of
``rows`` samples a rank holds n = rows x seq / CP tokens; activations are ``a`` bytes an element (the run's
precision). Per decoder layer, forward and backward alike (Megatron's mappings, ``parallel/collectives.py``):

- TP without SP: an all-reduce of [n, hidden] after the attention's and the MLP's row-parallel linear (forward) and
  of the input gradient before their column-parallel linears (backward).
- TP with SP: an all-gather of the sequence shards [n / TP, hidden] -> [n, hidden] before each column-parallel
  linear and a reduce-scatter after each row-parallel one, in the forward; the other way round in the backward;
  in the backward too, an all-reduce of the gradient of each weight that sees a sequence shard (the two norms, a
  row-parallel bias: the attention's o and a dense MLP's down projection).
- TP > 1: all-reduces of the gradients of the replicated q/k norm weights and of an MoE layer's replicated weights,
  its router's and its shared expert's gate's (Qwen2-MoE).
- CP (DeepSpeed-Ulysses): all-to-alls of q, k and v (k and v after repeating heads that do not split over CP) and of
  the attention output, each way.
- EP: per MoE layer an all-to-all of the assignment counts (int64, one per expert) and of the routed rows each
  way, dispatch and combine: n x top-k rows of [hidden] leave a rank; as many arrive on average (balanced routing:
  exact summed over the EP group, where a rank's share depends on the routing).

The embedding (vocab-parallel: an all-reduce of its output; under SP a reduce-scatter, and in the backward the
all-gather of its gradient), the final norm (under SP the all-reduce of its weight's gradient) and the head (under SP
an all-gather of its input; without, an all-reduce of its input gradient) add theirs, the loss a few [n] fp32
all-reduces (not counted: a few bytes a token). Between pipeline stages a micro batch's activations travel
forward and their gradient back: [n / TP, hidden] under SP, or where DeepSpeed partitions the send over TP (and
all-gathers it on the next stage; that all-gather, in DeepSpeed's engine, is left out), else [n, hidden]. After the micro batches: the gradients' reduction over
DP x CP (ZeRO-0 an all-reduce of the rank's parameters; ZeRO-1/2 a reduce-scatter and the parameters' all-gather).
"""

from __future__ import annotations

from dataclasses import dataclass

from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.pipeline.schedules import schedule_record

COUNT_BYTES = 8  # the EP all-to-all of assignment counts: int64


@dataclass(frozen=True)
class Transfer:
    """One collective call: its kind (``call_graph.COLLECTIVE_KINDS``), its group (TP, CP, EP, PP, DP, DP x CP) and
    the bytes of its whole tensor on one rank."""

    kind: str
    group: str
    bytes: float


def decoder_layer_transfers(config: TrainingConfig, layer: int, rows: int,
                            element: int) -> tuple[list[Transfer], list[Transfer]]:
    """(forward, backward) collectives of decoder layer ``layer`` for ``rows`` samples on one rank, activations of
    ``element`` bytes."""
    m, par = config.model, config.parallel
    tp, cp, ep = par.tensor, par.context, par.expert
    n = rows * config.seq_length // cp
    h, hd = m.hidden_size, m.head_dim
    forward: list[Transfer] = []
    backward: list[Transfer] = []
    if tp > 1:
        hidden = n * h * element
        if par.sequence_parallel:
            for _ in range(2):  # attention, MLP
                forward += [Transfer("all_gather", "TP", hidden), Transfer("reduce_scatter", "TP", hidden)]
                backward += [Transfer("reduce_scatter", "TP", hidden), Transfer("all_gather", "TP", hidden)]
            backward += [Transfer("all_reduce", "TP", h * element)] * 2  # the norms' weights
            # the row-parallel biases, added to the reduce-scattered shard: o's, and a dense MLP's down projection's
            biases = int(m.o_bias) + int(m.mlp_bias and not m.is_moe_layer(layer))
            backward += [Transfer("all_reduce", "TP", h * element)] * biases
        else:
            forward += [Transfer("all_reduce", "TP", hidden)] * 2
            backward += [Transfer("all_reduce", "TP", hidden)] * 2
        if m.qk_norm:
            backward += [Transfer("all_reduce", "TP", hd * element)] * 2
        if m.is_moe_layer(layer):  # the router's weight [experts, hidden]; a shared expert's gate [1, hidden]
            backward.append(Transfer("all_reduce", "TP", m.num_local_experts * h * element))
            moe = m.family.moe
            if moe.shared_expert and moe.shared_expert_gated:
                backward.append(Transfer("all_reduce", "TP", h * element))
    if cp > 1:
        shapes = config.local_shapes
        q, kv = shapes.heads * hd, shapes.kv_heads * shapes.kv_repeats * hd
        exchanged = [Transfer("all_to_all", "CP", n * width * element) for width in (q, kv, kv, q)]
        forward += exchanged
        backward += exchanged
    if ep > 1 and m.is_moe_layer(layer):
        rows_out = n * m.num_experts_per_tok * h * element
        counts = Transfer("all_to_all", "EP", m.num_local_experts * COUNT_BYTES)
        forward += [counts, Transfer("all_to_all", "EP", rows_out), Transfer("all_to_all", "EP", rows_out)]
        backward += [Transfer("all_to_all", "EP", rows_out)] * 2
    return forward, backward


def end_layer_transfers(config: TrainingConfig, kind: str, rows: int,
                        element: int) -> tuple[list[Transfer], list[Transfer]]:
    """(forward, backward) TP collectives of the embedding (``EmbeddingPipe``), the final norm (``FinalNormPipe``)
    or the head (``LMHeadPipe``)."""
    par = config.parallel
    if par.tensor == 1 or kind not in ("EmbeddingPipe", "FinalNormPipe", "LMHeadPipe"):
        return [], []
    if kind == "FinalNormPipe":  # under SP its weight sees a sequence shard: its gradient is summed over TP
        if not par.sequence_parallel:
            return [], []
        return [], [Transfer("all_reduce", "TP", config.model.hidden_size * element)]
    hidden = rows * config.seq_length // par.context * config.model.hidden_size * element
    if kind == "EmbeddingPipe":  # its output's reduction; under SP the reduce-scatter's backward all-gathers
        if par.sequence_parallel:
            return [Transfer("reduce_scatter", "TP", hidden)], [Transfer("all_gather", "TP", hidden)]
        return [Transfer("all_reduce", "TP", hidden)], []
    if par.sequence_parallel:
        return [Transfer("all_gather", "TP", hidden)], [Transfer("reduce_scatter", "TP", hidden)]
    return [], [Transfer("all_reduce", "TP", hidden)]


def pipe_partitioned(config: TrainingConfig) -> bool:
    """Whether DeepSpeed's pipeline engine sends 1/TP of a stage's output from each TP rank and all-gathers it over
    TP on the next stage (``pipe_partitioned``): TP > 1 under a schedule DeepSpeed runs, without SP and without MoE
    (``training/engine/deepspeed_config.py`` turns it off there)."""
    par = config.parallel
    return (par.tensor > 1 and not par.sequence_parallel and config.model.family.moe is None
            and schedule_record(config.pipeline.schedule).deepspeed_runs_it)


def boundary_bytes(config: TrainingConfig, element: int) -> float:
    """The activations of one micro batch that one rank sends across a pipeline stage boundary (and their gradient,
    back): [n / TP, hidden] under SP (its sequence shard) or a partitioned send, else [n, hidden]."""
    par = config.parallel
    n = config.batch.micro_batch_size * config.rows_per_sample * config.seq_length / par.context
    split = par.sequence_parallel or pipe_partitioned(config)
    return (n / par.tensor if split else n) * config.model.hidden_size * element


def rank_step_bytes(config: TrainingConfig, world_size: int, pipeline_rank: int,
                    element: int) -> dict[str, float]:
    """Bytes per step on one rank of pipeline rank ``pipeline_rank``, keyed ``"<kind> <group>"`` as the call graph
    names its collectives: its layers' collectives over every micro batch and the stage boundaries' sends and
    recvs. (The gradients' reduction after the step is left out: DeepSpeed buckets and pads it.)"""
    from llama_megatron.training.diagnostics.memory_estimate import virtual_stages

    stages, placement = virtual_stages(config)
    rows = config.batch.micro_batch_size * config.rows_per_sample
    micro_batches = config.gradient_accumulation_steps(world_size)
    out: dict[str, float] = {}

    def add(transfers: list[Transfer], times: int = 1) -> None:
        for t in transfers:
            key = f"{t.kind} {t.group}"
            out[key] = out.get(key, 0.0) + t.bytes * times

    layer = 0
    for stage, kinds in enumerate(stages):
        mine = placement.holds(pipeline_rank, stage)
        for position, entry in enumerate(kinds):
            if entry.kind == "DecoderLayerPipe":
                if mine:
                    for transfers in decoder_layer_transfers(config, layer, rows, element):
                        add(transfers, micro_batches)
                layer += 1
            elif mine:
                kind = entry.kind
                if kind == "EmbeddingPipe" and (stage or position):  # a tied table after the layers: the head
                    kind = "LMHeadPipe"
                for transfers in end_layer_transfers(config, kind, rows, element):
                    add(transfers, micro_batches)
        if mine and config.parallel.pipeline > 1:
            boundary = [Transfer(k, "PP", boundary_bytes(config, element)) for k in ("recv", "send")]
            if stage > 0 and not placement.holds(pipeline_rank, stage - 1):  # activations in, gradient out
                add(boundary, micro_batches)
            if stage < len(stages) - 1 and not placement.holds(pipeline_rank, stage + 1):  # out, and back in
                add(boundary, micro_batches)
    return out
