"""Start real training runs: the `deepspeed` launcher for several processes, plain python for one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import rank_pool

from llama_megatron.parallel.placement import launcher_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tiny training configs every launched test starts from, with its own --set overrides
PRETRAIN_CONFIG = os.path.join(ROOT, "tests", "configs", "e2e_pretrain.json")
SFT_CONFIG = os.path.join(ROOT, "tests", "configs", "e2e_sft.json")
# every run started through here (and by files that record theirs): a fixture that fails shows their output tails
# (conftest.py's report hook)
LAUNCHED: list[subprocess.CompletedProcess] = []


def record(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    LAUNCHED.append(result)
    return result


def train_args(config: str, overrides: list[str]) -> list[str]:
    return ["--config", config] + [a for item in overrides for a in ("--set", item)]


def run_args(prefix: str, out, *overrides: str, config: str = PRETRAIN_CONFIG) -> list[str]:
    """The arguments of one launched run of the tiny pretraining config: its data (a preprocessed ``prefix``), its
    output directory, then ``overrides`` (``key=value``, as ``--set`` takes them)."""
    return train_args(config, [f"data.prefix={prefix}", f"output_dir={out}", *overrides])


def launch(nprocs: int, config: str, overrides: list[str], timeout: int = 600,
           entry: list[str] | None = None, check: bool = True, launcher: bool = False) -> subprocess.CompletedProcess:
    """Run a training command from the repo root; ``entry`` replaces ``-m llama_megatron.train``."""
    return run_command(nprocs, entry or ["-m", "llama_megatron.train"], train_args(config, overrides), timeout, check,
                       launcher)


def launch_many(nprocs: int, runs: list[list[str]], runs_file: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    """Several training runs (each a ``train_args`` list) in one launch: see tests/scripts/train_many.py."""
    with open(runs_file, "w", encoding="utf-8") as fh:
        json.dump(runs, fh)
    return run_command(nprocs, [os.path.join(ROOT, "tests", "scripts", "train_many.py")], [runs_file], timeout)


def run_command(nprocs: int, entry: list[str], args: list[str], timeout: int = 600,
                check: bool = True, launcher: bool = False, fresh: bool = False) -> subprocess.CompletedProcess:
    """``entry args`` (``["-m", MODULE, ...]`` or ``[SCRIPT, ...]``) in one plain process, or as ``nprocs`` ranks of
    the ``deepspeed`` launcher (for one process too when ``launcher``). The ranks are forked from this worker's rank
    pool (tests/rank_pool.py: the same entry point, arguments and environment as the launcher gives them, without
    its and the imports' start-up) unless ``fresh``: then the real launcher and interpreters run, as a user's
    command does (what the launchers and a fresh process's output are tested by)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    plain = nprocs == 1 and not launcher
    if plain:
        # one process has this pytest worker's share of the cores while the test waits (the multi-process runs it
        # is compared with use one thread per rank; the tolerances hold either way); never more threads than that
        # share: OpenMP threads spin-wait for each other, and one without a core of its own stalls them all
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            env.pop(key, None)
    if not fresh and rank_pool.POOL.accepts(env):
        module = entry[0] == "-m"
        kind, target, rest = ("module", entry[1], entry[2:]) if module else ("script", entry[0], entry[1:])
        try:
            result = rank_pool.run(kind, target, [*rest, *args], nprocs, env, ROOT, timeout, launcher=not plain)
        except subprocess.TimeoutExpired as exc:
            record(subprocess.CompletedProcess(exc.cmd, -9, exc.output, exc.stderr))
            raise
    else:
        if plain:
            cmd = [sys.executable, *entry, *args]
        else:
            module_or_script = ["--module", *entry[1:]] if entry[0] == "-m" else entry
            cmd = [*launcher_command(nprocs), *module_or_script, *args]
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    record(result)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, result.args))} failed ({result.returncode}):\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def run_python(argv: list[str], env: dict[str, str] | None = None, cwd: str = ROOT, timeout: float = 600,
               fresh: bool = False) -> subprocess.CompletedProcess:
    """``python ARGV`` (``SCRIPT ...``, ``-m MODULE ...`` or ``-c CODE ...``) as one plain process in ``cwd``, its
    output captured: forked from the rank pool (tests/rank_pool.py) unless ``fresh`` or ``env`` sets a variable the
    interpreter reads as it starts; then a new interpreter, as a user's shell starts one."""
    env = dict(os.environ if env is None else env)
    if not fresh and rank_pool.POOL.accepts(env):
        kind = {"-m": "module", "-c": "code"}.get(argv[0], "script")
        target, rest = (argv[1], argv[2:]) if kind != "script" else (argv[0], argv[1:])
        return record(rank_pool.run(kind, target, rest, 1, env, cwd, timeout, launcher=False))
    return record(subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                                 timeout=timeout))


def losses(output_dir: str, key: str = "loss") -> dict[int, float]:
    """step -> ``key`` (the training loss, or ``val_loss``) from a run's metrics.jsonl."""
    out = {}
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            if key in record:
                out[record["step"]] = record[key]
    return out


def assert_losses_close(got: dict[int, float], want: dict[int, float], rel: float, steps) -> None:
    for step in steps:
        assert step in got, f"step {step} missing from run (have {sorted(got)})"
        assert abs(got[step] - want[step]) <= rel * abs(want[step]), (
            f"step {step}: {got[step]!r} vs reference {want[step]!r} (rel tol {rel})"
        )


def hf_adamw_twin(config, eod_id: int | None = None):
    """The family's transformers class (LlamaForCausalLM, Qwen2ForCausalLM, ...) with this run's seeded initial
    weights, torch AdamW over the same parameter groups and the run's LR schedule, and the run's training dataset
    (read from the repository root): the reference a single-process run is replayed against."""
    import torch
    from model_utils import hf_class, hf_config, to_transformers

    from llama_megatron.model.build import build_model
    from llama_megatron.model.tp_slicing import rank_state_dicts_to_hf
    from llama_megatron.parallel.context import ParallelContext
    from llama_megatron.training.engine.lr_schedule import build_scheduler
    from llama_megatron.training.engine.optimizer import parameter_groups
    from llama_megatron.training.run.batches import build_datasets

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        init = build_model(config.model, config.parallel, ParallelContext.single(), seed=config.seed)
        train_ds, _, _ = build_datasets(config, eod_id)
    finally:
        os.chdir(cwd)
    hf = hf_class(config.model)(hf_config(config.model, attn_implementation="sdpa")).float()
    hf.load_state_dict(to_transformers(rank_state_dicts_to_hf([init.state_dict()], config.model), config.model))
    opt = config.optimizer
    optimizer = torch.optim.AdamW(parameter_groups(hf, opt.weight_decay), lr=opt.lr, betas=opt.betas, eps=opt.eps)
    return hf, optimizer, build_scheduler(optimizer, opt, config.train.steps), train_ds


def _routing_loads(hf) -> dict:
    """{router: its assignments per expert since the last clear}, counted by a hook on each of HF's DeepSeek-V3
    routers from the expert ids it returns (its output (logits, weights, ids))."""
    import torch

    loads = {}
    for module in hf.modules():
        if type(module).__name__ == "DeepseekV3TopkRouter":
            loads[module] = torch.zeros(module.num_experts, dtype=torch.long)

            def count(router, args, output):
                loads[router] += torch.bincount(output[2].flatten(), minlength=router.num_experts)

            module.register_forward_hook(count)
    return loads


def assert_run_replays_hf(run_dir, config, rel: float = 1e-4, norm_rel: float = 1e-3) -> None:
    """The one-process run in ``run_dir`` (its metrics.jsonl) step by step against :func:`hf_adamw_twin` on the same
    batches: the loss within ``rel`` and the clipped gradient norm within ``norm_rel`` at every step."""
    import torch
    import torch.nn.functional as F

    from llama_megatron.parallel.context import ParallelContext
    from llama_megatron.training.run.batches import step_batches

    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        ours = {r["step"]: r for r in map(json.loads, fh) if "loss" in r}
    hf, optimizer, scheduler, train_ds = hf_adamw_twin(config)
    steps = config.train.steps
    loads = _routing_loads(hf)
    for step, micro_batches in enumerate(step_batches(train_ds, config, ParallelContext.single(), 0, steps), start=1):
        optimizer.zero_grad()
        total = 0.0
        for mb in micro_batches:
            out = hf(input_ids=mb.input_ids, position_ids=mb.position_ids)
            loss = F.cross_entropy(out.logits.flatten(0, 1), mb.labels.flatten())
            if config.model.family.moe and config.model.output_router_logits:  # HF adds it with labels given
                loss = loss + config.model.router_aux_loss_coef * out.aux_loss
            (loss / len(micro_batches)).backward()
            total += loss.item() / len(micro_batches)
        norm = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), config.optimizer.clip_grad))
        optimizer.step()
        scheduler.step()
        with torch.no_grad():  # DeepSeek-V3's routing biases: the report's rule on HF's own choices this step
            for router, counts in loads.items():
                load = counts.double()
                router.e_score_correction_bias += config.moe.bias_update_rate * torch.sign(load.mean() - load).float()
                counts.zero_()
        loss, grad_norm = ours[step]["loss"], ours[step]["grad_norm"]
        assert abs(total - loss) <= rel * loss, f"step {step}: HF {total} vs ours {loss}"
        assert abs(norm - grad_norm) <= norm_rel * norm, f"step {step}: grad norm HF {norm} vs ours {grad_norm}"
    assert sorted(ours) == list(range(1, steps + 1))
