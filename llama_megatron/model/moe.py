"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE): a router picks ``num_experts_per_tok`` of
``num_local_experts`` SwiGLU experts per token, and the token's output is their weighted sum.

Routing is transformers' ``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter``: softmax of the router logits in fp32,
top-k, the k weights renormalised to sum to 1 (Qwen: only with ``norm_topk_prob``); no capacity, no token dropped,
no noise. Qwen2-MoE adds a shared expert every token passes through, scaled by ``sigmoid(x W_gate)``
(:attr:`~llama_megatron.families.MoEFamily.shared_expert`). Llama 4 routes otherwise (``routing`` "sigmoid_input",
transformers' ``Llama4Router``): the top-k of the logits, the sigmoid of each chosen logit (fp32, cast back) scaling
the token on its way into the expert, the expert outputs summed unweighted, plus an ungated shared expert. DeepSpeed's ``TopKGate`` differs on each of
these (capacity and dropping, random second-expert sampling, another auxiliary loss), so the router is ours; the
expert-parallel groups and the token all-to-all are plain DeepSpeed/torch.distributed collectives.

Layouts:

- Tensor parallelism splits every expert as the dense MLP is split (gate/up rows, down columns): the layer gathers
  its input once (the sequence under SP), every TP rank routes the same tokens the same way, and the partial sums of
  all experts are reduced once (reduce-scattered under SP). Replicating the experts instead would either repeat
  every expert's FLOPs on every TP rank or need a second token split; the split keeps the dense MLP's collectives.
  The router and a shared expert's gate are replicated: every TP rank computes them whole, and each weight's
  gradient is summed over TP (:class:`Router`).
- Expert parallelism gives EP rank r the experts ``[r E / EP, (r + 1) E / EP)``: each rank sends every token
  assignment (token, chosen expert) to the rank holding the expert, the experts run on what arrives from every
  rank, and the outputs travel back (two all-to-alls each way). The router is replicated like any other weight.
- The combination of a token's k expert outputs is a sum over k in ascending expert order, whatever the layout.
- A shared expert is split over TP as a routed one, and is replicated over EP like the attention (every rank runs it
  on its own tokens); its gate, one row ``[1, hidden]``, is replicated as the router is, for the same reason.

The experts run as grouped GEMMs (:mod:`llama_megatron.parallel.grouped_linear`) where ``kernels`` says so (every
choice but ``reference``): gate/up of every local expert in one product over the rows sorted by expert, the
activation, down in another, with the permutation, counts and offsets on the device (no host read at EP 1); the
reference runs the experts one after another on their rows, whose counts it reads on the host. Both compute each
expert's rows with the same products. At EP > 1 the all-to-all's split sizes are read once, right after the counts'
exchange (Megatron-core's all-to-all dispatcher reads them there too; torchtitan avoids the read by padding).

Token dropping (the training JSON's ``moe`` section, :class:`ExpertCapacity`), off by default: an expert keeps at
most its capacity of a rank's assignments (by routing weight or by position), the dropped output zero, optionally
every expert's input padded to its capacity (fixed shapes).

The load-balancing loss (HF's ``load_balancing_loss_func``, Switch Transformer eq. 4-6) needs, over every layer's
router, the count of assignments per expert and the sum of router probabilities per expert: each MoE layer adds
those two rows and a third, its assignments dropped per expert, to a ``[3, E]`` statistic that travels with the
hidden states through the pipeline, and the loss (:func:`router_aux_loss`) is formed from it on the last stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.model.kernels import REFERENCE, Kernels
from llama_megatron.model.mlp import gate_up_parts
from llama_megatron.model.moe_section import ExpertCapacity, assignment_counts, keep_within_capacity
from llama_megatron.model.routing import choose_in_groups
from llama_megatron.parallel.collectives import all_reduce_grad_in_tp, all_to_all_tokens, scale_gradient
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import LocalShapes
from llama_megatron.parallel.grouped_linear import expert_offsets, grouped_linear, pack_evenly
from llama_megatron.parallel.layers import (
    LocalLinear,
    column_parallel_input,
    mark_replicated,
    row_parallel_output,
)
from llama_megatron.parallel.weight_grad import WeightGradStore, linear


class ExpertMLP(nn.Module):
    """One expert: SwiGLU with this TP rank's ``rows`` of gate/up (fused as the dense MLP's) and columns of down."""

    def __init__(self, config: ModelConfig, rows: int, kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = LocalLinear(config.hidden_size, 2 * rows, "gate_up")
        self.gate_up_proj.output_parts = gate_up_parts(2 * rows)
        self.down_proj = LocalLinear(rows, config.hidden_size, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.swiglu(self.gate_up_proj(x)))


class Router(nn.Module):
    """Router logits ``x W^T`` (W: [experts, hidden], replicated over TP); also the shared expert's gate (one row).
    With ``bias`` (DeepSeek-V3) it holds ``e_score_correction_bias`` [experts] beside W: replicated, not trained
    (``requires_grad`` off), added to the scores for the choice only and moved between steps by the experts' loads.

    Under TP each rank's experts yield a partial sum, so the gradient reaching the routing weights (through the
    combination) is partial too: the weight's gradient is summed over the TP group, as an SP norm's is.
    """

    def __init__(self, config: ModelConfig, pctx: ParallelContext, outputs: int, bias: bool = False) -> None:
        super().__init__()
        self.pctx = pctx
        self.weight = mark_replicated(nn.Parameter(torch.empty(outputs, config.hidden_size)))
        if bias:
            self.e_score_correction_bias = mark_replicated(nn.Parameter(torch.zeros(outputs), requires_grad=False))
        if pctx.tp_size > 1:
            self.weight.sequence_parallel = True
        # a zero-bubble schedule's W computes the weight's gradient (and its TP sum) later (weight_grad.py)
        self.weight_grad_store: WeightGradStore | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = all_reduce_grad_in_tp(self.weight, self.pctx) if self.pctx.tp_size > 1 else self.weight
        return linear(x, weight, None, self.weight_grad_store)


class MoEMLP(nn.Module):
    """The MoE block of one decoder layer: ``forward(x) -> (output, router statistics [3, E])``."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes,
                 kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.pctx = pctx
        self.num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        self.norm_topk = config.family.moe.norm_topk(config)
        self.weights_in_model_dtype = config.family.moe.weights_in_model_dtype
        self.scales_inputs = config.family.moe.routing == "sigmoid_input"
        self.grouped_routing = config.family.moe.routing == "sigmoid_group"
        if self.grouped_routing:
            self.n_group, self.topk_group = config.n_group, config.topk_group
            self.routed_scaling_factor = config.routed_scaling_factor
            # the training step's assignments per expert (its forwards with gradients: no evaluation, no rollout),
            # read and cleared by routing.update_routing_biases; int64, which a cast to bf16 leaves alone
            self.register_buffer("step_counts", torch.zeros(config.num_local_experts, dtype=torch.long),
                                 persistent=False)
        self.local_ids = shapes.expert_ids(pctx.ep_rank)
        self.router = Router(config, pctx, config.num_local_experts, bias=config.family.moe.router_bias)
        # keyed by global expert id, so parameter names are the same whichever EP rank holds the expert
        self.experts = nn.ModuleDict({str(e): ExpertMLP(config, shapes.expert_intermediate, kernels)
                                      for e in self.local_ids})
        self.shared = config.family.moe.shared_expert
        self.shared_gated = self.shared and config.family.moe.shared_expert_gated
        if self.shared:
            self.shared_expert = ExpertMLP(config, shapes.shared_intermediate, kernels)
        if self.shared_gated:
            self.shared_expert_gate = Router(config, pctx, 1)
        self.kernels = kernels
        self.capacity = ExpertCapacity()  # token dropping (the training JSON's moe section): none by default
        # the grouped experts read their parameters here, not in each expert's forward: ZeRO-3 gathers every
        # parameter of the block (its experts') when the block starts (DeepSpeed's "leaf module")
        self._z3_leaf = kernels.grouped_experts
        self.mark_experts()
        self.pack_experts()

    def mark_experts(self) -> None:
        """DeepSpeed's mark of an expert parameter (reduced over its expert-data-parallel group), on every parameter
        of the experts: also on what is added to them after construction (LoRA adapters)."""
        if self.pctx.ep_size > 1:
            for param in self.experts.parameters():
                param.allreduce, param.group_name = False, self.pctx.expert_group_name

    def pack_experts(self, dtype: torch.dtype | None = None) -> None:
        """On the grouped path, this rank's experts' parameters in one buffer (in ``dtype`` where given), expert
        after expert, so that the grouped products read each kind as one strided tensor instead of stacking a copy
        every call (:func:`~llama_megatron.parallel.grouped_linear.as_one_tensor`)."""
        if self.kernels.grouped_experts:
            pack_evenly(list(self.experts.parameters()), dtype)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls this on every module that has it, before it reads its expert groups."""
        if self.pctx.ep_size > 1:
            self.pctx.register_expert_groups()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = column_parallel_input(x, self.pctx)  # every TP rank routes the same (whole-sequence) tokens
        tokens = full.reshape(-1, full.shape[-1])
        logits = self.router(tokens)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = self.choose(logits, probs)
        if self.norm_topk and not self.grouped_routing:  # (grouped routing's own rule, in choose)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(tokens.dtype)
        chosen, order = chosen.sort(dim=-1)  # ascending expert id: the order a token's outputs are summed in
        weights = weights.gather(-1, order)
        rank = kept = None
        if self.capacity.capacity_factor is not None:
            rank, kept = keep_within_capacity(chosen.reshape(-1), weights.reshape(-1), self.num_experts,
                                              self.capacity.capacity(chosen.numel(), self.num_experts),
                                              self.capacity.drop_policy)
        scales = weights.reshape(-1) if self.scales_inputs else None
        if self.capacity.pad_to_capacity:
            outputs = self._run_padded(tokens, chosen.reshape(-1), rank, kept, scales)
        else:
            outputs = self._run_experts(tokens, chosen.reshape(-1), scales, kept)
        if not self.scales_inputs:
            outputs = (outputs * weights.reshape(-1, 1)).to(tokens.dtype)  # Mixtral: fp32 product, cast back
        combined = outputs.view(tokens.shape[0], self.top_k, -1).sum(dim=1)
        if self.shared_gated:  # this TP rank's partial sum, reduced with the routed experts'
            combined = combined + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        elif self.shared:
            combined = combined + self.shared_expert(tokens)
        out = row_parallel_output(combined.view_as(full), self.pctx)
        stats = self._statistics(logits, probs, chosen, kept)
        if self.grouped_routing and self.training and torch.is_grad_enabled():
            self.step_counts += assignment_counts(chosen.reshape(-1), self.num_experts)
        return out, stats

    def choose(self, logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts ([tokens, k], best first) and their weights before normalisation: the
        largest router probabilities, or for Llama 4 the largest logits with their sigmoids (fp32, cast back: they
        scale the experts' inputs)."""
        if self.scales_inputs:
            weights, chosen = torch.topk(logits, self.top_k, dim=-1)
            return torch.sigmoid(weights.float()).to(logits.dtype), chosen
        if self.grouped_routing:
            return choose_in_groups(logits, self.router.e_score_correction_bias, self.n_group, self.topk_group,
                                    self.top_k, self.norm_topk, self.routed_scaling_factor)
        return torch.topk(probs, self.top_k, dim=-1)

    def _statistics(self, logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor,
                    kept: torch.Tensor | None) -> torch.Tensor:
        """This layer's rows of the router statistics: assignments per expert (no gradient), summed router
        probabilities per expert (the aux loss's two terms: the router's choices, before any capacity drops some,
        as Megatron-core counts them) and assignments dropped per expert. HF forms the first two from a softmax in
        the logits' dtype (fp32 routing aside)."""
        dropped = torch.zeros(self.num_experts, device=logits.device)
        if kept is not None:
            dropped = assignment_counts(chosen.reshape(-1).masked_fill(kept, self.num_experts),
                                        self.num_experts + 1)[:-1].float()
        if logits.dtype != torch.float32:
            probs = torch.softmax(logits, dim=-1)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices
        counts = assignment_counts(chosen.reshape(-1), self.num_experts).float()
        return torch.stack([counts, probs.float().sum(dim=0), dropped])

    def _run_experts(self, tokens: torch.Tensor, expert_of: torch.Tensor, input_scales: torch.Tensor | None = None,
                     kept: torch.Tensor | None = None) -> torch.Tensor:
        """Each assignment's expert output ([tokens x k, hidden], rows in assignment order): assignments sorted by
        expert (each token scaled by its assignment's ``input_scales`` first, where given), exchanged with the EP
        ranks holding the experts, run, and returned; an assignment not ``kept`` (over its expert's capacity) sorts
        last, runs nowhere and returns zeros. At EP 1 nothing is read on the host on the grouped path; at EP > 1 the
        all-to-all's split sizes are, once, right after the counts are exchanged."""
        k = self.top_k
        if kept is not None:  # the dropped go to expert E, which no rank holds
            expert_of = expert_of.masked_fill(~kept, self.num_experts)
        by_expert = torch.argsort(expert_of, stable=True)
        inputs = tokens[by_expert // k]
        if input_scales is not None:
            inputs = inputs * input_scales[by_expert].unsqueeze(-1)
        per_expert = assignment_counts(expert_of, self.num_experts + 1)[:-1]
        ep = self.pctx.ep_size
        if ep == 1:
            if self._grouped():  # the rows past the last expert's (the dropped) come back zero
                outputs = self._grouped_experts(inputs, per_expert, tail=kept is not None)
            else:
                counts = per_expert.tolist()
                outputs = self._local_experts(inputs[:sum(counts)], [counts])
                if kept is not None:  # the dropped rows, after the last expert's
                    outputs = torch.cat([outputs, outputs.new_zeros(inputs.shape[0] - outputs.shape[0],
                                                                    outputs.shape[1])])
        else:
            # what every EP rank sends this rank's experts, [source rank, local expert]
            received = torch.empty_like(per_expert)
            dist.all_to_all_single(received, per_expert, group=self.pctx.ep_group)
            sent_counts, received_counts = torch.stack([per_expert, received]).view(2, ep, -1).tolist()
            send, recv = [sum(c) for c in sent_counts], [sum(c) for c in received_counts]
            arrived = all_to_all_tokens(inputs[:sum(send)], recv, send, self.pctx.ep_group)
            if self._grouped():
                result = self._grouped_arrivals(arrived, received_counts)
            else:
                result = self._local_experts(arrived, received_counts)
            outputs = all_to_all_tokens(result, send, recv, self.pctx.ep_group)
            if kept is not None:
                outputs = torch.cat([outputs, outputs.new_zeros(inputs.shape[0] - outputs.shape[0], outputs.shape[1])])
        if kept is not None:
            outputs = torch.where(kept[by_expert].unsqueeze(-1), outputs, 0.0)
        return outputs[torch.argsort(by_expert)]  # back to assignment order (an index: saves only the indices)

    def _run_padded(self, tokens: torch.Tensor, expert_of: torch.Tensor, rank: torch.Tensor, kept: torch.Tensor,
                    input_scales: torch.Tensor | None) -> torch.Tensor:
        """:meth:`_run_experts` with every expert's input padded to its capacity C: assignment i fills slot
        ``expert x C + rank`` (zero rows where an expert has fewer), the dropped none; the shapes, and the
        all-to-all's split sizes at EP > 1, are fixed by the config, so nothing is read on the host."""
        capacity = self.capacity.capacity(expert_of.numel(), self.num_experts)
        slots = self.num_experts * capacity
        inputs = tokens[torch.arange(expert_of.numel(), device=tokens.device) // self.top_k]
        if input_scales is not None:
            inputs = inputs * input_scales.unsqueeze(-1)
        slot = torch.where(kept, expert_of * capacity + rank, slots)  # the dropped into one spare slot, discarded
        padded = inputs.new_zeros(slots + 1, inputs.shape[1]).index_add(0, slot, inputs)[:slots]
        ep = self.pctx.ep_size
        local = self.num_experts // ep
        counts = [[capacity] * local for _ in range(ep)]
        if ep == 1:
            result = (self._grouped_experts(padded, torch.full((local,), capacity, device=tokens.device))
                      if self._grouped() else self._local_experts(padded, counts))
        else:
            split = [local * capacity] * ep
            arrived = all_to_all_tokens(padded, split, split, self.pctx.ep_group)
            result = self._grouped_arrivals(arrived, counts) if self._grouped() else self._local_experts(arrived, counts)
            result = all_to_all_tokens(result, split, split, self.pctx.ep_group)
        return torch.cat([result, result.new_zeros(1, result.shape[1])])[slot]

    def _grouped(self) -> bool:
        """The experts as grouped products (``kernels`` other than reference), but where FP8 scales an expert's
        linears: torchao's float8 grouped GEMM is CUDA-only (SM90+) and scales per group, not as the per-expert
        float8 linears the layouts and checkpoints are held to (docs/moe.md)."""
        return self.kernels.grouped_experts and all(
            e.gate_up_proj.float8 is None and e.down_proj.float8 is None for e in self.experts.values())

    def _local_experts(self, rows: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """Run this rank's experts one after another on ``rows`` (the reference): blocks from each source rank in
        turn, each block split by local expert (``counts[source][expert]``); the outputs come back in the same
        order."""
        blocks = [list(block.split(per_source)) for block, per_source in
                  zip(rows.split([sum(c) for c in counts]), counts)]
        outputs = [[None] * len(counts[0]) for _ in counts]
        for j, expert in enumerate(self.experts.values()):
            pieces = [blocks[s][j] for s in range(len(counts))]
            result = expert(torch.cat(pieces))  # also on no rows: the expert's gradient is then zero, not None
            for s, piece in enumerate(result.split([p.shape[0] for p in pieces])):
                outputs[s][j] = piece
        return torch.cat([piece for per_source in outputs for piece in per_source])

    def _grouped_arrivals(self, rows: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """:meth:`_local_experts` on the grouped path: the arrived blocks ([source][local expert]) reordered by
        expert (each expert's rows from every source in turn, as the loop concatenates them), run, put back."""
        starts, position = [], 0
        for per_source in counts:
            starts.append([])
            for count in per_source:
                starts[-1].append(position)
                position += count
        order = torch.cat([torch.arange(starts[s][j], starts[s][j] + counts[s][j], device=rows.device)
                           for j in range(len(counts[0])) for s in range(len(counts))])
        per_expert = torch.tensor([sum(per_source[j] for per_source in counts) for j in range(len(counts[0]))],
                                  device=rows.device)
        out = self._grouped_experts(rows[order], per_expert)
        return out[torch.argsort(order)]

    def _grouped_experts(self, rows: torch.Tensor, per_expert: torch.Tensor, tail: bool = False) -> torch.Tensor:
        """This rank's experts on ``rows`` sorted by local expert (``per_expert`` rows each, on the device; with
        ``tail``, rows past them that come back zero): gate/up as one grouped product, the activation, down as
        another; LoRA adapters on experts as grouped products of their factors. Row for row the products of
        :meth:`_local_experts`."""
        experts = list(self.experts.values())
        offsets = expert_offsets(per_expert)
        hidden = self._grouped_linear(rows, [e.gate_up_proj for e in experts], offsets, tail)
        return self._grouped_linear(self.kernels.swiglu(hidden), [e.down_proj for e in experts], offsets, tail)

    @staticmethod
    def _grouped_linear(rows: torch.Tensor, linears: list[LocalLinear], offsets: torch.Tensor,
                        tail: bool) -> torch.Tensor:
        """What each expert's ``LocalLinear`` computes on its rows (the weight's product, plus its adapter's
        ``(x A^T) B^T s``), for every expert at once."""
        out = grouped_linear(rows, [linear.weight for linear in linears], offsets, linears[0].weight_grad_store,
                             tail)
        if linears[0].lora is None:
            return out
        factors = [linear.lora.low_rank_factors() for linear in linears]
        store = linears[0].lora.weight_grad_store
        low_rank = grouped_linear(rows, [a for a, _ in factors], offsets, store, tail)
        return out + grouped_linear(low_rank, [b for _, b in factors], offsets, store, tail) * linears[0].lora.scaling


def pack_experts(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """:meth:`MoEMLP.pack_experts` on every MoE layer of ``model``: once it is built, and again once it is on its
    device (a move, or a cast such as DeepSpeed's to bf16, copies each parameter on its own: the training engine
    packs them in the dtype DeepSpeed will train them in, which its cast then leaves alone)."""
    for module in model.modules():
        if isinstance(module, MoEMLP):
            module.pack_experts(dtype)


class ExpertGroups(nn.Module):
    """What a rank holding no MoE block of an expert-parallel model carries (a pipeline stage of dense layers only:
    Llama 4's under interleaved 1F1B): DeepSpeed forms its expert groups when its engine calls
    ``set_deepspeed_parallelism`` on a module, a collective every rank must join."""

    def __init__(self, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        self.pctx.register_expert_groups()


def router_aux_loss(stats: torch.Tensor, config: ModelConfig, pctx: ParallelContext) -> torch.Tensor:
    """``router_aux_loss_coef`` x HF's load-balancing loss of a micro batch from the summed statistics of every
    MoE layer: E x sum_e (assignments_e / n) (probabilities_e / n), n the routed rows (layers x tokens).

    Under context parallelism each rank holds a sequence shard: the counts are summed over the CP group (they carry
    no gradient) and each rank returns CP times its share of the probability term, which is what the loss rule
    (training/engine/training_engine.py) averages over DP x CP ranks. Every TP rank computes the whole term from the same tokens,
    but their router gradients are summed over TP (:class:`Router`), so its gradient is scaled by 1 / TP.
    """
    counts, prob_sums = stats[0].detach(), stats[1]
    if pctx.cp_size > 1:
        counts = counts.clone()
        dist.all_reduce(counts, group=pctx.cp_group)
    rows = counts.sum() / config.num_experts_per_tok
    loss = config.num_local_experts * (counts * prob_sums).sum() / rows.square() * pctx.cp_size
    return scale_gradient(config.router_aux_loss_coef * loss, 1.0 / pctx.tp_size)
