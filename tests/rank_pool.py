"""A fork server for the suite's launched runs: torch, DeepSpeed and the package imported once per pytest worker,
every rank of every run a fresh process forked from it.

A launch on a 2-core machine is mostly process start-up (../shared/notes/pitfalls.md, docs/layout.md): the
``deepspeed`` launcher's two Python processes, then every rank importing torch, DeepSpeed, torch._dynamo and
DeepSpeed's Muon module (5 s of CPU a rank), for a few seconds of training. Here one server process per pytest
worker imports all of that once and does nothing else; a run asks it for N ranks, and it forks N children, each
set up as the ``deepspeed`` launcher sets up a rank (its environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE,
MASTER_*, CROSS_*, PYTHONPATH, CUDA_VISIBLE_DEVICES; ``--local_rank=i`` after the script; stdin closed; its output
captured) and running the same entry point with the same arguments (``python -m MODULE``, ``python SCRIPT``, or a
function for :mod:`dist_utils`). The children end as an interpreter ends (non-daemon threads joined, atexit
handlers, streams flushed); the run's exit status is the launcher's (the first rank to fail, the others then
terminated as ``deepspeed.launcher.launch`` terminates them).

Nothing is kept between runs: the server never runs a job itself (no tensor op, no thread, no process group: :func:`_check_pristine` refuses to fork otherwise), so each child starts from the state of an
interpreter that has just imported the modules, whatever ran before it. What differs from a fresh interpreter is
only what is fixed when an interpreter starts: its hash seed (every child of one server shares it) and the
variables read as torch, OpenMP and oneDNN load (:data:`STARTUP_VARIABLES`: a run that sets one of them otherwise
gets a real launch). ``tests/test_rank_pool.py`` holds the pool to a fresh ``deepspeed`` launch bit for bit on
every layout family. The launchers themselves, signals sent to them, and what a user sees a fresh process print
keep real launches (``launch_utils.run_command(..., launcher=True)``).
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

# Read once, as the interpreter, torch, OpenMP (libgomp reads its variables as it loads) or oneDNN start: a child
# inherits the server's values whatever its own environment says, so a run that sets any of them otherwise is not
# the server's to run (:meth:`RankPool.accepts`).
STARTUP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE",
                     "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE", "PYTHONWARNINGS",
                     "PYTHONSAFEPATH", "PYTHONPATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "MALLOC_CONF",
                     "OMP_WAIT_POLICY", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_SPINCOUNT", "KMP_AFFINITY",
                     "DS_ACCELERATOR", "TORCH_LOGS", "TORCHDYNAMO_DISABLE", "TORCHINDUCTOR_CACHE_DIR",
                     "TORCHINDUCTOR_FX_GRAPH_CACHE", "LLAMA_MEGATRON_VERBOSE")

# What a rank imports: the training command with everything its runs reach (engines, pipeline, ZeRO's Muon module
# the first gradient reduction imports, torch._dynamo through a torch optimizer, torchao for FP8, transformers for
# the tokenizer and exports, lm-eval for eval.tasks), imported by the server once. A module missing here is only
# imported by the runs that need it, each time.
PRELOAD = ("torch", "numpy", "deepspeed", "torch._dynamo", "torch.distributed.elastic.multiprocessing.errors",
           "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.pipe.engine",
           "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.bf16_optimizer",
           "deepspeed.checkpoint", "torchao.float8", "transformers", "safetensors.torch", "psutil",
           "llama_megatron.cli", "llama_megatron.train", "llama_megatron.commands.train",
           "llama_megatron.training.run.loop", "llama_megatron.training.run.generate",
           "llama_megatron.training.engine.pipeline_engine", "llama_megatron.training.engine.training_engine",
           "llama_megatron.data.sp_fastpath", "sentencepiece", "google.protobuf.text_format", "torch.profiler",
           "deepspeed.module_inject.auto_ep_layer", "deepspeed.moe.ep_experts", "deepspeed.comm.mori",
           "encodings.idna", "encodings.raw_unicode_escape")
# how long a rank has to end once the launcher terminates it (deepspeed.launcher.launch: psutil.wait_procs's 30 s)
TERMINATE_GRACE = 30.0


@dataclass
class Job:
    """One launch: ``kind`` "module" (``python -m target args``), "script" (``python target args``), "code"
    (``python -c target args``) or "function" (``target`` a pickled ``(fn, args)``: ``fn(rank, world_size, *args)``
    run inside a gloo group, as :mod:`dist_utils` runs it) on ``nprocs`` ranks, with ``env`` (the launch's whole
    environment) in ``cwd``."""

    kind: str
    target: Any
    args: list
    nprocs: int
    env: dict[str, str]
    cwd: str
    timeout: float | None = None
    local_rank_arg: bool = True  # the deepspeed launcher appends --local_rank=i; one plain process has none
    launcher: bool = True  # as under a launcher (RANK and the rest set); False: one plain process
    port: int = 0
    out_dir: str = ""


@dataclass
class JobResult:
    returncodes: list[int | None]
    returncode: int
    timed_out: bool = False
    seconds: float = 0.0
    cpu_seconds: float = 0.0


# --- the server ----------------------------------------------------------------------------------------------------

def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional dependency (torchao, lm-eval) not installed: its runs import nothing
            pass
    import deepspeed.ops

    # DeepSpeed probes which of its ops this machine can build the first time anything asks (a compiler run and
    # setuptools' import, 0.3 s): every rank's process groups ask (process_groups.skip_cpu_shared_memory_op)
    deepspeed.ops.__compatible_ops__  # noqa: B018 - the attribute's first read runs the probe


def _check_pristine() -> None:
    """The server must be what a just-started interpreter is after its imports: one thread (a fork copies only the
    calling thread: a lock another thread held would stay held in the child), no process group."""
    import torch.distributed as dist

    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    problems = []
    if threads != 1 or threading.active_count() != 1:
        problems.append(f"{threads} threads ({[t.name for t in threading.enumerate()]})")
    if dist.is_available() and dist.is_initialized():
        problems.append("a process group")
    if problems:
        raise RuntimeError(f"rank pool server is not pristine: {', '.join(problems)}")


def _rank_env(job: Job, rank: int) -> dict[str, str]:
    """The environment ``deepspeed.launcher.launch`` gives local rank ``rank`` (runner.py prepends the working
    directory to PYTHONPATH; launch.py sets the rest), or the launch's own for one plain process."""
    env = dict(job.env)
    if not job.launcher:
        return env
    env["PYTHONPATH"] = job.cwd + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port), WORLD_SIZE=str(job.nprocs), CROSS_RANK="0",
               CROSS_SIZE="1", LOCAL_SIZE=str(job.nprocs), RANK=str(rank), LOCAL_RANK=str(rank),
               CUDA_VISIBLE_DEVICES=",".join(map(str, range(job.nprocs))))
    return env


def _exit_code(exc: BaseException) -> int:
    """The exit status an interpreter gives an exception that ends its main (printing what it prints)."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        print(code, file=sys.stderr)
        return 1
    traceback.print_exception(exc)
    return 1


def _run_child(job: Job, rank: int) -> int:
    """In the forked child: become rank ``rank`` of ``job`` and run its entry point as the interpreter would."""
    import runpy

    env = _rank_env(job, rank)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(job.cwd)
    import numpy as np
    import torch

    # a fresh interpreter seeds these generators from the OS (random re-seeds itself at a fork)
    np.random.seed()
    torch.seed()
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS", "").isdigit()
                          else _DEFAULT_THREADS)
    extra = [f"--local_rank={rank}"] if job.launcher and job.local_rank_arg else []
    if job.kind == "function":
        return _run_function(job, rank)
    if job.launcher and job.cwd not in sys.path:  # runner.py's PYTHONPATH, as the interpreter reads it
        sys.path.insert(1, job.cwd)
    if job.kind == "module":
        sys.argv = [job.target, *extra, *job.args]
        sys.path[0] = job.cwd  # `python -m` puts the working directory first
        sys.modules.pop(job.target, None)  # runs as __main__, as `-m` does, not the copy the server imported
        runpy.run_module(job.target, run_name="__main__", alter_sys=True)
    elif job.kind == "code":
        sys.argv = ["-c", *extra, *job.args]
        sys.path[0] = ""  # `python -c` puts the working directory first, as ""
        main = sys.modules["__main__"].__dict__
        main.clear()
        main.update(__name__="__main__", __builtins__=__builtins__)
        exec(compile(job.target, "<string>", "exec"), main)
    else:
        sys.argv = [job.target, *extra, *job.args]
        sys.path[0] = os.path.dirname(os.path.abspath(job.target))
        runpy.run_path(job.target, run_name="__main__")
    return 0


def _run_function(job: Job, rank: int) -> int:
    import torch.distributed as dist

    fn, args = pickle.loads(job.target)
    dist.init_process_group("gloo", rank=rank, world_size=job.nprocs)
    try:
        fn(rank, job.nprocs, *args)
    finally:
        dist.destroy_process_group()
    return 0


def _child_main(job: Job, rank: int, out_path: str, err_path: str) -> None:
    """A forked rank: its streams, its run, then the interpreter's own ending (threads joined, atexit, flush)."""
    try:
        os.close(_CONNECTION_FD)  # the server's: a rank's own children must not hold it open
        for path, target, flags in ((os.devnull, 0, os.O_RDONLY), (out_path, 1, os.O_WRONLY | os.O_CREAT),
                                    (err_path, 2, os.O_WRONLY | os.O_CREAT)):
            fd = os.open(path, flags, 0o644)
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        profile_dir = job.env.get("RANK_POOL_PROFILE")  # where each rank's cProfile of its job goes
        profiler = None
        if profile_dir:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        try:
            code = _run_child(job, rank)
        except BaseException as exc:  # noqa: BLE001 - the interpreter's own handling of an uncaught exception
            code = _exit_code(exc)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(os.path.join(profile_dir, f"rank{rank}.{os.getpid()}.prof"))
        threading._shutdown()  # non-daemon threads, as the interpreter joins them before atexit
        if os.environ.get("RANK_POOL_LATE_IMPORTS"):  # what the server could import for every job (PRELOAD)
            with open(f"{os.environ['RANK_POOL_LATE_IMPORTS']}.{os.getpid()}", "w", encoding="utf-8") as fh:
                fh.write("\n".join(sorted(set(sys.modules) - _SERVER_MODULES)))
        import atexit as _atexit

        _atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
                pass
    except BaseException:  # noqa: BLE001 - never return into the server's loop
        traceback.print_exc()
        code = 1
    os._exit(code)


def _signal_trees(pids: list[int], sig: int) -> None:
    """``sig`` to each of ``pids`` and every process below it, as ``deepspeed.launcher.launch``'s
    ``terminate_process_tree`` signals a rank's tree (the ranks are reaped by the server's loop, never here)."""
    import psutil

    for pid in pids:
        try:
            tree = [psutil.Process(pid)]
            tree += tree[0].children(recursive=True)
        except psutil.Error:
            continue
        for process in tree:
            try:
                process.send_signal(sig)
            except psutil.Error:
                pass


def _all_stopped(pids: list[int]) -> bool:
    import psutil

    try:
        return all(psutil.Process(pid).status() == psutil.STATUS_STOPPED for pid in pids)
    except psutil.Error:
        return False


def _serve_job(job: Job) -> JobResult:
    """Fork the job's ranks, then wait for them as the launcher does: once one fails, SIGTERM to the others and
    SIGKILL :data:`TERMINATE_GRACE` seconds later; past the job's timeout, SIGKILL to all."""
    started = time.monotonic()
    before = set(sys.modules)
    _check_pristine()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pids: list[int] = []
    for rank in range(job.nprocs):
        pid = os.fork()
        if pid == 0:
            _child_main(job, rank, os.path.join(job.out_dir, f"rank{rank}.out"),
                        os.path.join(job.out_dir, f"rank{rank}.err"))
        pids.append(pid)
    codes: dict[int, int | None] = dict.fromkeys(pids)
    deadline = None if job.timeout is None else started + job.timeout
    kill_at: float | None = None
    failed: int | None = None
    timed_out = False
    cpu = 0.0  # the ranks' CPU seconds (their children's not counted)
    fds = {os.pidfd_open(pid): pid for pid in pids}  # readable once the process has ended
    try:
        while fds:
            wakeups = [t for t in (deadline, kill_at and min(kill_at, time.monotonic() + 1.0)) if t is not None]
            ready, _, _ = select.select(list(fds), [], [], max(0.0, min(wakeups) - time.monotonic())
                                        if wakeups else None)
            now = time.monotonic()
            alive = list(fds.values())
            if not ready and deadline is not None and now >= deadline:  # as subprocess.run's timeout kills
                timed_out, deadline, kill_at = True, None, None
                _signal_trees(alive, signal.SIGKILL)
            elif not ready and kill_at is not None and (now >= kill_at or _all_stopped(alive)):
                # (a stopped rank, SIGSTOP's, cannot act on the SIGTERM: its grace would be waited out for nothing)
                kill_at = None
                _signal_trees(alive, signal.SIGKILL)
            for fd in ready:
                pid = fds.pop(fd)
                os.close(fd)
                _, status, usage = os.wait4(pid, 0)
                codes[pid] = os.waitstatus_to_exitcode(status)
                cpu += usage.ru_utime + usage.ru_stime
                if codes[pid] != 0 and failed is None:  # the launcher terminates every rank once one fails
                    failed = codes[pid]
                    _signal_trees(list(fds.values()), signal.SIGTERM)
                    kill_at = now + TERMINATE_GRACE
    finally:
        for fd in fds:
            os.close(fd)
    assert before == set(sys.modules), "the server imported modules while serving a job"
    returncode = failed if failed is not None else 0
    if job.launcher:  # launch.py's sys.exit(returncode): a rank killed by signal N makes it exit 256 - N
        returncode &= 0xFF
    return JobResult([codes[p] for p in pids], returncode, timed_out, time.monotonic() - started, cpu)


_DEFAULT_THREADS = 1  # a rank's thread count where its environment sets none (the client says what a fresh one has)
_CONNECTION_FD = -1
_SERVER_MODULES: set[str] = set()


def serve(fd: int) -> None:
    """The server's loop on the connection ``fd``: a :class:`Job` in, its :class:`JobResult` out."""
    global _DEFAULT_THREADS, _CONNECTION_FD
    _CONNECTION_FD = fd
    conn = Connection(fd)
    _preload()
    import torch

    _DEFAULT_THREADS = int(os.environ.pop("RANK_POOL_DEFAULT_THREADS", "0")) or torch.get_num_threads()
    _SERVER_MODULES.update(sys.modules)
    gc.collect()
    gc.freeze()  # the children's collections (and their page copies) skip what the server imported
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        try:
            result = _serve_job(job)
        except BaseException as exc:  # noqa: BLE001 - reported to the client, which fails the test with it
            conn.send(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            continue
        conn.send(result)


# --- the client ----------------------------------------------------------------------------------------------------

class RankPool:
    """This pytest worker's fork server, started at its first run and ended with the worker."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._env: dict[str, str] = {}
        self.jobs = 0

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a run with environment ``env`` can be forked from the server (its start-up variables equal), and
        the pool is on (``RANK_POOL=0`` in the test session's environment turns it off: every run a fresh launch)."""
        if os.environ.get("RANK_POOL") == "0":
            return False
        server_env = self._env or self._server_env()
        return all(env.get(name) == server_env.get(name) for name in STARTUP_VARIABLES)

    @staticmethod
    def _server_env() -> dict[str, str]:
        return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        env = self._server_env()
        # a fresh rank's own default thread count (torch's, without OMP_NUM_THREADS): the server itself loads
        # OpenMP with one thread, as every launched rank has (launch_utils sets it), and a child sets its own
        env["RANK_POOL_DEFAULT_THREADS"] = str(len(os.sched_getaffinity(0)))
        log = open(os.path.join(tempfile.gettempdir(), f"rank-pool-{os.getpid()}.log"), "wb")  # noqa: SIM115
        self._server = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], cwd=ROOT, env=env,
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT)
        log.close()
        theirs.close()
        self._conn = Connection(ours.detach())
        self._env = env
        try:
            ready = self._conn.recv()
        except EOFError:
            ready = None
        if ready != "ready":
            self.close()
            raise RuntimeError(f"the rank pool server did not start: see {log.name}")
        atexit.register(self.close)

    def run(self, job: Job) -> JobResult:
        if self._server is None or self._server.poll() is not None:
            self._start()
        self.jobs += 1
        self._conn.send(job)
        try:
            result = self._conn.recv()
        except EOFError:
            self._server = None
            raise RuntimeError("the rank pool server died") from None
        if isinstance(result, str):
            raise RuntimeError(f"the rank pool server refused the job: {result}")
        return result

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._server is not None:
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
            self._server = None


POOL = RankPool()


def run(kind: str, target: Any, args: list[str], nprocs: int, env: dict[str, str], cwd: str = ROOT,
        timeout: float | None = None, launcher: bool = True,
        local_rank_arg: bool = True) -> subprocess.CompletedProcess:
    """One launch forked from this worker's server; what ``subprocess.run(..., capture_output=True, text=True)`` of
    the launcher would return (each rank's output after the one before's). Raises ``subprocess.TimeoutExpired``
    past ``timeout`` (its ranks killed), as ``subprocess.run`` does."""
    from llama_megatron.parallel.placement import free_port

    with tempfile.TemporaryDirectory(prefix="rank-pool-") as out_dir:
        job = Job(kind, target, list(args), nprocs, dict(env), os.path.abspath(cwd), timeout, local_rank_arg,
                  launcher, free_port() if launcher else 0, out_dir)
        result = POOL.run(job)
        if os.environ.get("RANK_POOL_LOG"):  # a line per launch: where the suite's time goes (docs/layout.md)
            import json

            with open(os.environ["RANK_POOL_LOG"], "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"), "nprocs": nprocs,
                                     "target": target if isinstance(target, str) else "<function>",
                                     "seconds": round(result.seconds, 3), "cpu": round(result.cpu_seconds, 3)}) + "\n")
        outputs = []
        for stream in ("out", "err"):
            parts = []
            for rank in range(nprocs):
                path = os.path.join(out_dir, f"rank{rank}.{stream}")
                if os.path.exists(path):
                    with open(path, encoding="utf-8", errors="replace") as fh:
                        parts.append(fh.read())
            outputs.append("".join(parts))
    described = ["rank-pool", f"--nprocs={nprocs}", *(["-m"] if kind == "module" else []),
                 target if isinstance(target, str) else "<function>", *map(str, args)]
    if result.timed_out:
        raise subprocess.TimeoutExpired(described, timeout, outputs[0], outputs[1])
    return subprocess.CompletedProcess(described, result.returncode, outputs[0], outputs[1])


if __name__ == "__main__":
    import rank_pool  # the server's Job and JobResult pickled under this module's name, as the client knows them

    rank_pool.serve(int(sys.argv[1]))
