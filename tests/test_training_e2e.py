"""Whole training runs under the real `deepspeed` launcher (gloo, CPU) against the single-process run.

Data: the Shakespeare corpus shipped in data/, tokenised by `llama-megatron preprocess` with the shipped
tokenizer. Every layout must reproduce the TP1-PP1 losses step by step (fp32, relative 1e-4), and TP1-PP1 must
reproduce plain transformers + torch AdamW on the same batches.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from launch_utils import ROOT, assert_losses_close, launch, losses

from llama_megatron.checkpoint.hf_mapping import rank_state_dicts_to_hf
from llama_megatron.cli import main as cli_main
from llama_megatron.model.build import build_model
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.training.batches import build_datasets, step_batches
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.optimizer import parameter_groups
from llama_megatron.training.schedule import build_scheduler

CONFIG = os.path.join(ROOT, "tests", "configs", "e2e_pretrain.json")
REL = 1e-4


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("data")
    prefix = str(out / "shakespeare")
    rc = cli_main(["preprocess", "--input", os.path.join(ROOT, "data/corpus/shakespeare.jsonl"), "--tokenizer",
                   os.path.join(ROOT, "data/tokenizer"), "--output-prefix", prefix, "--append-eod", "--quiet"])
    assert rc == 0
    return prefix + "_text_document"


@pytest.fixture(scope="module")
def short_documents_prefix(tmp_path_factory) -> str:
    """Every line of the corpus as its own document: most samples pack several documents."""
    import json

    out = tmp_path_factory.mktemp("short-docs")
    text = out / "lines.txt"
    with open(os.path.join(ROOT, "data/corpus/shakespeare.jsonl"), encoding="utf-8") as src:
        lines = [line for record in src for line in json.loads(record)["text"].splitlines() if line.strip()]
    text.write_text("\n".join(lines[:20000]) + "\n", encoding="utf-8")
    rc = cli_main(["preprocess", "--input", str(text), "--tokenizer", os.path.join(ROOT, "data/tokenizer"),
                   "--output-prefix", str(out / "lines"), "--append-eod", "--quiet"])
    assert rc == 0
    return str(out / "lines_text_document")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def _common(prefix: str, out: str, *extra: str) -> list[str]:
    return [f"data.prefix={prefix}", f"output_dir={out}", *extra]


@pytest.fixture(scope="module")
def reference(data_prefix, work) -> dict:
    """TP1-PP1, one process, 20 steps with checkpoints at 10 and 20."""
    out = str(work / "ref")
    launch(1, CONFIG, _common(data_prefix, out, "train.steps=20", f"checkpoint.save={out}/ckpt",
                              "checkpoint.interval=10", "checkpoint.keep_last=2", "eval.interval=10",
                              f"logging.tensorboard_dir={out}/tb"))
    return {"dir": out, "losses": losses(out)}


@pytest.fixture(scope="module")
def reference_per_document(short_documents_prefix, work) -> dict[int, float]:
    out = str(work / "ref-perdoc")
    launch(1, CONFIG, _common(short_documents_prefix, out, "data.per_document_attention=true"))
    return losses(out)


def test_reference_learns_and_matches_hf_adamw(reference, data_prefix) -> None:
    """TP1-PP1 under DeepSpeed equals transformers.LlamaForCausalLM + torch.optim.AdamW, step by step."""
    import json

    ours = reference["losses"]
    assert ours[20] < ours[1] - 0.5, "loss must fall on real text"
    records = [json.loads(line) for line in open(os.path.join(reference["dir"], "metrics.jsonl"))]
    grad_norms = {r["step"]: r["grad_norm"] for r in records}

    from transformers import LlamaConfig, LlamaForCausalLM

    config = TrainingConfig.from_file(CONFIG, [f"data.prefix={data_prefix}", "train.steps=20"])
    pctx = ParallelContext.single()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        init = build_model(config.model, config.parallel, pctx, seed=config.seed)
        train_ds, _, _ = build_datasets(config)
    finally:
        os.chdir(cwd)
    hf = LlamaForCausalLM(LlamaConfig(**config.model.to_hf_dict(), attn_implementation="sdpa")).float()
    hf.load_state_dict(rank_state_dicts_to_hf([init.state_dict()], config.model))
    opt = config.optimizer
    optimizer = torch.optim.AdamW(parameter_groups(hf, opt.weight_decay), lr=opt.lr, betas=opt.betas, eps=opt.eps)
    scheduler = build_scheduler(optimizer, opt, config.train.steps)
    for step, micro_batches in enumerate(step_batches(train_ds, config, pctx, 0, 10), start=1):
        optimizer.zero_grad()
        total = 0.0
        for mb in micro_batches:
            logits = hf(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten())
            (loss / len(micro_batches)).backward()
            total += loss.item() / len(micro_batches)
        norm = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), opt.clip_grad))
        optimizer.step()
        scheduler.step()
        assert abs(total - ours[step]) <= REL * ours[step], f"step {step}: HF {total} vs ours {ours[step]}"
        assert abs(norm - grad_norms[step]) <= 1e-3 * norm, f"step {step}: grad norm HF {norm} vs {grad_norms[step]}"


def test_metrics_tensorboard_and_eval_only(reference, data_prefix, work) -> None:
    """metrics.jsonl has the documented fields; TensorBoard got events; --eval-only reproduces val_loss."""
    import json

    records = [json.loads(line) for line in open(os.path.join(reference["dir"], "metrics.jsonl"))]
    assert [r["step"] for r in records] == list(range(1, 21))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert all(isinstance(r[key], float) for r in records), key
    evaluated = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(evaluated) == [10, 20]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(reference["dir"], "tb")))

    out = str(work / "eval-only")
    result = launch(1, CONFIG, _common(data_prefix, out, "train.steps=20", "eval.interval=10",
                                       f"checkpoint.load={reference['dir']}/ckpt"),
                    entry=["-m", "llama_megatron.train", "--eval-only"])
    assert "val loss" in result.stdout
    (record,) = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert record["step"] == 20
    assert abs(record["val_loss"] - evaluated[20]) <= 1e-6 * evaluated[20]


def test_exact_resume(reference, data_prefix, work) -> None:
    """10 steps + resume + 10 steps == 20 steps straight (fp32, 1e-6)."""
    out = str(work / "resume")
    ref = reference["dir"]
    launch(1, CONFIG, _common(data_prefix, out, "train.steps=20", f"checkpoint.load={ref}/ckpt",
                              "checkpoint.tag=global_step10"))
    resumed = losses(out)
    assert sorted(resumed) == list(range(11, 21))
    assert_losses_close(resumed, reference["losses"], 1e-6, range(11, 21))


@pytest.mark.parametrize(
    "name, nprocs, extra",
    [
        ("tp2-pp2", 4, ["parallel.tensor=2", "parallel.pipeline=2", "deepspeed_config=ds_configs/zero1_fp32.json"]),
        ("tp1-pp2-dp2", 4, ["parallel.pipeline=2", "deepspeed_config=ds_configs/zero1_fp32.json"]),
        ("tp2-sp-recompute", 2, ["parallel.tensor=2", "parallel.sequence_parallel=true",
                                 "activation_checkpointing.interval=1"]),
        ("zero1-dp2", 2, ["deepspeed_config=ds_configs/zero1_fp32.json"]),
        ("zero2-dp2", 2, ["deepspeed_config=ds_configs/zero2_fp32.json", "checkpoint.interval=10"]),
        ("zero3-dp2", 2, ['deepspeed_config={"zero_optimization": {"stage": 3, '
                          '"stage3_param_persistence_threshold": 0}}', "checkpoint.interval=10"]),
    ],
)
def test_parallel_layout_matches_single_process(name, nprocs, extra, reference, data_prefix, work) -> None:
    out = str(work / name)
    launch(nprocs, CONFIG, _common(data_prefix, out, *extra, f"checkpoint.save={out}/ckpt"))
    assert_losses_close(losses(out), reference["losses"], REL, range(1, 11))
    if name.startswith(("zero2", "zero3")):
        _check_zero_to_fp32(f"{out}/ckpt", reference["dir"] + "/ckpt")


def _check_zero_to_fp32(ckpt: str, reference_ckpt: str) -> None:
    """DeepSpeed's zero_to_fp32 recovers the full fp32 weights of a ZeRO-2/3 checkpoint (PP=1)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    recovered = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="global_step10")
    reference = torch.load(f"{reference_ckpt}/global_step10/mp_rank_00_model_states.pt", weights_only=True)["module"]
    assert recovered.keys() == reference.keys()
    for key, tensor in reference.items():
        torch.testing.assert_close(recovered[key].float(), tensor, rtol=1e-3, atol=1e-4, msg=key)


def test_per_document_attention_survives_pipeline(reference_per_document, short_documents_prefix, work) -> None:
    """Packed samples with per-document attention (and activation checkpointing): TP2-PP2 equals one process,
    and differs from plain causal attention over the same packed tokens."""
    out = str(work / "perdoc-tp2-pp2")
    launch(4, CONFIG, _common(short_documents_prefix, out, "data.per_document_attention=true", "parallel.tensor=2",
                              "parallel.pipeline=2", "deepspeed_config=ds_configs/zero1_fp32.json",
                              "activation_checkpointing.interval=1"))
    assert_losses_close(losses(out), reference_per_document, REL, range(1, 11))
    causal = str(work / "perdoc-off")
    launch(1, CONFIG, _common(short_documents_prefix, causal, "train.steps=1"))
    assert not math.isclose(losses(causal)[1], reference_per_document[1], rel_tol=1e-3)


def test_resume_with_another_data_parallel_degree(reference, data_prefix, work) -> None:
    """ZeRO-1 at DP2 saved at step 5, resumed at DP1 through DeepSpeed's universal checkpoint."""
    dp2 = str(work / "zero1-dp2-save")
    launch(2, CONFIG, _common(data_prefix, dp2, "deepspeed_config=ds_configs/zero1_fp32.json",
                              f"checkpoint.save={dp2}/ckpt", "checkpoint.interval=5", "train.steps=5"))
    out = str(work / "zero1-dp1-resume")
    launch(1, CONFIG, _common(data_prefix, out, "deepspeed_config=ds_configs/zero1_fp32.json",
                              f"checkpoint.load={dp2}/ckpt"))
    resumed = losses(out)
    assert sorted(resumed) == list(range(6, 11))
    assert_losses_close(resumed, reference["losses"], REL, range(6, 11))
    assert os.path.isdir(os.path.join(dp2, "ckpt", "global_step5_universal"))


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


def test_bf16_pipeline_zero1_trains_close_to_fp32(reference, data_prefix, work) -> None:
    """bf16 weights with PP2 + ZeRO-1 (fp32 gradient accumulation): same trajectory within bf16 precision."""
    out = str(work / "bf16-pp2")
    launch(2, CONFIG, _common(data_prefix, out, "parallel.pipeline=2", "deepspeed_config=ds_configs/zero1_bf16.json"))
    assert_losses_close(losses(out), reference["losses"], 2e-2, range(1, 11))


def test_tied_embeddings_across_pipeline_stages(data_prefix, work) -> None:
    """Tied input/output embeddings on the first and last stage (TiedLayerSpec) train like one process."""
    tied = "model.tie_word_embeddings=true"
    single = str(work / "tied-ref")
    launch(1, CONFIG, _common(data_prefix, single, tied))
    out = str(work / "tied-tp2-pp2")
    launch(4, CONFIG, _common(data_prefix, out, tied, "parallel.tensor=2", "parallel.pipeline=2",
                              "deepspeed_config=ds_configs/zero1_fp32.json"))
    assert_losses_close(losses(out), losses(single), REL, range(1, 11))
