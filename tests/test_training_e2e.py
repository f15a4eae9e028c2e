"""Whole training runs under the real `deepspeed` launcher (gloo, CPU) against the single-process run.

Data: the Shakespeare corpus shipped in data/, tokenised by `llama-megatron preprocess` with the shipped
tokenizer. Every layout (TP, SP, PP, DP, ZeRO, and context parallelism with each of them) must reproduce the TP1-PP1
losses step by step (fp32, relative 1e-4), and TP1-PP1 must reproduce plain transformers + torch AdamW on the same
batches.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from launch_utils import (
    PRETRAIN_CONFIG,
    ROOT,
    assert_losses_close,
    assert_run_replays_hf,
    launch,
    launch_many,
    losses,
    train_args,
)

from llama_megatron.cli import main as cli_main
from llama_megatron.training.config import TrainingConfig

CONFIG = PRETRAIN_CONFIG
REL = 1e-4
# Layouts are compared over HALF steps (past the 2 warm-up steps, Adam's moments in play); checkpoints are saved
# at HALF and resumed to FULL.
HALF, FULL = 6, 12


@pytest.fixture(scope="module")
def data_prefix(shakespeare_prefix) -> str:
    return shakespeare_prefix


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def _common(prefix: str, out: str, *extra: str) -> list[str]:
    return [f"data.prefix={prefix}", f"output_dir={out}", f"train.steps={HALF}", *extra]


@pytest.fixture(scope="module")
def single_process(data_prefix, short_documents_prefix, work) -> dict[str, str]:
    """Every one-process run the layouts are compared with, in one process (tests/scripts/train_many.py): TP1-PP1
    FULL steps with checkpoints at HALF and FULL ("ref"), per-document attention ("ref-perdoc"), tied embeddings
    ("ref-tied") and one causal step over the per-document data ("perdoc-off"); name -> output dir."""
    ref = str(work / "ref")
    runs = {"ref": (data_prefix, [f"train.steps={FULL}", f"checkpoint.save={ref}/ckpt", f"checkpoint.interval={HALF}",
                                  "checkpoint.keep_last=2", f"eval.interval={HALF}", f"logging.tensorboard_dir={ref}/tb"]),
            "ref-perdoc": (short_documents_prefix, ["data.per_document_attention=true"]),
            "ref-tied": (data_prefix, [TIED]),
            "perdoc-off": (short_documents_prefix, ["train.steps=1"])}
    dirs = {name: str(work / name) for name in runs}
    launch_many(1, [train_args(CONFIG, _common(prefix, dirs[name], *extra)) for name, (prefix, extra) in runs.items()],
                str(work / "single-process.json"))
    return dirs


@pytest.fixture(scope="module")
def reference(single_process) -> dict:
    """TP1-PP1, one process, FULL steps with checkpoints at HALF and FULL."""
    return {"dir": single_process["ref"], "losses": losses(single_process["ref"])}


@pytest.fixture(scope="module")
def reference_per_document(single_process) -> dict[int, float]:
    return losses(single_process["ref-perdoc"])


def test_reference_learns_and_matches_hf_adamw(reference, data_prefix) -> None:
    """TP1-PP1 under DeepSpeed equals transformers.LlamaForCausalLM + torch.optim.AdamW, step by step."""
    ours = reference["losses"]
    assert ours[FULL] < ours[1] - 0.5, "loss must fall on real text"
    config = TrainingConfig.from_file(CONFIG, [f"data.prefix={data_prefix}", f"train.steps={FULL}"])
    assert_run_replays_hf(reference["dir"], config, REL)


@pytest.mark.launched
def test_metrics_tensorboard_and_eval_only(reference, data_prefix, work) -> None:
    """metrics.jsonl has the documented fields, run.json the layout; TensorBoard got events; `evaluate`
    reproduces val_loss."""
    records = [json.loads(line) for line in open(os.path.join(reference["dir"], "metrics.jsonl"))]
    assert [r["step"] for r in records] == list(range(1, FULL + 1))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert all(isinstance(r[key], float) for r in records), key
    evaluated = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(evaluated) == [HALF, FULL]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(reference["dir"], "tb")))

    info = json.load(open(os.path.join(reference["dir"], "run.json")))
    assert (info["tensor"], info["pipeline"], info["data_parallel"], info["zero_stage"], info["precision"],
            info["seq_length"]) == (1, 1, 1, 0, "fp32", 32)

    out = str(work / "eval-only")  # the evaluate verb through `python -m llama_megatron`
    result = launch(1, CONFIG, _common(data_prefix, out, f"train.steps={FULL}", f"eval.interval={HALF}",
                                       f"checkpoint.load={reference['dir']}/ckpt"),
                    entry=["-m", "llama_megatron", "evaluate"])
    assert "val loss" in result.stdout
    (record,) = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert record["step"] == FULL
    assert abs(record["val_loss"] - evaluated[FULL]) <= 1e-6 * evaluated[FULL]


@pytest.mark.launched
def test_exact_resume(reference, data_prefix, work) -> None:
    """HALF steps + resume + HALF steps == FULL steps straight (fp32, 1e-6)."""
    out = str(work / "resume")
    ref = reference["dir"]
    launch(1, CONFIG, _common(data_prefix, out, f"train.steps={FULL}", f"checkpoint.load={ref}/ckpt",
                              f"checkpoint.tag=global_step{HALF}"))
    resumed = losses(out)
    assert sorted(resumed) == list(range(HALF + 1, FULL + 1))
    assert_losses_close(resumed, reference["losses"], 1e-6, range(HALF + 1, FULL + 1))


ZERO1 = "deepspeed_config=ds_configs/zero1_fp32.json"
PER_DOCUMENT = "data.per_document_attention=true"
ZERO3 = 'deepspeed_config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}'
TIED = "model.tie_word_embeddings=true"
BF16_REL = 2e-2  # bf16 weights against the fp32 reference: bf16's precision, not an exactness claim
# a bf16 run resumed at another data-parallel degree against its saved run: at PP 1 DeepSpeed accumulates bf16
# gradients in bf16, so DP1 rounds every element after each of its 4 micro batches where DP2 rounded after 2 and
# then averaged two ranks': the gradients part by a bf16 rounding or two (3.9e-3 relative) at every step, which AdamW
# carries into every weight. Held to a quarter of one bf16 rounding of the loss; observed 2.3e-5 on AVX-512 CPUs,
# 2.8e-4 with no SIMD at all (ATEN_CPU_CAPABILITY=default), growing from 4.5e-6 at the first step after the resume
BF16_RESUME_REL = 1e-3


def _matrix() -> dict[str, tuple[str, list[str], float]]:
    """Every 4-rank layout a user can configure, as name -> (reference, overrides, relative tolerance).

    SP x PP x recompute x per-document attention at TP2 (PP1 runs are TP2 x DP2; the half fraction of the 16: each
    combination of three of the four factors is in exactly one run), then SP with ZeRO-2/3, bf16
    with SP and PP, tied embeddings with SP and PP, and TP1 x PP2 x DP2; then the fast kernels (`kernels:
    compiled`: torch.compile'd elementwise kernels, chunked linear cross-entropy, GQA without K/V copies) under
    the hardest of these (TP2 x PP2 with SP, recomputation and per-document attention) against the same
    reference-kernel run. One compiled run only: every rank of a compiled run compiles its kernels (the CI starts
    with an empty inductor cache), and what the kernels compute does not depend on the layout: bf16, tied
    embeddings and other TP shapes are tests/test_model_kernels.py's, CP2 x TP2 with SP tests/test_parallel_context.py's. The reference is the TP1-PP1 single-process
    run on the same data: "causal", "per_document" or "tied".
    """
    runs: dict[str, tuple[str, list[str], float]] = {}
    for per_document in (False, True):
        for pipeline in (1, 2):
            for sp in (False, True):
                for recompute in (0, 1):
                    if (per_document + (pipeline == 2) + sp + recompute) % 2:
                        continue  # the half fraction: every combination of any three of the four factors, once
                    name = (f"{'perdoc' if per_document else 'causal'}-tp2-pp{pipeline}"
                            f"{'-sp' if sp else ''}{'-recompute' if recompute else ''}")
                    overrides = ["parallel.tensor=2", f"parallel.pipeline={pipeline}",
                                 f"parallel.sequence_parallel={str(sp).lower()}",
                                 f"activation_checkpointing.interval={recompute}", ZERO1]
                    if per_document:
                        overrides.append("data.per_document_attention=true")
                    runs[name] = ("per_document" if per_document else "causal", overrides, REL)
    sp_tp2 = ["parallel.tensor=2", "parallel.sequence_parallel=true"]
    runs["causal-tp2-sp-zero2-dp2"] = ("causal", [*sp_tp2, "deepspeed_config=ds_configs/zero2_fp32.json"], REL)
    runs["causal-tp2-sp-zero3-dp2"] = ("causal", [*sp_tp2, ZERO3], REL)
    runs["causal-tp2-pp2-sp-bf16"] = ("causal", [*sp_tp2, "parallel.pipeline=2",
                                                 "deepspeed_config=ds_configs/zero1_bf16.json"], BF16_REL)
    runs["tied-tp2-pp2-sp"] = ("tied", [*sp_tp2, "parallel.pipeline=2", TIED, ZERO1], REL)
    runs["causal-tp1-pp2-dp2"] = ("causal", ["parallel.pipeline=2", ZERO1], REL)
    compiled = "kernels=compiled"
    runs["compiled-perdoc-tp2-pp2-sp-recompute"] = ("per_document", [
        *sp_tp2, "parallel.pipeline=2", "activation_checkpointing.interval=1", "data.per_document_attention=true",
        ZERO1, compiled], REL)
    # context parallelism (Ulysses): 4 heads, 2 KV heads, so at TP2 one KV head per TP rank is repeated for CP2
    cp2_tp2 = ["parallel.context=2", "parallel.tensor=2"]
    runs["causal-cp2-tp2"] = ("causal", [*cp2_tp2, ZERO1], REL)
    runs["perdoc-cp2-tp2-sp-recompute"] = ("per_document", [
        *cp2_tp2, "parallel.sequence_parallel=true", "activation_checkpointing.interval=1", PER_DOCUMENT, ZERO1], REL)
    runs["causal-cp2-pp2"] = ("causal", ["parallel.context=2", "parallel.pipeline=2", ZERO1], REL)
    runs["perdoc-cp2-dp2-zero3"] = ("per_document", ["parallel.context=2", PER_DOCUMENT, ZERO3], REL)
    return runs


MATRIX = _matrix()
# The 4- and 8-rank runs take micro batches of 4 (the references: 2), so each step is 1 or 2 micro batches instead of
# 2 or 4: the same global batches and loss, half the collectives on this 2-core machine.
BIG_MICRO = "batch.micro_batch_size=4"


@pytest.fixture(scope="module")
def reference_tied(single_process) -> dict[int, float]:
    return losses(single_process["ref-tied"])


@pytest.fixture(scope="module")
def layout_matrix(data_prefix, short_documents_prefix, work) -> dict[str, dict[int, float]]:
    """All of MATRIX in one 4-process launch (each run through the train entry point, see train_many.py)."""
    runs = []
    for name, (reference, overrides, _) in MATRIX.items():
        prefix = short_documents_prefix if reference == "per_document" else data_prefix
        runs.append(train_args(CONFIG, _common(prefix, str(work / name), BIG_MICRO, *overrides)))
    launch_many(4, runs, str(work / "matrix.json"))
    return {name: losses(str(work / name)) for name in MATRIX}


@pytest.mark.parametrize("name", list(MATRIX))
def test_layout_matches_single_process(name, layout_matrix, reference, reference_per_document,
                                       reference_tied) -> None:
    """Each layout trains the TP1-PP1 model: per-step losses within 1e-4 (fp32) over HALF steps."""
    reference_name, _, rel = MATRIX[name]
    want = {"causal": reference["losses"], "per_document": reference_per_document, "tied": reference_tied}
    assert_losses_close(layout_matrix[name], want[reference_name], rel, range(1, HALF + 1))


EIGHT_RANK = {  # CP2 x TP2 x PP2 with everything on (8 processes on this 2-core machine; CP2 x TP2 and CP2 x PP2
    # without SP, recomputation and per-document attention are 4-rank runs above)
    "perdoc-cp2-tp2-pp2-sp-recompute": ("per_document", [
        "parallel.context=2", "parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true",
        "activation_checkpointing.interval=1", PER_DOCUMENT, ZERO1]),
}


@pytest.fixture(scope="module")
def eight_rank_runs(data_prefix, short_documents_prefix, work) -> dict[str, dict[int, float]]:
    runs = []
    for name, (reference, overrides) in EIGHT_RANK.items():
        prefix = short_documents_prefix if reference == "per_document" else data_prefix
        runs.append(train_args(CONFIG, _common(prefix, str(work / name), BIG_MICRO, *overrides)))
    launch_many(8, runs, str(work / "eight-rank.json"))
    return {name: losses(str(work / name)) for name in EIGHT_RANK}


@pytest.mark.parametrize("name", list(EIGHT_RANK))
def test_context_tensor_pipeline_layout_matches_single_process(name, eight_rank_runs, reference,
                                                               reference_per_document) -> None:
    """CP2 x TP2 x PP2, with SP, recomputation and per-document attention and without: the TP1-PP1 losses (1e-4)."""
    want = reference_per_document if EIGHT_RANK[name][0] == "per_document" else reference["losses"]
    assert_losses_close(eight_rank_runs[name], want, REL, range(1, HALF + 1))


TWO_RANK = {  # name -> overrides: TP1 x DP2 under ZeRO-1/2/3 (fp32) and ZeRO-2 (bf16), TP1 x PP2 ZeRO-1 fp32 and bf16,
    # CP2 ZeRO-1 fp32
    "zero1-dp2": [ZERO1],
    "zero2-dp2": ["deepspeed_config=ds_configs/zero2_fp32.json"],
    "zero3-dp2": [ZERO3],
    "bf16-zero2-dp2": ["deepspeed_config=ds_configs/zero2_bf16.json"],
    "tp1-pp2": ["parallel.pipeline=2", ZERO1],
    "bf16-tp1-pp2": ["parallel.pipeline=2", "deepspeed_config=ds_configs/zero1_bf16.json"],
    "cp2": ["parallel.context=2", ZERO1],
}
SAVE_AT_HALF = [f"train.steps={FULL}", f"checkpoint.interval={HALF}"]
CP_RESUME_REL = 1e-6
EXPORT_ATOL = 1e-4


@pytest.fixture(scope="module")
def two_rank_runs(data_prefix, work) -> dict[str, str]:
    """All of TWO_RANK in one 2-process launch, FULL steps saved at HALF and FULL; name -> output dir."""
    dirs = {name: str(work / name) for name in TWO_RANK}
    launch_many(2, [train_args(CONFIG, _common(data_prefix, dirs[name], *extra, *SAVE_AT_HALF,
                                               f"checkpoint.save={dirs[name]}/ckpt"))
                    for name, extra in TWO_RANK.items()], str(work / "two-rank.json"))
    return dirs


@pytest.mark.parametrize("name", list(TWO_RANK))
def test_two_rank_layout_matches_single_process(name, two_rank_runs, reference) -> None:
    rel = BF16_REL if "bf16" in name else REL
    assert_losses_close(losses(two_rank_runs[name]), reference["losses"], rel, range(1, FULL + 1))
    if name.startswith(("zero2", "zero3")):
        _check_zero_to_fp32(f"{two_rank_runs[name]}/ckpt", reference["dir"] + "/ckpt")


@pytest.fixture(scope="module")
def two_rank_resumed(two_rank_runs, reference, data_prefix, work) -> dict[str, dict[int, float]]:
    """Every TWO_RANK checkpoint of step HALF resumed to step FULL with the same layout, and the single-process
    reference's (ZeRO-0) at CP2 ("reference-at-cp2"), in one 2-process launch."""
    resumes = {name: (f"{two_rank_runs[name]}/ckpt", extra) for name, extra in TWO_RANK.items()}
    resumes["reference-at-cp2"] = (f"{reference['dir']}/ckpt", ["parallel.context=2"])
    dirs = {name: str(work / f"{name}-resumed") for name in resumes}
    launch_many(2, [train_args(CONFIG, _common(data_prefix, dirs[name], *extra, f"train.steps={FULL}",
                                               f"checkpoint.load={ckpt}", f"checkpoint.tag=global_step{HALF}"))
                    for name, (ckpt, extra) in resumes.items()], str(work / "two-rank-resumed.json"))
    return {name: losses(out) for name, out in dirs.items()}


@pytest.mark.parametrize("name", list(TWO_RANK))
def test_exact_resume_of_every_checkpoint_kind(name, two_rank_runs, two_rank_resumed) -> None:
    """HALF steps + resume + HALF steps == FULL steps, for ZeRO-1/2/3, PP2, fp32 and bf16 (ZeRO-0 PP1: test_exact_resume)."""
    resumed = two_rank_resumed[name]
    assert sorted(resumed) == list(range(HALF + 1, FULL + 1))
    assert_losses_close(resumed, losses(two_rank_runs[name]), 1e-6, range(HALF + 1, FULL + 1))


def test_resume_at_another_context_degree(two_rank_resumed, reference) -> None:
    """The single-process (CP1, ZeRO-0) checkpoint of step HALF resumed at CP2 continues the FULL-step run (the CP2
    checkpoint resumed at CP1: test_resume_with_another_data_parallel_degree[cp2])."""
    resumed = two_rank_resumed["reference-at-cp2"]
    assert sorted(resumed) == list(range(HALF + 1, FULL + 1))
    assert_losses_close(resumed, reference["losses"], CP_RESUME_REL, range(HALF + 1, FULL + 1))


def test_export_after_context_parallel_run(two_rank_runs, reference, work) -> None:
    """The CP2 run's checkpoint exports to the same HF model as the single-process run's: same config, same tensor
    names, every element within EXPORT_ATOL after FULL steps (observed 3.4e-5; the DP2 and PP2 runs differ from it by
    4.3e-5 as well: Adam turns summation-order differences of near-zero gradients into lr-sized steps)."""
    from safetensors.torch import load_file

    exported = {}
    for name, ckpt in (("cp2", f"{two_rank_runs['cp2']}/ckpt"), ("single", f"{reference['dir']}/ckpt")):
        out = str(work / f"export-{name}")
        assert cli_main(["export", "--input", ckpt, "--tag", f"global_step{FULL}", "--output", out]) == 0
        tensors = {}
        for file in sorted(os.listdir(out)):
            if file.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(out, file)))
        exported[name] = (json.load(open(os.path.join(out, "config.json"))), tensors)
    (cp2_config, cp2), (single_config, single) = exported["cp2"], exported["single"]
    assert cp2_config == single_config and cp2.keys() == single.keys()
    worst = max((cp2[k] - single[k]).abs().max().item() for k in single)
    print(f"largest difference of an exported element: {worst:.3g}")
    assert worst <= EXPORT_ATOL


def _check_zero_to_fp32(ckpt: str, reference_ckpt: str) -> None:
    """DeepSpeed's zero_to_fp32 recovers the full fp32 weights of a ZeRO-2/3 checkpoint (PP=1)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    recovered = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=f"global_step{HALF}")
    reference = torch.load(f"{reference_ckpt}/global_step{HALF}/mp_rank_00_model_states.pt", weights_only=True)["module"]
    assert recovered.keys() == reference.keys()
    for key, tensor in reference.items():
        torch.testing.assert_close(recovered[key].float(), tensor, rtol=1e-3, atol=1e-4, msg=key)


@pytest.mark.launched
def test_per_document_attention_changes_the_loss(reference_per_document, single_process) -> None:
    """The per-document references are not plain causal attention over the same packed tokens in disguise."""
    assert not math.isclose(losses(single_process["perdoc-off"])[1], reference_per_document[1], rel_tol=1e-3)


# ZeRO-2's partitions in fp32 take the same conversion and loader as ZeRO-1's and bf16 ZeRO-2's: not run again
UNIVERSAL = {name: TWO_RANK[name] for name in ("zero1-dp2", "zero3-dp2", "bf16-zero2-dp2")}
UNIVERSAL["cp2"] = [ZERO1]  # the CP2 checkpoint resumed at CP1: ZeRO partitions 2 -> 1


@pytest.fixture(scope="module")
def universal_resumed(two_rank_runs, data_prefix, work) -> dict[str, dict[int, float]]:
    """The DP2 (and CP2) checkpoints of step HALF resumed at DP1 CP1 (one process) through DeepSpeed's universal
    checkpoint."""
    dirs = {name: str(work / f"{name}-dp1-resumed") for name in UNIVERSAL}
    launch_many(1, [train_args(CONFIG, _common(data_prefix, dirs[name], *extra, f"train.steps={FULL}",
                                               f"checkpoint.load={two_rank_runs[name]}/ckpt",
                                               f"checkpoint.tag=global_step{HALF}"))
                    for name, extra in UNIVERSAL.items()], str(work / "universal-resumed.json"))
    return {name: losses(out) for name, out in dirs.items()}


@pytest.mark.parametrize("name", list(UNIVERSAL))
def test_resume_with_another_data_parallel_degree(name, two_rank_runs, universal_resumed) -> None:
    """ZeRO-1/3 and bf16 ZeRO-2 at DP2, and ZeRO-1 at CP2, resumed at DP1 CP1 through a universal checkpoint converted
    beside the original: the FULL-step run continues (observed: 6.9e-8 fp32; DP1 sums gradients in another order;
    bf16: see BF16_RESUME_REL)."""
    resumed = universal_resumed[name]
    assert sorted(resumed) == list(range(HALF + 1, FULL + 1))
    assert_losses_close(resumed, losses(two_rank_runs[name]), BF16_RESUME_REL if "bf16" in name else 1e-6,
                        range(HALF + 1, FULL + 1))
    assert os.path.isdir(os.path.join(two_rank_runs[name], "ckpt", f"global_step{HALF}_universal"))


@pytest.mark.launched
def test_restarted_job_resumes_after_a_rank_is_killed(two_rank_runs, data_prefix, work, monkeypatch) -> None:
    """Rank 1 of a 2-process job is SIGKILLed as it starts step 6; the same command again, with checkpoint.load
    "auto", continues from step 4 (the last complete checkpoint) exactly as the uninterrupted run."""
    out = str(work / "killed")
    ckpt_dir = os.path.join(out, "ckpt")
    args = _common(data_prefix, out, ZERO1, f"checkpoint.save={ckpt_dir}", "checkpoint.load=auto",
                   "checkpoint.interval=2")
    entry = [os.path.join(ROOT, "tests", "scripts", "kill_rank.py")]
    monkeypatch.setenv("KILL_AT_STEP", str(HALF))
    first = launch(2, CONFIG, args, entry=entry, check=False)
    assert first.returncode != 0
    assert f"no checkpoint in {ckpt_dir} yet: starting fresh" in first.stdout
    assert open(os.path.join(ckpt_dir, "latest")).read() == "global_step4"
    assert sorted(losses(out)) == list(range(1, HALF))

    monkeypatch.delenv("KILL_AT_STEP")
    second = launch(2, CONFIG, args, entry=entry)
    assert f"resumed from checkpoint {ckpt_dir}/global_step4 (step 4; RNG state restored)" in second.stdout
    assert open(os.path.join(ckpt_dir, "latest")).read() == f"global_step{HALF}"
    steps = [r["step"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in r]
    assert steps == [*range(1, HALF), *range(5, HALF + 1)]  # the restart redoes step 5, whose checkpoint was never written
    assert_losses_close(losses(out), losses(two_rank_runs["zero1-dp2"]), 1e-6, range(1, HALF + 1))


@pytest.mark.launched
def test_kill_during_save_keeps_previous_checkpoint(data_prefix, work, monkeypatch) -> None:
    out = str(work / "crash")
    ckpt_dir = os.path.join(out, "ckpt")
    monkeypatch.setenv("CRASH_AT_STEP", "4")
    result = launch(1, CONFIG, _common(data_prefix, out, f"checkpoint.save={ckpt_dir}", "checkpoint.interval=2",
                                       "train.steps=4"),
                    entry=[os.path.join(ROOT, "tests", "scripts", "crash_during_save.py")], check=False)
    assert result.returncode != 0
    assert open(os.path.join(ckpt_dir, "latest")).read() == "global_step2"
    assert not os.path.exists(os.path.join(ckpt_dir, "global_step4"))
    assert os.path.isdir(os.path.join(ckpt_dir, ".tmp-global_step4"))
    # the previous checkpoint still loads and trains on; the next save clears the half-written one
    launch(1, CONFIG, _common(data_prefix, out + "-resumed", f"checkpoint.load={ckpt_dir}",
                              f"checkpoint.save={ckpt_dir}", "checkpoint.interval=2", "train.steps=4"))
    assert open(os.path.join(ckpt_dir, "latest")).read() == "global_step4"
    assert not os.path.exists(os.path.join(ckpt_dir, ".tmp-global_step4"))
    assert sorted(losses(out + "-resumed")) == [3, 4]
