"""Training runs with faults injected, for tests/test_training_faults.py (one launch, several runs, like train_many.py).

    deepspeed --num_gpus N tests/scripts/inject_faults.py RUNS.json

RUNS.json is a list of ``{"argv": [...], "expect": exit code, "faults": {...}}``; every run goes through the real
entry point of ``llama_megatron.train``, and the launch fails (exit 1) when a run's exit code is not the expected
one. Faults, each at optimizer steps counted from 1:

- ``"loss": {"STEP": factor}``: the loss divisor of that step multiplied by ``factor`` on every rank that computes
  the loss: ``"nan"`` makes the loss and every gradient NaN, ``0`` makes them infinite, ``0.1`` multiplies them
  by ten (a spike);
- ``"signal": {"step": STEP, "rank": R, "name": "SIGTERM"}``: the signal sent to rank R's own process as that step
  starts (it finishes the step: the run must stop after it);
- ``"file_size": {"save": N, "rank": R, "bytes": B}``: while the N-th checkpoint is written, rank R may write
  files of at most B bytes (RLIMIT_FSIZE, SIGXFSZ ignored: the write fails with EFBIG as on a full disk);
  Under ``checkpoint.async_save`` the limit stays while the background writer writes that save's files;
- ``"write_delay": SECONDS``: every file of an asynchronous save written that much later by the writer thread (so
  steps run, signals arrive and the next save starts while a save is in flight);
- ``"copy_delay": SECONDS``: the writer thread's host copy of an asynchronous save starts that much later (so the
  next step's forward and backward passes run first, and its optimizer step must wait for the copy);
- ``"kill_in_writer": {"save": N, "rank": R}``: rank R's writer thread SIGKILLs its process as it is about to write
  the second file of the N-th (asynchronous) save;
- ``"universal": {"rank": R, "bytes": B}`` the same limit while rank R converts a checkpoint to the universal
  format (its ``ds_to_universal`` process inherits it), or ``{"rank": R, "signal": "SIGSTOP"}`` sent to rank R
  as its conversion starts; ``"progress_seconds"`` sets how often the conversion's progress is logged.
"""

import json
import os
import resource
import signal
import sys
import time

from llama_megatron import train
from llama_megatron.checkpoint.universal import conversion as universal_conversion
from llama_megatron.process_exit import exit_process
from llama_megatron.training import background_save, checkpointer, checkpointing, objectives
from llama_megatron.training.engine.training_engine import TrainingEngine

RANK = int(os.environ.get("RANK", "0"))
FAULTS: dict = {}
_divisor, _train_step, _save = objectives.loss_divisor, TrainingEngine.train_step, checkpointing.save_checkpoint
_convert, _progress_seconds = universal_conversion._convert, universal_conversion.PROGRESS_SECONDS
_saves = [0]


def _next_step(engine) -> int:
    return int(engine.engine.global_steps) + 1


def loss_divisor(engine, micro_batches):
    divisor = _divisor(engine, micro_batches)
    factor = FAULTS.get("loss", {}).get(str(_next_step(engine)))
    if divisor is None or factor is None:
        return divisor
    return divisor * float(factor)


def train_step(self, micro_batches):
    fault = FAULTS.get("signal")
    if fault and fault["step"] == _next_step(self) and fault.get("rank", 0) == RANK:
        os.kill(os.getpid(), getattr(signal, fault.get("name", "SIGTERM")))
    return _train_step(self, micro_batches)


def _with_file_size_limit(limit: int, call, *args, **kwargs):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        return call(*args, **kwargs)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


_submit, _complete = background_save.BackgroundWriter.submit, checkpointing.PendingSave.complete
_lift: list = []  # the file size limit to restore once an asynchronous save is done


def save_checkpoint(engine, save_dir, meta, keep_last, pctx, background=None, progress=None, rank_state=None):
    _saves[0] += 1
    fault = FAULTS.get("file_size")
    if not (fault and fault["save"] == _saves[0] and fault.get("rank", 0) == RANK):
        return _save(engine, save_dir, meta, keep_last, pctx, background, progress, rank_state)
    if background is None:
        return _with_file_size_limit(fault["bytes"], _save, engine, save_dir, meta, keep_last, pctx, None, progress,
                                     rank_state)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _lift.append(resource.getrlimit(resource.RLIMIT_FSIZE))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fault["bytes"], _lift[-1][1]))
    return _save(engine, save_dir, meta, keep_last, pctx, background, progress, rank_state)


def complete(self, wait):
    try:
        done = _complete(self, wait)
    except BaseException:
        done = True
        raise
    finally:
        if done and _lift:
            resource.setrlimit(resource.RLIMIT_FSIZE, _lift.pop())
    return done


def submit(self, write, tag_dir, name):
    delay, kill = FAULTS.get("write_delay", 0), FAULTS.get("kill_in_writer")
    files = self.__dict__.setdefault("files_of_save", {})
    files[_saves[0]] = files.get(_saves[0], 0) + 1

    def delayed(number=files[_saves[0]], save=_saves[0]):
        if kill and kill["save"] == save and kill.get("rank", 0) == RANK and number == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(delay)
        return write()  # the file's manifest entry

    return _submit(self, delayed, tag_dir, name)


_fill = background_save.HostSnapshots.fill


def fill(self):
    time.sleep(FAULTS.get("copy_delay", 0))
    _fill(self)


def convert(*args, **kwargs):
    fault = FAULTS.get("universal")
    if not (fault and fault.get("rank", 0) == RANK):
        return _convert(*args, **kwargs)
    if "signal" in fault:
        os.kill(os.getpid(), getattr(signal, fault["signal"]))
        return _convert(*args, **kwargs)
    return _with_file_size_limit(fault["bytes"], _convert, *args, **kwargs)


objectives.loss_divisor = loss_divisor
TrainingEngine.train_step = train_step
# where the saves call it too: checkpointer.py imported it by name, maybe before this script ran (the rank pool's
# server imports every module a run needs before forking the ranks)
checkpointing.save_checkpoint = checkpointer.save_checkpoint = save_checkpoint
checkpointing.PendingSave.complete = complete
background_save.BackgroundWriter.submit = submit
background_save.HostSnapshots.fill = fill
universal_conversion._convert = convert


def main(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        runs = json.load(fh)
    for run in runs:
        FAULTS.clear()
        FAULTS.update(run.get("faults", {}))
        universal_conversion.PROGRESS_SECONDS = FAULTS.get("progress_seconds", _progress_seconds)
        _saves[0] = 0
        rc = train.main(run["argv"])
        if rc != run.get("expect", 0):
            print(f"run exited {rc}, expected {run.get('expect', 0)}: {' '.join(run['argv'])}", file=sys.stderr,
                  flush=True)
            return 1
    return 0


if __name__ == "__main__":
    exit_process(main(next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))))
