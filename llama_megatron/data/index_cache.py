"""Build-once cache of index arrays shared by every rank that starts at the same time.

Each entry is a directory of ``.npy`` files (or any files: :func:`cached_directory`) plus ``description.json``, named by a hash of everything the arrays
depend on. The first process to take an exclusive ``flock`` builds the arrays into a private temporary directory
and renames it into place (atomic); the others block on the lock, then load. Where ``flock`` is unavailable
(some network file systems) every process builds the same arrays and the rename race keeps exactly one.
Arrays are memory-mapped on load and never pickled.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator

import numpy as np

from llama_megatron.errors import ConfigError

DESCRIPTION = "description.json"


def cache_key(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def file_fingerprint(path: str, window: int = 1 << 20) -> str:
    """Size plus a hash of the first and last MiB: cheap on huge indexes, and covers sizes[] and doc_idx[]."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(digest_size=16)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(window))
        if size > window:
            f.seek(max(window, size - window))
            h.update(f.read(window))
    return h.hexdigest()


@contextlib.contextmanager
def _exclusive(lock_path: str) -> Iterator[None]:
    with open(lock_path, "a+b") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # No locking here: fall through; the atomic rename below still keeps one copy.
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(lock_file, fcntl.LOCK_UN)


def _complete(entry: str) -> bool:
    return os.path.isfile(os.path.join(entry, DESCRIPTION))


def cached_directory(cache_dir: str, name: str, description: dict, write: Callable[[str], None]) -> str:
    """The path of a cache entry that ``write(tmp_dir)`` fills, built once per ``description`` under ``cache_dir``."""
    entry = os.path.join(cache_dir, f"{name}-{cache_key(description)}")
    if _complete(entry):
        return entry
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with _exclusive(entry + ".lock"):
            if not _complete(entry):
                _write_entry(entry, description, write)
        # Safe even while others wait on it: whoever gets the lock next finds the entry complete.
        with contextlib.suppress(FileNotFoundError):
            os.remove(entry + ".lock")
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise ConfigError(
            f"cannot write the cache in {cache_dir} ({exc.strerror}); set data.cache_dir to a writable dir"
        ) from None
    return entry


def cached_arrays(
    cache_dir: str, name: str, description: dict, build: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """The arrays ``build()`` returns, computed once per ``description`` and cached under ``cache_dir``."""

    def write(tmp: str) -> None:
        for key, arr in build().items():
            np.save(os.path.join(tmp, f"{key}.npy"), np.ascontiguousarray(arr), allow_pickle=False)

    entry = cached_directory(cache_dir, name, description, write)
    try:
        return _load_entry(entry, description)
    except (OSError, ValueError, KeyError) as exc:  # truncated .npy, edited description.json, ...
        raise ConfigError(
            f"index cache {entry} is unreadable ({exc}); delete that directory to rebuild it"
        ) from None


def _write_entry(entry: str, description: dict, write: Callable[[str], None]) -> None:
    tmp = f"{entry}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        write(tmp)
        with open(os.path.join(tmp, DESCRIPTION), "w", encoding="utf-8") as f:
            json.dump(description, f, indent=1, sort_keys=True)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not _complete(entry):  # somebody else won the race only if their entry is there
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_entry(entry: str, description: dict) -> dict[str, np.ndarray]:
    check_entry(entry, description)
    names = sorted(f[:-4] for f in os.listdir(entry) if f.endswith(".npy"))
    return {k: np.load(os.path.join(entry, f"{k}.npy"), mmap_mode="r", allow_pickle=False) for k in names}


def check_entry(entry: str, description: dict) -> None:
    """The entry's stored description must be the one its name was hashed from (not edited, not a collision)."""
    with open(os.path.join(entry, DESCRIPTION), encoding="utf-8") as f:
        stored = json.load(f)
    stored.pop("arrays", None)  # entries written before cached_directory existed list their arrays here
    if stored != json.loads(json.dumps(description)):
        raise ConfigError(f"cache entry {entry} does not match its name; delete the directory")


_RANGE_CHUNK = 1 << 26  # tokens per vectorised min/max pass: bounded memory at any file size


def token_range(ds, cache_dir: str) -> tuple[int, int]:
    """(smallest, largest) token id of an indexed dataset, read once per file: every token in vectorised chunks the
    first time (about 3 ms per million tokens here), then from the cache beside the index (keyed by both files)."""
    from llama_megatron.data.indexed_dataset import data_paths

    def build() -> dict[str, np.ndarray]:
        tokens = ds.tokens
        lo, hi = 0, -1
        for start in range(0, tokens.size, _RANGE_CHUNK):
            chunk = tokens[start: start + _RANGE_CHUNK]
            lo = int(chunk.min()) if start == 0 else min(lo, int(chunk.min()))
            hi = max(hi, int(chunk.max()))
        return {"range": np.asarray([lo, hi], dtype=np.int64)}

    description = {"kind": "token-range", "version": 1, "files": [file_fingerprint(p) for p in data_paths(ds.prefix)]}
    name = os.path.basename(ds.prefix) + "-token-range"
    lo, hi = cached_arrays(cache_dir, name, description, build)["range"].tolist()
    return lo, hi


def check_token_range(ds, cache_dir: str, vocab_size: int) -> None:
    """Every id of ``ds`` must index the model's embedding table: one line before launch, not on one rank hours
    into the run when that sample is read."""
    if not ds.num_tokens:
        return
    lo, hi = token_range(ds, cache_dir)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ConfigError(f"data prefix {ds.prefix!r} holds token id {bad}, outside the model's vocab_size "
                          f"{vocab_size}: was it preprocessed with another tokenizer?")
