"""Outputs appear whole or not at all, and what a killed writer leaves is no trap for the next one, each fault
injected in-process: links planted at an output or a temp name are not followed, and the temps of killed
conversions, preprocessing (tokens and SFT shards) and reference tables are reclaimed while a live writer's stay."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
from launch_utils import ROOT

from llama_megatron.checkpoint.atomic import atomic_output_dir, check_output, write_text_atomic
from llama_megatron.checkpoint.directory import LATEST_FILE
from llama_megatron.errors import CheckpointError, ConfigError
from llama_megatron.training import save_dir as save_dirs

ONE = SimpleNamespace(rank=0, world_size=1)


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
        save_dirs.SaveDirLock(str(tmp_path)).acquire()
    assert victim.read_text() == "precious"
    assert oct(os.stat(tmp_path / LATEST_FILE).st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_killed_conversion_temp_is_reclaimed(tmp_path) -> None:
    """``.tmp-<out>-<pid>`` of a writer that is gone goes; a live writer's stays."""
    dead, live = tmp_path / ".tmp-out-4194304", tmp_path / f".tmp-out-{os.getppid()}"
    dead.mkdir()
    live.mkdir()
    with atomic_output_dir(str(tmp_path / "out"), overwrite=False) as tmp:
        open(os.path.join(tmp, "f"), "w").close()
    assert sorted(os.listdir(tmp_path)) == [live.name, "out"]


def test_a_killed_preprocess_temps_are_reclaimed(tmp_path) -> None:
    """``PREFIX.bin.tmp-<pid>`` and the index spools of a preprocess that is gone go when the prefix is written
    again; another prefix's, and a live writer's, stay."""
    import numpy as np

    from llama_megatron.data.indexed_dataset import IndexedDatasetWriter

    dead = ["o.bin.tmp-4194304", "o.idx.tmp-4194304", "o.idx.tmp-4194304.sizes", "o.idx.tmp-4194304.docs"]
    kept = [f"o.bin.tmp-{os.getppid()}", "other.bin.tmp-4194304"]
    for name in dead + kept:
        (tmp_path / name).write_bytes(b"x")
    with IndexedDatasetWriter(str(tmp_path / "o"), np.uint16) as writer:
        writer.add_document([1, 2, 3])
        writer.finalize()
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["o.bin", "o.idx"])


def test_a_killed_sft_preprocess_meta_temp_is_reclaimed(tmp_path) -> None:
    """``PREFIX_sft.json.tmp-<pid>`` of a preprocess-sft that is gone goes when the prefix is written again, as
    the shards' temps do; a live writer's stays."""
    import json

    from llama_megatron.data.sft.preprocess import preprocess_sft

    dead, live = "o_sft.json.tmp-4194304", f"o_sft.json.tmp-{os.getppid()}"
    for name in (dead, live, "o_tokens.bin.tmp-4194304"):
        (tmp_path / name).write_text("{")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    preprocess_sft([str(src)], os.path.join(ROOT, "data", "tokenizer"), str(tmp_path / "o"), quiet=True)
    assert sorted(os.listdir(tmp_path)) == sorted(["in.jsonl", live, "o_sft.json", "o_tokens.bin", "o_tokens.idx",
                                                   "o_mask.bin", "o_mask.idx"])


def test_a_killed_reference_table_temp_is_reclaimed(tmp_path) -> None:
    """The table's temp carries the host and pid: a dead writer's on this host goes, a live one's and another
    host's (a cache directory shared across nodes) stay."""
    import numpy as np

    from llama_megatron.training.run.reference import store_table

    host = socket.gethostname()
    kept = [f"ab12.npy.tmp-{host}-{os.getppid()}", "ab12.npy.tmp-elsewhere-4194304"]
    for name in [f"ab12.npy.tmp-{host}-4194304", f"cd34.npy.tmp-{host}-4194304", *kept]:
        (tmp_path / name).write_bytes(b"x")
    store_table(str(tmp_path / "ef56.npy"), np.ones((3, 2)))
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "ef56.npy"])
    assert np.load(tmp_path / "ef56.npy").tolist() == [[1.0, 1.0]] * 3
