"""What the ranks of one launch share on a host before any process group (llama_megatron/host_sockets.py):

- one mistake, one line: under the deepspeed launcher at 4 processes a bad ``--set`` prints exactly one ``error:``
  line and exits 2 (errors.report_once: the first rank to fail prints, the others check in and stay silent);
  the same with ranks started one by one, a late one included;
- two runs started at once on one port (as two recipes with the launcher's default would be): both finish, the
  one whose rank 0 found the port taken moved its rendezvous to a free one and said so in one line, and both
  trained exactly what one run alone trains; a taken port where the ranks cannot be told (not one launcher's on one
  host) is one line naming the address and --master_port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from launch_utils import ROOT, losses, record, train_args

from llama_megatron.errors import REPORT_HOLD_S, ConfigError
from llama_megatron.parallel import job_store, placement

CONFIG = os.path.join(ROOT, "configs", "pretrain", "tiny-cpu.json")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def _deepspeed(processes: int, port: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(processes), "--master_port",
            str(port), "--module", "llama_megatron.train", *train_args(CONFIG, overrides)]


@pytest.mark.launched
def test_a_bad_set_at_four_processes_is_one_error_line() -> None:
    result = record(subprocess.run(_deepspeed(4, placement.free_port(), ["train.stpes=3"]), cwd=ROOT, env=ENV,
                                   capture_output=True, text=True, timeout=600))
    assert result.returncode == 2, result.stderr[-3000:]
    assert _errors(result.stdout + result.stderr) == ["error: unknown keys in 'train': stpes"], \
        result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    # the ranks' own lines: DeepSpeed's accelerator guess is not repeated per rank (the launcher's two remain)
    assert (result.stdout + result.stderr).count("Setting accelerator to CPU") <= 2


RANK_SCRIPT = "from llama_megatron.errors import report_once; report_once('the same mistake')"


def _rank(rank: int, world: int) -> subprocess.Popen:
    env = dict(ENV, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world), LOCAL_RANK=str(rank))
    return subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.launched
def test_report_once_with_a_late_rank() -> None:
    """Ranks of one parent (as a launcher's are) failing one after another: one line, printed by the first; the
    reporter waits for the last one's check-in and then every rank has ended, long before the hold runs out."""
    first = [_rank(r, 4) for r in range(3)]
    start = time.monotonic()
    while not any(p.poll() is not None for p in first[1:]):  # a silent rank ends once it checked in
        time.sleep(0.05)
    late = _rank(3, 4)
    outputs = [p.communicate() for p in [*first, late]]
    took = time.monotonic() - start
    assert [p.returncode for p in [*first, late]] == [0] * 4
    lines = [line for _, err in outputs for line in _errors(err)]
    assert lines == ["error: the same mistake"], outputs
    assert took < 0.5 * REPORT_HOLD_S, took




@pytest.mark.launched
def test_two_runs_started_at_once_on_one_port_both_finish(shakespeare_prefix, tmp_path) -> None:
    port = placement.free_port()  # the same for both, as the launcher's default would be
    runs = {name: tmp_path / name for name in ("a", "b")}
    overrides = [f"data.prefix={shakespeare_prefix}", "parallel.pipeline=1", "train.steps=3", "eval.interval=0",
                 "checkpoint.save=null", "checkpoint.load=null", "checkpoint.interval=0", "logging.tensorboard_dir=null"]
    started = {name: subprocess.Popen(_deepspeed(2, port, [*overrides, f"output_dir={out}"]), cwd=ROOT, env=ENV,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, out in runs.items()}
    results = {}
    for name, process in started.items():
        out, err = process.communicate()
        results[name] = record(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    for result in results.values():
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    moved = [name for name, result in results.items()
             if f"port {port} (MASTER_PORT) is in use on this host, by another job: this one's rendezvous is on port "
             in result.stdout]
    assert len(moved) == 1, {name: r.stdout[-2000:] for name, r in results.items()}
    assert losses(str(runs["a"])) == losses(str(runs["b"])) and sorted(losses(str(runs["a"]))) == [1, 3]


def test_a_taken_port_the_ranks_cannot_be_told_is_one_line() -> None:
    """Ranks that are not one launcher's on one host (here: 2 of a 4-rank job): rank 0 cannot move the
    rendezvous, so the taken port is one line naming it and the flag."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        where = placement.Placement(rank=0, world_size=4, local_rank=0, local_world_size=2, launcher="deepspeed")
        with pytest.raises(ConfigError) as error:
            job_store.settle_job_store(("127.0.0.1", port), where, 10.0)
    assert str(error.value) == (
        f"the rendezvous port {port} at 127.0.0.1 (MASTER_ADDR:MASTER_PORT) is in use on this host, by another job "
        "or program: start this one with another port (deepspeed --master_port P, torchrun --master-port P, or "
        "MASTER_PORT=P under srun)")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_available_cores_are_the_affinity_not_the_host() -> None:
    """A job bound to fewer cores than the host has (taskset, Slurm's binding, a cpuset) sizes its threads by the
    cores it may use: the host's count oversubscribed 4 ranks bound to 4 of 16 cores with 4 threads each."""
    allowed = os.sched_getaffinity(0)
    assert placement.available_cores() == len(allowed)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert placement.available_cores() == 1
    finally:
        os.sched_setaffinity(0, allowed)
