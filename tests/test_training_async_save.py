"""Asynchronous saves (``checkpoint.async_save``, training/background_save.py): training goes on while a thread
writes the files; the tag becomes ``latest`` only when every rank's files are complete. Real runs under the
deepspeed launcher (gloo, CPU), DP2 and PP2:

- a checkpoint saved in the background resumes bit for bit, at ZeRO-0, 1, 2 and 3 (DP2), at PP2, with expert
  parallelism (a Mixtral model at EP2) and for LoRA adapters (on the ZeRO-1 run's checkpoint);
- faults injected while a save is in flight (tests/scripts/inject_faults.py; the host copy made 0.5 s late, so the
  next step's optimizer step waits for it, and each file written 0.5 s late so that steps run meanwhile; a copy
  that read a weight after that step changed it fails the exact resumes below): SIGTERM to one rank (the run waits for the save in flight, saves the stopping step, exits 0,
  and the restart continues bit for bit); saves every step, back to back (each waits for the one before); the run
  ending with a save in flight (the last tag complete and latest); a full disk on one rank during the background
  write (exit 4 at the next step boundary, one line, the temporary removed, latest still the previous tag, which
  resumes exactly); kill -9 of one rank's process from inside its writer (the previous tag stays latest and intact
  and resumes exactly); the step guard ending the run (NaN losses) while a good step's save is in flight (exit 3
  once that tag is complete and latest).
- the host copy's bytes, as the run logs them, equal what ``estimate`` reports for the layout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from launch_utils import (
    PRETRAIN_CONFIG,
    ROOT,
    assert_losses_close,
    launch_many,
    losses,
    run_args,
    run_command,
)

from llama_megatron.checkpoint.manifest import verify_tag
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.diagnostics.memory_estimate import estimate
from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config

CONFIG = PRETRAIN_CONFIG
STEPS, HALF = 6, 3
ZERO = {stage: f"deepspeed_config=ds_configs/zero{stage}_fp32.json" for stage in range(4)}
ASYNC = "checkpoint.async_save=true"
MIXTRAL_EP2 = ["model.model_type=mixtral", "model.num_key_value_heads=4", "model.num_local_experts=4",
               "model.num_experts_per_tok=2", "parallel.expert=2"]
LAYOUTS = {"zero0-dp2": [ZERO[0]], "zero1-dp2": [ZERO[1]], "zero2-dp2": [ZERO[2]], "zero3-dp2": [ZERO[3]],
           "zero1-pp2": [ZERO[1], "parallel.pipeline=2"], "ep2-zero1": [ZERO[1], *MIXTRAL_EP2],
           # adapters on the zero1-dp2 run's last checkpoint (saved before, in the same launch)
           "lora-dp2": [ZERO[1], 'lora={"rank": 4, "alpha": 8}', "checkpoint.finetune=true", "LORA_BASE"]}


def _args(prefix: str, out, *overrides: str) -> list[str]:
    return run_args(prefix, out, f"train.steps={STEPS}", *overrides)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("async-save")


@pytest.fixture(scope="module")
def resumes(work, shakespeare_prefix) -> dict:
    """Each layout straight, saved in the background at step 3 (and 6), and resumed from step 3; one launch."""
    runs = []
    for name, overrides in LAYOUTS.items():
        overrides = [f"checkpoint.load={work / 'zero1-dp2-saved' / 'ckpt'}" if o == "LORA_BASE" else o
                     for o in overrides]
        saved = work / f"{name}-saved"
        runs += [_args(shakespeare_prefix, work / f"{name}-straight", *overrides),
                 _args(shakespeare_prefix, saved, *overrides, ASYNC, f"checkpoint.save={saved}/ckpt",
                       f"checkpoint.interval={HALF}"),
                 _args(shakespeare_prefix, work / f"{name}-resumed", *overrides, f"checkpoint.load={saved}/ckpt",
                       f"checkpoint.tag=global_step{HALF}", "checkpoint.finetune=false")]
    result = launch_many(2, runs, str(work / "resumes.json"))
    return {"stdout": result.stdout}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_background_save_resumes_bit_for_bit(name, resumes, work) -> None:
    straight = losses(str(work / f"{name}-straight"))
    assert losses(str(work / f"{name}-saved")) == straight, "saving in the background changed the run"
    resumed = losses(str(work / f"{name}-resumed"))
    assert sorted(resumed) == list(range(HALF + 1, STEPS + 1))
    assert_losses_close(resumed, straight, 0.0, range(HALF + 1, STEPS + 1))
    ckpt = work / f"{name}-saved" / "ckpt"
    assert (ckpt / "latest").read_text() == f"global_step{STEPS}"
    for tag in (HALF, STEPS):
        verify_tag(str(ckpt / f"global_step{tag}"))  # every file in the manifest, checksums equal
    assert not [n for n in os.listdir(ckpt) if n.startswith(".tmp")]
    assert f"saving checkpoint {ckpt}/global_step{HALF} in the background" in resumes["stdout"]
    # the host copy is what `estimate` says it is (the largest rank's: a stage's first DP rank, which also saves
    # the module's weights), up to the few bytes of Adam's step counters
    (copied,) = re.findall(rf"saved checkpoint {re.escape(str(ckpt))}/global_step{HALF} \(written in the "
                           r"background from a host copy of ([0-9.]+) MiB on the largest rank\)", resumes["stdout"])
    config = TrainingConfig.from_file(CONFIG, [o for o in LAYOUTS[name] if o != "LORA_BASE"] + [ASYNC])
    stages = estimate(config, build_deepspeed_config(config, os.path.join(ROOT, config.deepspeed_config), 2), 2).stages
    assert float(copied) == pytest.approx(max(s.async_save_host for s in stages) / 2**20, abs=2e-3)


def _fault_run(prefix: str, out, *overrides: str, expect: int = 0, faults: dict | None = None) -> dict:
    argv = _args(prefix, out, ZERO[1], ASYNC, f"checkpoint.save={out}/ckpt", *overrides)
    return {"argv": argv, "expect": expect, "faults": {"write_delay": 0.5, "copy_delay": 0.5, **(faults or {})}}


def _inject(nprocs: int, runs: list[dict], runs_file, check: bool = True) -> subprocess.CompletedProcess:
    with open(runs_file, "w", encoding="utf-8") as fh:
        json.dump(runs, fh)
    return run_command(nprocs, [os.path.join(ROOT, "tests", "scripts", "inject_faults.py")], [str(runs_file)],
                       timeout=1200, check=check)


@pytest.fixture(scope="module")
def faults(work, shakespeare_prefix) -> dict:
    p = shakespeare_prefix
    straight = work / "zero1-dp2-straight"  # from the resumes launch
    runs = [
        _fault_run(p, work / "sigterm", "checkpoint.interval=2", "checkpoint.load=auto",
                   faults={"signal": {"step": 3, "rank": 1, "name": "SIGTERM"}}),
        _fault_run(p, work / "sigterm", "checkpoint.interval=2", "checkpoint.load=auto"),
        _fault_run(p, work / "back-to-back", "checkpoint.interval=1"),
        _fault_run(p, work / "disk", "checkpoint.interval=2", expect=4,
                   faults={"file_size": {"save": 2, "rank": 1, "bytes": 65536}}),
        _fault_run(p, work / "disk", "checkpoint.interval=2", "checkpoint.load=auto"),
        # NaN from step 3 on, one bad step allowed: the step guard ends the run while step 2's save is in flight
        _fault_run(p, work / "guard", "checkpoint.interval=2", "train.max_bad_steps=1", expect=3,
                   faults={"loss": {str(s): "nan" for s in range(3, STEPS + 1)}}),
    ]
    result = _inject(2, runs, work / "faults.json")
    killed = _inject(2, [_fault_run(p, work / "killed", "checkpoint.interval=2",
                                    faults={"kill_in_writer": {"save": 2, "rank": 1}})], work / "killed.json",
                     check=False)
    restarted = _inject(2, [_fault_run(p, work / "killed", "checkpoint.interval=2", "checkpoint.load=auto")],
                        work / "restarted.json")
    return {"result": result, "killed": killed, "restarted": restarted, "straight": losses(str(straight))}


def test_sigterm_with_a_save_in_flight_waits_saves_and_resumes_exactly(faults, work) -> None:
    out = work / "sigterm"
    assert "stopped at step 3 on SIGTERM" in faults["result"].stdout
    assert (out / "ckpt" / "latest").read_text() == f"global_step{STEPS}"
    got = losses(str(out))  # the stopped run's steps 1-3, then the restart's 4-6, appended
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_losses_close(got, faults["straight"], 0.0, range(1, STEPS + 1))
    verify_tag(str(out / "ckpt" / "global_step3"))


def test_saves_back_to_back_and_at_the_end_are_all_complete(faults, work) -> None:
    ckpt = work / "back-to-back" / "ckpt"
    tags = sorted(n for n in os.listdir(ckpt) if n.startswith("global_step"))
    assert tags == [f"global_step{s}" for s in range(1, STEPS + 1)]
    for tag in tags:
        verify_tag(str(ckpt / tag))
    assert (ckpt / "latest").read_text() == f"global_step{STEPS}"
    assert_losses_close(losses(str(work / "back-to-back")), faults["straight"], 0.0, range(1, STEPS + 1))


def test_a_full_disk_during_the_background_write_ends_the_run_and_keeps_the_last_tag(faults, work) -> None:
    errors = [line for line in faults["result"].stderr.splitlines() if line.startswith("error:")]
    ckpt = work / "disk" / "ckpt"
    assert any(line.startswith(f"error: saving checkpoint {ckpt}/global_step4 failed on rank 1 (") and
               "the partial save was removed and latest still names global_step2" in line for line in errors), errors
    got = losses(str(work / "disk"))  # steps 1-5 (the failure is seen at step 5's boundary), then the resume's 3-6
    assert_losses_close(got, faults["straight"], 0.0, range(1, STEPS + 1))
    assert (ckpt / "latest").read_text() == f"global_step{STEPS}"
    assert not [n for n in os.listdir(ckpt) if n.startswith(".tmp")]


def test_the_step_guard_ends_the_run_after_the_save_in_flight_is_complete(faults, work) -> None:
    """The run stops on a bad step (exit 3, expected by the launch) only once the good step's save in flight is
    written: that tag is complete and latest, nothing of the bad step is saved."""
    ckpt = work / "guard" / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step2"
    verify_tag(str(ckpt / "global_step2"))
    assert sorted(n for n in os.listdir(ckpt) if n.startswith(("global_step", ".tmp"))) == ["global_step2"]
    assert f"saved checkpoint {ckpt}/global_step2 (written in the background" in faults["result"].stdout


def test_kill_9_during_the_background_write_keeps_the_previous_tag(faults, work) -> None:
    assert faults["killed"].returncode != 0
    ckpt = work / "killed" / "ckpt"
    assert (ckpt / "latest").read_text() == f"global_step{STEPS}"  # after the restart
    verify_tag(str(ckpt / "global_step2"))
    resumed_from = [line for line in faults["restarted"].stdout.splitlines() if "global_step2" in line]
    assert resumed_from, faults["restarted"].stdout[-2000:]
    got = losses(str(work / "killed"))
    assert_losses_close(got, faults["straight"], 0.0, range(1, STEPS + 1))
