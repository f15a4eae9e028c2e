"""Universal-checkpoint conversion for a resume at another ZeRO partition count (checkpoint/universal_conversion.py),
with faults injected into real 2-process runs (tests/scripts/inject_faults.py, deepspeed launcher, gloo):

- a ZeRO-1 checkpoint saved by one process resumed by two: rank 0 converts with several workers and logs its
  progress, rank 1 waits on the rendezvous store; the run continues as the one-process run does;
- the conversion's writes failing on rank 0 (RLIMIT_FSIZE, as a full disk): both ranks exit 4 with rank 0's one
  line, no partial conversion is left and the checkpoint resumes afterwards;
- rank 0 stopped (SIGSTOP) as it starts converting: rank 1 exits 5 within its timeouts with one line naming rank 0,
  instead of waiting in a barrier until the process group's 30-minute timeout.
"""

from __future__ import annotations

import io
import json
import os
import shutil

import pytest
from launch_utils import ROOT, assert_losses_close, losses, run_command, train_args

from llama_megatron.checkpoint import universal_conversion
from llama_megatron.checkpoint.manifest import verify_tag
from llama_megatron.checkpoint.universal_conversion import conversion_workers

CONFIG = os.path.join(ROOT, "tests", "configs", "e2e_pretrain.json")
SAVED_AT, STEPS = 3, 6


def _args(prefix: str, out, *overrides: str) -> list[str]:
    return train_args(CONFIG, [f"data.prefix={prefix}", f"output_dir={out}", "deepspeed_config=ds_configs/zero1_fp32.json",
                               f"train.steps={STEPS}", *overrides])


def _inject(nprocs: int, runs: list[dict], path) -> object:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(runs, fh)
    return run_command(nprocs, [os.path.join(ROOT, "tests", "scripts", "inject_faults.py")], [str(path)],
                       timeout=900, check=False)


@pytest.fixture(scope="module")
def runs(shakespeare_prefix, tmp_path_factory):
    """One process: the uninterrupted reference and a save at step SAVED_AT (three copies of it). Two processes:
    a resume whose conversion cannot write (then the same resume again), and one whose rank 0 stops."""
    work = tmp_path_factory.mktemp("universal")
    one = _inject(1, [
        {"argv": _args(shakespeare_prefix, work / "reference")},
        {"argv": _args(shakespeare_prefix, work / "saved", f"train.steps={SAVED_AT}",
                       f"checkpoint.save={work}/saved/ckpt", f"checkpoint.interval={SAVED_AT}")},
    ], work / "one.json")
    assert one.returncode == 0, one.stderr[-3000:]
    for copy in ("disk", "stopped"):
        shutil.copytree(work / "saved" / "ckpt", work / copy / "ckpt")
    resume = [f"checkpoint.load={work}/{{}}/ckpt", f"checkpoint.save={work}/{{}}-resumed/ckpt"]
    two = _inject(2, [
        {"argv": _args(shakespeare_prefix, work / "disk-resumed", *(a.format("disk") for a in resume)), "expect": 4,
         "faults": {"universal": {"rank": 0, "bytes": 262144}}},
        {"argv": _args(shakespeare_prefix, work / "disk-resumed", *(a.format("disk") for a in resume),
                       "checkpoint.universal_workers=2"), "faults": {"progress_seconds": 0.5}},
    ], work / "two.json")
    stopped = _inject(2, [
        {"argv": _args(shakespeare_prefix, work / "stopped-resumed", *(a.format("stopped") for a in resume),
                       "distributed.timeout_minutes=0.1"),
         # expecting 0, rank 1 leaves the launch with 1 after its 5, and the launcher ends the stopped rank 0
         "faults": {"universal": {"rank": 0, "signal": "SIGSTOP"}}},
    ], work / "stopped.json")
    return work, two, stopped


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_a_failed_conversion_ends_every_rank_with_rank0s_line(runs) -> None:
    work, two, _ = runs
    assert two.returncode == 0, two.stderr[-3000:]  # each run exited as expected: 4, then 0
    failed = [e for e in _errors(two.stderr) if "to a universal checkpoint failed" in e]
    # every rank exits 4 with rank 0's reason, printed once for the launch (llama_megatron/errors.py, report_once)
    assert len(failed) == 1, two.stderr[-3000:]
    assert f"disk/ckpt/global_step{SAVED_AT} to a universal checkpoint failed (1. Extracting ZeRO fragments): " \
           "RuntimeError: " in failed[0] and "GiB free there; the checkpoint itself is unchanged" in failed[0]


def test_the_resume_after_it_converts_and_continues_exactly(runs) -> None:
    work, two, _ = runs
    resumed = losses(work / "disk-resumed")
    assert sorted(resumed) == list(range(SAVED_AT + 1, STEPS + 1))
    # the universal checkpoint's optimizer state at DP2: the same run as one process, gradients summed in
    # another order
    assert_losses_close(resumed, losses(work / "reference"), 1e-6, range(SAVED_AT + 1, STEPS + 1))
    ckpt = work / "disk" / "ckpt"
    assert (ckpt / f"global_step{SAVED_AT}_universal").is_dir()
    assert (ckpt / "latest_universal").read_text() == f"global_step{SAVED_AT}_universal"
    assert not [n for n in os.listdir(ckpt) if n.startswith(".tmp")]  # the failed attempt's output went
    log = two.stdout
    assert f"converting {ckpt}/global_step{SAVED_AT} to a universal checkpoint (2 extract, 2 merge workers); " \
           "the other ranks wait for it" in log
    assert f"universal conversion of global_step{SAVED_AT}: " in log  # progress while it runs
    assert f"converted global_step{SAVED_AT} to a universal checkpoint in " in log


def test_a_stopped_rank0_ends_the_waiting_ranks(runs) -> None:
    work, _, stopped = runs
    assert stopped.returncode != 0 and "run exited 5, expected 0" in stopped.stderr, stopped.stderr[-3000:]
    lines = [e for e in _errors(stopped.stderr) if "rank 0 stopped answering while converting" in e
             or "rank 0 reported nothing for" in e]
    assert len(lines) == 1 and f"stopped/ckpt/global_step{SAVED_AT}" in lines[0], stopped.stderr[-3000:]
    ckpt = work / "stopped" / "ckpt"
    assert not (ckpt / f"global_step{SAVED_AT}_universal").exists()
    verify_tag(str(ckpt / f"global_step{SAVED_AT}"))  # the checkpoint itself intact


def test_conversion_workers(tmp_path, monkeypatch) -> None:
    (tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 1000)
    assert conversion_workers(str(tmp_path), 3) == (3, 3)
    cores = min(8, 2 * len(os.sched_getaffinity(0)))
    assert conversion_workers(str(tmp_path)) == (cores, cores)

    class Memory:
        available = 2 * 1000 + 1  # room for one optimizer file and its fragments

    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory())
    assert conversion_workers(str(tmp_path)) == (1, cores)


def test_output_reader_follows_phases_and_progress() -> None:
    stream = io.BytesIO(b"args = Namespace()\n*** 1. Extracting ZeRO fragments\n 0%|  | 0/4 [00:00<?, ?it/s]\r"
                        b" 50%|##| 2/4 [00:01<00:01, 2.0it/s]\r*** 2. Merging slices .....\n"
                        b" 25%|#| 3/12 [00:02<00:06]\rTraceback (most recent call last):\n  File \"x.py\"\n"
                        b"RuntimeError: unexpected pos 704 vs 598\n")
    reader = universal_conversion._OutputReader(stream)
    reader.join()
    assert reader.progress() == "2. Merging slices 3/12"
    assert reader.error() == "RuntimeError: unexpected pos 704 vs 598"
