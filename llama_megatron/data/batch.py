"""What a micro batch carries through DP, TP, SP and PP: the written contract between data and model.

A dataset item (any ``data.type``) is a dict of numpy arrays: ``tokens`` (seq_length + 1), and optionally
``loss_mask`` (seq_length; 0 = the next token is not trained), ``position_ids`` and ``segment_ids``
(seq_length; positions restart and the segment id changes where a packed document starts). :func:`collate`
turns ``micro_batch_size`` items into a :class:`MicroBatch`:

- ``input_ids`` = tokens[:-1], ``labels`` = tokens[1:] with -100 where the loss mask is 0 (ignored by the loss);
- ``position_ids``: the item's, or 0..seq_length-1; ``segment_ids``: the item's, or None (plain causal).

Data parallelism: each DP rank collates its own disjoint items (Megatron's sampler order). Context parallelism:
every CP rank of a DP rank collates the same items and keeps its contiguous shard of ``input_ids`` and ``labels``
(:meth:`MicroBatch.context_shard`); positions and segments stay full length. Tensor and sequence parallelism:
every TP rank gets the same micro batch; under SP the embedding output is what is cut into sequence shards, while
positions, segments and labels stay as they are (attention and the loss see the rank's whole sequence or shard). Pipeline parallelism: the first stage consumes ``(input_ids, position_ids[,
segment_ids])``, the ids travel with the hidden states to every stage, and the last stage consumes ``labels``.
The loss of a step is the mean over the unmasked tokens of its whole global batch, whatever the micro batch
count, DP and PP (training/engine/training_engine.py, "the loss rule").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llama_megatron.data.sampler import collate as stack_samples
from llama_megatron.parallel.context_parallel import context_shard
from llama_megatron.parallel.cross_entropy import IGNORE_INDEX


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    segment_ids: torch.Tensor | None = None
    # preference pairs: the sequence each label belongs to (-1: none), sequence 2k and 2k + 1 the chosen and the
    # rejected one of the micro batch's pair k; and each pair's sample id in its dataset (host)
    sequence_ids: torch.Tensor | None = None
    pair_ids: torch.Tensor | None = None
    # online RL: values per label ([b, s] like ``labels``, host) its objective reads, by name (GRPO's advantages
    # and the log-probabilities of generation time)
    label_values: dict[str, torch.Tensor] | None = None

    def to(self, device) -> MicroBatch:
        """On ``device``; to CUDA through pinned memory without waiting (a plain copy from pageable memory would
        stall the host until the device has finished its queue, once per micro batch)."""
        values = None if self.label_values is None else {k: to_device(v, device) for k, v in self.label_values.items()}
        return MicroBatch(*(None if t is None else to_device(t, device) for t in
                            (self.input_ids, self.position_ids, self.labels, self.segment_ids,
                             self.sequence_ids)), pair_ids=self.pair_ids, label_values=values)

    def pipeline_inputs(self, loss_divisor: torch.Tensor | None = None) -> tuple:
        """``((input_ids, position_ids[, segment_ids]), labels)``, or ``(labels, loss_divisor)`` as the second item:
        what DeepSpeed's pipeline engine feeds the first stage and the last stage's loss_fn."""
        return self.model_inputs(), (self.labels if loss_divisor is None else (self.labels, loss_divisor))

    def model_inputs(self) -> tuple:
        """``(input_ids, position_ids[, segment_ids])``: what the first pipeline stage consumes."""
        inputs = (self.input_ids, self.position_ids)
        if self.segment_ids is not None:
            inputs += (self.segment_ids,)
        return inputs

    def context_shard(self, rank: int, size: int) -> MicroBatch:
        """Context-parallel rank ``rank``'s share: its contiguous shard of ``input_ids`` and ``labels``; the position
        and segment ids stay full length (RoPE takes the shard's true positions from them, and attention, which
        sees whole sequences after its all-to-all, the document boundaries)."""
        if size == 1:
            return self
        sequence_ids = None if self.sequence_ids is None else context_shard(self.sequence_ids, rank, size).contiguous()
        values = None if self.label_values is None else {
            k: context_shard(v, rank, size).contiguous() for k, v in self.label_values.items()}
        return MicroBatch(context_shard(self.input_ids, rank, size).contiguous(), self.position_ids,
                          context_shard(self.labels, rank, size).contiguous(), self.segment_ids, sequence_ids,
                          self.pair_ids, values)

    def num_targets(self) -> int:
        """Labels that count in the loss (not ignored); read on the host, before the batch moves to the device."""
        return int((self.labels != IGNORE_INDEX).sum())


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor goes to CUDA through pinned memory, asynchronously."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def collate(items: list[dict[str, np.ndarray]]) -> MicroBatch:
    """Samples of seq+1 tokens -> inputs tokens[:-1], labels tokens[1:] (plus positions/documents if packed)."""
    if "pair_ids" in items[0]:
        return _collate_pairs(items)
    return _micro_batch({k: torch.from_numpy(v.astype(np.int64)) for k, v in stack_samples(items).items()})


def _collate_pairs(items: list[dict[str, np.ndarray]]) -> MicroBatch:
    """Items of preference pairs (a padded pair's two rows, or a packed row of whole pairs) -> one micro batch
    whose rows are the items' rows in order, the sequences numbered across it (pair k: sequences 2k and 2k + 1)."""
    rows: dict[str, list[np.ndarray]] = {key: [] for key in items[0] if key != "pair_ids"}
    pairs = 0
    for item in items:
        for key, value in item.items():
            if key == "sequence_ids":
                value = np.where(value >= 0, value + 2 * pairs, -1)
            if key != "pair_ids":
                rows[key].append(value.reshape(-1, value.shape[-1]))
        pairs += item["pair_ids"].size
    batch = _micro_batch({k: torch.from_numpy(np.concatenate(v).astype(np.int64)) for k, v in rows.items()})
    batch.pair_ids = torch.from_numpy(np.concatenate([item["pair_ids"] for item in items]).astype(np.int64))
    return batch


def _micro_batch(arrays: dict[str, torch.Tensor]) -> MicroBatch:
    tokens = arrays["tokens"]
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    position_ids = arrays.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids).contiguous()
    if "loss_mask" in arrays:
        labels = labels.masked_fill(arrays["loss_mask"] == 0, IGNORE_INDEX)
    return MicroBatch(input_ids, position_ids, labels, arrays.get("segment_ids"), arrays.get("sequence_ids"))
