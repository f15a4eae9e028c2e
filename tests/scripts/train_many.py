"""Several whole training runs in one launch, each through the real entry point of `llama_megatron.train`.

    deepspeed --num_gpus 4 tests/scripts/train_many.py RUNS.json

RUNS.json is a list of argument lists, e.g. ``[["--config", "C.json", "--set", "parallel.tensor=2"], ...]``.
Every run builds its own process groups, model, DeepSpeed engine and data, exactly as a launch of
`llama_megatron.train` does; only the launcher start-up, the imports and the default process group are shared,
which is what makes a matrix of layouts affordable on a 2-core CI machine.

A run given as ``{"verb": "profile", "args": [...]}`` is that `llama-megatron` verb's run instead (its own entry point,
in the same processes). A run given as ``{"args": [...], "loaded_state": DIR}`` also writes, once its setup has loaded ``checkpoint.load``
and before its first step, this rank's share of the state it holds to ``DIR/rank{R}.pt`` (:func:`dump_state`).
"""

import gc
import json
import os
import sys

from llama_megatron import train
from llama_megatron.training.run import loop


def dump_state(session, out_dir: str) -> None:
    """Per parameter (by name): its weight on this rank and, where ZeRO partitions it, the fragment of its fp32
    master and Adam moments this rank holds (``start``, ``numel`` in the flattened parameter), its group's learning
    rate and weight decay and its Adam step."""
    import torch

    engine = session.engine.engine
    optimizer = engine.optimizer
    lp_groups = optimizer.bf16_groups if hasattr(optimizer, "bf16_groups") else optimizer.bit16_groups  # bf16 ZeRO-1
    group_of = {id(p): i for i, group in enumerate(lp_groups) for p in group}
    state = {}
    for name, param in engine.module.named_parameters():
        entry = {"weight": param.detach().clone()}
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:
            group = group_of[id(param)]
            settings = optimizer.optimizer.param_groups[group]
            address = mapping.lp_fragment_address
            entry.update(start=address.start, numel=address.numel, fp32=mapping.get_hp_fragment().clone(),
                         lr=settings["lr"], weight_decay=settings["weight_decay"],
                         step=int(optimizer.optimizer.state[settings["params"][0]]["step"]),
                         **{key: mapping.get_optim_state_fragment(key).clone() for key in ("exp_avg", "exp_avg_sq")})
        state[name] = entry
    os.makedirs(out_dir, exist_ok=True)
    torch.save(state, os.path.join(out_dir, f"rank{session.pctx.rank}.pt"))


def main(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        runs = json.load(fh)
    open_session = loop.open_session
    for run in runs:
        argv = run["args"] if isinstance(run, dict) else run
        if isinstance(run, dict) and "verb" in run:
            from llama_megatron.cli import main as cli_main

            rc = cli_main([run["verb"], *argv])
            if rc:
                print(f"run failed ({rc}): {run['verb']} {' '.join(argv)}", file=sys.stderr, flush=True)
                return rc
            gc.collect()
            continue
        if isinstance(run, dict):
            def opened(*args, out=run["loaded_state"], **kwargs):
                session = open_session(*args, **kwargs)
                dump_state(session, out)
                return session

            loop.open_session = opened
        try:
            rc = train.main(argv)
        finally:
            loop.open_session = open_session
        if rc:
            print(f"run failed ({rc}): {' '.join(argv)}", file=sys.stderr, flush=True)
            return rc
        gc.collect()
    return 0


if __name__ == "__main__":
    # the deepspeed launcher appends --local_rank=N
    sys.exit(main(next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))))
