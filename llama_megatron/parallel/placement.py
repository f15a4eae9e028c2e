"""Where this process sits in the job, as its launcher set it up: rank and size from the environment (the deepspeed
launcher, torchrun, srun, or none), srun's variables turned into torch's rendezvous, the launchers above the
process, and free ports for a one-host launch."""

from __future__ import annotations

import functools
import os
import random
import re
import socket
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass

from llama_megatron.errors import ConfigError

# The variables torch's env:// rendezvous reads; every launcher we support ends up setting them.
RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (what ``taskset``, Slurm's binding or a container's
    cpuset leave it), not the host's count, which oversubscribes a bound job's cores."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port free on this host now, for a one-host rendezvous.

    Chosen at random just below the kernel's ephemeral range: a port the kernel handed out for ``bind(0)`` is free
    again once we close it, and any socket another job opens before the launcher binds it (gloo and NCCL open
    hundreds) may be given the same one; ports below that range are never handed out, so only another explicit
    choice can collide, one chance in thousands."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every try taken: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_command(num_procs: int) -> list[str]:
    """The ``deepspeed`` launcher for ``num_procs`` local processes on a free port, in its module form (a
    ``pip install --target`` of DeepSpeed has no ``deepspeed`` script); append the script or ``--module`` entry."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_procs),
            "--master_port", str(free_port())]


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the job, as its launcher set it up: global rank and size, and the ranks on its
    own node (launchers number ranks node by node: node n holds ranks n x local .. n x local + local - 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(self.local_world_size, 1))

    def group_spans_nodes(self, consecutive: int) -> bool:
        """Whether a group of ``consecutive`` ranks (TP's: the fastest axis) would cross a node boundary."""
        return self.world_size > self.local_world_size and self.local_world_size % consecutive != 0


def placement(environ: MutableMapping[str, str] | None = None) -> Placement:
    """This process's placement from the environment: torchrun (LOCAL_WORLD_SIZE), the deepspeed launcher
    (LOCAL_SIZE), or srun (SLURM_* variables, when no launcher set RANK); one process without any of them."""
    env = os.environ if environ is None else environ
    if "RANK" in env:
        world = int(env.get("WORLD_SIZE", "1"))
        local = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or (_slurm_local_size(env) if
                                                                          _in_slurm_step(env) else None)
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "deepspeed" if "LOCAL_SIZE" in env else "env"
        return Placement(int(env["RANK"]), world, int(env.get("LOCAL_RANK", "0")), int(local or world), launcher)
    if _in_slurm_step(env):
        return Placement(int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env.get("SLURM_LOCALID", "0")),
                         _slurm_local_size(env), "srun")
    return Placement()


def adopt_launcher_env(environ: MutableMapping[str, str] | None = None) -> Placement:
    """Make torch's env:// rendezvous work under whatever started this process, before any process group:

    - a launcher (deepspeed, torchrun, a scheduler exporting RANK/WORLD_SIZE/MASTER_ADDR/...): as it is;
    - ``srun`` starting every task itself: RANK and the rest from SLURM_PROCID, SLURM_STEP_NUM_TASKS,
      SLURM_LOCALID and the step's tasks per node; MASTER_ADDR, unless exported, the step's first node;
      MASTER_PORT, unless exported, derived from the job id (the same on every node, no port to agree on);
    - nothing: a one-process rendezvous on a free local port (instead of DeepSpeed probing for MPI).
    """
    env = os.environ if environ is None else environ
    where = placement(env)
    if environ is None:
        launcher_chain()  # as the process starts: StopRequests watches these launchers
    if "RANK" in env:
        return where
    if where.launcher == "srun":
        master = env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST") or
                                                      env.get("SLURM_JOB_NODELIST", ""))
        if not master:
            raise ConfigError("under srun without MASTER_ADDR: SLURM_STEP_NODELIST names no node to rendezvous at; "
                              "export MASTER_ADDR=<first node>")
        port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 10000)
        env.update(RANK=str(where.rank), WORLD_SIZE=str(where.world_size), LOCAL_RANK=str(where.local_rank),
                   LOCAL_WORLD_SIZE=str(where.local_world_size), MASTER_ADDR=master, MASTER_PORT=port)
        return where
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR=env.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=env.get("MASTER_PORT", str(free_port())))
    return where


def _in_slurm_step(env) -> bool:
    # inside `srun` (a job step): SLURM_STEP_NUM_TASKS; a batch script's own shell has SLURM_PROCID too, but no
    # step of its own, and must stay one process
    return "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env


def _slurm_local_size(env) -> int:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE ("4(x2),2": four on each of the first two nodes, two
    on the third) and SLURM_NODEID."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={spec!r}: not SLURM's count list (e.g. 4(x2),2)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    if node < len(counts):
        return counts[node]
    return int(env.get("SLURM_STEP_NUM_TASKS", "1"))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("gpu[03-05,09],cpu1" -> "gpu03") without calling scontrol."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[([^],-]+)[^]]*\]", r"\1", nodelist[:end].strip())


# What a launcher's command line runs (its script's or module's name): the deepspeed runner and its per-node
# launch.py, torchrun, SLURM's srun and the slurmstepd that starts a step's tasks on each node, MPI's launchers.
LAUNCHER_PROGRAMS = {"deepspeed": "the deepspeed launcher", "deepspeed.launcher.runner": "the deepspeed launcher",
                     "deepspeed.launcher.launch": "deepspeed's launch.py", "torchrun": "torchrun",
                     "torch.distributed.run": "torchrun", "torch.distributed.launch": "torch.distributed.launch",
                     "srun": "srun", "slurmstepd": "slurmstepd", "mpirun": "mpirun", "mpiexec": "mpiexec"}


def launcher_program(cmdline: list[str]) -> str | None:
    """Which launcher of :data:`LAUNCHER_PROGRAMS` a command line runs (its description), or None: the first word
    that is not the Python interpreter or one of its options, or the module after ``-m``."""
    words = iter(cmdline[:8])
    for word in words:
        if word == "-m":
            return LAUNCHER_PROGRAMS.get(next(words, ""))
        name = os.path.basename(word)
        if name.startswith("-") or re.fullmatch(r"python[\d.]*", name):
            continue
        return LAUNCHER_PROGRAMS.get("slurmstepd" if name.startswith("slurmstepd") else name)
    return None


@dataclass(frozen=True)
class LauncherProcess:
    """A process that launched this rank, as it was when the rank started (its start time tells a reused pid)."""

    pid: int
    program: str
    started: float


@functools.cache
def launcher_chain() -> tuple[LauncherProcess, ...]:
    """The launchers above this process, nearest first: its parent and the parent's parents while each is a launcher
    (``launch.py`` and the runner under the deepspeed launcher; torchrun; slurmstepd). Under a launcher that set
    RANK the parent is one whatever its command line (a renamed or wrapped launcher). A process started by a shell
    has none: its shell may end (nohup) while it rightly goes on. Read once, as the process starts
    (:func:`adopt_launcher_env`), before a launcher that dies early could leave it a shorter chain."""
    import psutil

    chain: list[LauncherProcess] = []
    try:
        parent = psutil.Process().parent()
        while parent is not None and parent.pid > 1:
            program = launcher_program(parent.cmdline())
            if program is None:
                if not chain and placement().launcher in ("deepspeed", "torchrun"):
                    chain.append(LauncherProcess(parent.pid, "its launcher", parent.create_time()))
                break
            chain.append(LauncherProcess(parent.pid, program, parent.create_time()))
            parent = parent.parent()
    except psutil.Error:  # a process it may not read (another user's): the chain ends there
        pass
    return tuple(chain)


def launcher_gone(chain: tuple[LauncherProcess, ...]) -> LauncherProcess | None:
    """The first launcher of ``chain`` that has exited (a zombie its own parent has not reaped yet included), or
    None while all run."""
    import psutil

    for launcher in chain:
        try:
            process = psutil.Process(launcher.pid)
            if process.create_time() != launcher.started or process.status() == psutil.STATUS_ZOMBIE:
                return launcher
        except psutil.NoSuchProcess:
            return launcher
        except psutil.Error:
            continue
    return None
