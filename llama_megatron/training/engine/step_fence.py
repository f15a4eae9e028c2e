"""Engine mixin: a wait right before the optimizer step, the one point where the weights and optimizer state change.

An asynchronous save captures the state at a step boundary and copies it to host memory while the next step's
forward and backward passes run (training/background_save.py); the copy must be complete before the state it reads
changes. DeepSpeed's engines change it only in ``_take_model_step`` (the plain engine's ``step`` at a gradient
accumulation boundary, the pipeline engine's optimizer-step instruction), so that is where both of ours wait.
"""

from __future__ import annotations

from collections.abc import Callable


class ModelStepFence:
    """``before_model_step``, when set, is called (and returns) before every optimizer step of the engine."""

    before_model_step: Callable[[], None] | None = None

    def _take_model_step(self, lr_kwargs, *args, **kwargs):
        if self.before_model_step is not None:
            self.before_model_step()
        return super()._take_model_step(lr_kwargs, *args, **kwargs)
