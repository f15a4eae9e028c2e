"""The preference losses (model/preference.py) against TRL 1.16's ``DPOTrainer`` itself, loss type by loss type.

A tiny random ``LlamaForCausalLM``, its reference a copy, the policy then moved off it (so the log-ratios are not
zero); TRL's trainer computes its loss over one batch of pairs of unequal lengths, and ours is computed from the
same model's per-token log-probabilities over TRL's completion mask, the batch split into two micro batches whose
shares (each divided by the whole batch's counts) are summed: the whole-batch loss, as our runs compute it.
"""

from __future__ import annotations

import logging

import pytest
import torch
from chat_families import TOKENIZER

from llama_megatron.model.preference import (
    LOSS_TYPES,
    METRICS,
    BatchCounts,
    PairLogProbs,
    PreferenceLossConfig,
    metric_sums,
    preference_loss,
)

RECORDS = [
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " a city in the north of Europe."},
    {"prompt": "Two plus two makes", "chosen": " four, as any child knows.", "rejected": " five."},
    {"prompt": "Name a colour:", "chosen": " blue", "rejected": " the sound of rain on a roof"},
    {"prompt": "Say hello", "chosen": " Hello there, friend!", "rejected": " no"},
]
SETTINGS = {name: {} for name in LOSS_TYPES if name not in ("simpo", "orpo")}  # DPOTrainer's; those two below
SETTINGS.update({"robust": {"label_smoothing": 0.1}, "exo_pair": {"label_smoothing": 1e-3},
                 "discopop": {"discopop_tau": 0.2}})
COMBINED = {"sigmoid+sft": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
            "ipo+hinge": {"loss_type": ["ipo", "hinge"]}}


@pytest.fixture(scope="module")
def trl_setup(tmp_path_factory):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    logging.getLogger("trl").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    reference = LlamaForCausalLM(model.config)
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():  # the policy a step away from the reference
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    return model, reference, tokenizer, Dataset.from_list(RECORDS), str(tmp_path_factory.mktemp("dpo"))


def _trl_loss(trl_setup, settings: dict) -> tuple[float, dict, dict]:
    from trl import DPOConfig, DPOTrainer

    model, reference, tokenizer, dataset, out = trl_setup
    loss_type = settings.get("loss_type", ["sigmoid"])
    args = DPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
                     per_device_train_batch_size=len(RECORDS), max_length=None,
                     **{k: v for k, v in settings.items() if k != "loss_type"}, loss_type=loss_type)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=dataset,
                         processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(RECORDS))])
    loss = trainer._compute_loss(model, batch, return_outputs=False)
    logged = {name: trainer._metrics["train"][name][-1] for name in METRICS}
    return float(loss.detach()), logged, batch


def _sequence_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of each row's completion tokens, and their counts (TRL's rows: chosen, rejected)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logps = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["completion_mask"][:, 1:].to(logps.dtype)
    return (logps * mask).sum(dim=1), mask.sum(dim=1)


def _ours(trl_setup, batch, settings: dict) -> tuple[float, dict]:
    model, reference, *_ = trl_setup
    config = PreferenceLossConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()})
    assert config.problems() == []
    policy, tokens = _sequence_logps(model, batch)
    ref, _ = _sequence_logps(reference, batch)
    pairs = len(RECORDS)
    chosen, rejected = slice(0, pairs), slice(pairs, 2 * pairs)
    counts = BatchCounts(pairs=pairs, chosen_tokens=int(tokens[chosen].sum()))
    total, sums = 0.0, dict.fromkeys(METRICS, 0.0)
    for micro in (slice(0, 1), slice(1, pairs)):  # two micro batches, summed
        logps = PairLogProbs(policy[chosen][micro], policy[rejected][micro], ref[chosen][micro], ref[rejected][micro],
                             tokens[chosen][micro], tokens[rejected][micro])
        total += float(preference_loss(config, logps, counts))
        for name, value in metric_sums(config, logps).items():
            sums[name] += float(value)
    return total, {name: value / pairs for name, value in sums.items()}


@pytest.mark.parametrize("name", [*SETTINGS, *COMBINED])
def test_losses_and_metrics_equal_trl(trl_setup, name) -> None:
    settings = COMBINED.get(name) or {"loss_type": [name], **SETTINGS[name]}
    loss, logged, batch = _trl_loss(trl_setup, settings)
    ours, metrics = _ours(trl_setup, batch, settings)
    assert ours == pytest.approx(loss, rel=1e-5, abs=1e-7)
    for metric in METRICS:
        assert metrics[metric] == pytest.approx(logged[metric], rel=1e-5, abs=1e-6), metric


@pytest.mark.parametrize("settings, message", [
    ({"loss_type": ("aot",)}, "'aot' is not one of"),
    ({"loss_type": ("sigmoid", "sft"), "loss_weights": (1.0,)}, "1 weights for 2 loss types"),
    ({"beta": 0.0}, "beta must be > 0"),
    ({"label_smoothing": 0.5}, "label_smoothing must be in [0, 0.5)"),
    ({"loss_type": ("exo_pair",)}, "exo_pair needs label_smoothing > 0"),
])
def test_settings_are_checked(settings, message) -> None:
    problems = PreferenceLossConfig(**settings).problems()
    assert len(problems) == 1 and message in problems[0]


@pytest.mark.parametrize("name, settings", [("simpo", {}), ("simpo", {"label_smoothing": 0.2, "simpo_gamma": 1.0}),
                                            ("orpo", {})])
def test_reference_free_losses_equal_trls_own(name, settings) -> None:
    """SimPO as TRL's ``CPOTrainer.cpo_loss`` (loss_type simpo) and ORPO's odds-ratio term as
    ``ORPOTrainer.odds_ratio_loss`` compute them from the completions' mean token log-probabilities (their
    ``average_log_prob``), each called on the same values; ours from summed log-probabilities and token counts,
    in two micro batches over the whole batch's pair count. No reference enters either."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    generator = torch.Generator().manual_seed(3)
    pairs = 6
    tokens = torch.randint(3, 40, (2, pairs), generator=generator).float()
    sums = -tokens * (0.2 + 3 * torch.rand(2, pairs, generator=generator))  # mean token log-probs in [-3.2, -0.2]
    config = PreferenceLossConfig(loss_type=(name,), beta=0.3, **settings)
    assert config.problems() == [] and not config.needs_reference
    trainer = SimpleNamespace(beta=config.beta, label_smoothing=config.label_smoothing, loss_type=name, alpha=0.0,
                              simpo_gamma=config.simpo_gamma, accelerator=SimpleNamespace(device="cpu"))
    means = sums / tokens
    if name == "simpo":
        losses = CPOTrainer.cpo_loss(trainer, means[0], means[1])[0]
    else:  # ORPO's loss is its NLL minus the mean of these
        losses = -ORPOTrainer.odds_ratio_loss(trainer, means[0], means[1])[0]
    zeros = torch.zeros(pairs)
    ours = 0.0
    for micro in (slice(0, 2), slice(2, pairs)):
        logps = PairLogProbs(sums[0, micro], sums[1, micro], zeros[micro], zeros[micro], tokens[0, micro],
                             tokens[1, micro])
        ours += float(preference_loss(config, logps, BatchCounts(pairs=pairs, chosen_tokens=1)))
    assert ours == pytest.approx(float(losses.mean()), rel=1e-6)
