"""FP8 training under the launcher (`fp8` in the training JSON, docs/fp8.md): one process saved and resumed, a bf16
checkpoint resumed with FP8 on, and 2-process layouts against the one-process FP8 run. Two launches in all.

The runs are bf16 with fp32 master weights (FP8 is refused on fp32). A layout scales every cast as one process does
(tests/test_parallel_float8.py checks the amaxes), but it sums some products in another order (TP's all-reduce of
row-parallel partial sums, the pipeline's and ZeRO's bf16 gradient handling), and a float8 cast is a step function:
an operand that differs in its last bf16 bit can round to the neighbouring 8-bit value. So the layouts are held to
the loss agreement measured here (within 5.2e-4 of one process for rowwise, 1.4e-3 for tensorwise, over 8 steps;
FP8 and bf16 differ by 1.1e-3 at step 8), and what must be exact is: a resumed run continues its saved run to 1e-6.
"""

from __future__ import annotations

import json
import os

import pytest
from launch_utils import ROOT, assert_losses_close, launch_many, losses, train_args

pytestmark = pytest.mark.launched
pytest.importorskip("torchao.float8")

CONFIG = os.path.join(ROOT, "tests", "configs", "e2e_pretrain.json")
HALF, FULL = 4, 8
BF16 = "deepspeed_config=ds_configs/zero1_bf16.json"
FP8 = 'fp8={"recipe": "rowwise"}'
TENSORWISE = 'fp8={"recipe": "tensorwise"}'
EXACT = 1e-6
LAYOUT_REL = 3e-3  # see above: 1.4e-3 measured at most


def _lora(work) -> list[str]:
    return ['lora={"rank": 4, "alpha": 8}', f"checkpoint.load={work}/fp8/ckpt", f"checkpoint.tag=global_step{HALF}",
            "checkpoint.finetune=true"]


def _args(prefix: str, out, *extra: str) -> list[str]:
    return train_args(CONFIG, [f"data.prefix={prefix}", f"output_dir={out}", f"train.steps={FULL}", BF16, *extra])


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory, shakespeare_prefix) -> dict:
    work = tmp_path_factory.mktemp("fp8")
    save = [f"checkpoint.interval={HALF}"]
    single = [
        ("fp8", [FP8, f"checkpoint.save={work}/fp8/ckpt", *save, "logging.fp8_stats=true"]),
        ("tensorwise", [TENSORWISE]),
        ("bf16", [f"checkpoint.save={work}/bf16/ckpt", *save]),
        ("fp8-resumed", [FP8, f"checkpoint.load={work}/fp8/ckpt", f"checkpoint.tag=global_step{HALF}"]),
        ("bf16-resumed-in-fp8", [FP8, f"checkpoint.load={work}/bf16/ckpt", f"checkpoint.tag=global_step{HALF}"]),
        ("lora", [FP8, *_lora(work)]),  # the FP8 run's step-4 weights, frozen in FP8, adapters in bf16
        ("lora-frozen", [FP8, *_lora(work), "optimizer.lr=0", "optimizer.min_lr=0"]),
    ]
    launch_many(1, [_args(shakespeare_prefix, work / name, *extra) for name, extra in single],
                str(work / "single.json"))
    layouts = {
        "tp2": ["parallel.tensor=2"],
        "tp2-sp": ["parallel.tensor=2", "parallel.sequence_parallel=true"],
        "pp2": ["parallel.pipeline=2", "logging.fp8_stats=true"],
        "pp2-zb-h1": ["parallel.pipeline=2", "pipeline.schedule=zb-h1"],
        "cp2": ["parallel.context=2"],
        "dp2-zero2": ["deepspeed_config=ds_configs/zero2_bf16.json"],
        "tp2-tensorwise": ["parallel.tensor=2", TENSORWISE],
        "dp2-zero3": ["deepspeed_config=ds_configs/zero3_bf16.json"],
        "pp2-interleaved": ["parallel.pipeline=2", "pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2"],
        "pp2-zb-v": ["parallel.pipeline=2", "pipeline.schedule=zb-v", "pipeline.virtual_stages=2"],
    }
    launch_many(2, [_args(shakespeare_prefix, work / name, FP8, *extra) for name, extra in layouts.items()],
                str(work / "layouts.json"))
    return {name: losses(str(work / name)) for name, _ in single} | {
        name: losses(str(work / name)) for name in layouts} | {"dir": work}


def test_fp8_trains_and_records_its_recipe(fp8_runs) -> None:
    fp8, bf16 = fp8_runs["fp8"], fp8_runs["bf16"]
    assert sorted(fp8) == list(range(1, FULL + 1)) and fp8[FULL] < fp8[1] - 0.3, fp8
    # float8 rounds the GEMMs' operands: close to bf16's curve, not equal to it
    assert_losses_close(fp8, bf16, 2e-2, range(1, FULL + 1))
    assert any(abs(fp8[s] - bf16[s]) > 1e-6 * bf16[s] for s in fp8)
    info = json.load(open(fp8_runs["dir"] / "fp8" / "run.json", encoding="utf-8"))
    assert info["fp8"] == {"recipe": "rowwise", "modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                           "filter": None, "emulate": False}


def test_lora_on_an_fp8_base_lowers_the_loss_of_its_frozen_twin(fp8_runs) -> None:
    """LoRA on the FP8 run's step-4 weights, the base's GEMMs in float8 and the adapters in bf16, against the same
    run at learning rate 0 (the base's own loss on each batch): equal at step 1 (B = 0), lower by the end."""
    lora, frozen = fp8_runs["lora"], fp8_runs["lora-frozen"]
    assert sorted(lora) == sorted(frozen) == list(range(1, FULL + 1))
    assert_losses_close(lora, frozen, EXACT, [1])
    assert lora[FULL] < frozen[FULL], (lora, frozen)


@pytest.mark.parametrize("name", ["fp8", "pp2"])
def test_fp8_statistics_are_logged_and_plotted(fp8_runs, name) -> None:
    """`logging.fp8_stats`: every logged record holds each FP8 linear kind's casts with an amax and a scale per
    decoder layer, every layer's (under PP2 the two stages' layers together), and `plot` draws them."""
    from llama_megatron.training.diagnostics.plot import plot_runs

    run = fp8_runs["dir"] / name
    records = [json.loads(line) for line in open(run / "metrics.jsonl", encoding="utf-8")]
    assert len(records) == FULL
    for record in records:
        stats = record["fp8"]
        assert set(stats) == {f"{kind}.{cast}" for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
                              for cast in ("input", "weight", "grad_output", "weight_for_grad_input",
                                           "grad_output_for_grad_weight", "input_for_grad_weight")}
        for entry in stats.values():
            assert len(entry["amax"]) == 4 and all(a > 0 for a in entry["amax"]), entry
            assert all(s * a == pytest.approx(448.0, rel=1e-3) for s, a in zip(entry["scale"], entry["amax"]))
    png = plot_runs([str(run)], str(run / "fp8.png"))
    assert os.path.getsize(png) > 10_000


@pytest.mark.parametrize("name, saved", [("fp8-resumed", "fp8"), ("bf16-resumed-in-fp8", "bf16")])
def test_resume_continues_the_saved_state(fp8_runs, name, saved) -> None:
    """A FP8 run's checkpoint (high-precision weights) resumes exactly; a bf16 one resumes with FP8 on, its first
    step from the same weights (the loss is the FP8 forward of the bf16 run's weights: not the bf16 run's)."""
    resumed = fp8_runs[name]
    assert sorted(resumed) == list(range(HALF + 1, FULL + 1)), resumed
    if name == "fp8-resumed":
        assert_losses_close(resumed, fp8_runs["fp8"], EXACT, range(HALF + 1, FULL + 1))
    else:
        assert_losses_close(resumed, fp8_runs["bf16"], 2e-2, range(HALF + 1, FULL + 1))


@pytest.mark.parametrize("name", ["tp2", "tp2-sp", "pp2", "pp2-zb-h1", "cp2", "dp2-zero2", "tp2-tensorwise",
                                  "dp2-zero3", "pp2-interleaved", "pp2-zb-v"])
def test_fp8_layouts_match_one_process(fp8_runs, name) -> None:
    want = fp8_runs["tensorwise" if "tensorwise" in name else "fp8"]
    assert_losses_close(fp8_runs[name], want, LAYOUT_REL, range(1, FULL + 1))
