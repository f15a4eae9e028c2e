"""The reference policy of a full fine-tuning GRPO run with ``beta`` > 0: the starting weights, held by each rank as
it holds the policy's (its TP and PP shard; under ZeRO-3 its partition), and swapped in for the reference's forward.
No second model is built: the engine's own module runs with the held tensors in place of its parameters' storage,
then gets its own back. A LoRA run needs none of this: its reference is the base with the adapters off.

A run that saves checkpoints writes the held weights once, at its start, into ``<checkpoint.save>/grpo_reference/``
(a file per rank, weights-only, and the layout they were cut for); a resumed run reads them back from its load
directory, since the starting weights cannot be made again from weights that have moved.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator

import torch

from llama_megatron.checkpoint.atomic import write_text_atomic
from llama_megatron.checkpoint.direct_io import save_direct
from llama_megatron.checkpoint.manifest import fsync_dir
from llama_megatron.checkpoint.safe_load import load_file
from llama_megatron.errors import CheckpointError, SaveFailed
from llama_megatron.temps import reclaim_temps
from llama_megatron.training.background_save import write_failure_line
from llama_megatron.training.checkpointing import all_gather_objects

DIRECTORY = "grpo_reference"


def _storages(param: torch.Tensor) -> list[torch.Tensor]:
    """The tensor a parameter's values live in on this rank: its data, or under ZeRO-3 its partition (what a
    forward gathers the whole parameter from)."""
    partition = getattr(param, "ds_tensor", None)
    return [param if partition is None else partition]


def _release_gathered(params: list[torch.Tensor]) -> None:
    """ZeRO-3: drop every whole parameter a forward left gathered (the persistent small ones, the prefetched), so
    the next forward gathers each from the partitions in place then."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for param in params:
        if getattr(param, "ds_status", None) is ZeroParamStatus.AVAILABLE:
            param.partition()


class HeldReference:
    """This rank's copy of the starting weights of ``module`` (every parameter's local storages, in order)."""

    def __init__(self, module: torch.nn.Module, tensors: list[torch.Tensor] | None = None) -> None:
        self.params = list(module.parameters())
        live = [t for p in self.params for t in _storages(p)]
        if tensors is None:
            tensors = [t.detach().clone() for t in live]
        elif [tuple(t.shape) for t in tensors] != [tuple(t.shape) for t in live]:
            raise CheckpointError("the held reference weights do not fit this run's layout: resume with the layout "
                                  "(tensor, pipeline, data, context, expert degrees and ZeRO stage) of the save")
        self.tensors = [held.to(t.device, t.dtype) for held, t in zip(tensors, live)]

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The module computes with the held weights inside the block, with its own after it."""
        live = [t for p in self.params for t in _storages(p)]
        own = [t.data for t in live]
        _release_gathered(self.params)
        for t, held in zip(live, self.tensors):
            t.data = held
        try:
            yield
        finally:
            _release_gathered(self.params)  # gathered from the held partitions: not the policy's
            for t, mine in zip(live, own):
                t.data = mine


def _layout(pctx, zero: int) -> dict:
    return {"tensor": pctx.tp_size, "pipeline": pctx.pp_size, "data": pctx.dp_size, "context": pctx.cp_size,
            "expert": pctx.ep_size, "zero": zero}


_TEMP = r".*\.tmp\.(?P<pid>\d+)\..*"  # a writer's temp file (what a killed one leaves)


def store(reference: HeldReference, save_dir: str, pctx, zero: int) -> None:
    """Write this rank's held weights under ``save_dir`` (each file under a temp name, fsynced, renamed), then,
    once every rank has, rank 0 the layout; a write that fails on any rank (a full disk) is every rank's
    :class:`SaveFailed`, one line, before training starts."""
    directory = os.path.join(save_dir, DIRECTORY)
    path = os.path.join(directory, f"rank{pctx.rank:05d}.pt")
    error = None
    try:
        os.makedirs(directory, exist_ok=True)
        reclaim_temps(directory, _TEMP)
        fd, tmp = tempfile.mkstemp(prefix=f"rank{pctx.rank:05d}.pt.tmp.{os.getpid()}.", dir=directory)
        os.close(fd)
        try:
            save_direct([t.cpu() for t in reference.tensors], tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        fsync_dir(directory)
    except (OSError, RuntimeError) as exc:
        error = write_failure_line(exc)
    failed = [(rank, e) for rank, e in enumerate(all_gather_objects(error)) if e]
    if failed:
        rank, reason = failed[0]
        raise SaveFailed(f"the GRPO reference weights could not be written to {directory} (rank {rank}): {reason}")
    if pctx.rank == 0:
        write_text_atomic(os.path.join(directory, "layout.json"), json.dumps(_layout(pctx, zero)))
        fsync_dir(directory)


def load(module: torch.nn.Module, load_dir: str, pctx, zero: int) -> HeldReference:
    """The held weights a run's save directory kept for this rank; CheckpointError where they are gone or were cut
    for another layout."""
    directory = os.path.join(load_dir, DIRECTORY)
    try:
        with open(os.path.join(directory, "layout.json"), encoding="utf-8") as fh:
            layout = json.load(fh)
    except (OSError, ValueError):
        raise CheckpointError(f"{directory}/layout.json is missing or unreadable: a GRPO run with grpo.beta > 0 "
                              "resumes with the reference weights of its start, which its save directory keeps") \
            from None
    if layout != _layout(pctx, zero):
        raise CheckpointError(f"{directory} holds the reference weights of a run at {layout}; this one is at "
                              f"{_layout(pctx, zero)}: resume at the layout of the save")
    tensors = load_file(os.path.join(directory, f"rank{pctx.rank:05d}.pt"), mmap=False)
    return HeldReference(module, list(tensors))
