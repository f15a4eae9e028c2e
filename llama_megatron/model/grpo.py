"""GRPO and its loss family: group-relative advantages from rewards, and the clipped policy-gradient loss of each
completion token, as TRL's ``GRPOTrainer`` defines them (TRL 1.16: ``_generate_and_score_completions`` for the
advantages, ``_compute_loss`` for the loss and its metrics; the names are ``GRPOConfig``'s).

A loss is written as what one micro batch adds to the loss of the whole optimizer step (:func:`micro_batch_loss`
with the step's :class:`GRPOStepCounts`), so the micro batches of a step, wherever they run (data-parallel ranks,
gradient accumulation, a pipeline's last stage), add up to the loss whose gradient TRL's step takes: the mean over
its processes of the sum over its accumulated micro batches of each micro batch's loss. Each ``loss_type`` divides
by its own count:

- ``dapo`` (TRL's default) and ``cispo``: the completion tokens of the step (TRL's ``num_items_in_batch``, the
  generation batch's, when one generation serves one optimizer step);
- ``grpo``: each completion's token mean, averaged over the step's completions;
- ``luspo``: each completion's token sum, averaged over the completions;
- ``dr_grpo``: the tokens' sum over completions x ``max_completion_length``;
- ``bnpo``: each micro batch's token mean, averaged over the micro batches (the one count that depends on how the
  step is cut into micro batches: TRL's per-device micro batches are ours).

``top_entropy_quantile`` < 1 (Wang et al., "Beyond the 80/20 rule") keeps in the policy term only the tokens whose
entropy reaches that quantile of the micro step's completion tokens over every data-parallel (and CP) rank, TRL's
threshold over each ``_compute_loss`` call's tokens across processes (:func:`high_entropy_mask`).

Only sum-then-normalise reward aggregation (TRL's default ``multi_objective_aggregation``) is written; the ``sapo``
and ``vespo`` losses, the off-policy mask, vLLM's importance-sampling correction and the entropy bonus are not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_entropy

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "luspo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
_STD_FLOOR = 1e-4  # TRL's: advantages are divided by (std + 1e-4), so a group of equal rewards gives zeros


@dataclass(frozen=True)
class GRPOLossConfig:
    """TRL's ``GRPOConfig`` names and defaults: ``loss_type``, ``beta`` (the KL coefficient against the reference;
    0: no reference), ``epsilon`` and ``epsilon_high`` (the clip range ``[1 - epsilon, 1 + epsilon_high]``; for
    ``cispo`` the ratio's upper bound is ``epsilon_high``), ``delta`` (two-sided clipping: the ratio's cap),
    ``importance_sampling_level`` (``sequence``: GSPO's one ratio per completion), ``scale_rewards``,
    ``max_completion_length`` (``dr_grpo``'s constant) and ``use_bias_correction_kl`` (the KL term weighted by the
    importance ratio), ``top_entropy_quantile`` (the share of tokens, highest entropy first, the policy term
    keeps: 1 keeps all)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    scale_rewards: str = "group"
    max_completion_length: int = 512
    use_bias_correction_kl: bool = True
    top_entropy_quantile: float = 1.0

    @property
    def upper(self) -> float:
        """``epsilon_high``, or ``epsilon`` where it is not set (TRL's rule)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_reference(self) -> bool:
        return self.beta != 0.0

    def problems(self) -> list[str]:
        """What is wrong with these settings, one line each (empty: nothing)."""
        found = []
        for name, value, choices in (("loss_type", self.loss_type, LOSS_TYPES),
                                     ("scale_rewards", self.scale_rewards, SCALE_REWARDS),
                                     ("importance_sampling_level", self.importance_sampling_level,
                                      IMPORTANCE_SAMPLING_LEVELS)):
            if value not in choices:
                found.append(f"grpo.{name} {value!r} is not one of {', '.join(choices)}")
        if self.beta < 0:
            found.append(f"grpo.beta must be >= 0 (got {self.beta})")
        if not 0 <= self.epsilon < 1:
            found.append(f"grpo.epsilon must be in [0, 1) (got {self.epsilon})")
        if self.upper < 0:
            found.append(f"grpo.epsilon_high must be >= 0 (got {self.epsilon_high})")
        if self.delta is not None and self.delta <= 0:
            found.append(f"grpo.delta must be > 0 (got {self.delta})")
        if not 0 <= self.top_entropy_quantile <= 1:
            found.append(f"grpo.top_entropy_quantile must be in [0, 1] (got {self.top_entropy_quantile})")
        if self.max_completion_length < 1:
            found.append(f"grpo.max_completion_length must be >= 1 (got {self.max_completion_length})")
        return found


def _nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaN, with Bessel's correction (NaN where fewer than two values)."""
    keep = dim is not None
    dims = dim if keep else tuple(range(values.dim()))
    mean = torch.nanmean(values, dim=dims, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dims, keepdim=True)
    # the count in the values' dtype: TRL's nanstd divides two int64 counts, a float32 correction that float64
    # rewards would see; for float32 rewards (TRL's) the two are the same
    count = (~torch.isnan(values)).sum(dim=dims, keepdim=True).to(values.dtype)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze(dim) if keep else std.reshape(())


@dataclass(frozen=True)
class Advantages:
    """One value per completion of a generation batch (prompt after prompt, ``num_generations`` each)."""

    advantages: torch.Tensor  # what the loss multiplies each completion's tokens by
    rewards: torch.Tensor  # the weighted sum of the reward functions (NaN: no function scored it)
    std: torch.Tensor  # the deviation the advantages were divided by (or, for "none", would have been)


def group_advantages(rewards_per_function: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str = "group") -> Advantages:
    """Advantages of a generation batch from ``rewards_per_function`` [completions, functions] (NaN where a
    function returned None) and the functions' ``weights``: each completion's weighted reward sum (NaN where no
    function scored it) less its group's mean (NaN ignored), divided by the group's deviation (``group``), the whole
    batch's (``batch``) or nothing (``none``), plus 1e-4; a completion no function scored gets 0."""
    if rewards_per_function.shape[0] % num_generations:
        raise ValueError(f"{rewards_per_function.shape[0]} completions are not groups of {num_generations}")
    unscorable = torch.isnan(rewards_per_function).all(dim=1)
    rewards = (rewards_per_function * weights.to(rewards_per_function).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = float("nan")
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = _nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + _STD_FLOOR)
    return Advantages(torch.nan_to_num(advantages, nan=0.0), rewards, std)


@dataclass(frozen=True)
class TokenLosses:
    """Per completion token ([completions, tokens]; GSPO's ratio terms [completions, 1] where nothing else
    broadcasts them): the loss before its reduction, and what the metrics read."""

    loss: torch.Tensor
    ratio: torch.Tensor  # the importance ratio (exp of the log-ratio), per token or per completion
    kl: torch.Tensor | None  # the per-token KL estimate against the reference (beta > 0)
    low_clipped: torch.Tensor  # the ratio under 1 - epsilon where the advantage is negative
    high_clipped: torch.Tensor  # over 1 + epsilon_high (cispo: over epsilon_high) where the advantage is positive


def _whole_rows(sums: torch.Tensor) -> torch.Tensor:
    return sums


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float, group=None) -> torch.Tensor:
    """The trained tokens (``mask``) whose entropy is at least the ``quantile`` of every trained token's entropy of
    this micro step on the ranks of ``group`` (TRL's ``get_high_entropy_mask``: ``torch.quantile``'s linear
    interpolation, so ``quantile`` 1 keeps the highest-entropy token alone). Each rank's tokens are gathered
    padded to the longest with -1, which no entropy is."""
    local = entropies[mask].float()
    if group is not None and dist.get_world_size(group) > 1:
        size = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
        sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, size, group=group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.full((longest,), -1.0, dtype=local.dtype, device=local.device)
        padded[:local.numel()] = local
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        local = torch.cat([part[:int(s.item())] for part, s in zip(parts, sizes)])
    if local.numel() == 0:
        return torch.zeros_like(mask)
    return (entropies >= torch.quantile(local, quantile).to(entropies.dtype)) & mask


def token_losses(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 config: GRPOLossConfig, ref_logps: torch.Tensor | None = None,
                 rows: Callable[[torch.Tensor], torch.Tensor] = _whole_rows,
                 keep: torch.Tensor | None = None) -> TokenLosses:
    """The loss of each completion token from the policy's log-probabilities ``logps`` [B, T] (with their graph),
    those at generation time ``old_logps`` (equal to ``logps`` on the first pass over fresh completions), the
    completions' ``advantages`` [B] and the trained tokens' ``mask`` [B, T]; ``ref_logps`` where ``beta`` > 0.
    ``rows`` turns per-row sums over this shard of the tokens into the whole rows' (context parallelism: their sum
    over the CP ranks, gradients included). ``keep`` (:func:`high_entropy_mask`): the tokens whose policy term counts
    (the KL term counts on every token, as TRL's)."""
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logps - old_logps
    if config.importance_sampling_level == "sequence":
        sums = rows(torch.stack([(log_ratio * mask).sum(-1), mask.sum(-1).to(log_ratio.dtype)]))
        log_ratio = (sums[0] / sums[1].clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    kl = None
    if config.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        # k3, the estimator TRL (and DeepSeekMath) use: exp(r - p) - (r - p) - 1 >= 0
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if config.use_bias_correction_kl:
            kl = kl * ratio
    low = 1 - config.epsilon
    if config.loss_type == "cispo":
        loss = -torch.clamp(ratio, max=config.upper).detach() * advantages * logps
        low_clipped = torch.zeros(torch.broadcast_shapes(ratio.shape, advantages.shape), dtype=torch.bool,
                                  device=ratio.device)
        high_clipped = (ratio > config.upper) & (advantages > 0)
    else:
        clipped = torch.clamp(ratio, low, 1 + config.upper)
        capped = ratio if config.delta is None else torch.clamp(ratio, max=config.delta)
        loss = -torch.min(capped * advantages, clipped * advantages)
        # TRL's: of the ratio after delta's cap (delta at or under 1 + epsilon_high clips nothing high)
        low_clipped = (capped < low) & (advantages < 0)
        high_clipped = (capped > 1 + config.upper) & (advantages > 0)
    if keep is not None:
        loss = loss * keep.to(loss.dtype)
    if kl is not None:
        loss = loss + config.beta * kl
    return TokenLosses(loss, ratio, kl, low_clipped, high_clipped)


@dataclass(frozen=True)
class GRPOStepCounts:
    """Counts over one optimizer step (every data-parallel rank's micro batches): its completions, their trained
    tokens and its micro batches. The engine hands each divided by the M x DP micro batches its gradient is
    averaged over (objectives.py), which the division here then undoes: ``micro_batches`` is 1 there, and each
    micro batch's bnpo mean is averaged by the engine itself."""

    completions: int
    tokens: float
    micro_batches: int


def micro_batch_loss(per_token: torch.Tensor, mask: torch.Tensor, config: GRPOLossConfig,
                     counts: GRPOStepCounts, rows: Callable[[torch.Tensor], torch.Tensor] = _whole_rows) -> torch.Tensor:
    """What this micro batch adds to its step's loss: ``per_token`` (:attr:`TokenLosses.loss`) over the trained
    tokens ``mask``, divided as the ``loss_type`` says (module docstring), so that the step's micro batches sum to
    the loss TRL's step differentiates. Every type is a function of each row's loss sum and token count, which
    ``rows`` makes whole rows' (:func:`token_losses`)."""
    mask = mask.to(per_token.dtype)
    row_loss, row_tokens = rows(torch.stack([(per_token * mask).sum(-1), mask.sum(-1)]))
    if config.loss_type in ("dapo", "cispo"):
        return row_loss.sum() / max(counts.tokens, 1.0)
    if config.loss_type == "grpo":
        return (row_loss / row_tokens.clamp(min=1.0)).sum() / counts.completions
    if config.loss_type == "luspo":
        return row_loss.sum() / counts.completions
    if config.loss_type == "dr_grpo":
        return row_loss.sum() / (counts.completions * config.max_completion_length)
    if config.loss_type == "bnpo":
        return row_loss.sum() / row_tokens.sum().clamp(min=1.0) / counts.micro_batches
    raise ValueError(f"unknown loss_type {config.loss_type!r}")


def masked_sums(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[sum, count]`` of ``values`` over the trained tokens (a per-completion value [B, 1] counts once per
    completion, as TRL's metrics count it): summed over ranks, their ratio is TRL's global masked mean."""
    values = values.detach()
    values = values if values.is_floating_point() and values.dtype.itemsize >= 4 else values.float()
    if values.shape[-1] == 1:
        return torch.stack([values.sum(), torch.tensor(float(values.shape[0]), dtype=values.dtype,
                                                       device=values.device)])
    mask = mask.to(values.dtype)
    return torch.stack([(values * mask).sum(), mask.sum()])


# what GRPOLoss's metric sums hold, a [sum, count] pair each (TRL's masked means: over the completion tokens, or the
# completions for a value per completion); the mismatch is |the sampler's log-probability - the old policy's of a
# training pass| (TRL's sampling_logp_difference: the rollout/training gap at the same weights); ratio_gap is
# |importance ratio - 1|: 0 on a generation's first pass (on-policy), off it once the policy has moved
METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
           "sampler_logprob_diff", "ratio_gap")
VALUES = ("advantages", "old_logps", "ref_logps", "sampler_logps")  # the label values a GRPO micro batch carries


def grpo_targets(labels: torch.Tensor, values: dict[str, torch.Tensor], counts: torch.Tensor) -> tuple:
    """The loss's second argument for a GRPO micro batch, a tuple of tensors as DeepSpeed's pipeline moves labels:
    the labels, then :data:`VALUES` per label ([b, s] each: the completion's advantage at every position of its row,
    the log-probabilities of generation time on its tokens), then ``counts`` = the step's (completions, trained tokens, micro
    batches), each divided by the engine's averaging factor."""
    return (labels, *(values[name] for name in VALUES), counts)


class GRPOLoss:
    """The GRPO objective's loss of one micro batch (the ``objective`` of ``CausalLMLoss``) from its logits and
    :func:`grpo_targets`: each label's log-probability under logits / ``temperature`` (TRL's training pass), the
    token losses of :func:`token_losses` reduced by :func:`micro_batch_loss`; with it the sums of :data:`METRICS`.
    ``on_policy`` (one optimizer step per generation): the old log-probabilities are the policy's own, detached
    (TRL's rule: the ratio is exactly 1). ``captured``, when a list, receives each micro batch's per-label
    log-probabilities (the passes after generation: old and reference log-probabilities)."""

    metric_size = 2 * len(METRICS)

    def __init__(self, config: GRPOLossConfig, pctx: ParallelContext, vocab_size: int, temperature: float, on_policy: bool,
                 ignore_index: int = -100) -> None:
        self.config, self.pctx, self.vocab_size = config, pctx, vocab_size
        self.temperature, self.on_policy, self.ignore_index = temperature, on_policy, ignore_index
        self.captured: list[torch.Tensor] | None = None

    def _rows(self, sums: torch.Tensor) -> torch.Tensor:
        """Per-row sums of this CP rank's shard of the tokens -> the whole rows' (an all-reduce whose backward
        all-reduces the gradients: each CP rank computes the whole loss, and DeepSpeed's average over them is the
        gradient of one)."""
        if self.pctx.cp_size == 1:
            return sums
        return dist_nn.all_reduce(sums, group=self.pctx.cp_group)

    def __call__(self, logits: torch.Tensor, targets: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        labels, advantages, old_logps, ref_logps, sampler_logps, counts = targets
        scaled = logits / self.temperature
        logps = -vocab_parallel_cross_entropy(scaled, labels, self.pctx, self.vocab_size, self.ignore_index)
        mask = labels != self.ignore_index
        if self.captured is not None:
            self.captured.append(logps.detach())
        old = logps.detach() if self.on_policy else old_logps
        entropy = vocab_parallel_entropy(scaled.detach(), self.pctx, self.vocab_size)
        keep = None
        if self.config.top_entropy_quantile < 1 and self.captured is None:  # a training pass (not old/reference)
            keep = high_entropy_mask(entropy, mask, 1 - self.config.top_entropy_quantile, self.pctx.dp_cp_group)
        # every position of a row holds its completion's advantage: one per completion, [b, 1], as TRL's
        terms = token_losses(logps, old, advantages[:, :1], mask, self.config,
                             ref_logps if self.config.beta != 0.0 else None, self._rows, keep)
        loss = micro_batch_loss(terms.loss, mask, self.config, GRPOStepCounts(counts[0], counts[1], counts[2]),
                                self._rows)
        # no KL at beta 0: its count 0, so grpo_metrics leaves it out (TRL logs kl only with a reference)
        sums = [masked_sums(terms.kl, mask) if terms.kl is not None else logps.new_zeros(2, dtype=torch.float32),
                masked_sums(entropy, mask),
                masked_sums(terms.low_clipped, mask), masked_sums(terms.high_clipped, mask),
                masked_sums(terms.low_clipped | terms.high_clipped, mask),
                masked_sums((old.detach() - sampler_logps).abs(), mask),
                masked_sums((terms.ratio.detach() - 1).abs(), mask)]
        return loss, torch.cat([s.to(torch.float32) for s in sums])


def grpo_metrics(sums: torch.Tensor) -> dict[str, float]:
    """The masked means of :data:`METRICS` from :class:`GRPOLoss`'s sums added over a step's micro batches (one
    summed over no token, the KL at beta 0, is left out)."""
    pairs = sums.double().view(-1, 2)
    return {name: float(total / count) for name, (total, count) in zip(METRICS, pairs) if count > 0}
