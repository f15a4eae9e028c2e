"""A stop signal sent to the launcher's pid alone (``kill PID``; Kubernetes' SIGTERM to a container's first
process), under every launcher: the ranks finish the step, save and exit 0, no process of the job is left, and the
restart with ``checkpoint.load: auto`` continues exactly as the uninterrupted run.

Each job is 2 processes at PP2 under tests/scripts/signal_launcher.py, a child subreaper: the processes a killed
launcher leaves behind become its children, so it waits for every one and reads their exit codes. The signal goes
out once the run has logged step 3:

- SIGTERM to the ``deepspeed`` runner, which forwards nothing to its ``launch.py``: the ranks see the runner gone
  and stop (``launch.py`` then exits 0 with them); meanwhile a second run on the same save dir is refused;
- SIGTERM to ``launch.py``, which terminates every rank's process tree itself: they save and exit within its 30 s;
- SIGINT to ``torchrun``, which forwards it to its workers;
- SIGTERM to scripts/train_node.sh (the per-node script of multi-node jobs, which execs the runner).

srun forwards SIGTERM and SIGINT to its tasks itself, and a task whose slurmstepd is gone stops as under the
runner above (the watch of llama_megatron/training/faults/preemption.py); neither runs here without SLURM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launch_utils import PRETRAIN_CONFIG, ROOT, launch_many, losses, record, run_args

from llama_megatron.checkpoint.manifest import verify_tag
from llama_megatron.parallel.placement import free_port, launcher_command

CONFIG = PRETRAIN_CONFIG
SIGNAL_AT = 3
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# (case, what the signal goes to, the signal, the launcher's exit code, the reason each stopped rank logs)
CASES = [
    ("runner", "launcher", "SIGTERM", -15, "its launcher's exit (the deepspeed launcher, pid {launcher})"),
    ("launch-py", "deepspeed.launcher.launch", "SIGTERM", 1, "SIGTERM"),
    ("torchrun", "launcher", "SIGINT", 1, "SIGINT"),
    ("node-script", "launcher", "SIGTERM", -15, "its launcher's exit (the deepspeed launcher, pid {launcher})"),
]


def _args(prefix: str, out, *extra: str) -> list[str]:
    # the LR schedule ends at decay_steps (18): a run's LR at a step does not depend on train.steps; the only save
    # is the one the stop makes
    return run_args(prefix, out, "parallel.pipeline=2", f"checkpoint.save={out}/ckpt", "checkpoint.load=auto",
                    "checkpoint.interval=100000", *extra)


def _command(case: str, args: list[str], work) -> tuple[list[str], dict]:
    if case == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), "-m", "llama_megatron.train", *args], ENV
    if case == "node-script":
        hostfile = work / "hostfile"
        hostfile.write_text("localhost slots=2\n")
        return (["bash", os.path.join(ROOT, "scripts", "train_node.sh"), str(hostfile), "0", "127.0.0.1",
                 str(free_port()), *args[1:]], dict(ENV, PYTHON=sys.executable))
    return [*launcher_command(2), "--module", "llama_megatron.train", *args], ENV


@pytest.fixture(scope="module")
def stopped(shakespeare_prefix, tmp_path_factory) -> tuple[object, dict]:
    """Each case's job signalled at step SIGNAL_AT (what signal_launcher.py reports, and the job's stdout/stderr)."""
    work = tmp_path_factory.mktemp("launcher-signals")
    reports = {}
    for case, target, name, _, _ in CASES:
        out = work / case
        # steps enough that the job still runs however long the second run below takes beside neighbours, within
        # the training split's first epoch (about 1,800 steps): the data order then does not depend on train.steps
        args = _args(shakespeare_prefix, out, "train.steps=1500")
        command, env = _command(case, args, work)
        spec = {"command": command, "env": env, "metrics": str(out / "metrics.jsonl"), "step": SIGNAL_AT,
                "signal": name, "target": target, "log": str(work / case)}
        if case == "runner":  # a second run on the same save dir while the job runs (one process): refused
            spec["during"] = [sys.executable, "-m", "llama_megatron.train", *args, "--set", "parallel.pipeline=1"]
        (work / f"{case}.json").write_text(json.dumps(spec))
        result = record(subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "signal_launcher.py"),
                                        str(work / f"{case}.json")], cwd=ROOT, capture_output=True, text=True,
                                       timeout=1800))
        stdout, stderr = (work / f"{case}.out").read_text(), (work / f"{case}.err").read_text()
        assert result.returncode == 0, f"{case}: {result.stdout}\n{result.stderr[-3000:]}\n{stderr[-3000:]}"
        ckpt = out / "ckpt"  # as the job left it (the restart below saves there too)
        latest = (ckpt / "latest").read_text() if (ckpt / "latest").is_file() else None
        reports[case] = {**json.loads(result.stdout), "stdout": stdout, "stderr": stderr, "latest": latest,
                         "intact": latest is not None and verify_tag(str(ckpt / latest))}
    return work, reports


@pytest.fixture(scope="module")
def restarted(shakespeare_prefix, stopped) -> dict[str, dict[int, float]]:
    """One 2-process launch: the uninterrupted run, then every stopped job restarted for two more steps."""
    work, reports = stopped
    stops = {case: _stop_step(reports[case]["stdout"]) for case in reports}
    runs = [_args(shakespeare_prefix, work / "uninterrupted", f"train.steps={max(stops.values()) + 2}")]
    runs += [_args(shakespeare_prefix, work / case, f"train.steps={step + 2}") for case, step in stops.items()]
    launch_many(2, runs, str(work / "restarts.json"))
    return {name: losses(str(work / name)) for name in ["uninterrupted", *stops]}


def _stop_step(stdout: str) -> int:
    (line,) = [line for line in stdout.splitlines() if line.startswith("stopped at step")]
    return int(line.split()[3])


@pytest.mark.parametrize("case, target, name, launcher_code, reason", CASES, ids=[c[0] for c in CASES])
def test_a_signal_to_the_launcher_alone_stops_saves_and_resumes_exactly(case, target, name, launcher_code, reason,
                                                                       stopped, restarted) -> None:
    work, reports = stopped
    report = reports[case]
    assert report["launcher"] == launcher_code, report
    # every process of the job ended (waited for: the subreaper has no child left); the ranks' launch.py exits 0
    # when every rank did (deepspeed's launch.py exits with the first non-zero rank code)
    assert report["left"] == [], report
    ranks = [pid for pid, cmd in report["tree"].items() if "llama_megatron.train" in cmd]
    assert len(ranks) == 2, report["tree"]
    if case in ("runner", "node-script"):
        (launch_py,) = [r for r in report["reaped"] if "deepspeed.launcher.launch" in r["command"]]
        assert launch_py["code"] == 0, report
    step = _stop_step(report["stdout"])
    assert step >= report["signalled_at"]
    (line,) = [line for line in report["stdout"].splitlines() if line.startswith("stopped at step")]
    assert line == (f"stopped at step {step} on {reason.format(launcher=report['signalled'])}: saved checkpoint "
                    f"{work}/{case}/ckpt/global_step{step}; the same command with checkpoint.load auto continues "
                    "from there"), line
    assert "llama_megatron" not in "".join(t for t in report["stderr"].split("Traceback")[1:]), report["stderr"][-3000:]
    ckpt = work / case / "ckpt"
    assert report["latest"] == f"global_step{step}" and report["intact"], report
    if case == "runner":
        assert report["during"]["code"] == 2, report["during"]
        errors = [e for e in report["during"]["stderr"].splitlines() if e.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: checkpoint.save {ckpt} is in use by another run (pid "), \
            report["during"]
    # the restart continued exactly as the run that was never stopped
    resumed, reference = restarted[case], restarted["uninterrupted"]
    assert {s: resumed[s] for s in (step + 1, step + 2)} == {s: reference[s] for s in (step + 1, step + 2)}


def test_launcher_programs_are_told_by_their_command_lines() -> None:
    from llama_megatron.parallel.placement import launcher_program

    python = "/venv/bin/python3.11"
    assert launcher_program([python, "/venv/bin/deepspeed", "--num_gpus", "8"]) == "the deepspeed launcher"
    assert launcher_program([python, "-m", "deepspeed.launcher.runner", "--hostfile", "H"]) == "the deepspeed launcher"
    assert launcher_program([python, "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30="]) == \
        "deepspeed's launch.py"
    assert launcher_program(["/usr/bin/python3", "/venv/bin/torchrun", "--nnodes", "2"]) == "torchrun"
    assert launcher_program([python, "-m", "torch.distributed.run", "-m", "llama_megatron.train"]) == "torchrun"
    assert launcher_program(["srun", "--ntasks", "16", "python"]) == "srun"
    assert launcher_program(["slurmstepd: [1234.0]"]) == "slurmstepd"
    # a shell, the training entry itself, an interpreter running a script or code: not launchers
    for cmdline in (["bash", "scripts/train_node.sh"], [python, "-m", "llama_megatron.train", "--config", "deepspeed"],
                    [python, "train.py", "torchrun"], [python, "-c", "import torchrun"], ["-bash"], []):
        assert launcher_program(cmdline) is None, cmdline
