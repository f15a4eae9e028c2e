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

The load-balancing loss (HF's ``load_balancing_loss_func``, Switch Transformer eq. 4-6) needs, over every layer's
router, the count of assignments per expert and the sum of router probabilities per expert: each MoE layer adds
its two rows to a ``[2, E]`` statistic that travels with the hidden states through the pipeline, and the loss
(:func:`router_aux_loss`) is formed from it on the last stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.model.kernels import REFERENCE, Kernels
from llama_megatron.model.mlp import gate_up_parts
from llama_megatron.parallel.collectives import all_reduce_grad_in_tp, all_to_all_tokens, scale_gradient
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import LocalShapes
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

    Under TP each rank's experts yield a partial sum, so the gradient reaching the routing weights (through the
    combination) is partial too: the weight's gradient is summed over the TP group, as an SP norm's is.
    """

    def __init__(self, config: ModelConfig, pctx: ParallelContext, outputs: int) -> None:
        super().__init__()
        self.pctx = pctx
        self.weight = mark_replicated(nn.Parameter(torch.empty(outputs, config.hidden_size)))
        if pctx.tp_size > 1:
            self.weight.sequence_parallel = True
        # a zero-bubble schedule's W computes the weight's gradient (and its TP sum) later (weight_grad.py)
        self.weight_grad_store: WeightGradStore | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = all_reduce_grad_in_tp(self.weight, self.pctx) if self.pctx.tp_size > 1 else self.weight
        return linear(x, weight, None, self.weight_grad_store)


class MoEMLP(nn.Module):
    """The MoE block of one decoder layer: ``forward(x) -> (output, router statistics [2, E])``."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes,
                 kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.pctx = pctx
        self.num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        self.norm_topk = config.family.moe.norm_topk(config)
        self.weights_in_model_dtype = config.family.moe.weights_in_model_dtype
        self.scales_inputs = config.family.moe.routing == "sigmoid_input"
        self.local_ids = shapes.expert_ids(pctx.ep_rank)
        self.router = Router(config, pctx, config.num_local_experts)
        # keyed by global expert id, so parameter names are the same whichever EP rank holds the expert
        self.experts = nn.ModuleDict({str(e): ExpertMLP(config, shapes.expert_intermediate, kernels)
                                      for e in self.local_ids})
        self.shared = config.family.moe.shared_expert
        self.shared_gated = self.shared and config.family.moe.shared_expert_gated
        if self.shared:
            self.shared_expert = ExpertMLP(config, shapes.shared_intermediate, kernels)
        if self.shared_gated:
            self.shared_expert_gate = Router(config, pctx, 1)
        self.mark_experts()

    def mark_experts(self) -> None:
        """DeepSpeed's mark of an expert parameter (reduced over its expert-data-parallel group), on every parameter
        of the experts: also on what is added to them after construction (LoRA adapters)."""
        if self.pctx.ep_size > 1:
            for param in self.experts.parameters():
                param.allreduce, param.group_name = False, self.pctx.expert_group_name

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
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(tokens.dtype)
        chosen, order = chosen.sort(dim=-1)  # ascending expert id: the order a token's outputs are summed in
        weights = weights.gather(-1, order)
        if self.scales_inputs:
            outputs = self._run_experts(tokens, chosen.reshape(-1), weights.reshape(-1))
        else:
            outputs = self._run_experts(tokens, chosen.reshape(-1))
            outputs = (outputs * weights.reshape(-1, 1)).to(tokens.dtype)  # Mixtral: fp32 product, cast back
        combined = outputs.view(tokens.shape[0], self.top_k, -1).sum(dim=1)
        if self.shared_gated:  # this TP rank's partial sum, reduced with the routed experts'
            combined = combined + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        elif self.shared:
            combined = combined + self.shared_expert(tokens)
        out = row_parallel_output(combined.view_as(full), self.pctx)
        return out, self._statistics(logits, probs, chosen)

    def choose(self, logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts ([tokens, k], best first) and their weights before normalisation: the
        largest router probabilities, or for Llama 4 the largest logits with their sigmoids (fp32, cast back: they
        scale the experts' inputs)."""
        if self.scales_inputs:
            weights, chosen = torch.topk(logits, self.top_k, dim=-1)
            return torch.sigmoid(weights.float()).to(logits.dtype), chosen
        return torch.topk(probs, self.top_k, dim=-1)

    def _statistics(self, logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """This layer's rows of the aux-loss statistic: assignments per expert (no gradient) and summed router
        probabilities per expert. HF forms both from a softmax in the logits' dtype (fp32 routing aside)."""
        if logits.dtype != torch.float32:
            probs = torch.softmax(logits, dim=-1)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices
        counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts).float()
        return torch.stack([counts, probs.float().sum(dim=0)])

    def _run_experts(self, tokens: torch.Tensor, expert_of: torch.Tensor,
                     input_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Each assignment's expert output ([tokens x k, hidden], rows in assignment order): assignments sorted by
        expert (each token scaled by its assignment's ``input_scales`` first, where given), exchanged with the EP
        ranks holding the experts, run, and returned."""
        k = self.top_k
        by_expert = torch.argsort(expert_of, stable=True)
        inputs = tokens[by_expert // k]
        if input_scales is not None:
            inputs = inputs * input_scales[by_expert].unsqueeze(-1)
        per_expert = torch.bincount(expert_of, minlength=self.num_experts)
        ep = self.pctx.ep_size
        if ep == 1:
            outputs = self._local_experts(inputs, per_expert.view(1, -1).tolist())
        else:
            # what every EP rank sends this rank's experts, [source rank, local expert]
            received = torch.empty_like(per_expert)
            dist.all_to_all_single(received, per_expert, group=self.pctx.ep_group)
            send = per_expert.view(ep, -1).sum(dim=1).tolist()
            received = received.view(ep, -1)
            recv = received.sum(dim=1).tolist()
            arrived = all_to_all_tokens(inputs, recv, send, self.pctx.ep_group)
            outputs = all_to_all_tokens(self._local_experts(arrived, received.tolist()), send, recv,
                                        self.pctx.ep_group)
        return outputs[torch.argsort(by_expert)]  # back to assignment order (an index: saves only the indices)

    def _local_experts(self, rows: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """Run this rank's experts on ``rows``: blocks from each source rank in turn, each block split by local
        expert (``counts[source][expert]``); the outputs come back in the same order."""
        blocks = [list(block.split(per_source)) for block, per_source in
                  zip(rows.split([sum(c) for c in counts]), counts)]
        outputs = [[None] * len(counts[0]) for _ in counts]
        for j, expert in enumerate(self.experts.values()):
            pieces = [blocks[s][j] for s in range(len(counts))]
            result = expert(torch.cat(pieces))  # also on no rows: the expert's gradient is then zero, not None
            for s, piece in enumerate(result.split([p.shape[0] for p in pieces])):
                outputs[s][j] = piece
        return torch.cat([piece for per_source in outputs for piece in per_source])


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
