"""The step time of one layout on one device: compute, the communication the engine does not overlap, and the
pipeline's idle time from replaying the schedule's action lists with these pass times (docs/planner.md).

Every figure is for one micro batch on one rank of a virtual stage (a TP x CP group runs it together):

- compute: each GEMM's FLOPs at the device's GEMM efficiency for that GEMM's size (or its measured time); fused
  attention at its own efficiency, counting the half of the square a causal mask computes; norms, RoPE, SwiGLU,
  residuals and the loss's softmax as bytes read and written at the HBM bandwidth (a fused kernel's bytes, or what
  the eager reference kernels' operators move, counted by planner/traffic.py). The backward is split as the engine
  splits it: B (input gradients: a GEMM per forward GEMM, attention's backward, the elementwise backward) and W
  (weight gradients: a GEMM per forward GEMM). Recomputation adds the decoder layers' forward to B.
- communication inside a pass, never overlapped by this engine: each collective of
  ``training/diagnostics/collective_traffic.py`` (the bytes ``profile`` compares with what it counts): TP's
  all-reduces (under SP an all-gather and a reduce-scatter, the same time) twice per layer each way; Ulysses CP's
  all-to-alls of Q, K, V and the attention output; EP's dispatch and combine all-to-alls; each on the link its
  group crosses (rank order TP, CP, DP, PP).
- pipeline: send/recv of a micro batch's activations (or their gradient) between stages, a delay on every
  dependency that crosses ranks; the replay (training/pipeline/schedules.replay) gives the span.
- after the pipeline: gradient reduction over DP x CP (an all-reduce; ZeRO-1/2 a reduce-scatter and the
  parameters' all-gather, the same bytes), overlapped with the backward only where DeepSpeed's engine does
  (ZeRO-2/3 without a pipeline); ZeRO-3's per-micro-batch gathers of the parameters (forward and backward) and
  reduce-scatter of gradients, prefetched under the micro batch's compute; the optimizer's update as HBM traffic
  (offloaded: the gradients and parameters over the host link and Adam at the host's memory bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass

from llama_megatron.model.kernels import kernel_choice
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.diagnostics.collective_traffic import (
    Transfer,
    boundary_bytes,
    decoder_layer_transfers,
    end_layer_transfers,
)
from llama_megatron.training.diagnostics.deepspeed_memory import offloaded
from llama_megatron.training.diagnostics.flops import training_flops_per_token
from llama_megatron.training.diagnostics.memory_estimate import rank_parameter_counts, stage_layer_kinds
from llama_megatron.training.engine.deepspeed_config import zero_stage
from llama_megatron.training.pipeline.schedules import placement_of, replay, schedule_record
from llama_megatron.training.planner.devices import UNIT_PROFILE, DeviceProfile, Link
from llama_megatron.training.planner.traffic import decoder_layer_bytes, loss_bytes

ATTENTION_BACKWARD = 2.5  # fused attention's backward over its forward (FlashAttention-2's recomputes the scores)


@dataclass
class Pass:
    """Seconds of one pass: compute and communication inside it."""

    compute: float = 0.0
    comm: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.comm

    def add(self, other: Pass, times: float = 1.0) -> None:
        self.compute += other.compute * times
        self.comm += other.comm * times


@dataclass
class StepTime:
    step: float  # seconds per optimizer step
    compute: float  # the busiest rank's compute seconds in the step
    exposed_comm: float  # its communication seconds nobody overlaps
    idle: float  # its pipeline idle seconds (waiting for a neighbour)
    tokens_per_s_per_gpu: float
    mfu: float  # model FLOPs (training_flops_per_token) over the precision's peak

    @property
    def idle_share(self) -> float:
        return self.idle / self.step

    @property
    def comm_share(self) -> float:
        return self.exposed_comm / self.step


def ring(kind: str, group: int, nbytes: float, link: Link) -> float:
    """Seconds of a ring collective over ``group`` ranks of ``nbytes`` per rank (the whole tensor for an
    all-reduce, one rank's full buffer for all-gather / reduce-scatter / all-to-all)."""
    if group == 1 or nbytes == 0:
        return 0.0
    steps = group - 1
    share = steps / group * nbytes / link.bandwidth
    if kind == "all_reduce":
        return 2 * share + 2 * steps * link.latency
    return share + steps * link.latency


class CostModel:
    """Step times of the layouts of one model, sequence and batch on one device."""

    def __init__(self, device: DeviceProfile, precision: str = "bf16", gpus: int = 1,
                 gpus_per_node: int | None = None) -> None:
        self.device, self.precision = device, precision
        self.gpus_per_node = gpus_per_node or device.gpus_per_node  # --gpus-per-node, else the profile's
        self.ranks_per_node = min(gpus, self.gpus_per_node)
        cores = device.cores_per_node
        self.oversubscribed = bool(cores) and self.ranks_per_node > cores  # ranks share the node's cores
        self.recorded: set[tuple[int, int, int]] | None = None  # GEMM shapes seen, while gemm_shapes runs

    # --- links --------------------------------------------------------------------------------------------------
    def _link(self, stride: int, size: int) -> Link:
        """The link a group of ``size`` ranks ``stride`` apart crosses (nodes hold consecutive ranks)."""
        return self.device.link(stride * size > self.gpus_per_node)

    # --- passes -------------------------------------------------------------------------------------------------
    def _gemms(self, shapes: list[tuple[float, int, int, float]]) -> tuple[float, float, float]:
        """F, B, W seconds of the linears ``(rows, in, out, count)``: the forward [m, k] x [k, n], the input
        gradient [m, n] x [n, k] and the weight gradient [k, m] x [m, n] of each (one shape on a profile's
        roll-off; measured shapes differ, a skinny weight gradient most)."""
        f = b = w = 0.0
        for rows, k, n, count in shapes:
            m = max(1, round(rows))
            if self.recorded is not None:
                self.recorded.update({(m, k, n), (m, n, k), (k, m, n)})
            f += self.device.gemm_seconds(m, k, n, self.precision, count)
            b += self.device.gemm_seconds(m, n, k, self.precision, count)
            w += self.device.gemm_seconds(k, m, n, self.precision, count)
        return f, b, w

    def eager(self, config: TrainingConfig) -> bool:
        """Whether ``config``'s kernels on this device are the eager reference ones (``auto`` is on a CPU)."""
        return kernel_choice(config.kernels, self.device.torch_device) == "reference"

    @classmethod
    def gemm_shapes(cls, configs: list[TrainingConfig]) -> set[tuple[int, int, int]]:
        """Every (m, k, n) GEMM the passes of ``configs`` multiply (what ``plan --calibrate`` times); the shapes
        do not depend on the device, so any profile's figures do for walking the passes."""
        walker = cls(UNIT_PROFILE)
        walker.recorded = set()
        for config in configs:
            walker.stage_passes(config)
        return walker.recorded

    def decoder_layer(self, config: TrainingConfig, layer: int, rows: int, window: int | None = None,
                      chunk: int | None = None) -> tuple[Pass, Pass, Pass]:
        """F, B, W of decoder layer ``layer`` (its sliding ``window`` or attention ``chunk``) for ``rows`` samples
        on one rank."""
        m, par, dev = config.model, config.parallel, self.device
        tp, cp, ep = par.tensor, par.context, par.expert
        a = 2  # activations are bf16 (under FP8 too: only the GEMMs' operands are cast)
        n = rows * config.seq_length // cp  # tokens on this rank (the GEMMs see all of them: SP gathers first)
        h, hd = m.hidden_size, m.head_dim
        q, kv = m.num_attention_heads * hd // tp, m.num_key_value_heads * hd // tp
        linears = [(n, h, q + 2 * kv, 1), (n, q, h, 1)]  # fused QKV, output projection
        if m.is_moe_layer(layer):
            k, experts = m.num_experts_per_tok, m.num_local_experts
            width = m.expert_intermediate_size // tp
            per_expert = n * k * ep / experts  # balanced routing: the rows each of this rank's experts multiplies
            local = experts // ep
            linears += [(n, h, experts, 1),  # the router (not split over TP)
                        (per_expert, h, 2 * width, local), (per_expert, width, h, local)]
            if m.family.moe.shared_expert:
                shared = m.shared_intermediate_size // tp
                linears += [(n, h, 2 * shared, 1), (n, shared, h, 1)]
            mlp_width = width * k
        else:
            width = m.dense_intermediate_size // tp
            linears += [(n, h, 2 * width, 1), (n, width, h, 1)]  # fused gate and up, down
            mlp_width = width
        gemm_f, gemm_b, gemm_w = self._gemms(linears)
        keys = config.seq_length if window is None else min(config.seq_length, window)
        causal = 0.5 if window is None else min(1.0, window / config.seq_length)
        if chunk is not None:  # causal within each chunk
            causal = 0.5 * min(1.0, chunk / config.seq_length)
        heads = m.num_attention_heads // (tp * cp)  # Ulysses: all tokens, 1/CP of the TP rank's heads
        attention = dev.attention_seconds(4 * rows * config.seq_length * keys * heads * hd * causal)
        sp_tokens = n / tp if par.sequence_parallel else n
        if self.eager(config):  # counted from the engine's own operators (planner/traffic.py)
            traced = decoder_layer_bytes(m, tp, m.is_moe_layer(layer))
            forward_bytes, backward_bytes = traced.forward(n, sp_tokens), traced.backward(n, sp_tokens)
        else:  # fused: norms (read, write), residual adds (two reads, a write), RoPE on q and k, SwiGLU (two
            # reads, a write), each once; the backward twice
            forward_bytes = a * (sp_tokens * h * (2 * 2 + 2 * 3) + n * (2 * (q + kv) + 3 * mlp_width))
            backward_bytes = 2 * forward_bytes
        forward = Pass(gemm_f + attention + dev.memory_seconds(forward_bytes))
        backward_input = Pass(gemm_b + ATTENTION_BACKWARD * attention + dev.memory_seconds(backward_bytes))
        weight = Pass(gemm_w)
        sent_forward, sent_backward = decoder_layer_transfers(config, layer, rows, a)
        forward.comm += self._comm(config, sent_forward)
        backward_input.comm += self._comm(config, sent_backward)
        return forward, backward_input, weight

    def _comm(self, config: TrainingConfig, transfers: list[Transfer]) -> float:
        """Seconds of a pass's collectives, each on the link its group crosses (rank order TP, CP, DP, PP)."""
        par = config.parallel
        groups = {"TP": (1, par.tensor), "CP": (par.tensor, par.context), "EP": (par.tensor, par.expert)}
        return sum(ring(t.kind, groups[t.group][1], t.bytes, self._link(*groups[t.group])) for t in transfers)

    def end_layer(self, config: TrainingConfig, kind: str, rows: int) -> tuple[Pass, Pass, Pass]:
        """F, B, W of the embedding, the final norm or the LM head (with the loss) for ``rows`` samples."""
        m, par = config.model, config.parallel
        n = rows * config.seq_length // par.context
        h, tp = m.hidden_size, par.tensor
        vocab = config.local_shapes.vocab_rows
        if kind == "LMHeadPipe":
            f, b, w = self._gemms([(n, h, vocab, 1)])
            if self.eager(config):  # the fp32 cross-entropy over full logits, counted
                traced = loss_bytes(vocab, m.vocab_size)
                loss_f, loss_b = (self.device.memory_seconds(traced.forward(n, 0)),
                                  self.device.memory_seconds(traced.backward(n, 0)))
            else:  # fp32 logits: written, read, gradient
                loss_f = loss_b = self.device.memory_seconds(n * vocab * 4 * 3)
            sent_forward, sent_backward = end_layer_transfers(config, kind, rows, 2)
            return (Pass(f + loss_f, self._comm(config, sent_forward)),
                    Pass(b + loss_b, self._comm(config, sent_backward)), Pass(w))
        if kind == "EmbeddingPipe":
            look = self.device.memory_seconds(n * h * 2 * 2)
            sent_forward, sent_backward = end_layer_transfers(config, kind, rows, 2)
            return (Pass(look, self._comm(config, sent_forward)), Pass(look, self._comm(config, sent_backward)),
                    Pass())
        norm = self.device.memory_seconds(n / (tp if par.sequence_parallel else 1) * h * 2 * 2)
        return Pass(norm), Pass(2 * norm), Pass()

    def stage_passes(self, config: TrainingConfig) -> list[dict[str, Pass]]:
        """F, B, W per virtual stage, in stage order, for one micro batch."""
        rows = config.batch.micro_batch_size * config.rows_per_sample
        recompute = config.activation_checkpointing.interval > 0
        windows, chunks, model = config.model.layer_windows(), config.model.layer_chunks(), config.model
        alike: dict[tuple, tuple[Pass, Pass, Pass]] = {}  # layers of one kind and window cost the same
        stages, layer = [], 0
        for kinds in stage_layer_kinds(config):
            passes = {"F": Pass(), "B": Pass(), "W": Pass()}
            for kind in kinds:
                if kind == "DecoderLayerPipe":
                    key = (model.is_moe_layer(layer), windows[layer], chunks[layer])
                    if key not in alike:
                        f, b, w = self.decoder_layer(config, layer, rows, windows[layer], chunks[layer])
                        if recompute:
                            b.add(f)
                        alike[key] = (f, b, w)
                    f, b, w = alike[key]
                    layer += 1
                else:  # a tied table after the decoder layers is the head
                    f, b, w = self.end_layer(config, "LMHeadPipe" if kind == "EmbeddingPipe" and layer else kind,
                                             rows)
                for name, part in zip("FBW", (f, b, w)):
                    passes[name].add(part)
            stages.append(passes)
        return stages

    # --- the step -----------------------------------------------------------------------------------------------
    def step_time(self, config: TrainingConfig, world_size: int, ds: dict) -> StepTime:
        par, pipe = config.parallel, config.pipeline
        tp, pp, cp = par.tensor, par.pipeline, par.context
        dp = config.data_parallel_size(world_size)
        micro_batches = config.gradient_accumulation_steps(world_size)
        stages = self.stage_passes(config)
        chunks = len(stages) // pp
        record = schedule_record(pipe.schedule)
        costs = [{name: p.total for name, p in stage.items()} for stage in stages]
        comm = [sum(p.comm for p in stage.values()) for stage in stages]
        compute = [sum(p.compute for p in stage.values()) for stage in stages]
        boundary = boundary_bytes(config, 2)
        if pp > 1:
            link = self._link(tp * cp * dp, pp)
            transfer = boundary / link.bandwidth + link.latency
            if not record.split_backward:
                costs = [{"F": c["F"], "B": c["B"] + c["W"], "W": 0.0} for c in costs]
            replayed = replay(pipe.schedule, pp, micro_batches, chunks, costs, transfer)
            span = replayed["time"]
        else:
            span = micro_batches * sum(costs[0].values())
        placement = placement_of(pipe.schedule, pp, chunks)
        owner = [[placement.stage(r, c) for c in range(chunks)] for r in range(pp)]  # each rank's virtual stages
        rank_compute = [micro_batches * sum(compute[s] for s in owner[r]) for r in range(pp)]
        rank_comm = [micro_batches * sum(comm[s] for s in owner[r]) for r in range(pp)]
        busiest = max(range(pp), key=lambda r: rank_compute[r] + rank_comm[r])
        zero = zero_stage(ds)
        params = max(rank_parameter_counts(config))
        group = dp * cp
        link = self._link(tp, group)
        grad_bytes = 4 if ds.get("data_types", {}).get("grad_accum_dtype") in ("fp32", "float32") else 2
        after = 0.0
        per_micro_batch = 0.0
        if zero == 3:  # gathers in the forward and the backward, gradients reduce-scattered, per micro batch
            gathers = 2 * ring("all_gather", group, params * 2, link) + ring("reduce_scatter", group, params * 2,
                                                                             link)
            hidden = sum(compute[s] for s in owner[busiest])
            per_micro_batch = max(0.0, gathers - hidden)
        else:
            reduction = ring("all_reduce", group, params * grad_bytes, link)
            if zero == 2 and pp == 1:  # overlap_comm: reduced in buckets while the last backward runs
                last_backward = costs[0]["B"] + costs[0]["W"]
                reduction = max(0.0, reduction - last_backward)
            after += reduction
        owned = params / (group if zero >= 1 else 1)
        if offloaded(ds, "offload_optimizer"):  # gradients down, bf16 parameters up; Adam in host memory
            dev = self.device
            update = (owned * (grad_bytes + 2) / dev.host_link
                      + owned * 30 / dev.host_memory_bandwidth)  # reads master, moments, grad; writes 3 + bf16
        else:
            update = self.device.memory_seconds(owned * 16 + params * 2)  # Adam: master, moments, grads; bf16
        exposed = rank_comm[busiest] + micro_batches * per_micro_batch + after
        step = span + micro_batches * per_micro_batch + after + update
        if self.oversubscribed:  # the node's ranks share its cores: no faster than all their compute over them
            shared = self.ranks_per_node * sum(rank_compute) / pp / self.device.cores_per_node
            step = max(step, shared + exposed + update)
        idle = max(0.0, span - rank_compute[busiest] - rank_comm[busiest])
        tokens = config.batch.global_batch_size * config.seq_length
        flops = training_flops_per_token(config.model, config.seq_length) * tokens
        return StepTime(step=step, compute=rank_compute[busiest], exposed_comm=exposed, idle=idle,
                        tokens_per_s_per_gpu=tokens / step / world_size,
                        mfu=flops / (step * world_size * self.device.peak(self.precision)))
