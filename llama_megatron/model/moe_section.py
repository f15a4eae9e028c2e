"""The training JSON's ``moe`` section (:class:`ExpertCapacity`: token dropping, and DeepSeek-V3's routing-bias
update rate) and the counting it rests on."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llama_megatron.errors import ConfigError

DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class ExpertCapacity:
    """The training JSON's ``moe`` section: token dropping, off by default (every assignment runs: exact against
    transformers), Megatron-core's ``moe_expert_capacity_factor``, ``moe_pad_expert_input_to_capacity`` and
    ``moe_token_drop_policy``; and the update rate of DeepSeek-V3's routing bias (Megatron-core's
    ``moe_router_bias_update_rate``, torchtitan's ``load_balance_coeff``)."""

    # each expert takes at most ceil(factor x tokens x top_k / experts) of a rank's assignments per layer and micro
    # batch; the rest are dropped (their output is zero; the token keeps its other experts', unrenormalised)
    capacity_factor: float | None = None
    # every expert's input padded to its capacity with zero rows: fixed shapes (and at EP > 1 split sizes known
    # without a host read), at the cost of the padding's FLOPs
    pad_to_capacity: bool = False
    # which assignments an over-full expert keeps: "probs" (its highest routing weights) or "position" (the first
    # tokens of the micro batch)
    drop_policy: str = "probs"
    # DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step every MoE layer's routing bias moves by
    # rate x sign(mean load - load) per expert, from the step's assignments over every data-parallel rank (the
    # report's gamma; 0 keeps the bias as loaded)
    bias_update_rate: float = 0.001

    def check(self) -> None:
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"moe.capacity_factor must be > 0 (or null: no token dropped), got {self.capacity_factor}")
        if self.drop_policy not in DROP_POLICIES:
            raise ConfigError(f"moe.drop_policy {self.drop_policy!r}: choose {' or '.join(DROP_POLICIES)}")
        if not self.bias_update_rate >= 0:
            raise ConfigError(f"moe.bias_update_rate must be >= 0, got {self.bias_update_rate}")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ConfigError("moe.pad_to_capacity pads each expert's input to its capacity: set moe.capacity_factor")

    def capacity(self, assignments: int, num_experts: int) -> int:
        """Megatron-core's ``get_capacity``: the assignments one expert takes, from a rank's ``assignments``
        (tokens x top_k) of one layer and micro batch."""
        return math.ceil(assignments / num_experts * self.capacity_factor)


def keep_within_capacity(expert_of: torch.Tensor, priority: torch.Tensor, num_experts: int, capacity: int,
                         policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For each assignment (flat ``expert_of``), its rank among its expert's assignments (by ``priority``
    descending for "probs", by position for "position"; ties by position) and whether it is kept (rank <
    ``capacity``). On the device, no host read."""
    order = torch.arange(expert_of.numel(), device=expert_of.device)
    if policy == "probs":
        order = torch.argsort(priority.detach(), descending=True, stable=True)
    ranked = order[torch.argsort(expert_of[order], stable=True)]  # by expert, then by priority (or position)
    counts = assignment_counts(expert_of, num_experts)
    starts = counts.cumsum(0) - counts
    rank_sorted = torch.arange(expert_of.numel(), device=expert_of.device) - starts[expert_of[ranked]]
    rank = torch.empty_like(rank_sorted).scatter_(0, ranked, rank_sorted)
    return rank, rank < capacity



def assignment_counts(expert_of: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many assignments each expert received ([num_experts], int64, on the device): a scatter, not
    ``bincount``, which reads its input's maximum on the host."""
    return torch.zeros(num_experts, dtype=torch.long, device=expert_of.device).scatter_add_(
        0, expert_of, torch.ones_like(expert_of))
