"""GRPO's loss family and advantages (llama_megatron/model/grpo.py) against TRL 1.16's ``GRPOTrainer``: its own
``_compute_loss`` run on the same per-token log-probabilities (a stand-in trainer object carries the settings; the
log-probabilities come in where TRL would compute them from its model), the step cut into TRL's processes and
accumulated micro batches, against our micro batches' sum. Loss, its gradient with respect to every token's
log-probability, KL and clip fractions, for each loss type, beta 0 and > 0, a second pass (old log-probabilities
apart from the current ones), GSPO's sequence-level ratio, two-sided clipping and truncated completions masked out.
One process, no model."""

from __future__ import annotations

import collections
import types

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

from llama_megatron.model.grpo import (
    LOSS_TYPES,
    GRPOLossConfig,
    GRPOStepCounts,
    group_advantages,
    high_entropy_mask,
    masked_sums,
    micro_batch_loss,
    token_losses,
)

PROCESSES, ACCUMULATION, PER_DEVICE, TOKENS = 2, 2, 3, 7  # TRL's step: 2 processes x 2 micro batches of 3
# float64 throughout: TRL's code and ours order the same sums differently (a micro batch's mean of means against
# the step's sum); in float64 that leaves ~1e-16, so 1e-12 holds on any CPU
TOL = dict(rtol=1e-12, atol=1e-12)


def _trl_trainer(config: GRPOLossConfig, logps: torch.Tensor, entropies: torch.Tensor) -> types.SimpleNamespace:
    """What ``GRPOTrainer._compute_loss`` reads of its trainer, for one process of ``PROCESSES`` and a micro batch
    whose log-probabilities and entropies are ``logps`` and ``entropies`` (where TRL would run its model)."""
    args = types.SimpleNamespace(use_bias_correction_kl=config.use_bias_correction_kl, delta=config.delta,
                                 steps_per_generation=ACCUMULATION)
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
        top_entropy_quantile=config.top_entropy_quantile, off_policy_mask_threshold=None, loss_type=config.loss_type, beta=config.beta,
        importance_sampling_level=config.importance_sampling_level, epsilon_low=config.epsilon,
        epsilon_high=config.upper, args=args, use_vllm=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=ACCUMULATION, max_completion_length=config.max_completion_length,
        accelerator=types.SimpleNamespace(num_processes=PROCESSES, gather=lambda x: x, reduce=lambda x, **k: x,
                                          gather_for_metrics=lambda x: x, pad_across_processes=lambda x, **k: x),
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
    trainer.get_high_entropy_mask = lambda *a: GRPOTrainer.get_high_entropy_mask(trainer, *a)
    return trainer


def _step(seed: int) -> dict[str, torch.Tensor]:
    """One optimizer step's completions: log-probabilities now, at generation time and of the reference;
    advantages; trained tokens (completions of different lengths, one truncated completion masked whole)."""
    gen = torch.Generator().manual_seed(seed)
    n = PROCESSES * ACCUMULATION * PER_DEVICE
    logps = -torch.rand(n, TOKENS, generator=gen, dtype=torch.float64) * 3
    lengths = torch.randint(1, TOKENS + 1, (n,), generator=gen)
    lengths[4] = 0  # a truncated completion, masked out (mask_truncated_completions)
    return {"logps": logps, "old": logps + 0.3 * torch.randn(n, TOKENS, generator=gen, dtype=torch.float64),
            "ref": logps + 0.2 * torch.randn(n, TOKENS, generator=gen, dtype=torch.float64),
            "advantages": torch.randn(n, generator=gen, dtype=torch.float64),
            "entropies": torch.rand(n, TOKENS, generator=gen, dtype=torch.float64) * 5,
            "mask": (torch.arange(TOKENS) < lengths.unsqueeze(1)).to(torch.float64)}


def _trl_step(config: GRPOLossConfig, step: dict, second_pass: bool) -> tuple[torch.Tensor, torch.Tensor, list]:
    """TRL's step loss (the mean over processes of each one's accumulated micro-batch losses), its gradient with
    respect to the log-probabilities, and each micro batch's metrics."""
    logps = step["logps"].clone().requires_grad_(True)
    total, metrics = 0.0, []
    for start in range(0, logps.shape[0], PER_DEVICE):
        rows = slice(start, start + PER_DEVICE)
        trainer = _trl_trainer(config, logps[rows], step["entropies"][rows])
        inputs = {"prompt_ids": torch.zeros(PER_DEVICE, 1, dtype=torch.long),
                  "prompt_mask": torch.ones(PER_DEVICE, 1, dtype=torch.long),
                  "completion_ids": torch.zeros(PER_DEVICE, TOKENS, dtype=torch.long),
                  "completion_mask": step["mask"][rows], "advantages": step["advantages"][rows],
                  "num_items_in_batch": step["mask"].sum()}
        if second_pass:
            inputs["old_per_token_logps"] = step["old"][rows]
        if config.beta:
            inputs["ref_per_token_logps"] = step["ref"][rows]
        total = total + GRPOTrainer._compute_loss(trainer, None, inputs) / PROCESSES
        metrics.append({k: v[0] for k, v in trainer._metrics["train"].items()})
    total.backward()
    return total.detach(), logps.grad, metrics


def _our_step(config: GRPOLossConfig, step: dict, second_pass: bool) -> tuple[torch.Tensor, torch.Tensor, list]:
    logps = step["logps"].clone().requires_grad_(True)
    counts = GRPOStepCounts(completions=logps.shape[0], tokens=float(step["mask"].sum()),
                            micro_batches=PROCESSES * ACCUMULATION)
    total, metrics = 0.0, []
    for start in range(0, logps.shape[0], PER_DEVICE):
        rows = slice(start, start + PER_DEVICE)
        old = step["old"][rows] if second_pass else logps[rows].detach()
        keep = None  # one process here: the threshold over the micro batch's tokens, as TRL's over its call's
        if config.top_entropy_quantile < 1:
            keep = high_entropy_mask(step["entropies"][rows], step["mask"][rows].bool(), 1 - config.top_entropy_quantile)
        losses = token_losses(logps[rows], old, step["advantages"][rows], step["mask"][rows], config,
                              step["ref"][rows] if config.beta else None, keep=keep)
        total = total + micro_batch_loss(losses.loss, step["mask"][rows], config, counts)
        mask = step["mask"][rows]
        ratio = {"kl": losses.kl, "clip_ratio/low_mean": losses.low_clipped,
                 "clip_ratio/high_mean": losses.high_clipped,
                 "clip_ratio/region_mean": losses.low_clipped | losses.high_clipped}
        if config.loss_type == "cispo":
            ratio = {"kl": losses.kl, "cispo_clip_ratio": losses.high_clipped}
        metrics.append({k: float(s / c.clamp(min=1.0)) for k, v in ratio.items() if v is not None
                        for s, c in [masked_sums(v.to(torch.float64), mask)]})
    total.backward()
    return total.detach(), logps.grad, metrics


CASES = {  # name: (settings beside loss_type, second pass)
    "first-pass": ({}, False),
    "second-pass": ({}, True),
    "kl-second-pass": ({"beta": 0.04}, True),
    "kl-uncorrected": ({"beta": 0.1, "use_bias_correction_kl": False}, True),
    "two-sided-asymmetric": ({"epsilon_high": 0.28, "delta": 1.5}, True),
    "two-sided-capped": ({"epsilon_high": 0.28, "delta": 1.1}, True),  # delta under 1 + epsilon_high: no high clip
    "entropy-quantile": ({"top_entropy_quantile": 0.3, "beta": 0.04}, True),  # the KL term on every token
    "gspo": ({"importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4}, True),
    "gspo-kl": ({"importance_sampling_level": "sequence", "beta": 0.04}, True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_sum_to_trl_grpo_trainers_step(loss_type: str, case: str) -> None:
    settings, second_pass = CASES[case]
    if loss_type == "cispo":  # its clip is the ratio's bound itself (TRL's examples: epsilon_high 5)
        settings = {**settings, "epsilon_high": 5.0, "delta": None}
    config = GRPOLossConfig(loss_type=loss_type, max_completion_length=TOKENS, **settings)
    assert not config.problems()
    step = _step(seed=LOSS_TYPES.index(loss_type) * 10 + list(CASES).index(case))
    want_loss, want_grad, want_metrics = _trl_step(config, step, second_pass)
    loss, grad, metrics = _our_step(config, step, second_pass)
    torch.testing.assert_close(loss, want_loss, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)
    assert grad.abs().sum() > 0 and not grad[4].any()  # the masked completion moves nothing
    for ours, trl in zip(metrics, want_metrics):
        assert set(ours) == {k for k in trl if k in ours} and ours, (ours, trl)
        for key, value in ours.items():
            # TRL forms its clip fractions in float32 (a bool's .float()): one float32 rounding of a fraction
            assert value == pytest.approx(trl[key], rel=1e-7, abs=1e-12), key
    if not second_pass:  # on-policy: every ratio exactly 1, nothing clipped
        logps = step["logps"]
        losses = token_losses(logps, logps.clone(), step["advantages"], step["mask"], config)
        assert torch.equal(losses.ratio, torch.ones_like(losses.ratio))
        assert not losses.low_clipped.any() and not losses.high_clipped.any()


def test_advantages_are_trls_group_and_batch_normalisations() -> None:
    """By hand from TRL's definition: weighted reward sums (a function's None skipped; a completion no function
    scored: NaN reward, advantage 0), minus the group mean, over the group's (or the batch's) sample deviation +
    1e-4; equal rewards in a group give zero advantages."""
    nan = float("nan")
    per_function = torch.tensor([[1.0, 0.5], [0.0, nan], [1.0, 1.0], [nan, nan],  # group 0: one unscorable
                                 [0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], dtype=torch.float64)
    weights = torch.tensor([1.0, 2.0], dtype=torch.float64)
    rewards = [2.0, 0.0, 3.0, None, 1.5, 1.5, 1.5, 1.5]

    def stats(values: list[float]) -> tuple[float, float]:
        mean = sum(values) / len(values)
        return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5

    groups = [stats([r for r in rewards[g * 4:(g + 1) * 4] if r is not None]) for g in range(2)]
    batch = stats([r for r in rewards if r is not None])
    for scale in ("group", "batch", "none"):
        got = group_advantages(per_function, weights, 4, scale)
        want = []
        for i, reward in enumerate(rewards):
            mean, std = groups[i // 4]
            std = batch[1] if scale == "batch" else std
            want.append(0.0 if reward is None else (reward - mean) / (std + 1e-4 if scale != "none" else 1.0))
        torch.testing.assert_close(got.advantages, torch.tensor(want, dtype=torch.float64), **TOL)
        assert torch.isnan(got.rewards[3]) and not got.advantages[4:].any()  # equal rewards: no signal
    # in float32, as TRL holds rewards, the group deviations are its nanstd's bit for bit
    got = group_advantages(per_function.float(), weights.float(), 4)
    torch.testing.assert_close(got.std, nanstd(got.rewards.view(-1, 4), dim=1).repeat_interleave(4), rtol=0, atol=0)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(per_function, weights, 3)


def test_settings_are_checked() -> None:
    assert not GRPOLossConfig().problems()
    assert GRPOLossConfig().upper == 0.2 and GRPOLossConfig(epsilon_high=0.28).upper == 0.28
    bad = GRPOLossConfig(loss_type="sapo", scale_rewards="mean", importance_sampling_level="seq", beta=-1,
                         epsilon=1.0, delta=0.0, max_completion_length=0).problems()
    assert len(bad) == 7, bad
    assert GRPOLossConfig(beta=0.04).needs_reference and not GRPOLossConfig().needs_reference
