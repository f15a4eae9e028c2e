"""The pretraining loop on a session from :mod:`llama_megatron.training.run.setup`: train, evaluate, log, save."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

from llama_megatron.errors import ConfigError
from llama_megatron.parallel.placement import launcher_chain, placement
from llama_megatron.parallel.process_groups import barrier
from llama_megatron.training.checkpointer import Checkpointer
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.diagnostics.profiling import StepProfiler
from llama_megatron.training.engine.deepspeed_config import precision, zero_stage
from llama_megatron.training.faults.guard import StepGuard
from llama_megatron.training.faults.preemption import StopRequests
from llama_megatron.training.faults.watchdog import StallWatchdog, job_store
from llama_megatron.training.objectives import objective_of
from llama_megatron.training.resume import finished_run
from llama_megatron.training.run.batches import build_datasets, step_batches
from llama_megatron.training.run.metrics import Cadence, StepMeter, start_line
from llama_megatron.training.run.reference import prepare_reference
from llama_megatron.training.run.rollout import Rollout
from llama_megatron.training.run.setup import Session, open_session


def evaluate(session: Session, valid_ds, progress: Callable[[], None] | None = None) -> dict:
    """Loss and perplexity over ``eval.iters`` global batches of the validation split (from its start);
    ``progress`` is called at each forward pass (the watchdog's beat)."""
    config = session.config
    if valid_ds is None:
        raise ConfigError("evaluation needs a validation split (data.split gives it no documents)")
    batches = [mb for batch in step_batches(valid_ds, config, session.pctx, 0, config.eval.iters) for mb in batch]
    loss = session.engine.eval_loss(batches, progress)
    if not objective_of(config).perplexity:  # a preference loss is no token mean
        return {"val_loss": loss}
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


def run_evaluation(config: TrainingConfig, ds_source=None) -> dict:
    """Evaluate ``checkpoint.load`` (or the seeded model) on the validation split; one metrics record."""
    session = open_session(config, ds_source, mode="evaluate")
    _, valid_ds, _ = build_datasets(config, session.pre.eod_id)
    if objective_of(config).precomputed_reference(config):
        prepare_reference(session, [valid_ds], session.log, evaluation=True)
    result = {"step": session.step, **evaluate(session, valid_ds)}
    ppl = f" | val ppl {result['val_ppl']:.3f}" if "val_ppl" in result else ""
    session.log.log(session.step, result, f"eval step {session.step} | val loss {result['val_loss']:.6f}{ppl}")
    session.close()
    return result


def run_pretraining(config: TrainingConfig, ds_source=None, eval_only: bool = False,
                    profiler: StepProfiler | None = None) -> dict:
    """Train ``config``'s run; ``profiler`` (``llama-megatron profile``) records the steps it was asked for."""
    if eval_only:
        return run_evaluation(config, ds_source)
    finished = finished_run(config)
    if finished is not None:
        if placement().rank == 0:
            print(f"nothing to train: {config.checkpoint.save}/{finished.tag} holds this run at step {finished.step} "
                  f"of train.steps {config.train.steps}; to train it again from the start set checkpoint.overwrite "
                  "true, to train it on raise train.steps", flush=True)
        return {"step": finished.step}
    session = open_session(config, ds_source)
    try:
        return _train(session, config, profiler)
    finally:
        session.close()


def _train(session: Session, config: TrainingConfig, profiler: StepProfiler | None = None) -> dict:
    run = _TrainingRun(session, config)
    if profiler:
        engine = session.engine
        profiler.attach(session.pctx, precision(session.pre.ds_config), engine.engine if engine.pipelined else None)
    try:
        run.prepare()
        if run.rollout is not None:  # the policy generates each step's batches
            batches = run.rollout.step_batches(run.step, config.train.steps)
        else:
            batches = step_batches(run.train_ds, config, session.pctx, run.consumed, config.train.steps - run.step)
        while True:
            with profiler.step(run.step + 1) if profiler else contextlib.nullcontext():
                with profiler.data() if profiler else contextlib.nullcontext():
                    micro_batches = next(batches, None)
                if micro_batches is None or not run.train_step(micro_batches):
                    break
            if profiler and profiler.done(run.step):
                break
        run.finish()
    finally:
        run.close()
    return {"step": run.step, **run.last_metrics}


class _TrainingRun:
    """One training run's state between steps: its position, the step guard, stop requests, the stall watchdog,
    the saves (:class:`Checkpointer`) and the throughput window (:class:`StepMeter`)."""

    def __init__(self, session: Session, config: TrainingConfig) -> None:
        self.session, self.config, self.engine, self.log = session, config, session.engine, session.log
        self.step, self.consumed = session.step, session.consumed_samples
        pctx, train = session.pctx, config.train
        self.train_ds, self.valid_ds, _ = build_datasets(config, session.pre.eod_id)
        for split, ds in (("train", self.train_ds), ("valid", self.valid_ds)):
            describe = getattr(ds, "describe", None)  # SFT datasets count truncated/dropped samples and row filling
            if describe is not None:
                self.log.info(f"{split} data: {describe()}")
        self.log.info(start_line(config, pctx, self.engine.device.type, zero_stage(session.pre.ds_config),
                                 self.step + 1))
        self.guard = StepGuard(train.max_bad_steps, train.loss_spike_factor, train.loss_spike_window,
                               self.engine.device)
        self.stops = StopRequests(train.stop_signals, train.max_minutes, launcher_chain())
        self.watchdog = StallWatchdog(config.distributed.timeout_minutes, pctx.rank, pctx.world_size,
                                      (pctx.pp_rank, pctx.pp_size), *job_store(config.distributed.timeout_minutes))
        self.rollout = Rollout(session, self.log, self.watchdog) if objective_of(config).rollout else None
        self.saves = Checkpointer(self.engine, config, pctx, session.pre.ds_config, session.pre.checkpoint_lora(),
                                  session.pre.run_start, self.log, self.watchdog,
                                  self.rollout.rank_state if self.rollout is not None else None)
        self.meter = StepMeter(config, pctx.world_size, self.step)
        if self.meter.peak:
            self.log.info(f"MFU against {self.meter.peak:,.4g} TFLOP/s per device: {self.meter.peak_source}")
        self.skipped = self.engine.skipped_steps
        self.last_metrics: dict = {}
        self.train_seconds = 0.0  # the last step's forward, backward and optimizer step (GRPO logs it)

    def prepare(self) -> None:
        if objective_of(self.config).precomputed_reference(self.config):
            prepare_reference(self.session, [self.train_ds, self.valid_ds], self.log, watchdog=self.watchdog)
        self.watchdog.beat(self.step + 1, "reading its batches")

    def train_step(self, micro_batches) -> bool:
        """One optimizer step and what is due after it (checks, evaluation, log line, save); False to stop."""
        engine, watchdog = self.engine, self.watchdog
        watchdog.beat(self.step + 1, "forward, backward and optimizer step")
        lr = engine.learning_rate()
        started = time.perf_counter()
        loss_on_device = engine.train_step(micro_batches)  # read at check points only: reading syncs the host
        self.train_seconds = time.perf_counter() - started
        self.step += 1
        watchdog.beat(self.step, "the end-of-step checks")
        self.consumed += self.config.batch.global_batch_size
        self.meter.stepped()
        self.guard.record(self.step, loss_on_device, engine.grad_norm(), engine.skipped_steps > self.skipped)
        self.skipped = engine.skipped_steps
        stop = self.stops.poll()
        self.saves.settle(self.step, wait=False)
        due = Cadence.at(self.config, self.step)
        if due.log or due.save or stop:
            stop = self._checks_and_records(due, stop, lr)
        if stop:
            return False
        watchdog.beat(self.step + 1, "reading its batches")
        return True

    def _checks_and_records(self, due: Cadence, stop: str | None, lr: float) -> str | None:
        """The guard's verdict on the steps since the last check, then the evaluation, log line and save due; the
        stop request that ends the run here, if any (the guard's own end raises once its step is logged)."""
        reports = self.guard.check()
        for report in reports[:-1]:
            if report.bad:
                self.log.info(f"step {report.step}: bad step ({'; '.join(report.reasons)})")
        if self.guard.exhausted:  # log the step that ends the run, then stop (below)
            due, stop = Cadence(evaluate=False, save=False, log=True), None
        extras: dict = {}
        if due.evaluate:
            with self.watchdog.working(self.step, "evaluation") as progress:
                extras.update(evaluate(self.session, self.valid_ds, progress))
            if self.config.eval.tasks_due(self.step):
                with self.watchdog.working(self.step, "lm-eval tasks"):
                    extras.update(self._tasks())
        if due.log:  # read where logged only: each is an all-reduce over the world
            objective = self.engine.objective_metrics()
            if self.rollout is not None:  # the generation this step trained on, and the step's training apart
                objective = {**self.rollout.metrics, **(objective or {}), "train_s": self.train_seconds}
            extras.update(expert_load=self.engine.expert_load(), objective=objective, fp8=self.engine.fp8_stats())
            metrics, line = self.meter.record(reports[-1], lr, self.consumed, extras)
            self.log.log(reports[-1].step, metrics, line)
            self.last_metrics = metrics
        if self.guard.exhausted:
            self.saves.settle(self.step, wait=True)
        self.guard.stop()  # TrainingStopped (exit 3) after train.max_bad_steps bad steps in a row, once logged
        save = self.config.checkpoint
        saved = self.saves.save(self.step, self.consumed, self.guard) if due.save or (stop and save.save) else None
        if stop:
            self.saves.settle(self.step, wait=True)
            where = (f"saved checkpoint {save.save}/{saved}" if saved else
                     "nothing saved (no checkpoint.save)" if not save.save else "nothing saved")
            self.log.info(f"stopped at step {self.step} on {stop}: {where}; the same command with checkpoint.load "
                          "auto continues from there")
        return stop

    def _tasks(self) -> dict:
        """``eval.tasks`` on the model being trained (docs/evaluation.md): each task's metrics, and their seconds,
        which the tokens/s of the window leaves out."""
        start = time.perf_counter()  # the first evaluation's import of lm-eval (seconds) is the tasks' time too
        from llama_megatron.training.run.lm_harness import task_metrics

        metrics = task_metrics(self.session.config, self.session.pctx, self.engine.engine.module, self.step)
        seconds = time.perf_counter() - start
        self.meter.exclude(seconds)
        return {**metrics, "tasks_s": seconds}

    def finish(self) -> None:
        self.saves.settle(self.step, wait=True)  # beats "the last save's files" while a save is in flight
        self.watchdog.beat(self.step, "the final barrier")
        barrier()

    def close(self) -> None:
        self.stops.close()
        self.watchdog.close()
