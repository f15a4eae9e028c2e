"""The one owner of a run's saves, as torchtitan's ``CheckpointManager`` owns its run's: which steps are saved, whether
a step may be (a bad step or non-finite weights are never written, so ``latest`` and what retention keeps stay good),
the metadata written beside the weights (position, layout, the run's record), and the background save in flight
(``checkpoint.async_save``: at most one, whose host buffers the next save reuses) with its fence, which holds the
next optimizer step until the weights' host copy is taken. The save protocol itself (temp directory, manifest,
rename, ``latest``, retention) is :func:`llama_megatron.training.checkpointing.save_checkpoint`'s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from llama_megatron.checkpoint.directory import TMP_PREFIX, CheckpointMeta, step_tag
from llama_megatron.training.background_save import BackgroundSaves
from llama_megatron.training.checkpointing import PendingSave, save_checkpoint
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.engine.deepspeed_config import zero_stage
from llama_megatron.training.faults.guard import StepGuard
from llama_megatron.training.faults.watchdog import StallWatchdog


class Checkpointer:
    """Saves of one training run (module docstring). ``lora_section`` and ``run_start`` are what the setup path
    learnt of the run (its adapters' base, where its first step started), recorded in every save; ``log`` has
    ``info``; ``watchdog`` is beaten while files are written; ``rank_state`` gives what else each rank saves (the
    generation in progress of an online RL run)."""

    def __init__(self, engine, config: TrainingConfig, pctx, ds_config: dict[str, Any], lora_section: dict | None,
                 run_start: str | None, log, watchdog: StallWatchdog,
                 rank_state: Callable[[], dict] | None = None) -> None:
        self.engine, self.config, self.pctx, self.ds_config = engine, config, pctx, ds_config
        self.rank_state = rank_state
        self.lora_section, self.run_start, self.log, self.watchdog = lora_section, run_start, log, watchdog
        self.background = BackgroundSaves() if config.checkpoint.async_save else None
        if self.background is not None:  # a save's host copy runs beside the next step until its optimizer step
            engine.engine.before_model_step = self.background.writer.wait_copied
        self.pending: PendingSave | None = None

    def settle(self, step: int, wait: bool) -> None:
        """Finish the save in flight when every rank's files are written (``wait``: now); its failure ends the run."""
        if self.pending is None:
            return
        # waiting for the writers: their files growing is this rank's progress
        files = self.watchdog.working(step, "the last save's files", self.pending.tmp_dir)
        with files if wait else contextlib.nullcontext():
            if self.pending.complete(wait):
                self.log.info(f"saved checkpoint {self.pending.where} (written in the background from a host copy "
                              f"of {self.pending.host_copy_bytes / 2**20:.3f} MiB on the largest rank)")
                self.pending = None

    def save(self, step: int, consumed: int, guard: StepGuard) -> str | None:
        """Save ``step`` unless it was bad or left non-finite weights, after the save in flight has finished; the
        tag (also of a save now written in the background), or None."""
        self.settle(step, wait=True)  # at most one save in flight: its buffers are the next one's
        save_dir = self.config.checkpoint.save
        # a save longer than distributed.timeout_minutes (a 7B one) beats as its files grow and are hashed
        writing = os.path.join(save_dir, TMP_PREFIX + step_tag(step))
        with self.watchdog.working(step, "checkpoint save", writing) as progress:
            if not guard.clean:
                self.log.info(f"not saving a checkpoint at step {step}: the step was bad "
                              f"({'; '.join(guard.streak[-1].reasons)})")
                return None
            if not self.engine.parameters_finite():
                self.log.info(f"not saving a checkpoint at step {step}: the weights are not finite")
                return None
            saved = save_checkpoint(self.engine, save_dir, self.meta(step, consumed), self.config.checkpoint.keep_last,
                                    self.pctx, self.background, progress,
                                    self.rank_state() if self.rank_state is not None else None)
        if isinstance(saved, PendingSave):
            self.log.info(f"saving checkpoint {saved.where} in the background")
            self.pending, saved = saved, saved.tag
        else:
            self.log.info(f"saved checkpoint {save_dir}/{saved}")
        return saved

    def meta(self, step: int, consumed: int) -> CheckpointMeta:
        """What a save of ``step`` records beside the weights: the run's position, its layout and its record."""
        config, pctx = self.config, self.pctx
        return CheckpointMeta(
            step=step, consumed_samples=consumed, tensor=pctx.tp_size, pipeline=pctx.pp_size,
            data_parallel=pctx.dp_size, context=pctx.cp_size, expert=pctx.ep_size, zero_stage=zero_stage(self.ds_config),
            model=config.model.to_dict(), padded_vocab_size=config.local_shapes.padded_vocab_size,
            lora=self.lora_section, layer_placement=config.pipeline.layer_placement(pctx.pp_size),
            run=config.run_record(self.run_start),
        )
