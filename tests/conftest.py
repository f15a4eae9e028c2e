import os
import re
import sys

# Multi-process tests on a 2-core machine: one thread per process, or they oversubscribe and crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data/corpus/shakespeare.jsonl")


def _preprocess(text_file: str, prefix: str) -> str:
    """``text_file`` tokenised by `llama-megatron preprocess` with the shipped tokenizer (with EOD)."""
    from llama_megatron.cli import main as cli_main

    assert cli_main(["preprocess", "--input", text_file, "--tokenizer", os.path.join(ROOT, "data/tokenizer"),
                     "--output-prefix", prefix, "--append-eod", "--quiet"]) == 0
    return prefix + "_text_document"


@pytest.fixture(scope="session")
def shakespeare_prefix(tmp_path_factory) -> str:
    """The shipped corpus tokenised, once per test session."""
    return _preprocess(CORPUS, str(tmp_path_factory.mktemp("shakespeare") / "shakespeare"))


@pytest.fixture(scope="session")
def short_documents_prefix(tmp_path_factory) -> str:
    """Every line of the corpus as its own document (with EOD): most samples pack several documents, so
    per-document attention differs from causal attention in almost every sample."""
    import json

    out = tmp_path_factory.mktemp("short-docs")
    text = out / "lines.txt"
    with open(CORPUS, encoding="utf-8") as src:
        lines = [line for record in src for line in json.loads(record)["text"].splitlines() if line.strip()]
    text.write_text("\n".join(lines[:20000]) + "\n", encoding="utf-8")
    return _preprocess(str(text), str(out / "lines"))


# The slowest test files on a 2-core CPU (seconds, measured), started first so that the two xdist workers
# (scripts/test.sh) finish together instead of one running a long file alone at the end. A file not listed runs
# after these, in collection order; a wrong figure costs time, never a result.
FILE_SECONDS = {  # seconds in a whole run (2026-12-07, an Intel Xeon, 2 workers: each file beside the other's
    # load, a fresh clone), with the launched runs forked from the rank pool (tests/rank_pool.py)
    "test_readme_tour.py": 500, "test_model_families.py": 250, "test_training_e2e.py": 240,
    "test_training_planner.py": 230, "test_benchmark_scripts.py": 230, "test_training_fp8.py": 170,
    "test_training_pipeline_schedules.py": 170, "test_parallel_multinode.py": 170, "test_model_kernels.py": 140,
    "test_training_preference.py": 140, "test_training_profile.py": 120, "test_training_recipes.py": 150,
    "test_training_grpo.py": 75,
    "test_model_lora.py": 100, "test_rank_pool.py": 100, "test_training_lm_eval.py": 100,
    "test_training_estimate.py": 90, "test_training_lm_eval_layouts.py": 80, "test_training_launcher_signals.py": 70,
    "test_training_async_save.py": 70, "test_training_sft.py": 60, "test_model_moe.py": 50,
    "test_training_doctor.py": 50, "test_parallel_context.py": 40, "test_parallel_rendezvous.py": 40,
    "test_checkpoint_universal.py": 30, "test_parallel_zero3_init.py": 20, "test_training_faults.py": 20,
    "test_model_parity.py": 20, "test_parallel_float8.py": 20, "test_training_call_graph.py": 20,
    "test_training_generate.py": 20, "test_training_watchdog.py": 20,
}


# A command run in this process (generate, a refused train) sets up a single-process rendezvous: DeepSpeed writes
# RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* into os.environ and builds a gloo group. Left behind, they make the next
# test in this worker a rank of a job (accelerate's state behind TRL's and transformers' trainers then builds a
# group of its own; a check that a command builds no process group sees the last test's). Every test ends as it
# began.
RENDEZVOUS_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _rendezvous_left_as_found():
    import torch.distributed as dist

    saved = {key: os.environ.get(key) for key in RENDEZVOUS_VARIABLES}
    started = dist.is_available() and dist.is_initialized()
    yield
    if not started and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks added here
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if LAUNCHING_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.launched)
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: a file's own order is kept


# --- the quick loop: `-m "not launched"` runs every test that starts no process ----------------------------------

# Fixtures that start processes (a launcher, torch.multiprocessing, a worker pool, a subprocess): every test that
# uses one is marked `launched` at collection. A test whose own body starts one carries the mark itself
# (``@pytest.mark.launched``, or ``pytestmark`` for a file). Both are enforced below: a fixture not listed here, or a
# test without the mark, that starts a process fails, so the quick loop stays quick and starts nothing.
LAUNCHING_FIXTURES = {
    "checkpoints", "eight_rank_runs", "eval_layouts", "faults", "four_rank", "launched", "layout_matrix", "layouts", "lora_runs", "profiled", "profiled_layouts", "in_training",
    "fp8_runs", "gpu_runs", "reference", "references", "restarted", "resumes", "runs", "single", "single_process",
    "sft_run", "single_source", "stalled", "stopped", "tour", "trl_case", "twin_runs", "two_rank", "two_rank_resumed",
    "two_rank_runs",
    "universal_resumed",
}

_STARTED: list[str] = []  # what this process started, in order (the checks compare lengths)
# What counts as starting a process: a Python interpreter, a shell, a launcher (our code or a run of it), and any
# multiprocessing worker; not a system utility a library runs on its own (ldconfig for ctypes), which would make
# whichever test came first "launched"
_PROGRAMS = re.compile(r"python[\d.]*|bash|sh|deepspeed|torchrun|srun|llama-megatron")


def _count_starts() -> None:
    import multiprocessing.process
    import subprocess

    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def counted_popen_init(self, args, *rest, **kwargs):
        words = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
        if words and _PROGRAMS.fullmatch(os.path.basename(words[0])):
            _STARTED.append(" ".join(words)[:200])
        popen_init(self, args, *rest, **kwargs)

    def counted_start(self):
        _STARTED.append(f"a multiprocessing process ({getattr(self, '_target', None)})")
        process_start(self)

    subprocess.Popen.__init__ = counted_popen_init
    multiprocessing.process.BaseProcess.start = counted_start

    import rank_pool

    pool_run = rank_pool.RankPool.run

    def counted_pool_run(self, job):  # ranks forked from the rank pool's server are processes started too
        _STARTED.append(f"{job.nprocs} rank(s) from the rank pool: {job.target if job.kind != 'function' else 'fn'}")
        return pool_run(self, job)

    rank_pool.RankPool.run = counted_pool_run


_count_starts()


def _launched(item) -> bool:
    return item.get_closest_marker("launched") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = len(_STARTED)
    outcome = yield
    if len(_STARTED) > before and fixturedef.argname not in LAUNCHING_FIXTURES:
        outcome.force_exception(pytest.fail.Exception(
            f"fixture {fixturedef.argname!r} started a process ({_STARTED[before]}): add it to LAUNCHING_FIXTURES in "
            "tests/conftest.py", pytrace=False))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = len(_STARTED)
    outcome = yield
    if len(_STARTED) > before and not _launched(item):
        outcome.force_exception(pytest.fail.Exception(
            f"{item.nodeid} started a process ({_STARTED[before]}): mark it @pytest.mark.launched", pytrace=False))


# --- stress mode: the suite (or any file) with CPU-bound neighbours, as on a shared CI machine --------------------

def pytest_addoption(parser) -> None:
    parser.addoption("--stress", type=int, default=0, metavar="N",
                     help="run N CPU-bound neighbour processes (busy loops) for the whole session, as a shared CI "
                          "machine's neighbours do: a test whose healthy run depends on machine speed fails here "
                          "first (e.g. bash scripts/test.sh --stress 2 tests/test_parallel_multinode.py)")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "launched: the test or a fixture it uses starts processes (the launcher, "
                                       "torch.multiprocessing, a worker pool); -m 'not launched' is the quick loop")
    # the controller only (not each xdist worker): N neighbours in all
    count = config.getoption("--stress", 0)
    if count and not hasattr(config, "workerinput"):
        import subprocess

        config._stress_neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                                     for _ in range(count)]


def pytest_unconfigure(config) -> None:
    for neighbour in getattr(config, "_stress_neighbours", []):
        neighbour.kill()
        neighbour.wait()


# --- a fixture that fails shows what its launched runs printed --------------------------------------------------

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With RANK_POOL_LOG set (tests/rank_pool.py logs each launch's ranks there), a line per test with the CPU
    seconds this worker and the processes it waited for spent on it: where the suite's time goes."""
    log = os.environ.get("RANK_POOL_LOG")
    if not log:
        yield
        return
    import json
    import resource
    import time

    def cpu(who: int) -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    before = time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    yield
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"test": item.nodeid, "seconds": round(time.monotonic() - before[0], 3),
                             "self_cpu": round(cpu(resource.RUSAGE_SELF) - before[1], 3),
                             "children_cpu": round(cpu(resource.RUSAGE_CHILDREN) - before[2], 3)}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    import launch_utils

    item._launched_before = len(launch_utils.LAUNCHED)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup" and report.failed:
        import launch_utils

        for result in launch_utils.LAUNCHED[getattr(item, "_launched_before", 0):]:
            report.sections.append((f"launched run (exit {result.returncode}): {' '.join(map(str, result.args))[:300]}",
                                    f"stdout tail:\n{(result.stdout or '')[-2000:]}\nstderr tail:\n"
                                    f"{(result.stderr or '')[-4000:]}"))
