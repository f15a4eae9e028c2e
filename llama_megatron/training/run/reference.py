"""The reference's log-probabilities of every preference pair, computed once before training (TRL's
``precompute_ref_log_probs``), so that no second model is held: a forward pass of the starting weights (a LoRA
run's base: adapters off) over the pairs of the train and validation splits, under the run's own layout, engine and
precision.

The table ([pairs of the data, 2]: chosen, rejected, by the pair's sample id) is stored in the data's cache
directory under a key of what it depends on (the starting weights, the shards, the truncation, the rows, the
precision), so a later run from the same start on the same data reuses it; a run that saves checkpoints writes the
key into its save directory (``preference_reference.json``), where a resume finds which table is its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import socket
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from llama_megatron.checkpoint.atomic import write_text_atomic
from llama_megatron.checkpoint.lora_checkpoint import fingerprint
from llama_megatron.errors import CheckpointError
from llama_megatron.model.lora import adapters_off
from llama_megatron.temps import reclaim_temps
from llama_megatron.training.engine.deepspeed_config import precision
from llama_megatron.training.faults.watchdog import StallWatchdog
from llama_megatron.training.run.batches import step_batches
from llama_megatron.training.run.setup import Session

RECORD_FILE = "preference_reference.json"
TABLE_DIR = "reference-logps"


class _Rows:
    """The first ``rows`` rows of a dataset, repeated up to ``size``: the repeats' pairs are marked (negative
    ids) so that no result is written twice."""

    def __init__(self, dataset, rows: int, size: int) -> None:
        self.dataset, self.rows, self.size = dataset, rows, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        item = dict(self.dataset[i % self.rows])
        if i >= self.rows:
            item["pair_ids"] = -1 - item["pair_ids"]
        return item


def _start(session: Session) -> dict:
    """What the starting weights are: a checkpoint's fingerprint (a LoRA run's base), or the seeded model."""
    pre, config = session.pre, session.config
    if pre.lora_base is not None:
        return {"base": pre.lora_base.fingerprint}
    if pre.checkpoint is not None:
        return {"checkpoint": fingerprint(pre.load_dir, pre.checkpoint.tag)}
    return {"seed": config.seed, "model": config.model.to_dict()}


def reference_key(session: Session) -> str:
    config = session.config
    data = config.data
    truncation = data.pair_truncation(config.seq_length)
    description = {"version": 1, "start": _start(session), "shards": data.shards_fingerprint(),
                   "max_length": truncation.max_length, "keep_end": truncation.keep_end, "pack": data.pack,
                   "seq_length": config.seq_length, "precision": precision(session.pre.ds_config)}
    if config.fp8 is not None:  # the reference's GEMMs in float8: not a bf16 run's table
        description["fp8"] = dataclasses.asdict(config.fp8)
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:24]


def _table_path(session: Session, key: str) -> str:
    return os.path.join(session.config.data.cache_directory(), TABLE_DIR, f"{key}.npy")


def _resumed_key(session: Session) -> str:
    """The key a resumed run's checkpoint directory recorded at its start."""
    record = os.path.join(session.pre.load_dir, RECORD_FILE)
    try:
        with open(record, encoding="utf-8") as fh:
            return str(json.load(fh)["key"])
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{record} is missing or unreadable: a preference run resumes with the reference "
                              "log-probabilities of its start, which it names") from None


def prepare_reference(session: Session, datasets: list, log, evaluation: bool = False,
                      watchdog: StallWatchdog | None = None) -> None:
    """Set ``session.engine.reference_logps``: read the stored table of this run's start (a resume, or the
    evaluation of a preference run's checkpoint: the one its directory names), or compute and store it (a pass
    longer than the watchdog's timeout is progress: it beats at every forward, as an evaluation does)."""
    config, engine = session.config, session.engine
    resumed = session.pre.checkpoint is not None and not config.checkpoint.finetune and (
        session.step > 0 or evaluation)
    key = _resumed_key(session) if resumed else reference_key(session)
    path = _table_path(session, key)
    if os.path.isfile(path):
        table = np.load(path, allow_pickle=False)
        log.info(f"reference log-probabilities of {table.shape[0]:,} pairs read from {path}")
    elif resumed:
        raise CheckpointError(f"{path} (the reference log-probabilities this run started with) is gone: they "
                              "cannot be made again from moved weights; restart from the starting checkpoint")
    else:
        with (watchdog.working(session.step, "the reference log-probabilities") if watchdog else
              contextlib.nullcontext()) as progress:
            table = compute_reference(session, datasets, progress)
        if session.pctx.rank == 0:
            store_table(path, table)
        log.info(f"reference log-probabilities of {table.shape[0]:,} pairs computed, stored in {path}")
    if config.checkpoint.save and session.pctx.rank == 0 and not evaluation:
        os.makedirs(config.checkpoint.save, exist_ok=True)
        write_text_atomic(os.path.join(config.checkpoint.save, RECORD_FILE), json.dumps({"key": key, "table": path}))
    engine.reference_logps = torch.from_numpy(np.asarray(table, dtype=np.float32))


def store_table(path: str, table: np.ndarray) -> None:
    """Write ``table`` to ``path`` through a temp file named by this host and pid, after removing what a killed
    writer on this host left (a live writer's, and another host's sharing the cache directory, stay)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    host = socket.gethostname()
    reclaim_temps(directory, rf"[0-9a-f]+\.npy\.tmp-{re.escape(host)}-(?P<pid>\d+)")
    tmp = f"{path}.tmp-{host}-{os.getpid()}"
    with open(tmp, "wb") as fh:
        np.save(fh, table, allow_pickle=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@torch.no_grad()
def compute_reference(session: Session, datasets: list, progress: Callable[[], None] | None = None) -> np.ndarray:
    """The table ([pairs, 2], float64): every pair of ``datasets`` (their first epoch) run forward in global
    batches, each DP rank its share; the loss ranks fill the rows of their pairs, one all-reduce gathers them.
    ``progress`` is called before each forward of the model (the watchdog's beat)."""
    config, engine, pctx = session.config, session.engine, session.pctx
    table = torch.zeros(config.data.pair_count(), 2, dtype=torch.float64)
    loss_fn = engine.model.loss_fn
    writes = engine.holds_loss() and pctx.tp_rank == 0 and pctx.cp_rank == 0
    engine.reference_logps = None
    global_batch = config.batch.global_batch_size
    with adapters_off(engine.model):
        for dataset in datasets:
            if dataset is None:
                continue
            rows = min(len(dataset), dataset.stats["rows_per_epoch"])
            steps = math.ceil(rows / global_batch)
            for micro_batches in step_batches(_Rows(dataset, rows, steps * global_batch), config, pctx, 0, steps):
                loss_fn.objective.captured = []
                engine.eval_loss(micro_batches, progress)
                collected, loss_fn.objective.captured = loss_fn.objective.captured, None
                if not writes:
                    continue
                for mb, logps in zip(micro_batches, collected, strict=True):
                    kept = mb.pair_ids >= 0
                    table[mb.pair_ids[kept]] = logps.double().cpu().view(-1, 2)[kept]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    return table.numpy()
