"""Process-group start-up shared by the training entry points and the multi-process tests."""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import ipaddress
import logging
import os
import random
import re
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import torch

from llama_megatron import host_sockets
from llama_megatron.errors import ConfigError

# The variables torch's env:// rendezvous reads; every launcher we support ends up setting them.
RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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


def skip_cpu_shared_memory_op() -> bool:
    """On CPU, mark DeepSpeed's shared-memory all-reduce op (inference only; a 1-2 minute JIT build the first time a
    process group starts) incompatible so it is never built; True on CPU. Anything that lets DeepSpeed start the
    process group (HF Trainer in the benchmarks, too) calls this first."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return True


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


def rendezvous_address() -> tuple[str, int] | None:
    """MASTER_ADDR:MASTER_PORT, where every launcher keeps the job's key-value store (None without one)."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


class RendezvousStore:
    """A client of the job's key-value store (the rendezvous at MASTER_ADDR:MASTER_PORT, served by rank 0 under
    the deepspeed launcher and by the agent under torchrun): ranks publish progress there beside the process
    groups, so a stalled collective cannot hide it.

    Every request (the connection too) ends within ``timeout_s``, raising ``TimeoutError`` otherwise: a TCPStore
    request to a server that is alive but stopped (SIGSTOP, a paused host) waits forever whatever the store's own
    timeout, so each runs in a daemon thread that is abandoned when it does not answer. A store that did not answer
    once is not asked again (its connection may hold the unanswered request): every later request raises too."""

    def __init__(self, address: tuple[str, int], timeout_s: float) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._store = None
        self._failed: BaseException | None = None

    def set(self, key: str, value: str) -> None:
        self._call(lambda store: store.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call(lambda store: store.get(key))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda store: store.check(keys))

    def _connect(self):
        import datetime

        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore(self.address[0], self.address[1], is_master=False, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._store

    def _call(self, request):
        import threading

        if self._failed is not None:
            raise TimeoutError(f"the store at {self.address[0]}:{self.address[1]} did not answer before")
        result: list = []

        def run() -> None:
            try:
                result.append((True, request(self._connect())))
            except Exception as error:  # noqa: BLE001 - handed to the caller
                result.append((False, error))

        thread = threading.Thread(target=run, name="rendezvous-store", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not result:
            self._failed = TimeoutError(f"the store at {self.address[0]}:{self.address[1]} did not answer within "
                                        f"{self.timeout_s:g} s")
            raise self._failed
        ok, value = result[0]
        if not ok:
            raise value
        return value


def _alike_on_every_node(host: str) -> bool:
    """Whether every node resolves ``host`` to the same address: an IP address, or localhost (RFC 6761: loopback
    everywhere)."""
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _listen_host(host: str, port: int, where: Placement) -> str | None:
    """The address rank 0's store listens on: MASTER_ADDR as this host resolves it. None (every interface,
    torch's default) for a wildcard, a name that does not resolve, or a name that resolves to loopback here in a
    job spanning nodes (some /etc/hosts map a host's own name to 127.0.1.1 locally, which the other nodes resolve to
    the real address). A loopback address given as such (127.0.0.1, ::1, localhost) is loopback on every node: only
    this host's ranks can reach it, so the store listens there whatever the job's size."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, IndexError):
        return None
    ip = sockaddr[0]
    if ip in ("0.0.0.0", "::"):
        return None
    if ipaddress.ip_address(ip).is_loopback and where.nodes > 1 and not _alike_on_every_node(host):
        return None
    return ip


_SERVERS: list = []  # the job store's server and its listening socket: alive as long as the process


def serve_job_store(address: tuple[str, int], where: Placement, timeout_s: float):
    """Rank 0's server of a store of the job (the rendezvous at MASTER_ADDR:MASTER_PORT, or with port 0 one on a
    port the kernel picks: ``.port`` says which), listening on MASTER_ADDR only: torch's own listens on every
    interface, where any host that reaches the port may read and write the job's keys without authentication.
    None where the address gives no safe interface (:func:`_listen_host`): torch then serves it as before."""
    import datetime

    import torch.distributed as dist

    host = _listen_host(address[0], address[1], where)
    if host is None:
        return None
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
    try:
        sock.bind((host, address[1]))
        sock.listen(max(128, where.world_size))
        store = dist.TCPStore(address[0], sock.getsockname()[1], where.world_size, is_master=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    _SERVERS.append((store, sock))
    return store


def _port_moves(where: Placement) -> bool:
    """Whether rank 0 may serve the rendezvous on another port than the launcher's, telling the other ranks
    (:func:`settle_job_store`): every rank is a child of one deepspeed launcher on this host, so they can ask rank 0
    before any of them reaches the port (:mod:`llama_megatron.host_sockets`)."""
    return (where.launcher == "deepspeed" and where.world_size == where.local_world_size > 1
            and host_sockets.supported())


def _port_in_use(address: tuple[str, int]) -> ConfigError:
    return ConfigError(f"the rendezvous port {address[1]} at {address[0]} (MASTER_ADDR:MASTER_PORT) is in use on this "
                       f"host, by another job or program: start this one with another port (deepspeed --master_port P, "
                       f"torchrun --master-port P, or MASTER_PORT=P under srun)")


def settle_job_store(address: tuple[str, int], where: Placement, timeout_s: float):
    """Rank 0: serve the job's store at ``address`` (:func:`serve_job_store`; None where torch is to serve it). When
    that port is taken (another job on this host started with the launcher's default) and every rank is this
    launcher's (:func:`_port_moves`), rank 0 serves on a free port instead, says so in one line, and answers each
    other rank's question for the port; elsewhere a taken port is one line (:class:`ConfigError`). The other ranks
    of such a launch ask rank 0 before they touch the port (they never reach the other job's store), then go on with
    MASTER_PORT set to its answer; they return None."""
    moves = _port_moves(where)
    name = f"rendezvous/{host_sockets.launcher_key()}/{address[1]}"
    if where.rank != 0:
        if moves:
            os.environ["MASTER_PORT"] = _ask_port(name, timeout_s)
        return None
    try:
        server = serve_job_store(address, where, timeout_s)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        if not moves:
            raise _port_in_use(address) from None
        server = serve_job_store((address[0], 0), where, timeout_s)
        print(f"port {address[1]} (MASTER_PORT) is in use on this host, by another job: this one's rendezvous is on "
              f"port {server.port}", flush=True)
        os.environ["MASTER_PORT"] = str(server.port)
    if moves:
        holder = host_sockets.claim(name)
        if holder is not None:
            _SERVERS.append(holder)
            threading.Thread(target=host_sockets.answer, name="rendezvous-port", daemon=True,
                             args=(holder, os.environ["MASTER_PORT"].encode(), where.world_size - 1,
                                   timeout_s)).start()
    return server


def _ask_port(name: str, timeout_s: float) -> str:
    """Rank 0's answer to :func:`settle_job_store`'s question, asked until it comes (rank 0 may still be importing);
    past ``timeout_s`` one line."""
    deadline = time.monotonic() + timeout_s
    while (port := host_sockets.ask(name)) is None:
        if time.monotonic() > deadline:
            raise ConfigError(f"rank 0 of this launch did not say its rendezvous port within {timeout_s:g} s")
        time.sleep(0.05)
    return port.decode()


def progress_store_address(timeout_s: float) -> tuple[str, int] | None:
    """Where the ranks publish their progress (the stall watchdog), as rank 0 sees it: MASTER_ADDR:MASTER_PORT,
    whose store rank 0 serves on MASTER_ADDR only (:func:`init_distributed`); under torchrun, whose agent serves
    that one on every interface, a store of its own on MASTER_ADDR only (a port the kernel picks), unless
    MASTER_ADDR gives no safe interface (:func:`_listen_host`: the agent's then). The other ranks learn it from
    rank 0 over the process group."""
    address = rendezvous_address()
    where = placement()
    if address is None or where.world_size == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return address
    try:
        server = serve_job_store((address[0], 0), where, timeout_s)
    except OSError:  # MASTER_ADDR is no address of this host (a --master-addr that names another node)
        server = None
    return address if server is None else (address[0], server.port)


def rendezvous_store(timeout_s: float, address: tuple[str, int] | None = None) -> RendezvousStore | None:
    """The job's store with requests bounded by ``timeout_s`` (:class:`RendezvousStore`); None without a rendezvous
    address (``address`` overrides MASTER_ADDR:MASTER_PORT)."""
    address = address or rendezvous_address()
    return None if address is None else RendezvousStore(address, timeout_s)


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


VERBOSE_ENV = "LLAMA_MEGATRON_VERBOSE"  # "1": keep DeepSpeed's start-up prints and torch's deprecation warnings


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _DropAcceleratorGuess(logging.Filter):
    """DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
    which every process that imports it prints on a host without CUDA (each rank, the launcher twice): the run's
    first line says which device it trains on instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


def quiet_library_warnings() -> None:
    """Torch deprecates ``all_gather_into_tensor``, which DeepSpeed calls from many places, each warning once per
    rank, and DeepSpeed guesses its accelerator aloud in every process (:class:`_DropAcceleratorGuess`): nothing a
    user can change, so both are filtered unless ``LLAMA_MEGATRON_VERBOSE=1``. Called as a command starts, before
    DeepSpeed is imported (its logger keeps a filter added before it configures it), and again (idempotent) as the
    process group starts."""
    if verbose():
        return
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropAcceleratorGuess) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(_DropAcceleratorGuess())


# What DeepSpeed's PipelineModule prints on rank 0 as it is built: its seed settings, the topology and the layers
# of each stage (the last one's with its loss function)
_DEEPSPEED_PRINTS = re.compile(r"^(SEED_LAYERS=\S* BASE_SEED=\S* SEED_FN=\S*|Using topology: .*|stage=\d+ layers=\d+"
                               r"| +\d+: \S+|  loss: \S+)$")


@contextlib.contextmanager
def without_deepspeed_prints() -> Iterator[None]:
    """Drop DeepSpeed's start-up prints (``_DEEPSPEED_PRINTS``) from stdout inside the block, unless
    ``LLAMA_MEGATRON_VERBOSE=1``; any other line printed there passes through, after the block."""
    if verbose():
        yield
        return
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        kept = [line for line in buffer.getvalue().splitlines(keepends=True)
                if not _DEEPSPEED_PRINTS.match(line.rstrip("\n"))]
        if kept:
            sys.stdout.write("".join(kept))
            sys.stdout.flush()


def init_distributed(timeout_minutes: float = 30) -> None:
    """Initialise DeepSpeed's communication layer (gloo on CPU, NCCL on GPU: DeepSpeed picks).

    On CPU DeepSpeed would JIT-build its shared-memory all-reduce op (1-2 minutes) that only inference uses;
    mark it incompatible first. ``OMP_NUM_THREADS`` defaults to cores / local processes so several ranks on
    one host do not oversubscribe the CPU.
    """
    import datetime

    import deepspeed

    quiet_library_warnings()
    where = placement()
    if skip_cpu_shared_memory_op() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(where.local_world_size, 1)))
    address = rendezvous_address()
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves it
    server = None
    import torch.distributed as dist

    started = dist.is_available() and dist.is_initialized()  # a later run in the same processes (tests)
    if where.world_size > 1 and address is not None and not agent_store and not started:
        server = settle_job_store(address, where, 60.0 * timeout_minutes)
    if server is None:
        try:
            deepspeed.init_distributed(timeout=datetime.timedelta(minutes=timeout_minutes))
        except RuntimeError as exc:  # torch serving the store itself (a wildcard MASTER_ADDR) on a taken port
            if where.rank == 0 and address is not None and "EADDRINUSE" in str(exc):
                raise _port_in_use(address) from None
            raise
        return
    # rank 0 serves the store itself, bound to MASTER_ADDR: torch's env:// rendezvous then connects to it as a
    # client, as it does to torchrun's agent store (the variable says so only for this call)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    try:
        deepspeed.init_distributed(timeout=datetime.timedelta(minutes=timeout_minutes))
    finally:
        del os.environ["TORCHELASTIC_USE_AGENT_STORE"]


def barrier() -> None:
    """Wait for every rank; a no-op in a single process without torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def end_process_groups() -> None:
    """After a command's last collective: wait for every rank, then take the process groups down in order. Left
    to the interpreter's exit, a rank whose peer had already gone could abort in gloo's teardown ("terminate called
    without an active exception", exit -6: seen once at the end of a 2-rank `generate`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


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
