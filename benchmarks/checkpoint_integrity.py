"""What checkpoint integrity costs: the manifest's SHA-256 (writing a tag: hash + fsync; loading: hash) against
reading the same bytes, which every load does anyway, on one core.

A tag of ``--files`` files of ``--gib`` GiB in all (random bytes, as weights are) is written to ``--dir`` and
fsynced; then, best of ``--repeats`` with the files in the page cache: a plain read, ``verify_tag`` (sizes and
checksums) and ``write_manifest_for`` (hash, fsync, manifest). One JSON line: GiB/s of each, seconds per GiB of
verification, and verification's time against the read's.

    python benchmarks/checkpoint_integrity.py                   # 1 GiB in 8 files, in a temporary directory
    python benchmarks/checkpoint_integrity.py --gib 0.05 --dir /mnt/shared/tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llama_megatron.checkpoint.manifest import tag_files, verify_tag, write_manifest_for  # noqa: E402

_CHUNK = 1 << 24


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _read_all(tag_dir: str) -> None:
    for name in tag_files(tag_dir):
        with open(os.path.join(tag_dir, name), "rb") as fh:
            while fh.read(_CHUNK):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the tag")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write it (default: a temporary directory)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="integrity-", dir=args.dir)
    try:
        tag_dir = os.path.join(work, "global_step1")
        os.makedirs(tag_dir)
        size = int(args.gib * 2**30) // args.files
        for index in range(args.files):
            with open(os.path.join(tag_dir, f"layer_{index:02d}-model_00-model_states.pt"), "wb") as fh:
                for start in range(0, size, _CHUNK):
                    fh.write(os.urandom(min(_CHUNK, size - start)))
        write_manifest_for(tag_dir)
        total = size * args.files / 2**30
        read = _best(lambda: _read_all(tag_dir), args.repeats)
        verify = _best(lambda: verify_tag(tag_dir), args.repeats)
        write = _best(lambda: write_manifest_for(tag_dir), args.repeats)
        print(json.dumps({"benchmark": "checkpoint_integrity", "gib": round(total, 3), "files": args.files,
                          "read_gib_per_s": round(total / read, 3), "verify_gib_per_s": round(total / verify, 3),
                          "write_manifest_gib_per_s": round(total / write, 3),
                          "verify_seconds_per_gib": round(verify / total, 3),
                          "verify_time_vs_read": round(verify / read, 3)}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
