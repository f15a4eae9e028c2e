"""Start a launcher, signal one process of its tree once the run has logged a step, and account for every process.

    python tests/scripts/signal_launcher.py SPEC.json

SPEC: {"command": [...], "env": {...}, "metrics": "OUT/metrics.jsonl", "step": K, "signal": "SIGTERM",
"target": "launcher" | "deepspeed.launcher.launch", "log": "PREFIX", "during": [...] (optional)}.

This process makes itself a child subreaper (prctl PR_SET_CHILD_SUBREAPER): a process of the tree left without its
parent (a rank whose launcher was killed) becomes its child instead of init's, so it can wait for every one of them
and read their exit codes. Once ``metrics`` holds step K it runs the ``during`` command (optional, e.g. a second run
on the same save dir; its exit code and stderr are reported), sends the signal to the target alone (the launcher
it started, or the first descendant whose command line runs the named module), then waits until it has no child
left. It prints one JSON line: the launcher's exit code, every reaped process (pid, command, exit code), the
processes it signalled and saw, the step it signalled at, and the ``during`` command's result. Stdout and stderr of
the launcher tree go to LOG.out and LOG.err. No timeout: the test's own bounds the whole.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import psutil

from llama_megatron.parallel.placement import RENDEZVOUS_VARS

PR_SET_CHILD_SUBREAPER = 36


def _step(metrics: str) -> int:
    try:
        with open(metrics, encoding="utf-8") as fh:
            return max((json.loads(line).get("step", 0) for line in fh if line.endswith("\n")), default=0)
    except FileNotFoundError:
        return 0


def main(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        spec = json.load(fh)
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    # a job of its own: no rendezvous or scheduler variables inherited (an in-process run of the test worker may
    # have set RANK and MASTER_PORT in its environment)
    env = {k: v for k, v in os.environ.items()
           if k not in RENDEZVOUS_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(spec.get("env", {}))
    with open(spec["log"] + ".out", "w") as out, open(spec["log"] + ".err", "w") as err:
        launcher = subprocess.Popen(spec["command"], env=env, stdout=out, stderr=err, start_new_session=True)
    while _step(spec["metrics"]) < spec["step"]:
        if launcher.poll() is not None:
            break
        time.sleep(0.1)
    during = None
    if spec.get("during") and launcher.poll() is None:
        result = subprocess.run(spec["during"], env=env, capture_output=True, text=True)
        during = {"code": result.returncode, "stderr": result.stderr[-3000:]}
    if launcher.poll() is not None:  # ended before it could be signalled (a run too short for this machine)
        print(json.dumps({"launcher": launcher.returncode, "ended_before_the_signal": True}), flush=True)
        return 1
    tree = {p.pid: p.cmdline() for p in psutil.Process(launcher.pid).children(recursive=True)}
    tree[launcher.pid] = spec["command"]
    target = launcher.pid if spec["target"] == "launcher" else next(
        pid for pid, cmd in tree.items() if spec["target"] in cmd)
    signalled_at = _step(spec["metrics"])
    os.kill(target, getattr(signal, spec["signal"]))
    reaped = []
    launcher_code = None
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        code = os.waitstatus_to_exitcode(status)
        if pid == launcher.pid:
            launcher_code = code
        reaped.append({"pid": pid, "command": tree.get(pid, ["?"])[:6], "code": code})
    left = [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    print(json.dumps({"launcher": launcher_code, "signalled": target, "signalled_at": signalled_at,
                      "tree": {str(k): v[:6] for k, v in tree.items()}, "reaped": reaped, "left": left,
                      "during": during}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
