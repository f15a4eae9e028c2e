"""`llama-megatron estimate` against what real DeepSpeed engines and real autograd hold.

Model states: real engines (TrainingEngine under real gloo process groups, one optimizer step) for ZeRO-0..3 at
DP2 and TP2 x PP2 ZeRO-1; every case of a world size shares one launch. Activations: the storages autograd saves
during one micro batch's forward (saved_tensors_hooks), with and without recomputation.
"""

from __future__ import annotations

import json
import os

import torch
from dist_utils import run_distributed

from llama_megatron.parallel.context import ParallelContext
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.deepspeed_config import build_deepspeed_config
from llama_megatron.training.memory_estimate import estimate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "tests", "configs", "e2e_pretrain.json")
# odd sizes so ZeRO's padding shows: 63-wide norms, an 8127-element down projection
ODD = ["model.hidden_size=63", "model.num_attention_heads=3", "model.num_key_value_heads=3", "model.head_dim=22",
       "model.intermediate_size=129"]
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 10000}  # the embedding and head get partitioned


def _config(overrides: list[str]) -> TrainingConfig:
    return TrainingConfig.from_file(CONFIG, ["data={\"synthetic\": true}", "tokenizer=null", *overrides])


def _ds(stage: int | dict, bf16: bool = False) -> dict:
    zero = stage if isinstance(stage, dict) else {"stage": stage}
    return {"zero_optimization": zero, "bf16": {"enabled": bf16}}


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _measure(engine) -> dict:
    """Bytes of the parameters this rank holds and of its optimizer states (fp32 master + Adam)."""
    params = list(engine.model.parameters())
    held = [p.ds_tensor for p in params if hasattr(p, "ds_tensor")] + [p.data for p in params]
    wrapper = engine.optimizer
    basic = getattr(wrapper, "optimizer", wrapper)
    masters = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
                 "fp32_groups_flat"):
        masters += list(getattr(wrapper, name, None) or [])
    # Adam's scalar `step` tensors (4 bytes per parameter tensor) are left out: not model-sized state
    adam = [v for state in basic.state.values() for k, v in state.items() if torch.is_tensor(v) and k != "step"]
    return {"parameters": _storage_bytes(held), "optimizer": _storage_bytes(masters + adam),
            "wrapper": type(wrapper).__name__}


def _states_worker(rank: int, world_size: int, cases: list, out_dir: str) -> None:
    from llama_megatron.parallel.launch import init_distributed
    from llama_megatron.training.engine import MicroBatch, TrainingEngine

    init_distributed()
    results = []
    for overrides, ds_source in cases:
        config = _config(overrides)
        ds = build_deepspeed_config(config, ds_source, world_size)
        pctx = ParallelContext.build(config.parallel.tensor, config.parallel.pipeline,
                                     config.parallel.sequence_parallel)
        engine = TrainingEngine(config, ds, pctx)
        b, s = config.batch.micro_batch_size, config.seq_length
        ids = torch.randint(0, config.model.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(s).expand(b, s).contiguous()
        engine.train_step([MicroBatch(ids, pos, ids.clone())] * config.gradient_accumulation_steps(world_size))
        results.append({"stage": pctx.pp_rank, **_measure(engine)})
        del engine
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh)


def _run_states(tmp_path, world_size: int, cases: list) -> list[list[dict]]:
    run_distributed(_states_worker, world_size, cases, str(tmp_path))
    per_rank = [json.load(open(tmp_path / f"rank{r}.json", encoding="utf-8")) for r in range(world_size)]
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cases))]


def _check_states(cases: list, measured: list[list[dict]], world_size: int) -> list[str]:
    report = []
    for (overrides, ds_source), ranks in zip(cases, measured):
        config = _config(overrides)
        est = estimate(config, build_deepspeed_config(config, ds_source, world_size), world_size)
        for got in ranks:
            stage = est.stages[got["stage"]]
            want = {"parameters": stage.parameters + stage.cpu_parameters,
                    "optimizer": stage.optimizer + stage.cpu_optimizer}
            line = (f"{overrides} {ds_source} stage {got['stage']} ({got['wrapper']}): parameters "
                    f"{got['parameters']} vs {want['parameters']}, optimizer {got['optimizer']} vs {want['optimizer']}")
            report.append(line)
            assert got["parameters"] == want["parameters"] and got["optimizer"] == want["optimizer"], line
    return report


DP2_CASES = [
    ([], _ds(0)),
    ([], _ds(1)),
    ([], _ds(2)),
    ([], _ds(ZERO3)),
    ([], _ds(2, bf16=True)),
    (["model.tie_word_embeddings=true"], _ds(1)),
    (ODD, _ds(1)),
    (ODD, _ds(ZERO3)),
]
TP2_PP2_CASES = [
    (["parallel.tensor=2", "parallel.pipeline=2"], _ds(1)),
    (["parallel.tensor=2", "parallel.pipeline=2", "model.tie_word_embeddings=true"], _ds(1, bf16=True)),
]


def test_states_match_deepspeed_dp2(tmp_path):
    report = _check_states(DP2_CASES, _run_states(tmp_path, 2, DP2_CASES), 2)
    print("\n".join(report))


def test_states_match_deepspeed_tp2_pp2(tmp_path):
    report = _check_states(TP2_PP2_CASES, _run_states(tmp_path, 4, TP2_PP2_CASES), 4)
    print("\n".join(report))
