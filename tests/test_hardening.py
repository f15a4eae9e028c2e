"""The hardening of issue 41, each fault injected in-process (no launches): planted symlinks, a clock that runs
behind, a file system without flock, what killed writers leave, a hostile store client, hostile templates, deeply
nested lines, malformed checkpoints."""

from __future__ import annotations

import errno
import os
import re
import time
from types import SimpleNamespace

import pytest
from launch_utils import ROOT

from llama_megatron.checkpoint.atomic import atomic_output_dir, check_output, write_text_atomic
from llama_megatron.checkpoint.meta import LATEST_FILE, CheckpointMeta, saved_tags
from llama_megatron.errors import CheckpointError, ConfigError
from llama_megatron.training import checkpointing as ckpt
from llama_megatron.training.config import CheckpointConfig

ONE = SimpleNamespace(rank=0, world_size=1)


def _floor(requirement: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.search(r">=([\d.]+)", requirement).group(1).split("."))


def test_dependency_floors_exclude_the_vulnerable_releases() -> None:
    """torch <= 2.5.1: weights_only=True is bypassable (CVE-2025-32434); jinja2 < 3.1.6: a sandbox escape
    (CVE-2025-27516). Every untrusted file goes through one or the other."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as fh:  # (tomllib: Python >= 3.11 only)
        deps = dict(re.findall(r'^\s*"([A-Za-z0-9_-]+)(>=[^"]*)",', fh.read().split("dependencies = [")[1].split("]")[0],
                               re.M))
    assert _floor(deps["torch"]) >= (2, 6)
    assert _floor(deps["jinja2"]) >= (3, 1, 6)


# ---- symlinks ----

def test_overwrite_through_a_symlink_to_the_input_is_refused(tmp_path) -> None:
    src = tmp_path / "model"
    src.mkdir()
    (src / "w").write_text("keep")
    (tmp_path / "out").symlink_to(src)
    with pytest.raises(CheckpointError, match="overlaps the input"):
        check_output(str(tmp_path / "out"), True, inputs=(str(src),))
    (tmp_path / "inner").symlink_to(src / "sub", target_is_directory=True)
    with pytest.raises(CheckpointError, match="overlaps the input"):
        check_output(str(tmp_path / "inner"), True, inputs=(str(src),))
    assert (src / "w").read_text() == "keep"


def test_temp_names_are_not_followed(tmp_path) -> None:
    """A link planted where the temp file of ``latest`` used to be (``latest.tmp.<pid>``), and one planted as the
    save dir's ``.lock``: neither target is written."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / f"{LATEST_FILE}.tmp.{os.getpid()}").symlink_to(victim)
    write_text_atomic(str(tmp_path / LATEST_FILE), "global_step5")
    assert (tmp_path / LATEST_FILE).read_text() == "global_step5"
    (tmp_path / ".lock").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"\.lock is a symbolic link"):
        ckpt.SaveDirLock(str(tmp_path)).acquire()
    assert victim.read_text() == "precious"
    assert oct(os.stat(tmp_path / LATEST_FILE).st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- retention and fallback by save order, not clock ----

def _save(save_dir, step: int, clock: float, monkeypatch, keep_last: int = 2) -> None:
    """One save through the real finish path (manifest, rename, latest, retention) with the wall clock at
    ``clock``."""
    tmp = save_dir / f".tmp-global_step{step}"
    tmp.mkdir(parents=True)
    (tmp / "mp_rank_00_model_states.pt").write_bytes(os.urandom(64))
    meta = CheckpointMeta(step=step, consumed_samples=step, tensor=1, pipeline=1, data_parallel=1, zero_stage=0,
                          model={}, padded_vocab_size=128)
    monkeypatch.setattr(ckpt.time, "time", lambda: clock)
    ckpt.PendingSave(f"global_step{step}", str(save_dir), str(tmp), str(save_dir / f"global_step{step}"), meta,
                     keep_last, ONE, None).finish([{}])


def test_retention_and_fallback_ignore_a_clock_that_runs_behind(tmp_path, monkeypatch) -> None:
    """The node saving step 1100 has a clock an hour behind the one that saved 1000: retention still keeps 1100
    and the fallback still prefers it."""
    save_dir = tmp_path / "ckpt"
    _save(save_dir, 900, 1e9, monkeypatch)
    _save(save_dir, 1000, 1e9 + 100, monkeypatch)
    _save(save_dir, 1100, 1e9 + 200 - 3600, monkeypatch)
    assert saved_tags(str(save_dir)) == ["global_step1100", "global_step1000"]
    (save_dir / LATEST_FILE).write_text("global_step7")  # names a tag that is gone: fall back
    meta, notes = ckpt.choose_tag(str(save_dir), None, fallback=True)
    assert meta.tag == "global_step1100" and meta.save_index == 2
    # a rollback: resumed from 1000, the next save (1050) is the newest although its step is lower
    _save(save_dir, 1050, 0.0, monkeypatch)
    assert saved_tags(str(save_dir)) == ["global_step1050", "global_step1100"]


# ---- the save dir's lock where flock fails ----

def _no_flock(monkeypatch) -> None:
    def refuse(fh, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(ckpt.fcntl, "flock", refuse)


def test_without_flock_a_heartbeat_lock_file_owns_the_dir(tmp_path, monkeypatch) -> None:
    _no_flock(monkeypatch)
    monkeypatch.setattr(ckpt.SaveDirLock, "HEARTBEAT_S", 0.05)
    first = ckpt.SaveDirLock(str(tmp_path))
    assert first.acquire() is None
    assert "refuses flock (ENOLCK)" in first.note and ".lock.owner" in first.note
    owner = tmp_path / ".lock.owner"
    os.utime(owner, (1.0, 1.0))
    deadline = time.monotonic() + 10
    while os.stat(owner).st_mtime < 2.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.stat(owner).st_mtime > 2.0  # the heartbeat touched it
    holder = ckpt.SaveDirLock(str(tmp_path)).acquire()
    assert holder.startswith(f"pid {os.getpid()} on host ") and "heartbeat" in holder
    first.release()
    assert not owner.exists()
    # a killed holder's file (no heartbeat for longer than STALE_S) is taken over
    owner.write_text("pid 1 on host gone since then\n")
    os.utime(owner, (1.0, 1.0))
    second = ckpt.SaveDirLock(str(tmp_path))
    assert second.acquire() is None
    assert owner.read_text().startswith(f"pid {os.getpid()} ")
    second.release()


def test_take_save_dir_says_how_it_owns_the_dir_and_reclaims_temps(tmp_path, monkeypatch) -> None:
    """One line where flock fails; what killed saves left (SIGKILL: nothing ran) is removed once the run owns the
    dir, the checkpoints kept."""
    _no_flock(monkeypatch)
    save = tmp_path / "ckpt"
    for name in (".tmp-global_step5", ".old-global_step3-4194304", "global_step2"):
        (save / name).mkdir(parents=True)
    (save / "global_step2" / "llama_megatron.json").write_text("{}")
    (save / f"{LATEST_FILE}.tmp.77").write_text("global_step5")
    (save / f"{LATEST_FILE}.tmp.77.x1y2").write_text("global_step5")
    lines: list[str] = []
    lock = ckpt.take_save_dir(CheckpointConfig(save=str(save)), str(save), ONE, SimpleNamespace(info=lines.append))
    try:
        assert sorted(os.listdir(save)) == [".lock", ".lock.owner", "global_step2"]
        assert lines[0].startswith(f"note: checkpoint.save {save}: the file system refuses flock (ENOLCK)")
        assert lines[1].startswith(f"removed what killed saves left in {save}: .old-global_step3-4194304, .tmp-")
    finally:
        lock.release()


def test_a_killed_conversion_temp_is_reclaimed(tmp_path) -> None:
    """``.tmp-<out>-<pid>`` of a writer that is gone goes; a live writer's stays."""
    dead, live = tmp_path / ".tmp-out-4194304", tmp_path / f".tmp-out-{os.getppid()}"
    dead.mkdir()
    live.mkdir()
    with atomic_output_dir(str(tmp_path / "out"), overwrite=False) as tmp:
        open(os.path.join(tmp, "f"), "w").close()
    assert sorted(os.listdir(tmp_path)) == [live.name, "out"]
