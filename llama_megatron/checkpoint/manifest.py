"""Integrity of a checkpoint tag: ``manifest.json`` lists every file's size and SHA-256, written before the tag is
renamed into place, and every reader checks the tag against it.

    <tag>/manifest.json   {"version": 1, "algorithm": "sha256", "files": {"mp_rank_00_model_states.pt":
                           {"size": 1234, "sha256": "..."}, ...}}

A truncated or missing file fails the size check, which costs a ``stat`` per file and runs wherever a tag is
opened; a changed byte fails the checksum, which reads the file (SHA-256 runs at about 1 GB/s on one core of the
2-core test machine: docs/long-runs-and-faults.md). Training saves hash each file as its rank writes it
(checkpoint/direct_io.py) and fsync it; resumes verify spread over the ranks (training/checkpointing.py);
single-process readers (export, reshard, generate, conversion inputs) verify the whole tag. Tags written before manifests existed (or by other
tools) have none: they are read unverified, and readers say so.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence

from llama_megatron.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 24


def tag_files(tag_dir: str) -> list[str]:
    """Every regular file under ``tag_dir`` (relative paths, sorted), the manifest itself excepted."""
    found = []
    for root, dirs, files in os.walk(tag_dir):
        dirs.sort()
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), tag_dir)
            if rel != MANIFEST_FILE:
                found.append(rel)
    return sorted(found)


def file_digest(path: str, fsync: bool = False, progress: Callable[[], None] | None = None) -> dict:
    """Size and SHA-256 of ``path``; with ``fsync``, the file is also flushed to the disk. ``progress`` is called
    per 16 MiB read (a training save's watchdog beat: hashing a 7B save's shards takes minutes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress()
        if fsync:
            os.fsync(fh.fileno())
        size = fh.tell()
    return {"size": size, "sha256": digest.hexdigest()}


def digest_files(tag_dir: str, names: Iterable[str], fsync: bool = False,
                 progress: Callable[[], None] | None = None) -> dict[str, dict]:
    return {name: file_digest(os.path.join(tag_dir, name), fsync, progress) for name in names}


def write_manifest(tag_dir: str, entries: dict[str, dict]) -> None:
    """``manifest.json`` for ``entries`` (name -> size and sha256), written and fsynced."""
    data = {"version": MANIFEST_VERSION, "algorithm": "sha256", "files": dict(sorted(entries.items()))}
    path = os.path.join(tag_dir, MANIFEST_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def write_manifest_for(tag_dir: str) -> None:
    """Hash every file of a tag one process wrote (converters, reshard), fsync them, write the manifest."""
    write_manifest(tag_dir, digest_files(tag_dir, tag_files(tag_dir), fsync=True))
    fsync_tree(tag_dir)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(top: str) -> None:
    """fsync every directory under ``top`` (their entries: file names and renames), deepest first."""
    for root, _, _ in sorted(os.walk(top), key=lambda entry: -entry[0].count(os.sep)):
        fsync_dir(root)


def read_manifest(tag_dir: str) -> dict[str, dict] | None:
    """The manifest's entries, or None when the tag has none; CheckpointError when it is unreadable."""
    path = os.path.join(tag_dir, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        files = data["files"]
        if data.get("version") != MANIFEST_VERSION or not isinstance(files, dict):
            raise ValueError(f"version {data.get('version')!r}")
        for name, entry in files.items():
            if (os.path.isabs(name) or ".." in name.split("/") or not isinstance(entry.get("size"), int)
                    or not isinstance(entry.get("sha256"), str)):
                raise ValueError(f"bad entry {name!r}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path} is corrupt: {exc}") from None
    return files


def check_sizes(tag_dir: str, files: dict[str, dict]) -> None:
    """Every manifest file present with its size: the cheap check that catches truncation and missing files."""
    for name, entry in files.items():
        path = os.path.join(tag_dir, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CheckpointError(f"checkpoint {tag_dir} is incomplete: {name} is missing") from None
        if size != entry["size"]:
            raise CheckpointError(f"checkpoint {tag_dir} is damaged: {name} has {size} bytes, its manifest says "
                                  f"{entry['size']} (truncated or rewritten)")


def check_checksums(tag_dir: str, files: dict[str, dict], names: Sequence[str]) -> None:
    """The SHA-256 of each of ``names`` (a share of the manifest's files) against the manifest."""
    for name in names:
        if file_digest(os.path.join(tag_dir, name))["sha256"] != files[name]["sha256"]:
            raise CheckpointError(f"checkpoint {tag_dir} is damaged: {name} does not match its checksum in "
                                  f"{MANIFEST_FILE} (corrupted on disk or edited)")


def verify_tag(tag_dir: str, checksum: bool = True, share: tuple[int, int] = (0, 1)) -> bool:
    """Check a tag against its manifest: sizes of every file, and with ``checksum`` the SHA-256 of this process's
    share (``(index, count)``: every count-th file from index). False when the tag has no manifest."""
    files = read_manifest(tag_dir)
    if files is None:
        return False
    check_sizes(tag_dir, files)
    if checksum:
        index, count = share
        check_checksums(tag_dir, files, sorted(files)[index::count])
    return True
