"""Training objectives, one record each: what a run's loss is and everything that depends on it.

A run's objective follows from its data (``data.type``): the token loss (pretraining and SFT: the mean of the
labels' cross-entropy over the global batch) and preference tuning (TRL's DPOTrainer losses over pairs). Each
:class:`Objective` says how many rows of ``seq_length`` a sample takes, which config section belongs to it and
checks it, the loss the model's loss function computes for it (none: the token loss), the second argument of that
loss for each micro batch (its targets), whether its reference is computed before training, its metrics, its part
of the log line, and whether evaluation reports a perplexity. Code outside this module asks the run's record
(:func:`objective_of`), never which objective runs, so a new objective is one more record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llama_megatron.data.batch import MicroBatch, to_device
from llama_megatron.errors import ConfigError
from llama_megatron.model.preference import METRICS as PREFERENCE_METRICS
from llama_megatron.model.preference import PreferenceLoss, preference_targets
from llama_megatron.parallel.cross_entropy import IGNORE_INDEX

# ``config`` below is a TrainingConfig (training/config.py, which reads this module); ``engine`` a TrainingEngine:
# its ``device``, ``pctx``, ``holds_loss()`` and the reference's log-probabilities it holds (``reference_logps``)


@dataclass(frozen=True)
class Objective:
    name: str
    data_type: str | None  # the data.type that selects it; None: every other (the token loss)
    section: str | None  # the config section of its settings (its default when another objective runs)
    rows_per_sample: Callable[[Any], int]  # rows of seq_length tokens one sample of the data takes
    sample_unit: Callable[[Any], str]  # what the start line calls a sample of the batch ("" or " pairs")
    check: Callable[[Any], None]  # its section against the run's settings (ConfigError)
    loss: Callable[[Any, Any], Any]  # (config, pctx) -> the model's ObjectiveLoss (None: the token loss)
    targets: Callable[[Any, list[MicroBatch]], list]  # (engine, this rank's micro batches) -> the loss's targets
    precomputed_reference: Callable[[Any], bool]  # its reference is computed before training (run/reference.py)
    perplexity: bool  # its loss is a token mean: evaluation reports exp(loss)
    metric_names: tuple[str, ...]  # what its loss sums per micro batch, logged as means over the count below
    metric_count: Callable[[list[MicroBatch]], int]  # the count of a rank's micro batches those sums are over
    log_line: Callable[[dict], str]  # its part of the log line, from its metrics
    whole_logits: bool  # its loss needs every token's logits whole (no chunked head: activation estimates)


def loss_divisor(engine, micro_batches: list[MicroBatch]) -> torch.Tensor | None:
    """N / (M x DP x CP) of the token loss rule (training/engine/training_engine.py), on the device; None on
    pipeline stages without the loss (a DP x CP group lies within one stage, so skipping its all-reduce there is
    safe)."""
    if not engine.holds_loss():
        return None
    pctx = engine.pctx
    count = to_device(torch.tensor(sum(mb.num_targets() for mb in micro_batches), dtype=torch.int64), engine.device)
    if pctx.dp_cp_size > 1:  # the group DeepSpeed averages gradients over
        dist.all_reduce(count, group=pctx.dp_cp_group)
    return (count.clamp(min=1).double() / (len(micro_batches) * pctx.dp_cp_size)).float()


def _token_targets(engine, micro_batches: list[MicroBatch]) -> list:
    """Each micro batch's labels and the divisor of the loss rule; the labels alone on stages without the loss."""
    divisor = loss_divisor(engine, micro_batches)
    return [to_device(mb.labels, engine.device) if divisor is None else (to_device(mb.labels, engine.device), divisor)
            for mb in micro_batches]


def _preference_targets(engine, micro_batches: list[MicroBatch]) -> list:
    """The pair rule: each micro batch's loss is its pairs' losses summed over the global batch's pair count (and
    ``sft``'s over its chosen completion tokens), both divided by M x DP for DeepSpeed's averaging over M micro
    batches and DP x CP ranks (the CP ranks' gradients of a pair add up: model/preference.py); with the reference's
    log-probabilities of each micro batch's sequences (zeros while they are being computed)."""
    device, pctx = engine.device, engine.pctx
    labels = [to_device(mb.labels, device) for mb in micro_batches]
    if not engine.holds_loss():
        return labels
    pairs = sum(mb.pair_ids.numel() for mb in micro_batches)
    chosen = sum(int(((mb.labels != IGNORE_INDEX) & (mb.sequence_ids >= 0) & (mb.sequence_ids % 2 == 0)).sum())
                 for mb in micro_batches)
    counts = to_device(torch.tensor([pairs, chosen], dtype=torch.int64), device)
    if pctx.dp_cp_size > 1:
        dist.all_reduce(counts, group=pctx.dp_cp_group)
    counts = counts.double() / torch.tensor([pctx.cp_size, 1.0], dtype=torch.float64, device=device)
    counts = (counts.clamp(min=1) / (len(micro_batches) * pctx.dp_size)).float()

    def reference(mb: MicroBatch) -> torch.Tensor:
        if engine.reference_logps is None:
            return torch.zeros(2 * mb.pair_ids.numel(), device=device)
        return to_device(engine.reference_logps[mb.pair_ids].reshape(-1), device)

    return [preference_targets(label, counts, to_device(mb.sequence_ids, device), reference(mb))
            for label, mb in zip(labels, micro_batches)]


def _check_preference(config) -> None:
    problems = config.preference.loss().problems()
    if problems:
        raise ConfigError(problems[0])
    config.data.pair_truncation(config.seq_length).check_rows(config.seq_length, config.data.pack)


def _preference_line(metrics: dict) -> str:
    return f" | reward margin {metrics['rewards/margins']:.4f} accuracy {metrics['rewards/accuracies']:.3f}"


TOKEN_LOSS = Objective(
    name="token", data_type=None, section=None, rows_per_sample=lambda config: 1, sample_unit=lambda config: "",
    check=lambda config: None, loss=lambda config, pctx: None, targets=_token_targets,
    precomputed_reference=lambda config: False, perplexity=True, metric_names=(), metric_count=lambda mbs: 0,
    log_line=lambda metrics: "", whole_logits=False)

PREFERENCE = Objective(
    name="preference", data_type="preference", section="preference",
    # a padded pair is two rows (its chosen and rejected sequences); a packed pair's sequences share a row
    rows_per_sample=lambda config: 1 if config.data.pack else 2, check=_check_preference,
    sample_unit=lambda config: "" if config.data.pack else " pairs",  # a packed row holds whole pairs
    loss=lambda config, pctx: PreferenceLoss(config.preference.loss(), pctx, IGNORE_INDEX),
    targets=_preference_targets, precomputed_reference=lambda config: config.preference.loss().needs_reference,
    perplexity=False, metric_names=PREFERENCE_METRICS,
    metric_count=lambda micro_batches: sum(mb.pair_ids.numel() for mb in micro_batches),
    log_line=_preference_line, whole_logits=True)

OBJECTIVES = (TOKEN_LOSS, PREFERENCE)


def objective_of(config) -> Objective:
    """The record of ``config``'s objective (its data type's, else the token loss)."""
    for objective in OBJECTIVES:
        if objective.data_type == config.data.type:
            return objective
    return TOKEN_LOSS


def check_objective(config, defaults: dict[str, Any]) -> None:
    """The run's objective's settings; another objective's section set (differing from its ``defaults``) is an
    error, since nothing would read it."""
    running = objective_of(config)
    for objective in OBJECTIVES:
        section = objective.section
        if objective is not running and section is not None and getattr(config, section) != defaults[section]:
            raise ConfigError(f"the {section} section sets the loss of the {objective.name} objective, and data.type is "
                              f"{config.data.type!r}: set data.type {objective.data_type}, or leave the section out")
    running.check(config)
