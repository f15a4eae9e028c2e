"""The pretraining loop on a session from :mod:`llama_megatron.training.run.setup`: train, evaluate, log, save."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable

from llama_megatron.checkpoint.meta import TMP_PREFIX, CheckpointMeta, step_tag
from llama_megatron.data.sft_config import PreferenceData
from llama_megatron.errors import ConfigError
from llama_megatron.parallel.launch import barrier, launcher_chain, placement
from llama_megatron.training import checkpointing as ckpt
from llama_megatron.training.background_save import BackgroundSaves
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.diagnostics.flops import training_flops_per_token
from llama_megatron.training.engine.deepspeed_config import zero_stage
from llama_megatron.training.faults.guard import StepGuard
from llama_megatron.training.faults.preemption import StopRequests
from llama_megatron.training.faults.watchdog import StallWatchdog, job_store
from llama_megatron.training.pipeline.schedules import analytic_bubble
from llama_megatron.training.run.batches import build_datasets, step_batches
from llama_megatron.training.run.metrics import device_peak_tflops, format_eta
from llama_megatron.training.run.reference import prepare_reference
from llama_megatron.training.run.setup import Preflight, Session, open_session


def evaluate(session: Session, valid_ds, progress: Callable[[], None] | None = None) -> dict:
    """Loss and perplexity over ``eval.iters`` global batches of the validation split (from its start);
    ``progress`` is called at each forward pass (the watchdog's beat)."""
    config = session.config
    if valid_ds is None:
        raise ConfigError("evaluation needs a validation split (data.split gives it no documents)")
    batches = [mb for batch in step_batches(valid_ds, config, session.pctx, 0, config.eval.iters) for mb in batch]
    loss = session.engine.eval_loss(batches, progress)
    if config.data.type == PreferenceData.type:  # a preference loss is no token mean: no perplexity
        return {"val_loss": loss}
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


def run_evaluation(config: TrainingConfig, ds_source=None) -> dict:
    """Evaluate ``checkpoint.load`` (or the seeded model) on the validation split; one metrics record."""
    session = open_session(config, ds_source, mode="evaluate")
    _, valid_ds, _ = build_datasets(config, session.pre.eod_id)
    if config.data.type == PreferenceData.type and config.preference.loss().needs_reference:
        prepare_reference(session, [valid_ds], session.log, evaluation=True)
    result = {"step": session.step, **evaluate(session, valid_ds)}
    ppl = f" | val ppl {result['val_ppl']:.3f}" if "val_ppl" in result else ""
    session.log.log(session.step, result, f"eval step {session.step} | val loss {result['val_loss']:.6f}{ppl}")
    session.close()
    return result


def run_pretraining(config: TrainingConfig, ds_source=None, eval_only: bool = False) -> dict:
    if eval_only:
        return run_evaluation(config, ds_source)
    finished = ckpt.finished_run(config)
    if finished is not None:
        if placement().rank == 0:
            print(f"nothing to train: {config.checkpoint.save}/{finished.tag} holds this run at step {finished.step} "
                  f"of train.steps {config.train.steps}; to train it again from the start set checkpoint.overwrite "
                  "true, to train it on raise train.steps", flush=True)
        return {"step": finished.step}
    session = open_session(config, ds_source)
    try:
        return _train(session, config)
    finally:
        session.close()


def _train(session: Session, config: TrainingConfig) -> dict:
    engine, pctx, log = session.engine, session.pctx, session.log
    step, consumed = session.step, session.consumed_samples
    ds_config = session.pre.ds_config
    train_ds, valid_ds, _ = build_datasets(config, session.pre.eod_id)
    for split, ds in (("train", train_ds), ("valid", valid_ds)):
        describe = getattr(ds, "describe", None)  # SFT datasets count truncated/dropped samples and row filling
        if describe is not None:
            log.info(f"{split} data: {describe()}")

    tokens_per_step = config.batch.global_batch_size * config.rows_per_sample * config.seq_length
    # the full sequence length: under CP each rank attends over whole sequences for 1/CP of the heads, so the
    # step's FLOPs are those of the unsharded model, shared by all world_size ranks (per device: / world size)
    flops_per_step = training_flops_per_token(config.model, config.seq_length) * tokens_per_step
    peak = device_peak_tflops(config.logging.peak_tflops)
    micro_batches = config.gradient_accumulation_steps(pctx.world_size)
    pipe = config.pipeline
    bubble = analytic_bubble(pipe.schedule, pctx.pp_size, micro_batches, pipe.virtual_stages)
    chunks = f", {pipe.virtual_stages} virtual stages per rank" if pipe.virtual_stages > 1 else ""
    schedule = (f" ({pipe.schedule}{chunks}, {micro_batches} micro batches: bubble {100 * bubble:.1f}% at equal "
                "pass costs)" if pctx.pp_size > 1 else "")
    log.info(
        f"training {config.model.num_parameters() / 1e6:.1f}M parameters on {engine.device.type} | tensor {pctx.tp_size} pipeline "
        f"{pctx.pp_size}{schedule} context {pctx.cp_size} "
        f"data {pctx.dp_size} | ZeRO {zero_stage(ds_config)} | global batch "
        f"{config.batch.global_batch_size}{' pairs' if config.rows_per_sample == 2 else ''} x "
        f"{config.rows_per_sample * config.seq_length} tokens | steps {step + 1}..{config.train.steps}"
    )
    train = config.train
    guard = StepGuard(train.max_bad_steps, train.loss_spike_factor, train.loss_spike_window, engine.device)
    stops = StopRequests(train.stop_signals, train.max_minutes, launcher_chain())
    watchdog = StallWatchdog(config.distributed.timeout_minutes, pctx.rank, pctx.world_size,
                             (pctx.pp_rank, pctx.pp_size), *job_store(config.distributed.timeout_minutes))
    last_metrics: dict = {}
    background = BackgroundSaves() if config.checkpoint.async_save else None
    if background is not None:  # a save's host copy runs beside the next step until its optimizer step
        engine.engine.before_model_step = background.writer.wait_copied
    pending: ckpt.PendingSave | None = None  # an asynchronous save in flight (at most one)

    def settle(wait: bool) -> None:
        """Finish the save in flight when every rank's files are written (``wait``: now); its failure ends the run."""
        nonlocal pending
        if pending is None:
            return
        # waiting for the writers: their files growing is this rank's progress
        with watchdog.working(step, "the last save's files", pending.tmp_dir) if wait else contextlib.nullcontext():
            if pending.complete(wait):
                log.info(f"saved checkpoint {pending.where} (written in the background from a host copy of "
                         f"{pending.host_copy_bytes / 2**20:.3f} MiB on the largest rank)")
                pending = None

    start_step = step
    window_start, window_steps, run_start = time.perf_counter(), 0, time.perf_counter()
    save = config.checkpoint
    skipped = engine.skipped_steps
    try:
        if config.data.type == PreferenceData.type and config.preference.loss().needs_reference:
            prepare_reference(session, [train_ds, valid_ds], log, watchdog=watchdog)
        watchdog.beat(step + 1, "reading its batches")
        for micro_batches in step_batches(train_ds, config, pctx, consumed, train.steps - step):
            watchdog.beat(step + 1, "forward, backward and optimizer step")
            lr = engine.learning_rate()
            loss_on_device = engine.train_step(micro_batches)  # read at check points only: reading syncs the host
            step += 1
            watchdog.beat(step, "the end-of-step checks")
            consumed += config.batch.global_batch_size
            window_steps += 1
            guard.record(step, loss_on_device, engine.grad_norm(), engine.skipped_steps > skipped)
            skipped = engine.skipped_steps
            stop = stops.poll()
            settle(wait=False)
            evaluate_now = bool(config.eval.interval) and step % config.eval.interval == 0
            save_now = bool(save.save and save.interval) and (step % save.interval == 0 or step == train.steps)
            # step 1 too: the starting loss (ln of the vocabulary for a new model) is the curve's first point
            log_now = step % config.logging.interval == 0 or step in (1, train.steps) or evaluate_now
            if not (log_now or save_now or stop):
                watchdog.beat(step + 1, "reading its batches")
                continue
            reports = guard.check()
            for report in reports[:-1]:
                if report.bad:
                    log.info(f"step {report.step}: bad step ({'; '.join(report.reasons)})")
            if guard.exhausted:  # log the step that ends the run, then stop (below)
                evaluate_now = save_now = False
                stop, log_now = None, True
            metrics: dict = {}
            if evaluate_now:
                with watchdog.working(step, "evaluation") as progress:
                    metrics.update(evaluate(session, valid_ds, progress))
            if log_now:
                last = reports[-1]
                elapsed = time.perf_counter() - window_start
                tokens_per_s = tokens_per_step * window_steps / elapsed
                tflops = flops_per_step * window_steps / elapsed / 1e12 / pctx.world_size
                seconds_per_step = (time.perf_counter() - run_start) / (step - start_step)
                metrics.update(loss=last.loss, lr=lr, grad_norm=last.grad_norm, tokens_per_s=tokens_per_s,
                               tflops_per_device=tflops, mfu=tflops / peak if peak else None,
                               consumed_samples=consumed)
                if last.bad:
                    metrics["bad_step"] = "; ".join(last.reasons)
                load = engine.expert_load()
                if load is not None:
                    metrics["expert_load"] = load
                preference = engine.preference_metrics()
                if preference is not None:
                    metrics.update(preference)
                mfu = f" | MFU {100 * metrics['mfu']:.1f}%" if metrics["mfu"] else ""
                line = (f"step {last.step}/{train.steps} | loss {_fmt(last.loss, 6)} | lr {metrics['lr']:.3e} | grad "
                        f"norm {_fmt(last.grad_norm, 4)} | {tokens_per_s:,.0f} tok/s | {tflops:.3f} TFLOP/s{mfu} | "
                        f"ETA {format_eta(seconds_per_step * (train.steps - step))}")
                if load is not None:  # 1.0: every expert got its share (1 / experts) of the assignments
                    line += f" | expert load max/mean {max(load) * len(load):.2f}"
                if preference is not None:
                    line += (f" | reward margin {preference['rewards/margins']:.4f} accuracy "
                             f"{preference['rewards/accuracies']:.3f}")
                if last.bad:
                    line += f" | bad step: {metrics['bad_step']}"
                if "val_loss" in metrics:
                    line += f" | val loss {metrics['val_loss']:.6f}"
                if "val_ppl" in metrics:
                    line += f" | val ppl {metrics['val_ppl']:.3f}"
                log.log(last.step, metrics, line)
                last_metrics = metrics
                window_start, window_steps = time.perf_counter(), 0
            if guard.exhausted:
                settle(wait=True)
            guard.stop()  # TrainingStopped (exit 3) after train.max_bad_steps bad steps in a row, once logged
            saved = None
            if save_now or (stop and save.save):
                settle(wait=True)  # at most one save in flight: its buffers are the next one's
                # a save longer than distributed.timeout_minutes (a 7B one) beats as its files grow and are hashed
                writing = os.path.join(save.save, TMP_PREFIX + step_tag(step)) if save.save else None
                with watchdog.working(step, "checkpoint save", writing) as progress:
                    saved = _save_if_good(engine, guard, config, pctx, ds_config, step, consumed, log,
                                          session.pre, background, progress)
                if isinstance(saved, ckpt.PendingSave):
                    pending, saved = saved, saved.tag
            if stop:
                settle(wait=True)
                where = (f"saved checkpoint {save.save}/{saved}" if saved else
                         "nothing saved (no checkpoint.save)" if not save.save else "nothing saved")
                log.info(f"stopped at step {step} on {stop}: {where}; the same command with checkpoint.load auto "
                         "continues from there")
                break
            watchdog.beat(step + 1, "reading its batches")
        settle(wait=True)  # beats "the last save's files" while a save is in flight
        watchdog.beat(step, "the final barrier")
        barrier()
    finally:
        stops.close()
        watchdog.close()
    return {"step": step, **last_metrics}


def _save_if_good(engine, guard: StepGuard, config, pctx, ds_config, step, consumed, log, pre: Preflight,
                  background: BackgroundSaves | None = None,
                  progress: Callable[[], None] | None = None) -> str | ckpt.PendingSave | None:
    """Save unless the latest step was bad or left non-finite weights (a poisoned state is never written, so
    ``latest`` and what retention keeps stay good); returns the tag, or None."""
    if not guard.clean:
        log.info(f"not saving a checkpoint at step {step}: the step was bad ({'; '.join(guard.streak[-1].reasons)})")
        return None
    if not engine.parameters_finite():
        log.info(f"not saving a checkpoint at step {step}: the weights are not finite")
        return None
    return _save(engine, config, pctx, ds_config, step, consumed, log, pre, background, progress)


def _save(engine, config, pctx, ds_config, step, consumed, log, pre: Preflight,
          background: BackgroundSaves | None = None,
          progress: Callable[[], None] | None = None) -> str | ckpt.PendingSave:
    meta = CheckpointMeta(
        step=step, consumed_samples=consumed, tensor=pctx.tp_size, pipeline=pctx.pp_size, data_parallel=pctx.dp_size,
        context=pctx.cp_size, expert=pctx.ep_size, zero_stage=zero_stage(ds_config), model=config.model.to_dict(),
        padded_vocab_size=config.local_shapes.padded_vocab_size, lora=pre.checkpoint_lora(),
        layer_placement=config.pipeline.layer_placement(pctx.pp_size), run=config.run_record(pre.run_start),
    )
    saved = ckpt.save_checkpoint(engine, config.checkpoint.save, meta, config.checkpoint.keep_last, pctx, background,
                                 progress)
    if isinstance(saved, ckpt.PendingSave):
        log.info(f"saving checkpoint {saved.where} in the background")
    else:
        log.info(f"saved checkpoint {config.checkpoint.save}/{saved}")
    return saved


def _fmt(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"  # nan and inf print as such
