"""`llama-megatron doctor` under real launches: a healthy TP2 x PP2 job set up as the deepspeed launcher sets up its
ranks (forked from the rank pool, tests/rank_pool.py); ranks that disagree (another config on one rank, another copy
of the data behind the same path) and a rank that never starts, each rank a process of its own started as a
scheduler starts it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from launch_utils import PRETRAIN_CONFIG, ROOT, run_command, train_args

from llama_megatron.parallel.placement import free_port

CONFIG = PRETRAIN_CONFIG
TOKENIZER = os.path.join(ROOT, "data", "tokenizer")


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def _ranks(world: int, args_of, cwd_of=lambda rank: ROOT, started=None) -> list[subprocess.CompletedProcess]:
    """Plain processes with the variables a scheduler exports (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), 2 per
    "node"; only the ranks in ``started`` are started."""
    port = str(free_port())
    procs = []
    for rank in started if started is not None else range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, "-m", "llama_megatron", "doctor", *args_of(rank)],
                                      cwd=cwd_of(rank), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


@pytest.mark.launched
def test_a_healthy_tp2_pp2_job(shakespeare_prefix, tmp_path) -> None:
    report = tmp_path / "doctor.json"
    args = train_args(CONFIG, [f"data.prefix={shakespeare_prefix}", f"output_dir={tmp_path}", "parallel.tensor=2",
                               "parallel.pipeline=2", "batch.micro_batch_size=4",
                               f"checkpoint.save={tmp_path}/ckpt"]) + ["--output", str(report)]
    result = run_command(4, ["-m", "llama_megatron", "doctor"], args, launcher=True)
    assert _errors(result.stderr) == []
    table = result.stdout
    for row in ("ranks", "versions", "config", "data and tokenizer files", "checkpoint directory",
                "all-reduce, tensor groups of 2", "send/recv between the 2 pipeline stages", "stragglers",
                "transport environment"):
        assert any(line.startswith(row + " ") for line in table.splitlines()), (row, table)
    assert "doctor: 9 of 9 checks passed" in table
    data = json.loads(report.read_text())
    assert data["ok"] and [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    by_name = {c["name"]: c for c in data["checks"]}
    assert by_name["checkpoint directory"]["status"] == "ok"
    assert by_name["all-reduce, tensor groups of 2"]["data"]["slowest_bytes_per_s"] > 0
    assert len(by_name["data and tokenizer files"]["data"]["files"]) == 2 + len(os.listdir(TOKENIZER))
    assert not [n for n in os.listdir(tmp_path / "ckpt") if n.startswith(".doctor")]  # its probes removed


@pytest.mark.launched
def test_ranks_that_disagree_are_named(shakespeare_prefix, tmp_path) -> None:
    """Rank 1 runs another config (seed) and, behind the same relative data path, a copy of the data with one byte
    changed; behind the same relative checkpoint path rank 0 cannot create the directory (a file is there: the
    check used to skip a barrier rank 1 entered). The tokenizer dir holds a subdirectory (HF's
    ``.cache/huggingface/``), which is not one of its files."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, tokenizer)
    (tokenizer / ".cache" / "huggingface").mkdir(parents=True)
    for node in ("node0", "node1"):
        (tmp_path / node / "data").mkdir(parents=True)
        for suffix in (".bin", ".idx"):
            shutil.copy(shakespeare_prefix + suffix, tmp_path / node / "data" / f"corpus{suffix}")
    idx = tmp_path / "node1" / "data" / "corpus.idx"
    raw = bytearray(idx.read_bytes())
    raw[-1] ^= 1
    idx.write_bytes(bytes(raw))
    (tmp_path / "node0" / "ckpt").write_text("not a directory")

    def args_of(rank: int) -> list[str]:
        return train_args(CONFIG, ["data.prefix=data/corpus", f"tokenizer={tokenizer}", f"output_dir={tmp_path}",
                                   "checkpoint.save=ckpt", "parallel.tensor=2", *(["seed=7"] if rank == 1 else [])])

    results = _ranks(2, args_of, cwd_of=lambda rank: str(tmp_path / f"node{rank}"))
    assert [r.returncode for r in results] == [2, 0], results[0].stderr[-3000:]
    assert _errors(results[0].stderr) == [f"error: doctor: 3 check(s) failed: config, data and tokenizer files, "
                                          f"checkpoint directory (table above, {tmp_path}/doctor.json)"]
    rows = {line.split("  ")[0].strip(): line for line in results[0].stdout.splitlines()}
    assert "failed" in rows["config"] and "differs: rank 1 (" in rows["config"]
    assert "data/corpus.idx differ on rank 1 (" in rows["data and tokenizer files"]
    assert "data/corpus.bin" not in rows["data and tokenizer files"] and ".cache" not in results[0].stdout
    assert "ckpt: rank 0 (" in rows["checkpoint directory"] and "FileExistsError" in rows["checkpoint directory"]


@pytest.mark.launched
def test_a_rank_that_never_starts_is_named(shakespeare_prefix, tmp_path) -> None:
    """World size 3, 2 per node: rank 2 (node 1) never starts; both ranks present end within the timeout (30 s: the
    present ranks' own start-up, seconds apart beside CPU-bound neighbours, never reaches it)."""
    args = train_args(CONFIG, [f"data.prefix={shakespeare_prefix}", f"output_dir={tmp_path}",
                               "batch.global_batch_size=6"]) + ["--timeout-minutes", "0.5"]
    results = _ranks(3, lambda rank: args, started=[0, 1])
    for result in results:
        assert result.returncode == 5, result.stderr[-3000:]
        (line,) = _errors(result.stderr)
        assert line.startswith("error: doctor: rank 2 (node 1, no rank of it arrived) did not reach the "
                               "rendezvous at 127.0.0.1:") and line.endswith(" within 30 s (2 of 3 ranks did)"), line
