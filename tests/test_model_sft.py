"""SFT batches of the shipped chat set through the model, against transformers.LlamaForCausalLM (fp32), and at
TP1 against each family's class (Qwen2 with windows shorter than a sample, Qwen3, Mistral).

- Padded rows: the masked loss and every parameter gradient equal HF's loss with -100 labels on the same batch
  (TP1 here; TP2 with SP under 4 gloo processes), and changing what the mask hides (the pad tail) changes nothing.
- Packed rows (micro batch 2): every sample's logits and loss equal HF's run on that sample alone, TP1 here and
  TP2 x PP2 with SP through DeepSpeed's pipeline engine (the loss under PP through the training engine's loss
  rule, over two micro batches of which only one holds the sample's targets).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from dist_utils import run_distributed
from launch_utils import ROOT, SFT_CONFIG
from model_utils import assert_grads_match_hf, gather_shards, hf_model

from llama_megatron.data.batch import MicroBatch
from llama_megatron.model.build import build_model
from llama_megatron.model.tp_slicing import hf_to_rank_state_dict
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.cross_entropy import IGNORE_INDEX
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.run.batches import build_datasets, step_batches

CONFIG = SFT_CONFIG
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)
LOGITS_ATOL = 1e-5


def sft_config(cache_dir: str, *overrides: str) -> TrainingConfig:
    return TrainingConfig.from_file(CONFIG, [f"data.cache_dir={cache_dir}", *overrides])


def first_step(config: TrainingConfig) -> list[MicroBatch]:
    """The micro batches of step 1 (DP1), built from the repository root like a run."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        train_ds, _, _ = build_datasets(config, eod_id=2)
    finally:
        os.chdir(cwd)
    return next(step_batches(train_ds, config, ParallelContext.single(), 0, 1))


def load_from_hf(config: TrainingConfig, pctx: ParallelContext, hf) -> torch.nn.Module:
    """This rank's model (plain or pipeline stage) holding the HF model's weights."""
    model = build_model(config.model, config.parallel, pctx, initialize=False)
    padded = config.parallel.padded_vocab_size(config.model.vocab_size)
    state = hf_to_rank_state_dict(hf.state_dict(), config.model, pctx.tp_rank, pctx.tp_size, padded)
    own = model.state_dict()
    model.load_state_dict({k: state[k] for k in own})
    return model


def hf_loss(hf, mb: MicroBatch) -> torch.Tensor:
    """HF's own loss: ``shift_labels`` are our labels (already shifted), -100 where masked."""
    return hf(input_ids=mb.input_ids, position_ids=mb.position_ids, labels=mb.labels, shift_labels=mb.labels).loss


def check_padded_parity(config: TrainingConfig, pctx: ParallelContext, mb: MicroBatch) -> None:
    hf = hf_model(config.model)
    assert mb.segment_ids is None and (mb.labels == IGNORE_INDEX).any() and mb.num_targets() > 0
    ref = hf_loss(hf, mb)
    ref.backward()
    model = load_from_hf(config, pctx, hf)
    loss = model(mb.input_ids, mb.position_ids, None, (mb.labels, torch.tensor(float(mb.num_targets()))))
    torch.testing.assert_close(loss, ref, **LOSS_TOL)
    loss.backward()
    assert_grads_match_hf(model, hf, config.model, pctx, **GRAD_TOL)

    # What the mask hides changes nothing: every input token after a row's last target, replaced at random.
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ids = mb.input_ids.clone()
    for row in range(ids.shape[0]):
        last = int(torch.nonzero(mb.labels[row] != IGNORE_INDEX).max())
        ids[row, last + 1:] = torch.randint(3, config.model.vocab_size, (ids.shape[1] - last - 1,),
                                            generator=torch.Generator().manual_seed(row))
    assert not torch.equal(ids, mb.input_ids)
    changed = model(ids, mb.position_ids, None, (mb.labels, torch.tensor(float(mb.num_targets()))))
    torch.testing.assert_close(changed, loss, rtol=0, atol=1e-7)
    changed.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=0, atol=1e-8, msg=name)


def samples_of(mb: MicroBatch) -> list[tuple[int, int, int]]:
    """(row, start, end) of every packed sample: segments that hold a target (the pad tail holds none)."""
    out = []
    for row in range(mb.input_ids.shape[0]):
        segments = mb.segment_ids[row]
        for seg in segments.unique().tolist():
            where = torch.nonzero(segments == seg).flatten()
            start, end = int(where.min()), int(where.max()) + 1
            if (mb.labels[row, start:end] != IGNORE_INDEX).any():
                assert mb.position_ids[row, start:end].tolist() == list(range(end - start))
                out.append((row, start, end))
    return out


def only_sample(mb: MicroBatch, row: int | None, start: int = 0, end: int = 0) -> MicroBatch:
    """The micro batch with every label outside one sample ignored (row None: all ignored)."""
    labels = torch.full_like(mb.labels, IGNORE_INDEX)
    if row is not None:
        labels[row, start:end] = mb.labels[row, start:end]
    return MicroBatch(mb.input_ids, mb.position_ids, labels, mb.segment_ids)


def hf_sample(hf, mb: MicroBatch, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF logits and loss of one sample run alone."""
    alone = MicroBatch(mb.input_ids[row:row + 1, start:end], torch.arange(end - start)[None],
                       mb.labels[row:row + 1, start:end])
    with torch.no_grad():
        out = hf(input_ids=alone.input_ids, labels=alone.labels, shift_labels=alone.labels)
    return out.logits[0], out.loss


FAMILIES = {
    "llama": [],
    "qwen2-windows": ["model.model_type=qwen2", "model.use_sliding_window=true", "model.sliding_window=12",
                      "model.max_window_layers=1"],
    "qwen3": ["model.model_type=qwen3", "model.head_dim=24", "model.attention_bias=true"],
    "mistral": ["model.model_type=mistral", "model.sliding_window=9"],
}


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # gradients: the families' added parameters
def test_padded_masked_loss_and_grads_equal_hf_tp1(tmp_path, family) -> None:
    config = sft_config(str(tmp_path), *FAMILIES[family])
    (mb, *_) = first_step(config)
    check_padded_parity(config, ParallelContext.single(), mb)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_samples_equal_their_unpacked_runs_tp1(tmp_path, family) -> None:
    config = sft_config(str(tmp_path), "data.pack=true", "seq_length=128", *FAMILIES[family])
    micro_batches = first_step(config)
    hf = hf_model(config.model)
    model = load_from_hf(config, ParallelContext.single(), hf)
    checked = 0
    for mb in micro_batches:
        assert mb.input_ids.shape[0] == 2
        with torch.no_grad():
            local = model(mb.input_ids, mb.position_ids, mb.segment_ids)
        for row, start, end in samples_of(mb):
            ref_logits, ref_loss = hf_sample(hf, mb, row, start, end)
            assert (local[row, start:end] [:, : config.model.vocab_size] - ref_logits).abs().max() <= LOGITS_ATOL
            part = only_sample(mb, row, start, end)
            loss = model.loss_fn(local, (part.labels, torch.tensor(float(part.num_targets()))))
            torch.testing.assert_close(loss, ref_loss, **LOSS_TOL)
            checked += 1
    assert checked >= 2 * 2 * len(micro_batches)  # two samples or more per row on average


def _distributed_worker(rank: int, world_size: int, cache_dir: str) -> None:
    from llama_megatron.parallel.process_groups import init_distributed
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config
    from llama_megatron.training.engine.training_engine import TrainingEngine

    init_distributed()
    # TP2 x DP2 with SP: padded rows, loss and gradients against HF (both DP replicas check the same batch)
    config = sft_config(cache_dir, "parallel.tensor=2", "parallel.sequence_parallel=true")
    pctx = ParallelContext.build(tensor=2, sequence_parallel=True)
    check_padded_parity(config, pctx, first_step(config)[0])

    # TP2 x PP2 with SP: packed rows through DeepSpeed's pipeline engine
    config = sft_config(cache_dir, "parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true",
                        "data.pack=true", "seq_length=128", "batch.global_batch_size=4")
    pctx = ParallelContext.build(tensor=2, pipeline=2, sequence_parallel=True)
    micro_batches = first_step(config)
    assert len(micro_batches) == 2 and micro_batches[0].input_ids.shape[0] == 2
    hf = hf_model(config.model)
    ds_config = build_deepspeed_config(config, {"zero_optimization": {"stage": 0}}, world_size)
    engine = TrainingEngine(config, ds_config, pctx, load_from_hf(config, pctx, hf))
    engine.engine.eval()
    checked = 0
    for index, mb in enumerate(micro_batches):
        with torch.no_grad():
            out = engine.engine.eval_batch(iter([mb.pipeline_inputs()]), return_logits=True, num_micro_batches=1)
        logits = None
        if engine.engine.is_last_stage():
            logits = torch.cat(gather_shards(out[1], pctx), dim=-1)[..., : config.model.vocab_size]
        for row, start, end in samples_of(mb):
            ref_logits, ref_loss = hf_sample(hf, mb, row, start, end)
            if logits is not None:
                assert (logits[row, start:end] - ref_logits).abs().max() <= LOGITS_ATOL, (index, row, start)
            # the loss rule over both micro batches, only this sample's targets counting
            parts = [only_sample(m, row, start, end) if i == index else only_sample(m, None)
                     for i, m in enumerate(micro_batches)]
            beats: list[int] = []  # the watchdog's beat: every pipeline stage calls it per forward pass
            loss = engine.eval_loss(parts, functools.partial(beats.append, 1))
            assert len(beats) == len(parts), (pctx.pp_rank, len(beats))
            assert abs(loss - ref_loss.item()) <= 1e-5 * ref_loss.item(), (index, row, start, loss, ref_loss)
            checked += 1
    assert checked >= 2 * 2 * len(micro_batches)


@pytest.mark.launched
def test_distributed_tp2_sp_and_tp2_pp2_sp_packed(tmp_path) -> None:
    cache = str(tmp_path)
    # tokenise and index once here rather than in four processes at once
    first_step(sft_config(cache))
    first_step(sft_config(cache, "data.pack=true", "seq_length=128", "batch.global_batch_size=4"))
    run_distributed(_distributed_worker, 4, cache)


@pytest.mark.parametrize("pack", [False, True])
def test_sft_batches_are_what_the_config_asks(pack, tmp_path) -> None:
    config = sft_config(str(tmp_path), f"data.pack={str(pack).lower()}")
    micro_batches = first_step(config)
    assert len(micro_batches) == 4 and all(mb.input_ids.shape == (2, 64) for mb in micro_batches)
    assert all((mb.segment_ids is not None) == pack for mb in micro_batches)
