"""Several whole training runs in one launch, each through the real entry point of `llama_megatron.train`.

    deepspeed --num_gpus 4 tests/scripts/train_many.py RUNS.json

RUNS.json is a list of argument lists, e.g. ``[["--config", "C.json", "--set", "parallel.tensor=2"], ...]``.
Every run builds its own process groups, model, DeepSpeed engine and data, exactly as a launch of
`llama_megatron.train` does; only the launcher start-up, the imports and the default process group are shared,
which is what makes a matrix of layouts affordable on a 2-core CI machine.

A run given as ``{"verb": "profile", "args": [...]}`` is that `llama-megatron` verb's run instead (its own entry
point, in the same processes; `generate` keeps the launch's process groups up for the runs after it). A run given as
``{"args": [...], "loaded_state": DIR}`` also writes, once its setup has loaded ``checkpoint.load`` and before its
first step, this rank's share of the state it holds to ``DIR/rank{R}.pt`` (:func:`dump_state`). A run given as
``{"args": [...], "routes": {"record": DIR}}`` or ``{"routes": {"replay": DIR, "accumulation": A}}`` records every
MoE layer's expert choices, or routes its tokens as a recorded run did (:class:`RouteBook`).
"""

import contextlib
import gc
import json
import os
import sys
from collections.abc import Iterator

from llama_megatron import train
from llama_megatron.process_exit import exit_process
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


@contextlib.contextmanager
def _groups_ended_with_the_run() -> Iterator[None]:
    """Every process group the run creates (ours and DeepSpeed's: all through ``torch.distributed.new_group``)
    destroyed once it ends, through DeepSpeed's ``destroy_process_group``, which also drops its own references to
    each. A gloo group's transport thread wakes 100 times a second for as long as the group lives, which a rank
    keeping every run's groups (some ten a run) pays in every later run: measured on 2 cores, 50 idle groups cost
    a rank 7% of a core, and a launch of 18 layouts ended with 330 threads per rank."""
    import deepspeed.comm
    import torch.distributed as dist

    created = []
    new_group = dist.new_group

    def recorded(*args, **kwargs):
        group = new_group(*args, **kwargs)
        created.append(group)
        return group

    dist.new_group = recorded
    try:
        yield
    finally:
        dist.new_group = new_group
    for group in created:
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            deepspeed.comm.destroy_process_group(group)


def _collect_run() -> None:
    """The finished run's engine, model and groups collected, then what is left frozen: the modules and what lives
    on between runs (some million objects once torch._dynamo is imported) are no longer walked by every later
    collection, this one's and the interpreter's own at exit (0.5 s per rank between runs, 6 s at the end of a
    launch before it was: 84 s -> 56 s for the 18 layouts of tests/test_training_e2e.py on 2 cores)."""
    gc.collect()
    gc.freeze()


def _command_line(run: list[str] | dict) -> list[str]:
    """A training run's arguments, or a verb's run as ``[verb, *args]``."""
    if not isinstance(run, dict):
        return run
    return [run["verb"], *run["args"]] if "verb" in run else run["args"]


class RouteBook:
    """Every MoE layer's choice of experts in a one-process run, recorded, and imposed on the same run under another
    layout, so that the two compare as dense layouts do: a near tie between two experts' probabilities (bf16 and
    FP8 round the router's inputs differently under TP, and the order of a tie is then a coin) sends a token to
    another expert, and the runs part by more than any rounding.

    A choice is keyed by (MoE layer, global micro-batch, step): this rank's n-th call of a layer is micro batch
    ``n % A`` of step ``n // A`` (A: its accumulation steps), which Megatron's sampler numbers ``(n % A) x DP +
    dp_rank`` in the step's global order, as one process numbers it. A replaying rank routes each token to the
    recorded experts, weighted by its own probabilities of them, and keeps, per key, how far its own router's
    probabilities are from the recorded ones and which tokens its own choice would have sent elsewhere, with the
    recorded gap between their k-th and (k+1)-th expert."""

    def __init__(self, spec: dict, rank: int) -> None:
        import torch

        self.spec, self.rank = spec, rank
        self.replaying = "replay" in spec
        self.choices = torch.load(os.path.join(spec["replay"], "routes.pt")) if self.replaying else {}
        self.calls: dict[str, int] = {}
        self.report: dict[tuple, dict] = {}

    def patch(self, moe_class):
        import torch

        choose, book = moe_class.choose, self

        def recorded_choose(layer, logits, probs):
            weights, chosen = choose(layer, logits, probs)
            name = layer.route_name
            call = book.calls.get(name, 0)
            book.calls[name] = call + 1
            if not book.replaying:
                book.choices[(name, call)] = (chosen.clone(), probs.detach().clone())
                return weights, chosen
            if layer.pctx.cp_size > 1:
                raise RuntimeError("routes are keyed by whole micro batches: no context parallelism")
            accumulation, dp = book.spec["accumulation"], layer.pctx.dp_size
            key = (name, (call // accumulation) * accumulation * dp + (call % accumulation) * dp + layer.pctx.dp_rank)
            want, want_probs = book.choices[key]
            top = want_probs.topk(layer.top_k + 1, dim=-1).values
            flipped = [i for i, row in enumerate(chosen.sort(dim=-1).values.tolist()) if
                       tuple(row) != tuple(sorted(want[i].tolist()))]
            book.report[key] = {"prob_error": float((probs.detach() - want_probs).abs().max()),
                                "flips": [(i, float(top[i, -2] - top[i, -1])) for i in flipped],
                                "tokens": chosen.shape[0]}
            if layer.scales_inputs:
                return torch.sigmoid(logits.gather(-1, want).float()).to(logits.dtype), want
            return probs.gather(-1, want), want

        moe_class.choose = recorded_choose
        return choose

    def save(self) -> None:
        import torch

        if self.replaying:
            torch.save(self.report, os.path.join(self.spec["replay"], f"replay-rank{self.rank}.pt"))
        else:
            torch.save(self.choices, os.path.join(self.spec["record"], "routes.pt"))


def _routed(run: dict, run_training) -> int:
    """``run_training()`` with the MoE layers' routes recorded or replayed (:class:`RouteBook`)."""
    from llama_megatron.model import moe
    from llama_megatron.training.run import setup

    book = RouteBook(run["routes"], int(os.environ.get("RANK", "0")))
    load_model = setup.load_model

    def named(*args, **kwargs):  # every MoE layer knows its name in the model (the same in every layout)
        model = load_model(*args, **kwargs)
        for name, module in model.named_modules():
            if isinstance(module, moe.MoEMLP):
                module.route_name = name
        return model

    choose = book.patch(moe.MoEMLP)
    setup.load_model = named
    try:
        rc = run_training()
    finally:
        moe.MoEMLP.choose, setup.load_model = choose, load_model
    book.save()
    return rc


def _run(run: list[str] | dict) -> int:
    if isinstance(run, dict) and "verb" in run:
        from llama_megatron.cli import main as cli_main
        from llama_megatron.parallel.process_groups import barrier
        from llama_megatron.training.run import generate

        # the default group is the launch's, shared by every run: `generate` ends with a barrier here instead of
        # taking the groups down (what a launch of its own does before the interpreter's exit)
        end_process_groups = generate.end_process_groups
        generate.end_process_groups = barrier
        try:
            return cli_main(_command_line(run))
        finally:
            generate.end_process_groups = end_process_groups
    if not isinstance(run, dict):
        return train.main(run)
    if "routes" in run:
        return _routed(run, lambda: train.main(run["args"]))
    open_session = loop.open_session

    def opened(*args, **kwargs):
        session = open_session(*args, **kwargs)
        dump_state(session, run["loaded_state"])
        return session

    loop.open_session = opened
    try:
        return train.main(_command_line(run))
    finally:
        loop.open_session = open_session


def main(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        runs = json.load(fh)
    for run in runs:
        with _groups_ended_with_the_run():
            rc = _run(run)
        if rc:
            print(f"run failed ({rc}): {' '.join(_command_line(run))}", file=sys.stderr, flush=True)
            return rc
        _collect_run()
    return 0


if __name__ == "__main__":
    # the deepspeed launcher appends --local_rank=N
    exit_process(main(next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))))
