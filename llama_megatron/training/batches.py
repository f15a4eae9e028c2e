"""Dataset samples -> micro batches of this data-parallel rank, resumable at a consumed-sample count."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from llama_megatron.data.gpt_dataset import build_train_valid_test_datasets
from llama_megatron.data.sampler import PretrainingSampler
from llama_megatron.data.sampler import collate as stack_samples
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.engine import MicroBatch


def collate(items: list[dict[str, np.ndarray]]) -> MicroBatch:
    """Samples of seq+1 tokens -> inputs tokens[:-1], labels tokens[1:] (plus positions/documents if packed)."""
    arrays = {k: torch.from_numpy(v.astype(np.int64)) for k, v in stack_samples(items).items()}
    tokens = arrays["tokens"]
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    position_ids = arrays.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids).contiguous()
    if "loss_mask" in arrays:
        labels = labels.masked_fill(arrays["loss_mask"] == 0, -100)
    return MicroBatch(input_ids, position_ids, labels, arrays.get("segment_ids"))


def build_datasets(config: TrainingConfig, eod_id: int | None = None):
    global_batch = config.batch.global_batch_size
    num_samples = (
        config.train.steps * global_batch,
        config.eval.iters * global_batch if config.eval.interval else 0,
        0,
    )
    return build_train_valid_test_datasets(config.data, config.seq_length, config.seed, num_samples,
                                           vocab_size=config.model.vocab_size, eod_id=eod_id)


def step_batches(dataset, config: TrainingConfig, pctx: ParallelContext, consumed_samples: int,
                 max_steps: int | None = None) -> Iterator[list[MicroBatch]]:
    """Yield, per optimizer step, this rank's micro batches (Megatron's pretraining sampler order)."""
    micro = config.batch.micro_batch_size
    accum = config.batch.global_batch_size // (micro * pctx.dp_size)
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro, pctx.dp_rank, pctx.dp_size)
    step_micro: list[MicroBatch] = []
    steps = 0
    for indices in sampler:
        step_micro.append(collate([dataset[i] for i in indices]))
        if len(step_micro) == accum:
            yield step_micro
            step_micro = []
            steps += 1
            if max_steps is not None and steps >= max_steps:
                return
