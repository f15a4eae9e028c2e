"""Two "nodes" on this machine, every way clusters start jobs, against the single-node run; a stopped rank.

Each multi-node job is two launcher invocations of 2 processes each (master 127.0.0.1) training TP2 x PP2: the
deepspeed launcher with a hostfile and ``--no_ssh --node_rank N``, ``torchrun --nnodes 2 --node_rank N``, plain
processes with only srun's SLURM_* variables, and scripts/slurm_train.sbatch run with stand-ins for ``srun`` and
``scontrol``. Each must give the single-node 4-process run's losses and gradient norms bit for bit (that run, and the stopped one
below, are ranks of the rank pool, tests/rank_pool.py: the launchers here are the multi-node ones).

A rank stopped with SIGSTOP in a 4-process TP2 x PP2 run: every other rank exits 5 within
``distributed.timeout_minutes`` with one line naming the step, what it was doing, its pipeline stage and the silent
rank; the last checkpoint is intact and the job restarted on it continues exactly as the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
from launch_utils import PRETRAIN_CONFIG, ROOT, launch_many, record, run_args, run_command

from llama_megatron.checkpoint.manifest import verify_tag
from llama_megatron.parallel.job_store import rendezvous_store
from llama_megatron.parallel.placement import (
    adopt_launcher_env,
    first_host,
    free_port,
    placement,
)

CONFIG = PRETRAIN_CONFIG
STEPS = 4
STALL_MINUTES = 0.5
TP2_PP2 = ["parallel.tensor=2", "parallel.pipeline=2", "batch.micro_batch_size=4",
           "deepspeed_config=ds_configs/zero1_fp32.json"]  # ZeRO-1: the gradient norm is reported and compared
BASE_ENV = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                           "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                                           "MASTER_PORT")}
BASE_ENV.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _args(prefix: str, out, *extra: str) -> list[str]:
    return run_args(prefix, out, f"train.steps={STEPS}", *TP2_PP2, f"checkpoint.save={out}/ckpt", "checkpoint.interval=2",
                    *extra)


def _curve(out) -> dict[int, tuple[float, float]]:
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        return {r["step"]: (r["loss"], r.get("grad_norm")) for r in map(json.loads, fh) if "loss" in r}


def _run_all(commands: list[tuple[list[str], dict]], timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """Start every command at once (the nodes of one job), wait for all."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, env in commands]
    results = []
    try:
        for proc, (cmd, _) in zip(procs, commands):
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(record(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def _check(results: list[subprocess.CompletedProcess]) -> None:
    for result in results:
        assert result.returncode == 0, f"{' '.join(result.args)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def stalled(shakespeare_prefix, work) -> dict:
    """The 4-process run whose rank 3 stops itself (SIGSTOP) as step 3 starts, and what it left on disk."""
    out = work / "stalled"
    # 30 s: far beyond a healthy step of this model or its save, even beside CPU-bound neighbours (pytest --stress)
    runs = [{"argv": _args(shakespeare_prefix, out, f"distributed.timeout_minutes={STALL_MINUTES}"), "expect": 0,
             "faults": {"signal": {"step": 3, "rank": 3, "name": "SIGSTOP"}}}]
    runs_file = work / "stalled.json"
    runs_file.write_text(json.dumps(runs))
    result = run_command(4, [os.path.join(ROOT, "tests", "scripts", "inject_faults.py")], [str(runs_file)],
                         check=False)
    return {"result": result, "latest": (out / "ckpt" / "latest").read_text(),
            "tags": sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("global_step")),
            "intact": verify_tag(str(out / "ckpt" / "global_step2"))}


@pytest.fixture(scope="module")
def reference(shakespeare_prefix, work, stalled) -> dict[int, tuple[float, float]]:
    """The single-node 4-process run, and (same launch) the stalled run restarted on its checkpoint."""
    launch_many(4, [_args(shakespeare_prefix, work / "single-node"),
                    _args(shakespeare_prefix, work / "stalled", "checkpoint.load=auto")], str(work / "reference.json"))
    return _curve(work / "single-node")


def test_a_stopped_rank_ends_the_job_with_one_line_per_rank(stalled, reference, work) -> None:
    result = stalled["result"]
    assert result.returncode == 5, result.stderr[-3000:]
    lines = sorted(line for line in result.stderr.splitlines() if line.startswith("error:"))
    assert len(lines) == 3, result.stderr[-3000:]
    for rank, line in zip((0, 1, 2), lines):
        stage = 1 if rank < 2 else 2
        assert line.startswith("error: stalled at step 3 (forward, backward and optimizer step, pipeline stage "
                               f"{stage} of 2) on rank {rank} ("), line
        assert f"(distributed.timeout_minutes {STALL_MINUTES}); silent: rank 3 (" in line and "; rank" not in line, line
    # the last good state: step 2, intact; the restart (in `reference`) resumed it and went on as if never stopped
    assert stalled["latest"] == "global_step2" and stalled["tags"] == ["global_step2"] and stalled["intact"]
    resumed = _curve(work / "stalled")
    assert {s: resumed[s] for s in (3, 4)} == {s: reference[s] for s in (3, 4)}
    assert all(norm is not None for _, norm in reference.values())
    print("\n".join(lines))


def _hostfile(work) -> str:
    path = work / "hostfile"
    path.write_text("127.0.0.1 slots=2\nlocalhost slots=2\n")
    return str(path)


@pytest.mark.launched
def test_deepspeed_launcher_per_node_without_ssh(shakespeare_prefix, work, reference) -> None:
    """scripts/train_node.sh on each node: the deepspeed launcher with the hostfile, --no_ssh --node_rank N."""
    out, port = work / "deepspeed-no-ssh", str(free_port())
    script, env = os.path.join(ROOT, "scripts", "train_node.sh"), dict(BASE_ENV, PYTHON=sys.executable)
    nodes = [(["bash", script, _hostfile(work), str(node), "127.0.0.1", port, *_args(shakespeare_prefix, out)[1:]],
              env) for node in (0, 1)]
    _check(_run_all(nodes))
    assert _curve(out) == reference


@pytest.mark.launched
def test_torchrun_two_nodes(shakespeare_prefix, work, reference) -> None:
    out, port = work / "torchrun", str(free_port())
    nodes = [([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port,
               "-m", "llama_megatron.train", *_args(shakespeare_prefix, out)], BASE_ENV) for node in (0, 1)]
    _check(_run_all(nodes))
    assert _curve(out) == reference


def _srun_job_id() -> int:
    """A job id whose derived rendezvous port (20000 + id mod 10000) is free now."""
    while True:
        port = free_port()
        if 20000 <= port < 30000:
            return port - 20000


@pytest.mark.launched
def test_processes_started_by_srun(shakespeare_prefix, work, reference) -> None:
    """Every task started by srun itself: only SLURM's variables, no RANK, no MASTER_ADDR/PORT."""
    out, job = work / "srun", _srun_job_id()
    tasks = []
    for rank in range(4):
        env = dict(BASE_ENV, SLURM_JOB_ID=str(job), SLURM_PROCID=str(rank), SLURM_STEP_NUM_TASKS="4",
                   SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(rank // 2), SLURM_STEP_TASKS_PER_NODE="2(x2)",
                   SLURM_STEP_NODELIST="127.0.0.[1-2]", SLURM_JOB_NODELIST="127.0.0.[1-2]")
        tasks.append(([sys.executable, "-m", "llama_megatron.train", *_args(shakespeare_prefix, out)], env))
    _check(_run_all(tasks))
    assert _curve(out) == reference


FAKE_SRUN = """#!/usr/bin/env bash
# srun for the test: --nodes=N tasks, one per "node", each with its SLURM_NODEID, all at once
nodes=1
while [[ "$1" == -* ]]; do
  case "$1" in --nodes=*) nodes=${1#--nodes=} ;; esac
  shift
done
pids=()
for ((node = 0; node < nodes; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_STEP_NUM_TASKS=$nodes "$@" &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && [ "$3" = "127.0.0.[1-2]" ] && printf '127.0.0.1\\nlocalhost\\n'
"""


@pytest.mark.launched
def test_slurm_batch_script(shakespeare_prefix, work, reference) -> None:
    """scripts/slurm_train.sbatch as sbatch runs it, srun and scontrol standing in: the hostfile, the master and
    each node's rank come from SLURM's variables."""
    out, bin_dir = work / "slurm", work / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = dict(BASE_ENV, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID=str(_srun_job_id()),
               SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_SUBMIT_DIR=ROOT, SLURM_PROCID="0", SLURM_NNODES="2",
               GPUS_PER_NODE="2", PYTHON=sys.executable, HOSTFILE=str(work / "slurm-hostfile"))
    script = os.path.join(ROOT, "scripts", "slurm_train.sbatch")
    (result,) = _run_all([(["bash", script, CONFIG, *_args(shakespeare_prefix, out)[2:]], env)])
    _check([result])
    assert (work / "slurm-hostfile").read_text() == "127.0.0.1 slots=2\nlocalhost slots=2\n"
    assert "2 nodes x 2 processes, master 127.0.0.1:" in result.stdout
    assert _curve(out) == reference


def test_launcher_environments() -> None:
    """What each launcher leaves in the environment, read as one placement; srun's variables adopted."""
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "TORCHELASTIC_RUN_ID": "x"}
    assert placement(torchrun).local_world_size == 4 and placement(torchrun).nodes == 2
    deepspeed = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2"}
    assert placement(deepspeed).launcher == "deepspeed" and placement(deepspeed).group_spans_nodes(4)
    assert not placement(deepspeed).group_spans_nodes(2)
    srun = {"SLURM_PROCID": "6", "SLURM_STEP_NUM_TASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
            "SLURM_STEP_TASKS_PER_NODE": "3(x2),1", "SLURM_STEP_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "123456"}
    assert adopt_launcher_env(srun).launcher == "srun"
    assert {k: srun[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                 "MASTER_PORT")} == {"RANK": "6", "WORLD_SIZE": "7", "LOCAL_RANK": "0",
                                                     "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "gpu07",
                                                     "MASTER_PORT": "23456"}
    # a batch script's own shell (no job step) stays one process; so does a plain shell
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "1"}
    assert adopt_launcher_env(batch).world_size == 1 and batch["WORLD_SIZE"] == "1"
    for nodelist, host in [("gpu[03-05,09],cpu1", "gpu03"), ("node1,node2", "node1"), ("a-[001-004]x", "a-001x"),
                           ("rack[1-2]-n[3-4]", "rack1-n3")]:
        assert first_host(nodelist) == host


def test_tensor_groups_across_nodes_are_warned_about_in_preflight(monkeypatch, shakespeare_prefix, tmp_path) -> None:
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.run.setup import preflight

    config = TrainingConfig.from_file(CONFIG, [f"data.prefix={shakespeare_prefix}", f"output_dir={tmp_path}",
                                               *TP2_PP2])
    monkeypatch.chdir(ROOT)
    found = {}
    for local in ("1", "2", "4"):
        monkeypatch.setattr(os, "environ", {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_SIZE": local})
        found[local] = [n for n in preflight(config).notes if "tensor parallel" in n]
    assert found["2"] == found["4"] == []
    assert found["1"] == ["warning: tensor parallel groups of 2 span nodes (1 processes per node): their "
                          "all-reduces, the heaviest traffic, cross the network; use a tensor degree that divides "
                          "the processes per node"]


def _wait_stopped(pid: int, timeout_s: float = 120.0) -> None:
    """Until every thread of ``pid`` is in the stopped state (/proc: 'T')."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as fh:
                states.append(fh.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


@pytest.mark.launched
def test_a_stopped_store_does_not_hang_its_clients() -> None:
    """A TCPStore request to a server that is alive but stopped waits forever whatever its own timeout; through
    RendezvousStore it raises TimeoutError within the timeout, and every later request at once."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                               f"s = d.TCPStore('127.0.0.1', {port}, 2, True, wait_for_workers=False); "
                               "s.set('k', 'v'); print('up', flush=True); time.sleep(10**6)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        store = rendezvous_store(2.0, ("127.0.0.1", port))
        assert store.check(["k"]) and store.get("k") == b"v"
        os.kill(server.pid, signal.SIGSTOP)
        _wait_stopped(server.pid)  # kill() returns before every thread has stopped (the CI once got an answer)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=f"127.0.0.1:{port} did not answer within 2 s"):
            store.get("k")
        assert 2.0 <= time.monotonic() - start < 60.0  # bounded (a stopped server's request never returns)
        with pytest.raises(TimeoutError, match="did not answer before"):
            store.set("k", "w")
    finally:
        server.kill()
        server.wait()
        for thread in threading.enumerate():  # the abandoned request ends (connection reset) while the test runs
            if thread.name == "rendezvous-store":
                thread.join(timeout=120)
