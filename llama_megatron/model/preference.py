"""Preference-tuning losses: functions of a pair's four sequence log-probabilities (the policy's and the frozen
reference's, of the chosen and of the rejected completion), as TRL's ``DPOTrainer`` defines them (TRL 1.16,
``loss_type`` and ``loss_weights``; the reverse-KL divergence, its default).

A loss is written as a sum over the pairs and tokens of one micro batch divided by the counts of the whole global
batch (:class:`BatchCounts`), so the micro batches of a step, wherever they run (data-parallel ranks, a pipeline's
last stage), add up to exactly the loss TRL computes over that global batch at once: the mean over its pairs of each
pair loss, and for ``sft`` the mean over its chosen completions' tokens.

Left out: ``aot`` and ``aot_unpaired``, which sort the log-ratios across the batch (a pair's loss depends on the
others', so no sum over micro batches computes it); WPO weighting (``use_weighting``, which needs every token's
probabilities squared and summed over the vocabulary) and the f-divergences other than reverse KL.

In a run the last pipeline stage's loss function (``CausalLMLoss``) gets, with the labels, each label's sequence
(``MicroBatch.sequence_ids``: pair k's chosen is sequence 2k, its rejected 2k + 1), the reference's
log-probabilities of the micro batch's sequences, and the global batch's counts scaled for DeepSpeed's averaging
(:func:`preference_targets`); :func:`sequence_log_probs` sums the vocab-parallel cross-entropy's per-token values
over each sequence's trained labels, across context-parallel shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.cross_entropy import vocab_parallel_cross_entropy

# every loss this module computes; each needs the four log-probabilities, some the completions' token counts too
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
              "apo_down", "discopop", "sft", "sigmoid_norm", "simpo", "orpo")
# the losses that never read the reference (TRL's CPOTrainer "simpo", ORPOTrainer's odds ratio, the NLL): a run of
# only these needs no reference pass
REFERENCE_FREE = ("simpo", "orpo", "sft")


@dataclass(frozen=True)
class PreferenceLossConfig:
    """TRL's ``DPOConfig`` names: ``loss_type`` (one or several, summed with ``loss_weights``, default 1 each),
    ``beta`` (the reward scale), ``label_smoothing`` (``robust``, ``exo_pair`` and ``simpo``: the probability a
    label is flipped), ``discopop_tau`` and ``CPOConfig``'s ``simpo_gamma`` (SimPO's target margin)."""

    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5

    @property
    def needs_reference(self) -> bool:
        return any(name not in REFERENCE_FREE for name in self.loss_type)

    def problems(self) -> list[str]:
        """What is wrong with these settings, one line each (empty: nothing)."""
        found = [f"preference.loss_type {name!r} is not one of {', '.join(LOSS_TYPES)}"
                 for name in self.loss_type if name not in LOSS_TYPES]
        if not self.loss_type:
            found.append("preference.loss_type names no loss")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            found.append(f"preference.loss_weights has {len(self.loss_weights)} weights for "
                         f"{len(self.loss_type)} loss types")
        if not self.beta > 0:
            found.append(f"preference.beta must be > 0 (got {self.beta})")
        if not 0 <= self.label_smoothing < 0.5:
            found.append(f"preference.label_smoothing must be in [0, 0.5) (got {self.label_smoothing})")
        if "exo_pair" in self.loss_type and self.label_smoothing == 0:
            found.append("preference.loss_type exo_pair needs label_smoothing > 0 (its target is 1 - eps, eps)")
        if not self.discopop_tau > 0:
            found.append(f"preference.discopop_tau must be > 0 (got {self.discopop_tau})")
        if not self.simpo_gamma >= 0:
            found.append(f"preference.simpo_gamma must be >= 0 (got {self.simpo_gamma})")
        return found

    @property
    def weights(self) -> tuple[float, ...]:
        return self.loss_weights if self.loss_weights is not None else (1.0,) * len(self.loss_type)


@dataclass(frozen=True)
class BatchCounts:
    """The global batch's pairs and its chosen completions' tokens: the denominators of the loss's means."""

    pairs: int
    chosen_tokens: int


@dataclass
class PairLogProbs:
    """One micro batch's pairs: the policy's and the reference's summed log-probabilities of each chosen and
    rejected completion ([pairs] each), and each completion's trained tokens."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def pair_losses(config: PreferenceLossConfig, name: str, logps: PairLogProbs) -> torch.Tensor:
    """Each pair's loss of type ``name`` ([pairs]); ``sft`` has no pair form (:func:`preference_loss`)."""
    beta, eps = config.beta, config.label_smoothing
    chosen_ratio = logps.chosen - logps.ref_chosen  # log pi/pi_ref of the chosen completion
    rejected_ratio = logps.rejected - logps.ref_rejected
    margin = beta * (chosen_ratio - rejected_ratio)
    if name == "sigmoid":
        return -F.logsigmoid(margin)
    if name == "hinge":
        return torch.relu(1 - margin)
    if name in ("ipo", "sigmoid_norm"):  # the ratios per completion token
        per_token = (chosen_ratio / logps.chosen_tokens.clamp(min=1)
                     - rejected_ratio / logps.rejected_tokens.clamp(min=1))
        return (per_token - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * per_token)
    if name == "exo_pair":  # KL from the model's pair distribution to (1 - eps, eps)
        return (torch.sigmoid(margin) * (F.logsigmoid(margin) - math.log1p(-eps))
                + torch.sigmoid(-margin) * (F.logsigmoid(-margin) - math.log(eps)))
    if name == "nca_pair":
        chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
        return -F.logsigmoid(chosen_reward) - 0.5 * F.logsigmoid(-chosen_reward) - 0.5 * F.logsigmoid(-rejected_reward)
    if name == "robust":  # unbiased under labels flipped with probability eps
        return (-(1 - eps) * F.logsigmoid(margin) + eps * F.logsigmoid(-margin)) / (1 - 2 * eps)
    if name == "bco_pair":
        return -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
    if name == "sppo_hard":
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if name == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    if name == "apo_down":
        return torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(margin)
    if name == "discopop":
        mix = torch.sigmoid(margin / config.discopop_tau)
        return -F.logsigmoid(margin) * (1 - mix) + torch.exp(-margin) * mix
    # reference-free, over the completions' mean token log-probabilities (TRL's average_log_prob)
    chosen_mean = logps.chosen / logps.chosen_tokens.clamp(min=1)
    rejected_mean = logps.rejected / logps.rejected_tokens.clamp(min=1)
    if name == "simpo":  # CPOTrainer's loss_type "simpo" (SimPO: a target margin gamma, no reference)
        logits = chosen_mean - rejected_mean - config.simpo_gamma / beta
        return -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    if name == "orpo":  # ORPOTrainer's odds-ratio term (its whole loss adds the NLL: ["sft", "orpo"])
        log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
        return -beta * F.logsigmoid(log_odds)
    raise ValueError(f"no pair loss {name!r}")


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -log 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def preference_loss(config: PreferenceLossConfig, logps: PairLogProbs, counts: BatchCounts) -> torch.Tensor:
    """This micro batch's share of the global batch's loss: sum_pairs(weighted pair losses) / counts.pairs, and
    for ``sft`` -sum(chosen log-probabilities) / counts.chosen_tokens."""
    total = logps.chosen.new_zeros(())
    for name, weight in zip(config.loss_type, config.weights):
        if name == "sft":
            part = -logps.chosen.sum() / counts.chosen_tokens
        else:
            part = pair_losses(config, name, logps).sum() / counts.pairs
        total = total + weight * part
    return total


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def metric_sums(config: PreferenceLossConfig, logps: PairLogProbs) -> dict[str, torch.Tensor]:
    """Sums over this micro batch's pairs of what TRL logs as means over the batch's pairs (:data:`METRICS`): the
    implicit rewards beta log(pi/pi_ref), the share of pairs whose chosen reward is the higher, their margin, and the
    policy's sequence log-probabilities."""
    with torch.no_grad():
        chosen_reward = config.beta * (logps.chosen - logps.ref_chosen)
        rejected_reward = config.beta * (logps.rejected - logps.ref_rejected)
        values = (chosen_reward, rejected_reward, (chosen_reward > rejected_reward).to(chosen_reward.dtype),
                  chosen_reward - rejected_reward, logps.chosen, logps.rejected)
        return {name: value.detach().sum() for name, value in zip(METRICS, values)}


def preference_targets(labels: torch.Tensor, counts: torch.Tensor, sequence_ids: torch.Tensor,
                       reference: torch.Tensor) -> tuple:
    """The loss's second argument for preference pairs, a tuple of tensors as DeepSpeed's pipeline moves labels:
    ``counts`` = the global batch's (pairs, chosen completion tokens), each divided by the engine's averaging
    factor; ``reference`` the reference's log-probability of each sequence ([2 x pairs])."""
    return labels, counts, sequence_ids, reference


class PreferenceLoss:
    """The preference objective's loss of one micro batch (the ``objective`` of ``CausalLMLoss``) from its logits
    and :func:`preference_targets`; with it the sums of :data:`METRICS` and the micro batch's pair count.
    ``captured``, when a list, receives each micro batch's sequence log-probabilities (the reference pass before
    training)."""

    metric_size = len(METRICS) + 1

    def __init__(self, config: PreferenceLossConfig, pctx: ParallelContext, vocab_size: int,
                 ignore_index: int) -> None:
        self.config, self.pctx, self.vocab_size, self.ignore_index = config, pctx, vocab_size, ignore_index
        self.captured: list[torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor, targets: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        labels, counts, sequence_ids, reference = targets
        token_losses = vocab_parallel_cross_entropy(logits, labels, self.pctx, self.vocab_size, self.ignore_index)
        logps, tokens = sequence_log_probs(token_losses, labels, sequence_ids, reference.numel(), self.ignore_index,
                                           self.pctx)
        if self.captured is not None:
            self.captured.append(logps.detach())
        pairs = pair_log_probs(logps, tokens, reference)
        sums = torch.stack([*metric_sums(self.config, pairs).values(), logps.new_tensor(float(pairs.chosen.numel()))])
        return preference_loss(self.config, pairs, BatchCounts(counts[0], counts[1])), sums


def preference_metrics(sums: torch.Tensor) -> dict[str, float]:
    """TRL's means over the step's pairs from :class:`PreferenceLoss`'s sums added over every micro batch."""
    sums = sums.double()
    return {name: float(value) for name, value in zip(METRICS, sums[:-1] / sums[-1].clamp(min=1))}


def sequence_log_probs(token_losses: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor,
                       sequences: int, ignore_index: int,
                       pctx: ParallelContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability, trained tokens) of each of ``sequences`` sequences: minus the per-token cross-entropy
    summed over the labels of each (0 where ignored), and their count. Under context parallelism each rank holds a
    shard of every row: the sums are all-reduced over the CP group, and so are their gradients (every CP rank
    computes the same loss from the same sums, and each needs the gradient of the whole loss for its shard)."""
    trained = (labels != ignore_index) & (sequence_ids >= 0)
    index = sequence_ids.masked_fill(~trained, 0).reshape(-1)
    weights = trained.reshape(-1)
    logps = token_losses.new_zeros(sequences).index_add(0, index, -token_losses.reshape(-1) * weights)
    tokens = torch.zeros(sequences, dtype=torch.float32, device=labels.device).index_add_(
        0, index, weights.to(torch.float32))
    if pctx.cp_size > 1:
        logps = dist_nn.all_reduce(logps, group=pctx.cp_group)
        dist.all_reduce(tokens, group=pctx.cp_group)
    return logps, tokens


def pair_log_probs(logps: torch.Tensor, tokens: torch.Tensor, reference: torch.Tensor) -> PairLogProbs:
    """Sequences 2k and 2k + 1 as pair k's chosen and rejected."""
    reference = reference.to(logps.dtype)
    return PairLogProbs(logps[0::2], logps[1::2], reference[0::2], reference[1::2], tokens[0::2], tokens[1::2])
