"""The step guard: every step's loss, gradient norm and optimizer skip are checked, and a run that keeps producing
bad steps stops with one line before it can save one of them.

A step is bad when its loss or its gradient norm is not finite, when the optimizer skipped it (DeepSpeed's overflow
check: fp16 loss scaling, ZeRO's inf/NaN check in fp32 and bf16), or, with ``train.loss_spike_factor`` set, when
its loss exceeds that factor times the mean of the last ``train.loss_spike_window`` good losses (Megatron's
spiky-loss check, without its re-run). ``train.max_bad_steps`` consecutive bad steps stop the run (exit code 3);
a checkpoint is written only while the latest step is good (training/run/loop.py). A single fp16 loss-scale skip is
normal, so the default allows two in a row.

The values stay on the device as the step leaves them; :meth:`StepGuard.check` reads every step recorded since the
last check in one transfer (the loop checks on logging, evaluation and save steps, and at the end), and the ranks
agree on which steps were bad with one all-reduce, so all of them stop, or save, after the same step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llama_megatron.errors import TrainingStopped

REASONS = ("loss is not finite", "gradient norm is not finite", "the optimizer skipped the step", "loss spike")


@dataclass
class StepReport:
    """One checked step: its values (as measured, NaN and inf included; grad_norm None where the engine has none)
    and why it was bad, if it was."""

    step: int
    loss: float | None
    grad_norm: float | None
    reasons: tuple[str, ...]

    @property
    def bad(self) -> bool:
        return bool(self.reasons)


class StepGuard:
    def __init__(self, max_bad_steps: int, spike_factor: float | None = None, spike_window: int = 20,
                 device: torch.device | str = "cpu") -> None:
        self.max_bad_steps = max_bad_steps
        self.spike_factor = spike_factor
        self.good_losses: deque[float] = deque(maxlen=spike_window)
        self.device = torch.device(device)
        self.streak: list[StepReport] = []  # the consecutive bad steps up to the last checked one
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor | float | None, bool]] = []

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | float | None, skipped: bool) -> None:
        """A finished step's values, left where they are (no host transfer here)."""
        self._pending.append((step, loss, grad_norm, skipped))

    @property
    def clean(self) -> bool:
        """The latest checked step was good (nothing may be saved otherwise)."""
        return not self.streak and not self._pending

    @property
    def exhausted(self) -> bool:
        """``max_bad_steps`` consecutive bad steps: the run must stop (:meth:`stop`)."""
        return len(self.streak) >= self.max_bad_steps

    def stop(self) -> None:
        """Raise :class:`TrainingStopped` when :attr:`exhausted` (after the caller has logged the steps)."""
        if self.exhausted:
            raise TrainingStopped(self.stop_message())

    def check(self) -> list[StepReport]:
        """Read and judge the steps recorded since the last check (stop judging at the step that exhausts
        ``max_bad_steps``). Every rank must call it at the same steps."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        values = torch.stack([torch.stack([
            loss.detach().float().reshape(()).to(self.device),
            torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32, device=self.device)
            .reshape(()).float(),
        ]) for _, loss, norm, _ in pending]).cpu().tolist()
        reports = []
        flags = []
        window = deque(self.good_losses, maxlen=self.good_losses.maxlen)  # as this rank judges the steps
        for (step, _, norm, skipped), (loss, grad_norm) in zip(pending, values):
            bad = [not math.isfinite(loss), norm is not None and not math.isfinite(grad_norm), skipped,
                   self._spike(loss, window)]
            if not any(bad):
                window.append(loss)
            flags.append([float(b) for b in bad])
            reports.append(StepReport(step, loss, None if norm is None else grad_norm, ()))
        agreed = torch.tensor(flags, dtype=torch.float32, device=self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # any rank's bad step is every rank's
        judged = []
        for report, row in zip(reports, agreed.cpu().tolist()):
            report.reasons = tuple(reason for reason, flag in zip(REASONS, row) if flag)
            judged.append(report)
            if report.bad:
                self.streak.append(report)
                if self.exhausted:
                    break  # the run stops here, whatever the later steps of the window were
            else:
                self.streak.clear()
                self.good_losses.append(report.loss)
        return judged

    def _spike(self, loss: float, window: deque[float]) -> bool:
        if self.spike_factor is None or len(window) < window.maxlen or not math.isfinite(loss):
            return False
        return loss > self.spike_factor * sum(window) / len(window)

    def stop_message(self) -> str:
        first, last = self.streak[0], self.streak[-1]
        reasons = sorted({r for report in self.streak for r in report.reasons}, key=REASONS.index)
        steps = f"step {first.step}" if first is last else f"steps {first.step}-{last.step}"
        return (f"training stopped at step {last.step}: {len(self.streak)} bad steps in a row ({steps}: "
                f"{'; '.join(reasons)}; train.max_bad_steps is {self.max_bad_steps})")
