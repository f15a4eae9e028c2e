"""Several whole training runs in one launch, each through the real entry point of `llama_megatron.train`.

    deepspeed --num_gpus 4 tests/scripts/train_many.py RUNS.json

RUNS.json is a list of argument lists, e.g. ``[["--config", "C.json", "--set", "parallel.tensor=2"], ...]``.
Every run builds its own process groups, model, DeepSpeed engine and data, exactly as a launch of
`llama_megatron.train` does; only the launcher start-up, the imports and the default process group are shared,
which is what makes a matrix of layouts affordable on a 2-core CI machine.
"""

import gc
import json
import sys

from llama_megatron import train


def main(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        runs = json.load(fh)
    for argv in runs:
        rc = train.main(argv)
        if rc:
            print(f"run failed ({rc}): {' '.join(argv)}", file=sys.stderr, flush=True)
            return rc
        gc.collect()
    return 0


if __name__ == "__main__":
    # the deepspeed launcher appends --local_rank=N
    sys.exit(main(next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))))
