"""A checkpoint converted to DeepSpeed's universal format for a resume at another DP x CP or EP degree, with every
rank kept informed.

ZeRO saves each rank's slice of the optimizer state; another number of ZeRO partitions (over DP x CP, or an
expert's over its expert-data-parallel group) needs them merged per parameter first (DeepSpeed's
``ds_to_universal``, started through checkpoint/universal/experts.py). Rank 0 converts once, beside the original tag
(atomic: into a temporary dir, renamed when complete), with several worker processes: ``ds_to_universal``'s extract
pass holds one rank's optimizer file per worker, so the count (twice the cores, at most 8) is bounded by the host
memory available for those files (``checkpoint.universal_workers`` overrides it). Meanwhile:

- rank 0 logs the phase and its progress (``ds_to_universal``'s own counts) every 30 s;
- the other ranks wait on the job's rendezvous store, not in a collective: rank 0 publishes its state there every
  few seconds, so a failed conversion ends every rank at once with rank 0's one line (exit 4, as a failed save:
  the tag was verified before, so what fails is writing the conversion), and a rank 0 that stops (its state no longer
  changing for ``distributed.timeout_minutes``, or its store not answering) ends them with exit 5 naming it,
  instead of a barrier that ends only at the process group's timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

from llama_megatron.checkpoint.atomic import write_text_atomic
from llama_megatron.checkpoint.directory import META_FILE, TMP_PREFIX, universal_tag
from llama_megatron.checkpoint.manifest import fsync_dir, fsync_tree
from llama_megatron.errors import CheckpointError, SaveFailed, Stalled
from llama_megatron.parallel.job_store import rendezvous_store
from llama_megatron.parallel.placement import available_cores

PROGRESS_SECONDS = 30.0  # how often rank 0 logs the conversion's progress
PUBLISH_SECONDS = 2.0  # how often rank 0 refreshes its state in the store, and the others look
MAX_WORKERS = 8
STATE_KEY = "llama_megatron/universal/{nonce}"
LATEST_UNIVERSAL = "latest_universal"  # the file ds_to_universal writes beside its output


def conversion_workers(tag_dir: str, requested: int = 0) -> tuple[int, int]:
    """(extract, merge) worker processes: ``requested`` when set; otherwise twice the cores (the workers wait on
    files about as much as they compute: 4 workers on 2 cores converted 0.54B ~10% faster than 2,
    benchmarks/universal_conversion.py), at most 8, and the extract workers also bounded by the memory available
    for one optimizer file each (twice its size: the file and the fragments cut from it)."""
    if requested > 0:
        return requested, requested
    cores = available_cores()
    merge = max(1, min(MAX_WORKERS, 2 * cores))
    sizes = [os.path.getsize(os.path.join(tag_dir, name)) for name in os.listdir(tag_dir)
             if name.endswith("optim_states.pt")]
    extract = merge
    if sizes:
        import psutil

        extract = max(1, min(merge, psutil.virtual_memory().available // (2 * max(sizes))))
    return extract, merge


class _OutputReader:
    """``ds_to_universal``'s output read as it comes: the phase (its ``*** N. ...`` lines), the count of its
    progress bar (``3/8``), and the last lines for an error message."""

    _COUNT = re.compile(r"(\d+)/(\d+) \[")

    def __init__(self, stream) -> None:
        self.phase, self.count = "starting", ""
        self.tail: deque[str] = deque(maxlen=40)
        self._stream = stream
        self._thread = threading.Thread(target=self._read, name="ds_to_universal-output", daemon=True)
        self._thread.start()

    def feed(self, text: str) -> None:
        for line in filter(None, (part.strip() for part in re.split(r"[\r\n]", text))):
            if line.startswith("***"):
                self.phase, self.count = line.strip("* ").rstrip(". "), ""
            elif (match := self._COUNT.search(line)) is not None:
                self.count = f"{match.group(1)}/{match.group(2)}"
                continue
            self.tail.append(line)

    def _read(self) -> None:
        pending = ""
        while chunk := self._stream.read1(4096):
            pending += chunk.decode(errors="replace").replace("\r", "\n")  # progress bars redraw with \r
            complete, _, pending = pending.rpartition("\n")
            self.feed(complete)
        self.feed(pending)

    def join(self) -> None:
        self._thread.join(timeout=10)

    def progress(self) -> str:
        return f"{self.phase}" + (f" {self.count}" if self.count else "")

    def error(self) -> str:
        """The line that says what went wrong: the exception's, else the last one."""
        lines = list(self.tail)
        for line in reversed(lines):
            if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line):
                return line
        return lines[-1] if lines else "no output"


def ensure_universal(load_dir: str, tag: str, rank: int, log: Callable[[str], None] = print,
                     timeout_minutes: float = 30.0, workers: int = 0) -> str:
    """Make ``load_dir/tag``'s universal conversion exist (rank 0 converts, the others wait on the store), return
    its tag. In one process (or without a process group) rank 0 just converts."""
    converted = universal_tag(tag)
    key, store = _state_key(), None
    if key is not None:
        # a store that does not answer this long has a stopped host (rank 0 under the deepspeed launcher)
        store = rendezvous_store(max(10.0, min(60.0 * timeout_minutes, 300.0)))
    if rank != 0:
        if store is None:
            raise CheckpointError("waiting for rank 0's universal conversion needs the rendezvous store "
                                  "(MASTER_ADDR and MASTER_PORT)")
        _wait_for_rank0(store, key, f"{load_dir}/{tag}", timeout_minutes)
        return converted

    def publish(state: str, detail: str = "") -> None:
        if store is not None:
            store.set(key, json.dumps({"state": state, "detail": detail, "at": time.time()}))

    try:
        if not os.path.isdir(os.path.join(load_dir, converted)):
            _convert(load_dir, tag, converted, log, lambda detail: publish("running", detail), workers,
                     others_wait=store is not None)
    except (CheckpointError, SaveFailed) as error:
        publish("failed", json.dumps({"error": type(error).__name__, "message": str(error)}))
        raise
    except BaseException as error:
        publish("failed", json.dumps({"error": "CheckpointError", "message": f"converting {load_dir}/{tag} to a "
                                      f"universal checkpoint failed on rank 0: {error!r}"}))
        raise
    publish("done")
    return converted


def _convert(load_dir: str, tag: str, converted: str, log: Callable[[str], None],
             publish: Callable[[str], None], workers: int, others_wait: bool) -> None:
    tag_dir, target = os.path.join(load_dir, tag), os.path.join(load_dir, converted)
    tmp = os.path.join(load_dir, TMP_PREFIX + converted)
    shutil.rmtree(tmp, ignore_errors=True)
    extract, merge = conversion_workers(tag_dir, workers)
    log(f"converting {tag_dir} to a universal checkpoint ({extract} extract, {merge} merge workers)"
        + ("; the other ranks wait for it" if others_wait else ""))
    # ds_to_universal with the experts of an expert-parallel run added to its merge (checkpoint/universal/experts.py)
    cmd = [sys.executable, "-m", "llama_megatron.checkpoint.universal.experts", "--input_folder", tag_dir,
           "--output_folder", tmp, "--num_extract_workers", str(extract), "--num_merge_workers", str(merge)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = _OutputReader(proc.stdout)
    next_log = start + PROGRESS_SECONDS
    try:
        while proc.poll() is None:
            publish(output.progress())
            if time.monotonic() >= next_log:
                log(f"universal conversion of {tag}: {output.progress()} ({time.monotonic() - start:.0f} s)")
                next_log += PROGRESS_SECONDS
            try:
                proc.wait(timeout=min(PUBLISH_SECONDS, PROGRESS_SECONDS))
            except subprocess.TimeoutExpired:
                pass
    finally:
        if proc.poll() is None:  # rank 0 itself is ending (an exception, a signal): the conversion goes with it
            proc.kill()
            proc.wait()
        output.join()
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(load_dir).free / 2**30
        # the tag was verified before (manifest, safe load): what fails here is writing the conversion
        raise SaveFailed(f"converting {tag_dir} to a universal checkpoint failed ({output.phase}): {output.error()} "
                         f"({free:.1f} GiB free there; the checkpoint itself is unchanged)")
    shutil.copy(os.path.join(tag_dir, META_FILE), os.path.join(tmp, META_FILE))
    fsync_tree(tmp)
    os.replace(tmp, target)
    # ds_to_universal names its output folder (our temporary) in latest_universal: name the final one
    write_text_atomic(os.path.join(load_dir, LATEST_UNIVERSAL), converted)
    fsync_dir(load_dir)
    log(f"converted {tag} to a universal checkpoint in {time.monotonic() - start:.1f} s")


def _wait_for_rank0(store, key: str, what: str, timeout_minutes: float) -> None:
    """Until rank 0 publishes done (return) or failed (raise its error); exit 5 when it stops reporting."""
    timeout, host = 60.0 * timeout_minutes, socket.gethostname()
    last_change, last_value = time.monotonic(), None
    while True:
        try:
            value = store.get(key) if store.check([key]) else None
        except Exception as error:  # noqa: BLE001 - the store's host (rank 0 under deepspeed) stopped or went away
            raise Stalled(f"rank 0 stopped answering while converting {what} to a universal checkpoint: {error} "
                          f"(rank 0 hosts it under the deepspeed launcher; waiting on {host})") from error
        if value is not None:
            state = json.loads(value)
            if state["state"] == "done":
                return
            if state["state"] == "failed":
                failure = json.loads(state["detail"])
                raise (SaveFailed if failure["error"] == "SaveFailed" else CheckpointError)(failure["message"])
        if value != last_value:
            last_change, last_value = time.monotonic(), value
        elif time.monotonic() - last_change > timeout:
            doing = json.loads(value)["detail"] if value else "it has not started"
            raise Stalled(f"rank 0 reported nothing for {timeout / 60:g} min while converting {what} to a universal "
                          f"checkpoint (last: {doing}; distributed.timeout_minutes); waiting on {host}")
        time.sleep(PUBLISH_SECONDS / 2)


def _state_key() -> str | None:
    """This conversion's key in the store, the same on every rank and new for each attempt (a store outlives a
    failed attempt within one launch); None in one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    nonce = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(nonce, src=0)  # every rank arrives here together: a collective bounded as any
    return STATE_KEY.format(nonce=nonce[0])
