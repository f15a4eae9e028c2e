"""The save directory (training/save_dir.py, training/checkpointing.py), each fault injected in-process: retention
and the fallback follow the order of the saves, not a clock that runs behind; where the file system refuses flock
a heartbeat file owns the directory; what killed saves left is reclaimed as a run takes it; a listing that
disagrees with the files the ranks hashed fails the save."""

from __future__ import annotations

import errno
import os
import time
from types import SimpleNamespace

import pytest

from llama_megatron.checkpoint.directory import LATEST_FILE, CheckpointMeta, saved_tags
from llama_megatron.errors import SaveFailed
from llama_megatron.training import checkpointing as ckpt
from llama_megatron.training import resume
from llama_megatron.training import save_dir as save_dirs
from llama_megatron.training.config import CheckpointConfig

ONE = SimpleNamespace(rank=0, world_size=1)


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
    meta, notes = resume.choose_tag(str(save_dir), None, fallback=True)
    assert meta.tag == "global_step1100" and meta.save_index == 2
    # a rollback: resumed from 1000, the next save (1050) is the newest although its step is lower
    _save(save_dir, 1050, 0.0, monkeypatch)
    assert saved_tags(str(save_dir)) == ["global_step1050", "global_step1100"]


def _no_flock(monkeypatch) -> None:
    def refuse(fh, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(save_dirs.fcntl, "flock", refuse)


def test_without_flock_a_heartbeat_lock_file_owns_the_dir(tmp_path, monkeypatch) -> None:
    _no_flock(monkeypatch)
    monkeypatch.setattr(save_dirs.SaveDirLock, "HEARTBEAT_S", 0.05)
    first = save_dirs.SaveDirLock(str(tmp_path))
    assert first.acquire() is None
    assert "refuses flock (ENOLCK)" in first.note and ".lock.owner" in first.note
    owner = tmp_path / ".lock.owner"
    os.utime(owner, (1.0, 1.0))
    deadline = time.monotonic() + 10
    while os.stat(owner).st_mtime < 2.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.stat(owner).st_mtime > 2.0  # the heartbeat touched it
    holder = save_dirs.SaveDirLock(str(tmp_path)).acquire()
    assert holder.startswith(f"pid {os.getpid()} on host ") and "heartbeat" in holder
    first.release()
    assert not owner.exists()
    # a killed holder's file (no heartbeat for longer than STALE_S) is taken over
    owner.write_text("pid 1 on host gone since then\n")
    os.utime(owner, (1.0, 1.0))
    second = save_dirs.SaveDirLock(str(tmp_path))
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
    lock = save_dirs.take_save_dir(CheckpointConfig(save=str(save)), str(save), ONE, SimpleNamespace(info=lines.append))
    try:
        assert sorted(os.listdir(save)) == [".lock", ".lock.owner", "global_step2"]
        assert lines[0].startswith(f"note: checkpoint.save {save}: the file system refuses flock (ENOLCK)")
        assert lines[1].startswith(f"removed what killed saves left in {save}: .old-global_step3-4194304, .tmp-")
    finally:
        lock.release()


def test_a_listing_that_disagrees_with_the_hashed_files_fails_the_save(tmp_path, monkeypatch) -> None:
    """Rank 0's listing (a stale NFS directory cache) lacks a file another rank wrote and hashed: the save fails
    with one line instead of publishing a manifest that does not describe the tag; latest is untouched."""
    save_dir = tmp_path / "ckpt"
    _save(save_dir, 1, 1e9, monkeypatch)
    real = ckpt.tag_files
    monkeypatch.setattr(ckpt, "tag_files", lambda d: [n for n in real(d) if not n.startswith("zero_pp_rank_1")])
    tmp = save_dir / ".tmp-global_step2"
    tmp.mkdir()
    (tmp / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x" * 10)
    share = {"zero_pp_rank_1_mp_rank_00_optim_states.pt": {"size": 10, "sha256": "0" * 64}}
    meta = CheckpointMeta(step=2, consumed_samples=2, tensor=1, pipeline=1, data_parallel=1, zero_stage=0,
                          model={}, padded_vocab_size=128)
    with pytest.raises(SaveFailed, match="lacks zero_pp_rank_1_mp_rank_00_optim_states.pt, which the ranks wrote"):
        ckpt.PendingSave("global_step2", str(save_dir), str(tmp), str(save_dir / "global_step2"), meta, 0, ONE,
                         None).finish([share])
    assert (save_dir / LATEST_FILE).read_text() == "global_step1" and not tmp.exists()
