"""Training objectives, one record each: what a run's loss is and everything that depends on it.

A run's objective follows from its data (``data.type``): the token loss (pretraining and SFT: the mean of the
labels' cross-entropy over the global batch), preference tuning (TRL's DPOTrainer losses over pairs) and online
RL (GRPO: TRL's GRPOTrainer losses over completions the policy samples each step, ``data.type: prompts``). Each
:class:`Objective` says how many rows of ``seq_length`` a sample takes, which config section belongs to it and
checks it, the loss the model's loss function computes for it (none: the token loss), the second argument of that
loss for each micro batch (its targets), whether its reference is computed before training, its metrics, its part
of the log line, whether evaluation reports a perplexity, whether it rolls out its own batches and what `estimate`
adds for it. Code outside this module asks the run's record
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
from llama_megatron.model.grpo import GRPOLoss, GRPOLossConfig, grpo_metrics, grpo_targets
from llama_megatron.model.preference import (
    PreferenceLoss,
    PreferenceLossConfig,
    preference_metrics,
    preference_targets,
)
from llama_megatron.parallel.cross_entropy import IGNORE_INDEX


@dataclass
class PreferenceConfig:
    # DPOTrainer loss(es) of data.type preference: one name or a list, summed with loss_weights (docs/preference.md)
    loss_type: str | tuple[str, ...] = "sigmoid"
    loss_weights: tuple[float, ...] | None = None  # one weight per loss_type (default 1 each)
    beta: float = 0.1  # the implicit reward's scale: beta log(pi / pi_ref)
    label_smoothing: float = 0.0  # robust, exo_pair, simpo: the probability that a pair's labels are flipped
    discopop_tau: float = 0.05  # discopop's temperature
    simpo_gamma: float = 0.5  # simpo's target margin (TRL's CPOConfig)

    def loss(self) -> PreferenceLossConfig:
        names = (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)
        return PreferenceLossConfig(names, self.loss_weights, self.beta, self.label_smoothing, self.discopop_tau,
                                    self.simpo_gamma)


@dataclass
class GRPOConfig:
    """Online RL with TRL's GRPOTrainer semantics (data.type prompts; docs/grpo.md). The global batch counts
    completions: batch.global_batch_size / num_generations prompts per generation."""

    num_generations: int = 8  # completions sampled per prompt (a group)
    max_completion_length: int = 512  # new tokens at most per completion (TRL's default)
    temperature: float = 1.0  # sampling temperature; the training pass divides the logits by it too (TRL)
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens whose probability exceeds it (1: all)
    # token ids that end a completion (default: the tokenizer's EOS, the model config's and those its
    # generation_config.json declares, as `generate` stops)
    stop_ids: tuple[int, ...] | None = None
    # the reward functions: "package.module:function" or "path/to/file.py:function" (TRL's signature)
    reward_funcs: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] | None = None  # one per function (default 1 each)
    loss_type: str = "dapo"  # dapo, grpo, bnpo, dr_grpo, cispo, luspo (TRL's GRPOConfig)
    beta: float = 0.0  # the KL coefficient against the reference (0: no reference)
    epsilon: float = 0.2  # the clip range's lower side (and upper, unless epsilon_high)
    epsilon_high: float | None = None  # the clip range's upper side (DAPO's clip-higher; default: epsilon)
    delta: float | None = None  # two-sided clipping: the ratio's cap
    importance_sampling_level: str = "token"  # token, or sequence (GSPO)
    scale_rewards: str = "group"  # group, batch or none: what advantages are divided by
    mask_truncated_completions: bool = False  # completions that hit max_completion_length train no token
    num_iterations: int = 1  # optimizer steps per generation (old log-probabilities kept from generation time)
    # the share of each micro step's completion tokens, highest entropy first, whose policy term trains (1: all)
    top_entropy_quantile: float = 1.0
    log_completions: bool = False  # write each generation's completions to <output_dir>/completions/

    def loss(self) -> GRPOLossConfig:
        return GRPOLossConfig(self.loss_type, self.beta, self.epsilon, self.epsilon_high, self.delta,
                              self.importance_sampling_level, self.scale_rewards, self.max_completion_length,
                              top_entropy_quantile=self.top_entropy_quantile)

    def problems(self) -> list[str]:
        """What is wrong with these settings alone, one line each."""
        found = self.loss().problems()
        for name in ("num_generations", "num_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                found.append(f"grpo.{name} must be a positive integer (got {value!r})")
        if not self.temperature > 0:
            found.append(f"grpo.temperature must be > 0 (got {self.temperature})")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            found.append(f"grpo.top_k must be >= 0 and grpo.top_p in (0, 1] (got {self.top_k}, {self.top_p})")
        if not self.reward_funcs:
            found.append("grpo.reward_funcs names no reward function (module:function or file.py:function)")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            found.append(f"grpo.reward_weights has {len(self.reward_weights)} weights for {len(self.reward_funcs)} "
                         "reward functions")
        return found


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
    # its metrics from the sums its loss returns, added over a step's micro batches and every rank (None: it has
    # none); the copies TP and CP ranks hold cancel in the ratios they are made of
    metrics: Callable[[torch.Tensor], dict] | None
    log_line: Callable[[dict], str]  # its part of the log line, from its metrics
    whole_logits: bool  # its loss needs every token's logits whole (no chunked head: activation estimates)
    # after the data is read, before any process group: what needs it (a prompt that leaves no room, a reward
    # function that does not import), ConfigError
    check_prepared: Callable[[Any], None] = lambda config: None
    rollout: bool = False  # its batches are generated by the policy each step (training/run/rollout.py)
    # what `estimate` adds on a rank holding ``decoder_layers`` layers, in element bytes ``e``: bytes held outside the
    # training passes (a rollout's decoding: beside the model states, in place of the activations)
    rollout_bytes: Callable[[Any, int, int], int] = lambda config, decoder_layers, e: 0
    # it holds a copy of the starting weights as its reference (each rank its share; `estimate` counts it)
    holds_reference_weights: Callable[[Any], bool] = lambda config: False


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


def _grpo_targets(engine, micro_batches: list[MicroBatch]) -> list:
    """The step's counts for GRPO's normalisers (model/grpo.py): its completions, their trained tokens and its
    micro batches over every data-parallel rank, each divided by M x DP for DeepSpeed's averaging; with each
    micro batch's label values (advantages, log-probabilities of generation time)."""
    device, pctx = engine.device, engine.pctx
    labels = [to_device(mb.labels, device) for mb in micro_batches]
    if not engine.holds_loss():
        return labels
    completions = sum(mb.labels.shape[0] for mb in micro_batches)
    counts = to_device(torch.tensor([completions, sum(mb.num_targets() for mb in micro_batches)], dtype=torch.int64),
                       device)
    if pctx.dp_cp_size > 1:
        dist.all_reduce(counts, group=pctx.dp_cp_group)
    averaged = len(micro_batches) * pctx.dp_size
    counts = torch.cat([counts.double() / torch.tensor([pctx.cp_size, 1.0], dtype=torch.float64, device=device),
                        torch.tensor([float(averaged)], dtype=torch.float64, device=device)])
    counts = (counts.clamp(min=1) / averaged).float()
    return [grpo_targets(label, {k: to_device(v, device) for k, v in mb.label_values.items()}, counts)
            for label, mb in zip(labels, micro_batches)]


def _check_grpo(config) -> None:
    grpo = config.grpo
    problems = grpo.problems()
    if problems:
        raise ConfigError(problems[0])
    batch = config.batch.global_batch_size
    if batch % grpo.num_generations:
        raise ConfigError(f"batch.global_batch_size {batch} (completions per step) is not whole groups of "
                          f"grpo.num_generations {grpo.num_generations}")
    if config.train.loss_spike_factor is not None:
        raise ConfigError("train.loss_spike_factor compares a step's loss with its recent mean, and a GRPO loss is a "
                          "signed sum of advantages near 0 (a spike test would flag healthy steps): leave it null")
    if grpo.max_completion_length >= config.seq_length:
        raise ConfigError(f"grpo.max_completion_length {grpo.max_completion_length} leaves no room for a prompt "
                          f"in seq_length {config.seq_length}")


def _check_grpo_prepared(config) -> None:
    """Every prompt fits with a whole completion (a row is the prompt and the completion, its last token no input);
    every reward function loads."""
    from llama_megatron.data.rewards import load_reward_function

    room = config.seq_length + 1 - config.grpo.max_completion_length
    for number, record in enumerate(config.data.records, start=1):
        if len(record.ids) > room:
            raise ConfigError(f"{config.data.path}: prompt {number} is {len(record.ids)} tokens, and seq_length "
                              f"{config.seq_length} leaves {room} beside grpo.max_completion_length "
                              f"{config.grpo.max_completion_length}")
    for spec in config.grpo.reward_funcs:
        load_reward_function(spec)


def _grpo_rollout_bytes(config, decoder_layers: int, e: int) -> int:
    """A rank's decoding of one group (``num_generations`` rows of up to seq_length positions): its layers' KV
    cache, the prompt pass's largest layer (its MLP's intermediate activations), and a step's full logits in fp32
    (gathered, divided by the temperature, their log-softmax)."""
    m, tp, rows, seq = config.model, config.parallel.tensor, config.grpo.num_generations, config.seq_length
    heads, key_dim, value_dim = m.kv_cache_widths(tp)  # (MLA: its latent)
    cache = decoder_layers * rows * seq * max(1, heads) * (key_dim + value_dim) * e
    prompt_pass = rows * seq * (3 * m.intermediate_size // tp + 2 * m.hidden_size) * e
    return cache + prompt_pass + 3 * rows * config.local_shapes.padded_vocab_size * 4


def _grpo_line(metrics: dict) -> str:
    line = f" | reward {metrics['reward']:.4f} (std {metrics['reward_std']:.4f})" if "reward" in metrics else ""
    if "kl" in metrics:  # beta > 0
        line += f" | kl {metrics['kl']:.5f}"
    line += f" | clipped {metrics['clip_ratio/region_mean']:.3f} | entropy {metrics['entropy']:.3f}"
    if "generation_s" in metrics:
        line += f" | generation {metrics['generation_s']:.2f} s, training {metrics.get('train_s', 0.0):.2f} s"
    return line


TOKEN_LOSS = Objective(
    name="token", data_type=None, section=None, rows_per_sample=lambda config: 1, sample_unit=lambda config: "",
    check=lambda config: None, loss=lambda config, pctx: None, targets=_token_targets,
    precomputed_reference=lambda config: False, perplexity=True, metrics=None, log_line=lambda metrics: "",
    whole_logits=False)

PREFERENCE = Objective(
    name="preference", data_type="preference", section="preference",
    # a padded pair is two rows (its chosen and rejected sequences); a packed pair's sequences share a row
    rows_per_sample=lambda config: 1 if config.data.pack else 2, check=_check_preference,
    sample_unit=lambda config: "" if config.data.pack else " pairs",  # a packed row holds whole pairs
    loss=lambda config, pctx: PreferenceLoss(config.preference.loss(), pctx, config.model.vocab_size, IGNORE_INDEX),
    targets=_preference_targets, precomputed_reference=lambda config: config.preference.loss().needs_reference,
    perplexity=False, metrics=preference_metrics, log_line=_preference_line, whole_logits=True)

GRPO = Objective(
    name="grpo", data_type="prompts", section="grpo", rows_per_sample=lambda config: 1,
    sample_unit=lambda config: " completions", check=_check_grpo,
    loss=lambda config, pctx: GRPOLoss(config.grpo.loss(), pctx, config.model.vocab_size, config.grpo.temperature,
                                       on_policy=config.grpo.num_iterations == 1, ignore_index=IGNORE_INDEX),
    targets=_grpo_targets, precomputed_reference=lambda config: False, perplexity=False, metrics=grpo_metrics,
    log_line=_grpo_line, whole_logits=True, check_prepared=_check_grpo_prepared, rollout=True,
    rollout_bytes=_grpo_rollout_bytes,
    # full fine-tuning with beta > 0: the starting weights (a LoRA run's reference is its base, adapters off)
    holds_reference_weights=lambda config: config.grpo.beta != 0.0 and config.lora is None)

OBJECTIVES = (TOKEN_LOSS, PREFERENCE, GRPO)


def objective_of(config) -> Objective:
    """The record of ``config``'s objective (its data type's, else the token loss)."""
    for objective in OBJECTIVES:
        if objective.data_type == config.data.type:
            return objective
    return TOKEN_LOSS


def check_objective(config) -> None:
    """The run's objective's settings; another objective's section set (differing from its defaults) is an error,
    since nothing would read it."""
    running = objective_of(config)
    for objective in OBJECTIVES:
        section = objective.section
        settings = None if section is None else getattr(config, section)
        if objective is not running and settings is not None and settings != type(settings)():
            raise ConfigError(f"the {section} section sets the loss of the {objective.name} objective, and data.type is "
                              f"{config.data.type!r}: set data.type {objective.data_type}, or leave the section out")
    running.check(config)
