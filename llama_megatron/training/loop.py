"""The pretraining run: validate everything, start process groups, build the engine, loop, evaluate, save."""

from __future__ import annotations

import math
import os
import random
import time

import numpy as np
import torch

from llama_megatron.checkpoint.weights import load_model_weights
from llama_megatron.data.gpt_dataset import validate_data_config
from llama_megatron.errors import ConfigError
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.launch import barrier, init_distributed
from llama_megatron.training import checkpointing as ckpt
from llama_megatron.training.batches import build_datasets, step_batches
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.deepspeed_config import build_deepspeed_config, zero_stage
from llama_megatron.training.engine import TrainingEngine
from llama_megatron.training.flops import training_flops_per_token
from llama_megatron.training.metrics import RunLogger, device_peak_tflops, format_eta


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _check_tokenizer(config: TrainingConfig) -> int | None:
    """Tokenizer ids must fit the model's embedding table; returns its EOD id for per-document attention."""
    if not config.tokenizer:
        return None
    from llama_megatron.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer)
    tokenizer.check_against_model_vocab(config.model.vocab_size)
    return tokenizer.eos_id


def preflight(config: TrainingConfig, ds_source, world_size: int
              ) -> tuple[dict, ckpt.CheckpointMeta | None, int | None]:
    """Every check that needs no process group, so a bad setup fails in seconds with one line.

    Returns the DeepSpeed config, the checkpoint to load (if any) and the tokenizer's EOD id (if any).
    """
    config.validate(world_size)
    validate_data_config(config.data)
    eod_id = _check_tokenizer(config)
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    ds_config = build_deepspeed_config(config, ds_source, world_size, accelerator)
    meta = None
    if config.checkpoint.load:
        meta = ckpt.read_meta(config.checkpoint.load, config.checkpoint.tag)
        if config.checkpoint.finetune and meta.zero_stage < 3:
            # weights are read per (layer, TP rank): any PP, DP and ZeRO stage of this run will do
            ckpt.check_resume_layout(meta, config.parallel.tensor, meta.pipeline, config.checkpoint.load)
        else:
            ckpt.check_resume_layout(meta, config.parallel.tensor, config.parallel.pipeline,
                                     config.checkpoint.load)
        padded = config.parallel.padded_vocab_size(config.model.vocab_size)
        if meta.padded_vocab_size != padded:
            raise ConfigError(
                f"checkpoint {config.checkpoint.load}/{meta.tag} pads the vocab to {meta.padded_vocab_size}, this "
                f"run to {padded}: set parallel.make_vocab_size_divisible_by to match, or reshard the checkpoint"
            )
        if meta.model != config.model.to_dict():
            raise ConfigError(f"checkpoint {config.checkpoint.load}/{meta.tag} holds a different model config "
                              "than this run's model section")
    return ds_config, meta, eod_id


def run_pretraining(config: TrainingConfig, ds_source=None, eval_only: bool = False) -> dict:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ds_config, meta, eod_id = preflight(config, ds_source, world_size)

    init_distributed()
    pctx = ParallelContext.build(config.parallel.tensor, config.parallel.pipeline,
                                 config.parallel.sequence_parallel)
    _seed_everything(config.seed)
    log = RunLogger(pctx.rank == 0, config.output_dir, config.logging.tensorboard_dir,
                    config.logging.wandb_project, config.to_dict())

    load_tag = meta.tag if meta else None
    if meta and not config.checkpoint.finetune and ckpt.needs_universal(meta, pctx.dp_size):
        log.info(f"data parallel {meta.data_parallel} -> {pctx.dp_size}: loading through a universal checkpoint")
        load_tag = ckpt.ensure_universal(config.checkpoint.load, meta.tag, pctx.rank)
        ds_config.setdefault("checkpoint", {})["load_universal"] = True

    load_weights = None
    weights_only = bool(meta) and config.checkpoint.finetune and meta.zero_stage < 3
    if weights_only:
        tag_dir = os.path.join(config.checkpoint.load, meta.tag)
        load_weights = lambda model: load_model_weights(model, tag_dir, config.model, pctx.tp_rank)  # noqa: E731
    engine = TrainingEngine(config, ds_config, pctx, load_weights)
    step, consumed = 0, 0
    if meta:
        if not weights_only:
            ckpt.load_checkpoint(engine, config.checkpoint.load, load_tag, config.checkpoint.finetune)
        if not config.checkpoint.finetune:
            step, consumed = meta.step, meta.consumed_samples
        log.info(f"loaded checkpoint {config.checkpoint.load}/{meta.tag} (step {meta.step})"
                 + (" for fine-tuning" if config.checkpoint.finetune else ""))

    train_ds, valid_ds, _ = build_datasets(config, eod_id)

    def evaluate() -> dict:
        if valid_ds is None:
            raise ConfigError("evaluation needs a validation split (data.split gives it no documents)")
        batches = [mb for batch in step_batches(valid_ds, config, pctx, 0, config.eval.iters) for mb in batch]
        loss = engine.eval_loss(batches)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    if eval_only:
        result = {"step": step, **evaluate()}
        log.log(step, result, f"eval step {step} | val loss {result['val_loss']:.6f} | val ppl {result['val_ppl']:.3f}")
        log.close()
        return result

    tokens_per_step = config.batch.global_batch_size * config.seq_length
    flops_per_step = training_flops_per_token(config.model, config.seq_length) * tokens_per_step
    peak = device_peak_tflops(config.logging.peak_tflops)
    log.info(
        f"training {config.model.num_parameters() / 1e6:.1f}M parameters | tensor {pctx.tp_size} pipeline "
        f"{pctx.pp_size} data {pctx.dp_size} | ZeRO {zero_stage(ds_config)} | global batch "
        f"{config.batch.global_batch_size} x {config.seq_length} tokens | steps {step + 1}..{config.train.steps}"
    )
    last_metrics: dict = {}
    start_step = step
    window_start, window_steps, run_start = time.perf_counter(), 0, time.perf_counter()
    save = config.checkpoint
    for micro_batches in step_batches(train_ds, config, pctx, consumed, config.train.steps - step):
        lr = engine.learning_rate()
        loss = engine.train_step(micro_batches)
        step += 1
        consumed += config.batch.global_batch_size
        window_steps += 1
        metrics: dict = {}
        if config.eval.interval and step % config.eval.interval == 0:
            metrics.update(evaluate())
        if step % config.logging.interval == 0 or step == config.train.steps or metrics:
            elapsed = time.perf_counter() - window_start
            tokens_per_s = tokens_per_step * window_steps / elapsed
            tflops = flops_per_step * window_steps / elapsed / 1e12 / pctx.world_size
            seconds_per_step = (time.perf_counter() - run_start) / (step - start_step)
            metrics.update(loss=loss, lr=lr, grad_norm=engine.grad_norm(),
                           tokens_per_s=tokens_per_s, tflops_per_device=tflops,
                           mfu=tflops / peak if peak else None, consumed_samples=consumed)
            mfu = f" | MFU {100 * metrics['mfu']:.1f}%" if metrics["mfu"] else ""
            line = (f"step {step}/{config.train.steps} | loss {loss:.6f} | lr {metrics['lr']:.3e} | grad norm "
                    f"{_fmt(metrics['grad_norm'])} | {tokens_per_s:,.0f} tok/s | {tflops:.3f} TFLOP/s{mfu} | "
                    f"ETA {format_eta(seconds_per_step * (config.train.steps - step))}")
            if "val_loss" in metrics:
                line += f" | val loss {metrics['val_loss']:.6f} | val ppl {metrics['val_ppl']:.3f}"
            log.log(step, metrics, line)
            last_metrics = metrics
            window_start, window_steps = time.perf_counter(), 0
        if save.save and save.interval and (step % save.interval == 0 or step == config.train.steps):
            _save(engine, config, pctx, ds_config, step, consumed, log)
    barrier()
    log.close()
    return {"step": step, **last_metrics}


def _save(engine, config, pctx, ds_config, step, consumed, log) -> None:
    meta = ckpt.CheckpointMeta(
        step=step, consumed_samples=consumed, tensor=pctx.tp_size, pipeline=pctx.pp_size,
        data_parallel=pctx.dp_size, zero_stage=zero_stage(ds_config), model=config.model.to_dict(),
        padded_vocab_size=config.parallel.padded_vocab_size(config.model.vocab_size),
    )
    tag = ckpt.save_checkpoint(engine, config.checkpoint.save, meta, config.checkpoint.keep_last, pctx.rank)
    log.info(f"saved checkpoint {config.checkpoint.save}/{tag}")


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
