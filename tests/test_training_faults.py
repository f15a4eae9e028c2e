"""Faults injected into real runs (tests/scripts/inject_faults.py under the deepspeed launcher, gloo, CPU), each
asserting the exit code, the one line, what is on disk, and that the last good state is intact and resumes exactly:

- non-finite and spiking steps (ZeRO-0 and ZeRO-1 at DP2, bf16, TP2 x PP2): the step guard stops the run (exit 3)
  after train.max_bad_steps bad steps, nothing is saved from a bad step, the last good checkpoint survives
  keep_last, metrics.jsonl stays JSON; a single skipped ZeRO-1 step is survived;
- SIGTERM to one rank of TP2 x PP2 (every rank stops after the same step, saves, exits 0; the restart continues bit
  for bit), a wall-clock budget (a signal to the launcher alone, under each launcher, and a second run on the same
  save dir meanwhile: tests/test_training_launcher_signals.py);
- a file write failing during a save on one rank of two (RLIMIT_FSIZE, as a full disk): exit 4, the partial save
  removed, the previous checkpoint resumes exactly;
- a corrupted byte and a truncated file in the newest tag: export refuses them, `checkpoint.load: auto` falls back;
- retention with later steps present (a rollback), stale universal conversions, two runs on one save dir, a fresh
  run into a used save dir;
- every failure that used to come late (no validation split, logging.interval 0, a non-integer train.steps, token
  ids beyond the vocabulary, generate's output and context, a template that loops or allocates without bound, a
  negative world size) as one line and exit 2 before anything starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from launch_utils import PRETRAIN_CONFIG, ROOT, assert_losses_close, losses, run_command, train_args

from llama_megatron.cli import main as cli_main
from llama_megatron.training.save_dir import SaveDirLock

CONFIG = PRETRAIN_CONFIG
ZERO1 = "deepspeed_config=ds_configs/zero1_fp32.json"
BF16 = "deepspeed_config=ds_configs/zero1_bf16.json"
TP2_PP2 = ["parallel.tensor=2", "parallel.pipeline=2", "batch.micro_batch_size=4", ZERO1]
STEPS = 6


def _run(work, name: str, *overrides: str, expect: int = 0, faults: dict | None = None,
         save: bool = True) -> dict:
    out = work / name
    extra = [f"checkpoint.save={out}/ckpt", "checkpoint.interval=2"] if save else []
    argv = train_args(CONFIG, [f"output_dir={out}", f"train.steps={STEPS}", *extra, *overrides])
    return {"argv": argv, "expect": expect, "faults": faults or {}}


def _inject(nprocs: int, runs: list[dict], runs_file) -> subprocess.CompletedProcess:
    with open(runs_file, "w", encoding="utf-8") as fh:
        json.dump(runs, fh)
    return run_command(nprocs, [os.path.join(ROOT, "tests", "scripts", "inject_faults.py")], [str(runs_file)],
                       timeout=1200)


def _records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]  # json.loads: NaN would not be JSON


def _latest(out) -> str:
    with open(os.path.join(out, "ckpt", "latest"), encoding="utf-8") as fh:
        return fh.read()


def _tags(out) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(out, "ckpt")) if n.startswith("global_step"))


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def two_rank(work, shakespeare_prefix) -> subprocess.CompletedProcess:
    """DP2 runs with faults, one 2-process launch."""
    data = f"data.prefix={shakespeare_prefix}"
    nan_at_3 = {"loss": {"3": "nan"}}
    runs = [
        _run(work, "nan-zero0", data, "checkpoint.keep_last=1", expect=3, faults=nan_at_3),
        _run(work, "nan-zero1-once", data, ZERO1, faults=nan_at_3),
        _run(work, "inf-bf16", data, BF16, "checkpoint.keep_last=1", expect=3,
             faults={"loss": {str(s): 0 for s in (3, 4, 5)}}),
        _run(work, "spike", data, ZERO1, "train.loss_spike_factor=2", "train.loss_spike_window=2", expect=3,
             faults={"loss": {str(s): 0.1 for s in (4, 5, 6)}}),
        # the second save (step 4) cannot write its files on rank 1: a 64 kB file size limit, as a full disk
        _run(work, "disk", data, ZERO1, expect=4, faults={"file_size": {"save": 2, "rank": 1, "bytes": 65536}}),
        _run(work, "disk", data, ZERO1, "checkpoint.load=auto"),
    ]
    result = _inject(2, runs, work / "two-rank.json")
    return result


@pytest.fixture(scope="module")
def four_rank(work, shakespeare_prefix) -> subprocess.CompletedProcess:
    """TP2 x PP2: a diverging run; a run stopped by SIGTERM on rank 1 at step 3, its restart, and the same run
    uninterrupted; one 4-process launch."""
    data = f"data.prefix={shakespeare_prefix}"
    runs = [
        _run(work, "nan-tp2-pp2", data, *TP2_PP2, expect=3, faults={"loss": {str(s): "nan" for s in (3, 4, 5)}}),
        _run(work, "sigterm-tp2-pp2", data, *TP2_PP2, "checkpoint.load=auto",
             faults={"signal": {"step": 3, "rank": 1, "name": "SIGTERM"}}),
        _run(work, "sigterm-tp2-pp2", data, *TP2_PP2, "checkpoint.load=auto"),
        _run(work, "straight-tp2-pp2", data, *TP2_PP2, save=False),
    ]
    return _inject(4, runs, work / "four-rank.json")


@pytest.mark.parametrize("name, bad_from, stop_at, reasons", [
    ("nan-zero0", 3, 5, "loss is not finite; gradient norm is not finite"),
    ("inf-bf16", 3, 5, "the optimizer skipped the step"),
    ("spike", 4, 6, "loss spike"),
])
def test_diverging_runs_stop_and_keep_the_last_good_checkpoint(name, bad_from, stop_at, reasons, two_rank,
                                                               work) -> None:
    out = work / name
    line = (f"error: training stopped at step {stop_at}: 3 bad steps in a row (steps {bad_from}-{stop_at}: ")
    assert any(e.startswith(line) and reasons in e for e in _errors(two_rank.stderr)), two_rank.stderr[-3000:]
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, stop_at + 1))
    assert all("bad_step" in r for r in records[bad_from - 1:]) and not any("bad_step" in r for r in
                                                                             records[:bad_from - 1])
    # nothing saved from a bad step; keep_last never removed the last good save
    good = max(s for s in (2, 4) if s < bad_from)
    assert _latest(out) == f"global_step{good}" and f"global_step{good}" in _tags(out)
    assert not [n for n in os.listdir(out / "ckpt") if n.startswith(".tmp")]


def test_nonfinite_values_are_json_null(two_rank, work) -> None:
    step3 = _records(work / "nan-zero0")[2]
    assert step3["loss"] is None and step3["grad_norm"] is None and step3["nonfinite"] == ["loss", "grad_norm"]


def test_one_skipped_step_is_survived(two_rank, work) -> None:
    """ZeRO-1 skips the NaN step (DeepSpeed's overflow check): one bad step, then the run goes on and saves."""
    records = _records(work / "nan-zero1-once")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["step"] for r in records if "bad_step" in r] == [3]
    assert _latest(work / "nan-zero1-once") == f"global_step{STEPS}"
    assert all(np.isfinite(r["loss"]) for r in records if r["step"] != 3)


def test_a_failed_save_keeps_the_previous_checkpoint(two_rank, work) -> None:
    out = work / "disk"
    (line,) = {e for e in _errors(two_rank.stderr) if "global_step4 failed" in e}  # the same line from each rank
    # the injected limit fails the write with EFBIG, which the line names as the OS does (a full disk: ENOSPC)
    assert line.startswith(f"error: saving checkpoint {out}/ckpt/global_step4 failed on rank 1 (File too large; ") \
        and "the partial save was removed and latest still names global_step2" in line, line
    # the restart (checkpoint.load auto) resumed from step 2 and retraced steps 3 and 4 exactly
    steps = [r["step"] for r in _records(out)]
    assert steps == [1, 2, 3, 4, 3, 4, 5, 6]
    first, second = _records(out)[:4], _records(out)[4:]
    assert [r["loss"] for r in first[2:]] == [r["loss"] for r in second[:2]]
    assert _latest(out) == f"global_step{STEPS}"
    assert not [n for n in os.listdir(out / "ckpt") if n.startswith(".") and n != ".lock"]


def test_tp2_pp2_nan_stops(four_rank) -> None:
    assert any(e.startswith("error: training stopped at step 5: 3 bad steps in a row (steps 3-5:")
               for e in _errors(four_rank.stderr)), four_rank.stderr[-3000:]


def test_sigterm_on_one_rank_stops_every_rank_after_the_step_and_resumes_exactly(four_rank, work) -> None:
    out = work / "sigterm-tp2-pp2"
    stopped = [line for line in four_rank.stdout.splitlines() if line.startswith("stopped at step")]
    assert stopped == [f"stopped at step 3 on SIGTERM: saved checkpoint {out}/ckpt/global_step3; the same command "
                       "with checkpoint.load auto continues from there"], four_rank.stdout[-3000:]
    assert f"resumed from checkpoint {out}/ckpt/global_step3 (step 3; RNG state restored)" in four_rank.stdout
    steps = [r["step"] for r in _records(out)]
    assert steps == list(range(1, STEPS + 1))
    straight = losses(str(work / "straight-tp2-pp2"))
    assert_losses_close(losses(str(out)), straight, 0.0, range(1, STEPS + 1))  # bit for bit
    assert "Traceback" not in four_rank.stderr


def _damage(path, kind: str) -> None:
    if kind == "corrupt":  # 64 bytes overwritten inside the file
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            fh.write(b"\xff" * 64)
    else:
        os.truncate(path, os.path.getsize(path) - 100)


@pytest.fixture(scope="module")
def single_source(work, shakespeare_prefix) -> subprocess.CompletedProcess:
    """One process: a clean run saving steps 2, 4 and 6 (the copies below are damaged or rolled back), and a run
    with a wall-clock budget."""
    data = f"data.prefix={shakespeare_prefix}"
    runs = [_run(work, "clean", data), _run(work, "budget", data, "train.max_minutes=0.00001")]
    return _inject(1, runs, work / "single-source.json")


DAMAGE = {"corrupt": "does not match its checksum in manifest.json (corrupted on disk or edited)",
          "truncated": "has {size} bytes, its manifest says {want} (truncated or rewritten)"}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_export_refuses_a_damaged_tag(kind, single_source, work, capsys) -> None:
    """A corrupted byte (the checksum) or a truncated file (the size) in the newest tag: one line, exit 2, nothing
    written (the issue's case: 64 bytes inside mp_rank_00_model_states.pt used to export 3.4e38 weights)."""
    ckpt = work / f"export-{kind}" / "ckpt"
    shutil.copytree(work / "clean" / "ckpt", ckpt)
    path = ckpt / "global_step6" / "mp_rank_00_model_states.pt"
    want = os.path.getsize(path)
    _damage(path, kind)
    capsys.readouterr()
    assert cli_main(["export", "--input", str(ckpt), "--output", str(work / f"export-{kind}" / "hf")]) == 2
    what = "is damaged: mp_rank_00_model_states.pt " + DAMAGE[kind].format(size=os.path.getsize(path), want=want)
    assert capsys.readouterr().err == f"error: checkpoint {ckpt}/global_step6 {what}\n"
    assert not (work / f"export-{kind}" / "hf").exists()


@pytest.fixture(scope="module")
def single(work, shakespeare_prefix, single_source) -> subprocess.CompletedProcess:
    """One process: `checkpoint.load: auto` on damaged copies of the clean run; a rollback into its save dir."""
    data = f"data.prefix={shakespeare_prefix}"
    for kind in DAMAGE:
        ckpt = work / f"{kind}-resume" / "ckpt"
        shutil.copytree(work / "clean" / "ckpt", ckpt)
        _damage(ckpt / "global_step6" / "mp_rank_00_model_states.pt", kind)
    rollback = work / "rollback" / "ckpt"
    shutil.copytree(work / "clean" / "ckpt", rollback)
    os.makedirs(rollback / "global_step4_universal")  # a conversion of the tag the rollback saves again
    runs = [
        _run(work, f"{kind}-resume", data, "checkpoint.load=auto", f"train.steps={STEPS + 2}") for kind in DAMAGE
    ] + [_run(work, "rollback", data, f"checkpoint.load={rollback}", "checkpoint.tag=global_step2",
              "checkpoint.interval=1", "checkpoint.keep_last=2", "train.steps=4")]
    return _inject(1, runs, work / "single.json")


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_auto_resume_falls_back(kind, single, work) -> None:
    """The damaged newest tag is passed over (the truncation by size in preflight, the byte by checksum after the
    process groups start) with one line, and the run resumes from the previous tag exactly."""
    out = work / f"{kind}-resume"
    ckpt = out / "ckpt"
    passed = [line for line in single.stdout.splitlines() if line.startswith(f"passing over checkpoint {ckpt}/")]
    assert len(passed) == 1 and f"{ckpt}/global_step6 is damaged" in passed[0], single.stdout[-3000:]
    assert f"resumed from checkpoint {ckpt}/global_step4 (step 4; RNG state restored)" in single.stdout
    assert [r["step"] for r in _records(out)] == [5, 6, 7, 8]
    assert_losses_close(losses(str(out)), losses(str(work / "clean")), 0.0, [5, 6])  # bit for bit


def test_rollback_keeps_the_newest_saves(single, work) -> None:
    """Resumed from step 2 into the save dir that holds steps 2, 4, 6: saves 3 and 4 (4 again: it replaces the old
    one and its universal conversion), keep_last 2 keeps the two newest saves, never the one just written."""
    ckpt = work / "rollback" / "ckpt"
    assert _latest(work / "rollback") == "global_step4"
    assert _tags(work / "rollback") == ["global_step3", "global_step4"]
    assert not (ckpt / "global_step4_universal").exists()
    assert_losses_close(losses(str(work / "rollback")), losses(str(work / "clean")), 0.0, [3, 4])


def test_time_budget_saves_and_exits(single_source, work) -> None:
    assert (f"stopped at step 1 on the time budget (train.max_minutes 1e-05): saved checkpoint "
            f"{work}/budget/ckpt/global_step1") in single_source.stdout
    assert _latest(work / "budget") == "global_step1"


# --- failures that used to come late, now one line and exit 2 before anything starts -------------------------------

def _train_fails(capsys, overrides: list[str], message: str) -> None:
    from llama_megatron import train

    capsys.readouterr()
    assert train.main(train_args(CONFIG, overrides)) == 2
    err = capsys.readouterr().err
    assert _errors(err) == [f"error: {message}"] and err.count("\n") == 1, err


@pytest.mark.parametrize("overrides, message", [
    (["eval.interval=2", "data.split=100,0,0"],
     "eval.interval is set but data.split '100,0,0' gives the validation split no documents: give it a share, or set "
     "eval.interval 0"),
    (["logging.interval=0"], "logging.interval must be >= 1 (steps between log lines), got 0"),
    (["train.steps=abc"], 'train.steps must be an integer, got "abc"'),
    (["optimizer.betas=[0.9]"], "optimizer.betas must be a list, got [0.9]"),
    (["checkpoint.tag=../other/converted"], "checkpoint.tag '../other/converted' is not a plain tag name (letters, "
                                            "digits, '.', '_' and '-', starting with a letter or digit; no path)"),
    (["train.max_bad_steps=0"], "train.max_bad_steps must be >= 1, got 0"),
    (["train.stop_signals=[\"SIGKILL\"]"], "train.stop_signals: 'SIGKILL' is not one of SIGTERM, SIGUSR1, SIGUSR2, "
                                           "SIGINT"),
])
def test_config_mistakes(overrides, message, shakespeare_prefix, tmp_path, capsys) -> None:
    _train_fails(capsys, [f"data.prefix={shakespeare_prefix}", f"output_dir={tmp_path}/out", *overrides], message)
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")


def test_token_ids_beyond_the_vocabulary(tmp_path, shakespeare_prefix, capsys) -> None:
    """Found before launch by reading every token once (vectorised, cached beside the index); the shipped corpus's
    check is timed here."""
    from llama_megatron.data.index_cache import token_range
    from llama_megatron.data.indexed_dataset import MMapIndexedDataset, write_indexed_dataset

    prefix = str(tmp_path / "bad_text_document")
    write_indexed_dataset(prefix, [list(range(1, 200)), [7, 5000, 9] * 30], np.uint16)
    _train_fails(capsys, [f"data.prefix={prefix}", f"output_dir={tmp_path}/out"],
                 f"data prefix {prefix!r} holds token id 5000, outside the model's vocab_size 4100: was it "
                 "preprocessed with another tokenizer?")
    corpus = MMapIndexedDataset(shakespeare_prefix)
    start = time.perf_counter()
    assert token_range(corpus, str(tmp_path / "cache"))[1] < 4100
    print(f"token range of {corpus.num_tokens:,} tokens: {1e3 * (time.perf_counter() - start):.1f} ms (first read)")


def test_fresh_run_into_a_used_save_dir(single_source, work, capsys) -> None:
    ckpt = work / "used" / "ckpt"
    shutil.copytree(work / "clean" / "ckpt", ckpt)
    _train_fails(capsys, ['data={"type": "synthetic"}', f"output_dir={work}/used", f"checkpoint.save={ckpt}"],
                 f"checkpoint.save {ckpt} already holds checkpoints (global_step6, global_step4, global_step2) of "
                 "another run (it differs in data.prefix, data.split, data.type): save this one elsewhere, or replace "
                 "them with checkpoint.overwrite true (that run continues with its own config and checkpoint.load "
                 "auto)")
    (ckpt / "latest").write_text("../../clean/ckpt/global_step6")
    _train_fails(capsys, ['data={"type": "synthetic"}', f"output_dir={work}/used", f"checkpoint.load={ckpt}"],
                 f"{ckpt}/latest names '../../clean/ckpt/global_step6' is not a plain tag name (letters, digits, "
                 "'.', '_' and '-', starting with a letter or digit; no path)")


def test_generate_output_and_context(single_source, work, capsys) -> None:
    tokenizer = os.path.join(ROOT, "data", "tokenizer")
    base = ["generate", "--checkpoint", str(work / "clean" / "ckpt"), "--tokenizer", tokenizer]
    taken = work / "answers.jsonl"
    taken.write_text("keep me\n")
    for output, message in ((taken, f"--output {taken} exists (pass --overwrite to replace it)"),
                            (work / "nowhere" / "a.jsonl",
                             f"--output {work}/nowhere/a.jsonl: directory {work}/nowhere does not exist")):
        capsys.readouterr()
        assert cli_main([*base, "--prompt", "Hi", "--output", str(output)]) == 2
        assert _errors(capsys.readouterr().err) == [f"error: {message}"]
    assert taken.read_text() == "keep me\n"
    long_prompt = " ".join(["word"] * 200)
    capsys.readouterr()
    assert cli_main([*base, "--prompt", long_prompt, "--raw"]) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert "nothing fits after it in the model's context of 128 (max_position_embeddings)" in line
    assert cli_main([*base, "--prompt", "Hi", "--max-new-tokens", "1000", "--output", str(taken), "--overwrite"]) == 0
    err = capsys.readouterr().err
    (answer,) = [json.loads(line) for line in taken.read_text().splitlines()]
    room = 128 - answer["prompt_tokens"]
    assert f"note: prompt 1: --max-new-tokens 1000 capped to {room}" in err
    assert len(answer["tokens"]) <= room


@pytest.mark.parametrize("template, message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "chat template did not finish within 0.5 s"),
    ("{{ 'x' * 10**9 }}", "chat template builds a value of 1000000000 items (limit 16777216)"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "chat template builds a string of more than 16777216 characters"),
])
def test_unbounded_chat_templates(template, message, tmp_path, monkeypatch, capsys) -> None:
    """A template that loops or allocates without bound ends its record with one line (exit 2, nothing written),
    instead of hanging or dying with MemoryError."""
    monkeypatch.setattr("llama_megatron.data.sft.chat_template.RENDER_SECONDS", 0.5)
    jinja, chats = tmp_path / "t.jinja", tmp_path / "c.jsonl"
    jinja.write_text(template)
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": "b"}]}) + "\n")
    capsys.readouterr()
    assert cli_main(["preprocess-sft", "--input", str(chats), "--tokenizer", os.path.join(ROOT, "data", "tokenizer"),
                     "--output-prefix", str(tmp_path / "o"), "--chat-template", str(jinja), "--quiet"]) == 2
    assert _errors(capsys.readouterr().err) == [f"error: {chats}:1: {message}"]
    assert not list(tmp_path.glob("o_*"))


def test_estimate_refuses_a_negative_world_size(capsys) -> None:
    config = os.path.join(ROOT, "configs", "pretrain", "llama2-7b-tp2-pp2.json")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert cli_main(["estimate", "--config", config, "--world-size", "-4"]) == 2
    finally:
        os.chdir(cwd)
    assert _errors(capsys.readouterr().err) == ["error: world size must be a positive integer, got -4"]


@pytest.mark.launched
def test_a_crashed_run_does_not_keep_the_save_dir(tmp_path) -> None:
    """The owner's lock is a flock: the kernel drops it when the process dies, however it dies."""
    code = ("import sys, time; from llama_megatron.training.save_dir import SaveDirLock; "
            f"lock = SaveDirLock({str(tmp_path)!r}); assert lock.acquire() is None; print('held', flush=True); "
            "time.sleep(10**6)")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert "held" in (line.strip() for line in iter(holder.stdout.readline, ""))  # after what imports print
        assert SaveDirLock(str(tmp_path)).acquire().startswith(f"pid {holder.pid} on host ")
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        lock = SaveDirLock(str(tmp_path))
        assert lock.acquire() is None
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_written_tag_is_fsynced(tmp_path, monkeypatch) -> None:
    """Every file and directory of a tag reaches the disk before the tag can be published (converters and reshard
    call this; training saves fsync each rank's share of the files and the tree the same way)."""
    from llama_megatron.checkpoint import manifest

    tag = tmp_path / "tag"
    (tag / "sub").mkdir(parents=True)
    for name in ("a.pt", "sub/b.pt", "llama_megatron.json"):
        (tag / name).write_bytes(os.urandom(1000))
    synced = []
    real = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(manifest.os, "fsync", record)
    manifest.write_manifest_for(str(tag))
    assert {str(tag / n) for n in ("a.pt", "sub/b.pt", "llama_megatron.json", "manifest.json", "sub")} | \
        {str(tag)} <= set(synced)
    assert manifest.verify_tag(str(tag)) is True
