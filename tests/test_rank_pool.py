"""The rank pool (tests/rank_pool.py) keeps nothing between jobs: the same runs forked from a used pool and started
by a fresh `deepspeed` launch (or, for one process, a fresh interpreter) write the same metrics and the same
checkpoints, bit for bit, on every layout family the launched tests use: TP with SP, PP under each schedule, DP with
ZeRO 1-3 in bf16, CP with per-document attention, EP with a Mixtral, FP8, recomputation, Llama 4 in one process.

Before its runs, the pool runs a job that leaves behind everything a process can (a seed drawn, torch's default
dtype and thread count changed, an environment variable, a thread still running, a signal handler, a patched
function of the package): the pool's children start from its server, which ran none of it.
"""

from __future__ import annotations

import json
import os

import pytest
import rank_pool
import torch
from family_cases import FAMILIES
from launch_utils import PRETRAIN_CONFIG, ROOT, run_command, train_args

pytestmark = pytest.mark.launched

STEPS = 3
BF16 = "deepspeed_config=ds_configs/zero1_bf16.json"
ZERO1 = "deepspeed_config=ds_configs/zero1_fp32.json"
# name -> overrides: one run of each layout family, 4 ranks, 3 steps, a checkpoint at the last
FOUR_RANKS = {
    "tp2-pp2-sp-1f1b": ["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true"],
    "pp2-dp2-zb-h1": ["parallel.pipeline=2", "pipeline.schedule=zb-h1"],
    "pp2-tp2-interleaved": ["parallel.pipeline=2", "parallel.tensor=2", "pipeline.schedule=interleaved-1f1b",
                            "pipeline.virtual_stages=2"],
    "pp2-dp2-zb-v-recompute": ["parallel.pipeline=2", "pipeline.schedule=zb-v", "pipeline.virtual_stages=2",
                               "activation_checkpointing.interval=1"],
    "cp2-tp2-perdoc": ["parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
                       "data.per_document_attention=true"],
    "dp4-zero2-bf16": ["deepspeed_config=ds_configs/zero2_bf16.json"],
    "dp2-tp2-zero3-bf16": ["parallel.tensor=2", "deepspeed_config=ds_configs/zero3_bf16.json"],
    "mixtral-ep2-tp2-sp": [*FAMILIES["mixtral"].runs, "parallel.expert=2", "parallel.tensor=2", ZERO1,
                           "parallel.sequence_parallel=true"],
    "fp8-tp2-dp2": [BF16, 'fp8={"recipe": "rowwise"}', "parallel.tensor=2"],
}
ONE_PROCESS = {"llama4": FAMILIES["llama4"].runs, "fp8-tensorwise": [BF16, 'fp8={"recipe": "tensorwise"}']}
# what a record holds that depends on time, not on the run
TIMED = {"tokens_per_s", "tflops_per_device", "mfu", "hfu"}

LEAKY_JOB = """
import os, signal, threading, time, torch
import llama_megatron.model.moe as moe
torch.manual_seed(1234); torch.rand(3)
torch.set_default_dtype(torch.float64); torch.set_num_threads(2)
os.environ["LLAMA_MEGATRON_LEAK"] = "1"
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
moe.MoEMLP.choose = None
"""


def _runs(prefix: str, out, layouts: dict[str, list[str]]) -> list[list[str]]:
    return [train_args(PRETRAIN_CONFIG, [f"data.prefix={prefix}", f"output_dir={out}/{name}", f"train.steps={STEPS}",
                                         f"checkpoint.save={out}/{name}/ckpt", f"checkpoint.interval={STEPS}",
                                         *overrides]) for name, overrides in layouts.items()]


def _records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMED} for line in fh]


def _tensors(value, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a loaded checkpoint file, by its path in the nested containers."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    return {k: v for key, item in items for k, v in _tensors(item, f"{path}/{key}").items()}


def _checkpoint(run_dir) -> dict[str, dict[str, torch.Tensor]]:
    tag = os.path.join(run_dir, "ckpt", f"global_step{STEPS}")
    return {name: _tensors(torch.load(os.path.join(tag, name), map_location="cpu", weights_only=False))
            for name in sorted(os.listdir(tag)) if name.endswith(".pt")}


@pytest.fixture(scope="module")
def twin_runs(tmp_path_factory, shakespeare_prefix, short_documents_prefix) -> dict:
    work = tmp_path_factory.mktemp("pool")
    prefix = {name: short_documents_prefix if "perdoc" in name else shakespeare_prefix for name in FOUR_RANKS}
    leaky = rank_pool.run("code", LEAKY_JOB, [], 4, dict(os.environ, OMP_NUM_THREADS="1"))
    assert leaky.returncode == 0, leaky.stderr
    for kind, fresh in (("pool", False), ("fresh", True)):
        four = [run for name in FOUR_RANKS
                for run in _runs(prefix[name], work / kind, {name: FOUR_RANKS[name]})]
        with open(work / f"{kind}-four.json", "w", encoding="utf-8") as fh:
            json.dump(four, fh)
        run_command(4, [os.path.join(ROOT, "tests", "scripts", "train_many.py")], [str(work / f"{kind}-four.json")],
                    fresh=fresh)
        with open(work / f"{kind}-one.json", "w", encoding="utf-8") as fh:
            json.dump(_runs(shakespeare_prefix, work / kind, ONE_PROCESS), fh)
        run_command(1, [os.path.join(ROOT, "tests", "scripts", "train_many.py")], [str(work / f"{kind}-one.json")],
                    fresh=fresh)
    return {"dir": work, "leaky": leaky}


@pytest.mark.parametrize("name", [*FOUR_RANKS, *ONE_PROCESS])
def test_a_job_in_a_used_pool_equals_a_fresh_launch(twin_runs, name) -> None:
    pool, fresh = (twin_runs["dir"] / kind / name for kind in ("pool", "fresh"))
    assert _records(pool) == _records(fresh) and len(_records(pool)) == STEPS
    ours, theirs = _checkpoint(pool), _checkpoint(fresh)
    assert sorted(ours) == sorted(theirs) and ours
    for file, tensors in ours.items():
        assert sorted(tensors) == sorted(theirs[file]), file
        for path, tensor in tensors.items():
            other = theirs[file][path]
            assert tensor.dtype == other.dtype and torch.equal(tensor, other), (file, path)


def test_the_pool_reports_what_a_launcher_reports(tmp_path) -> None:
    """Exit codes as the deepspeed launcher gives them (a rank's code; 256 - N for a rank killed by signal N, the
    other ranks then terminated), each rank's output in rank order, one plain process without the launcher's
    variables."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = ("import os, signal, sys, time\nrank = int(os.environ['RANK'])\nprint('rank', rank, os.environ['WORLD_SIZE'],"
            " os.environ['LOCAL_SIZE'], sys.argv[1:])\nif rank == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(0 if rank == 0 else 600)")
    killed = rank_pool.run("code", code, ["--x"], 3, env, timeout=120)
    assert killed.returncode == 256 - 9
    assert killed.stdout.splitlines()[:2] == ["rank 0 3 3 ['--local_rank=0', '--x']",
                                              "rank 1 3 3 ['--local_rank=1', '--x']"]
    plain = rank_pool.run("code", "import os, sys; print(os.environ.get('RANK')); sys.exit(3)", [], 1, env,
                          launcher=False)
    assert (plain.returncode, plain.stdout) == (3, "None\n")
    raised = rank_pool.run("code", "raise ValueError('boom')", [], 2, env)
    assert raised.returncode == 1 and raised.stderr.count("ValueError: boom") >= 1
