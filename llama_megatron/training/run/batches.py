"""Dataset samples -> micro batches of this data-parallel rank, resumable at a consumed-sample count."""

from __future__ import annotations

from collections.abc import Iterator

from llama_megatron.data.batch import MicroBatch, collate
from llama_megatron.data.sampler import PretrainingSampler
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.training.config import TrainingConfig


def build_datasets(config: TrainingConfig, eod_id: int | None = None):
    """(train, valid, test) datasets of the run's data section, sized for its steps and evaluations."""
    config.data.prepare(config.tokenizer)
    global_batch = config.batch.global_batch_size
    num_samples = (
        config.train.steps * global_batch,
        config.eval.iters * global_batch if config.eval.interval else 0,
        0,
    )
    return config.data.build(config.seq_length, config.seed, num_samples, config.model.vocab_size, eod_id)


def step_batches(dataset, config: TrainingConfig, pctx: ParallelContext, consumed_samples: int,
                 max_steps: int | None = None) -> Iterator[list[MicroBatch]]:
    """Yield, per optimizer step, this rank's micro batches (Megatron's pretraining sampler order): the samples of
    its DP rank, cut to its context-parallel shard."""
    micro = config.batch.micro_batch_size
    accum = config.batch.accumulation_steps(pctx.dp_size)
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro, pctx.dp_rank, pctx.dp_size)
    step_micro: list[MicroBatch] = []
    steps = 0
    for indices in sampler:
        step_micro.append(collate([dataset[i] for i in indices]).context_shard(pctx.cp_rank, pctx.cp_size))
        if len(step_micro) == accum:
            yield step_micro
            step_micro = []
            steps += 1
            if max_steps is not None and steps >= max_steps:
                return
