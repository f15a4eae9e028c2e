"""GRPO runs (``data.type: "prompts"`` + the ``grpo`` section) under the real launcher, against TRL 1.16's
``GRPOTrainer``.

A random HF LLaMA (the e2e model) converted to TP1 and TP2 is trained on four arithmetic prompts (chat messages with
an ``answer`` column) with two reward functions of a file (one reads the completion ids, one the text and the
column; weights 1 and 0.5): two prompts x four completions per step, four steps, completions of at most twelve
tokens ending at any of 301 stop ids (so some end and some are truncated). Our runs sample their completions on their
own weights and log them; ``GRPOTrainer`` replays them through its ``rollout_func`` (prompts in the same order), and
each step's loss (``compute_loss``), KL, entropy, clip fractions, rewards and advantages must be TRL's within 1e-4
relative, for each ``loss_type`` (dapo, grpo, bnpo, dr_grpo, cispo, luspo), ``num_iterations`` 1 and 2,
``scale_rewards`` group, batch and none, ``mask_truncated_completions``, GSPO's sequence-level ratio,
``top_entropy_quantile``, and ``beta`` >
0 with LoRA against TRL + PEFT (its reference: the adapters disabled) and in full fine-tuning (TRL's reference: a
copy of the start; ours the starting weights each rank holds, also under ZeRO-3 and TP2 x PP2, and read back on
resume).

On-policy means on-policy: with ``num_iterations`` 1 no token is clipped; with 2 the first pass's ratio is 1 (its
clip fractions are 0 where the second's are not). The sampler's log-probabilities (incremental, KV cache) against
the training pass's: their mean gap is logged, and held under 1e-5 in fp32.

Layouts: TP2 with SP, PP2 (1F1B, ZB-H1, and interleaved 1F1B and ZB-V over virtual stages), DP2 under ZeRO-2 and
ZeRO-3, TP2 x PP2 with SP and recomputation sample the one-process run's completions and train its losses; LoRA with
beta at TP2; mixtures of experts (Mixtral's routing; Qwen2-MoE's) at EP2 against their one-process runs; CP2 (each
rank training its shard of every row) for the per-row losses (grpo's token means, GSPO's sequence ratio); the
entropy quantile's threshold over DP2 and CP2 ranks' tokens. bf16 runs stay on-policy within a stated sampler gap.
TensorBoard receives the step's metrics. Runs resumed from a generation's end, from within one, and after a reward
raised equal the uninterrupted ones; resumes that lack what a generation needs stop in one line.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from family_cases import RUNS as FAMILY_RUNS
from launch_utils import ROOT, launch_many, losses, train_args
from model_utils import peft_twin, recording_losses, save_and_convert

from llama_megatron.training.config import TrainingConfig

CONFIG = os.path.join(ROOT, "tests", "configs", "e2e_grpo.json")
TOKENIZER = os.path.join(ROOT, "data", "tokenizer")
STEPS, GENERATIONS = 4, 4
REL = 1e-4
# a step's loss on fresh completions is -sum(advantages x ratio 1) over a count: for the group-normalised types that
# cancels to float32 rounding (1e-8 here), which a relative bound cannot hold; 1e-6 is a few ulps of its unit terms
LOSS_ABS = 1e-6
# a generation's second pass trains on ratios moved off 1, whose float32 drift over three updates at lr 2e-2 reaches
# 8.6e-6 at step 4 in any layout whose micro batches are not the one process's (grpo, loss 0.14: 6e-5 relative), and
# 3.4e-6 against TRL's HF model under ATEN_CPU_CAPABILITY=avx2; a loss near 0 (most policy terms dropped by the
# entropy quantile, the rest cancelling: 0.013) holds it absolutely
LATER_PASS_ABS = 2e-5
# the KL estimate exp(r - p) - (r - p) - 1 (times the ratio) grows the float32 drift of a log-probability p by about
# exp(|r - p|) where the policy has moved a token far from the reference r (1-2 nats by step 4 at this lr): the step's
# loss, of which beta x KL is a part, holds 1e-4, the KL itself 3e-4 (observed 1.1e-4)
KL_REL = 3e-4
STOP_IDS = [2, *range(1000, 1300)]  # the tokenizer's EOS and 300 more: about 7% of the vocabulary ends a completion
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "o_proj", "down_proj"]}
PROMPTS = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
           for a, b in ((2, 3), (4, 4), (7, 1), (6, 9))]
REWARDS = '''
def id_parity(completion_ids, **kwargs):
    return [sum(ids) % 5 / 4 for ids in completion_ids]


def says_answer(completions, answer, **kwargs):
    return [float(a in c[0]["content"]) + 0.1 * len(c[0]["content"].split()) for c, a in zip(completions, answer)]
'''
CASES = {  # name -> our grpo settings (TRL's GRPOConfig takes the same names)
    "dapo": {},
    "grpo-iter2-batch": {"loss_type": "grpo", "num_iterations": 2, "scale_rewards": "batch"},
    "bnpo-none": {"loss_type": "bnpo", "scale_rewards": "none"},
    "dr_grpo-masked": {"loss_type": "dr_grpo", "mask_truncated_completions": True},
    "cispo-iter2": {"loss_type": "cispo", "num_iterations": 2, "epsilon_high": 1.05},
    "luspo-iter2": {"loss_type": "luspo", "num_iterations": 2},
    "gspo-iter2": {"loss_type": "dapo", "importance_sampling_level": "sequence", "num_iterations": 2},
    "lora-beta-iter2": {"beta": 0.05, "num_iterations": 2},
    "beta-iter2": {"beta": 0.05, "num_iterations": 2},  # full fine-tuning: the starting weights held as reference
    # the policy term of the highest-entropy 40% of each micro step's tokens (the second pass: of its own entropies)
    "entropy-iter2": {"top_entropy_quantile": 0.4, "num_iterations": 2},
}
# case -> the tag a second run resumes from (beta-iter2: its held reference weights read back from the save directory)
RESUMED = {"dapo": "global_step2", "grpo-iter2-batch": "global_step1", "beta-iter2": "global_step2"}
ZERO1 = "deepspeed_config=ds_configs/zero1_fp32.json"
LAYOUTS = {  # name -> (case, checkpoint TP, processes, overrides)
    "dapo-tp2-sp": ("dapo", 2, 2, ["parallel.tensor=2", "parallel.sequence_parallel=true", ZERO1]),
    "grpo-iter2-batch-pp2": ("grpo-iter2-batch", 1, 2, ["parallel.pipeline=2", "batch.micro_batch_size=4", ZERO1]),
    "grpo-iter2-batch-dp2-zero2": ("grpo-iter2-batch", 1, 2, ["batch.micro_batch_size=2",
                                                              "deepspeed_config=ds_configs/zero2_fp32.json"]),
    "lora-beta-iter2-tp2": ("lora-beta-iter2", 2, 2, ["parallel.tensor=2", ZERO1]),
    "dapo-tp2-pp2-sp-recompute": ("dapo", 2, 4, ["parallel.tensor=2", "parallel.pipeline=2", "batch.micro_batch_size=4",
                                                 "parallel.sequence_parallel=true", "activation_checkpointing.interval=1",
                                                 ZERO1]),
    "dapo-dp2-zero3": ("dapo", 1, 2, ["batch.micro_batch_size=4", "deepspeed_config=ds_configs/zero3_fp32.json"]),
    "grpo-iter2-batch-pp2-interleaved": ("grpo-iter2-batch", 1, 2, [
        "parallel.pipeline=2", "pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2",
        "batch.micro_batch_size=4", ZERO1]),
    # our pipeline engine's schedules: the weight gradients split from the input gradients (zb-h1), over V-placed chunks
    "grpo-iter2-batch-pp2-zb-h1": ("grpo-iter2-batch", 1, 2, ["parallel.pipeline=2", "pipeline.schedule=zb-h1",
                                                              "batch.micro_batch_size=4", ZERO1]),
    "grpo-iter2-batch-pp2-zb-v": ("grpo-iter2-batch", 1, 2, ["parallel.pipeline=2", "pipeline.schedule=zb-v",
                                                             "pipeline.virtual_stages=2", "batch.micro_batch_size=4",
                                                             ZERO1]),
    "moe-ep2": ("moe", 1, 2, ["parallel.expert=2", "batch.micro_batch_size=4", ZERO1]),
    "qwen2-moe-ep2": ("qwen2-moe", 1, 2, ["parallel.expert=2", "batch.micro_batch_size=4", ZERO1]),
    # the entropy threshold over a micro step's tokens: gathered from both DP ranks (4 rows each, as the one process's
    # micro batch of 8) and from both CP ranks (each a shard of every row)
    "entropy-iter2-dp2-zero2": ("entropy-iter2", 1, 2, ["batch.micro_batch_size=4",
                                                        "deepspeed_config=ds_configs/zero2_fp32.json"]),
    "entropy-iter2-cp2": ("entropy-iter2", 1, 2, ["parallel.context=2", ZERO1]),
    # a CP rank trains its shard of each row; the per-row sums (each completion's token mean, GSPO's ratio) are whole
    "grpo-iter2-batch-cp2": ("grpo-iter2-batch", 1, 2, ["parallel.context=2", "batch.micro_batch_size=4",
                                                        "deepspeed_config=ds_configs/zero2_fp32.json"]),
    "gspo-iter2-cp2": ("gspo-iter2", 1, 2, ["parallel.context=2", ZERO1]),
    # the held reference: under ZeRO-3 each rank's partition of the starting weights, over a pipeline each stage's
    "beta-iter2-dp2-zero3": ("beta-iter2", 1, 2, ["batch.micro_batch_size=4",
                                                  "deepspeed_config=ds_configs/zero3_fp32.json"]),
    "beta-iter2-tp2-pp2": ("beta-iter2", 2, 4, ["parallel.tensor=2", "parallel.pipeline=2", "batch.micro_batch_size=4",
                                                ZERO1]),
}
# mixtures of experts from the seeded start, each one-process run the reference of its EP2 run: Mixtral's routing (4
# experts, top 2), and Qwen2-MoE's (a shared expert beside the routed ones, MoE on alternate layers, sliding windows
# the decoding's KV cache keeps, the router's aux loss)
SEEDED = ["checkpoint.load=null", "checkpoint.finetune=false"]
MOES = {"moe": ["model.model_type=mixtral", "model.num_local_experts=4", "model.num_experts_per_tok=2", *SEEDED],
        # the router's aux loss is a mean over micro batches: the one process takes the EP2 ranks' micro batches
        "qwen2-moe": [*FAMILY_RUNS["qwen2_moe"], *SEEDED, "batch.micro_batch_size=4"]}
# bf16 (DeepSpeed's bf16 optimizer), one process and TP2 x PP2: sampling from bf16 logits is not compared across
# layouts (a draw near a rounding boundary picks another token); what is held is the sampler's gap to the training
# pass (BF16_SAMPLER_GAP) and on-policy ratios of 1
BF16 = {"dapo-bf16": (1, []), "dapo-tp2-pp2-bf16": (4, ["parallel.tensor=2", "parallel.pipeline=2",
                                                         "batch.micro_batch_size=4"])}
BF16_CONFIG = "deepspeed_config=ds_configs/zero1_bf16.json"


def _settings(case: str) -> dict:
    return {"stop_ids": STOP_IDS, **CASES[case]}


def _overrides(work, case: str, tp: int) -> list[str]:
    rewards = os.path.join(work, "rewards.py")
    overrides = [f"data.path={work / 'prompts.jsonl'}", f"checkpoint.load={work / f'tp{tp}'}",
                 f"grpo.reward_funcs={json.dumps([rewards + ':id_parity', rewards + ':says_answer'])}",
                 "grpo.reward_weights=[1.0,0.5]"]
    overrides += [f"grpo.{key}={json.dumps(value)}" for key, value in _settings(case).items()]
    if case.startswith("lora"):
        overrides.append(f"lora={json.dumps(LORA)}")
    return overrides


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """The HF model converted to TP1 and TP2, the prompts and rewards; every run of this file in one launch per
    process count."""
    pytest.importorskip("trl")
    from transformers import LlamaConfig, LlamaForCausalLM

    work = tmp_path_factory.mktemp("grpo")
    config = TrainingConfig.from_file(CONFIG, [f"data.path={os.path.join(ROOT, 'data', 'chat', 'sample_prompts.jsonl')}"])
    torch.manual_seed(13)
    hf_dir = save_and_convert(LlamaForCausalLM(LlamaConfig(**config.model.to_hf_dict())), work, TOKENIZER, (1, 2),
                              config.parallel.make_vocab_size_divisible_by)
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS), encoding="utf-8")
    (work / "rewards.py").write_text(REWARDS, encoding="utf-8")
    by_procs: dict[int, list] = {1: []}
    for case in CASES:
        tp1 = [*_overrides(work, case, 1), f"output_dir={work / case}"]
        if case in RESUMED:  # saved every step, then resumed from one
            tp1 += [f"checkpoint.save={work / 'ckpt' / case}", "checkpoint.interval=1"]
        by_procs[1].append(train_args(CONFIG, tp1))
    for case, tag in RESUMED.items():  # each saving into a directory of its own at its end
        by_procs[1].append(train_args(CONFIG, [*_overrides(work, case, 1), f"output_dir={work / f'resumed-{case}'}",
                                               f"checkpoint.load={work / 'ckpt' / case}", "checkpoint.finetune=false",
                                               f"checkpoint.tag={tag}", f"checkpoint.save={work / 'ckpt-resumed' / case}",
                                               f"checkpoint.interval={STEPS}"]))
    for name, family in MOES.items():
        board = [f"logging.tensorboard_dir={work / name / 'tb'}"] if name == "moe" else []
        by_procs[1].append(train_args(CONFIG, [*_overrides(work, "dapo", 1), *family, f"output_dir={work / name}",
                                               *board]))
    for name, (case, tp, procs, overrides) in LAYOUTS.items():
        base = [*_overrides(work, "dapo", tp), *MOES[case]] if case in MOES else _overrides(work, case, tp)
        by_procs.setdefault(procs, []).append(train_args(CONFIG, [*base, *overrides, f"output_dir={work / name}"]))
    for name, (procs, overrides) in BF16.items():
        by_procs.setdefault(procs, []).append(train_args(CONFIG, [*_overrides(work, "dapo", 2 if procs > 1 else 1),
                                                                  *overrides, BF16_CONFIG,
                                                                  f"output_dir={work / name}"]))
    for procs, runs in sorted(by_procs.items()):
        launch_many(procs, runs, str(work / f"runs-{procs}.json"))
    return {"work": work, "hf_dir": hf_dir, "config": config}


def _generations(run_dir) -> list[list[dict]]:
    return [[json.loads(line) for line in open(path, encoding="utf-8")]
            for path in sorted(glob.glob(os.path.join(run_dir, "completions", "generation_*.jsonl")))]


def _metrics(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8"))
            if "loss" in r}


def _trl_replay(launched, case: str) -> dict:
    """GRPOTrainer from the same weights (TRL + PEFT for LoRA) on our run's completions, replayed: each step's
    compute_loss, logged metrics and the advantages of each generation."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    work, config = launched["work"], launched["config"]
    generations = _generations(work / case)
    settings = _settings(case)
    rows = [row for generation in generations for row in generation]
    per_group = config.grpo.num_generations
    dataset = Dataset.from_list([PROMPTS[row["record"]] for row in rows[::per_group]])
    replayed = iter(generations)

    def rollout(prompts: list, trainer) -> dict:
        generation = next(replayed)
        assert prompts == [row["prompt"] for row in generation]
        prompt_ids = trainer._tokenize_prompts(prompts)[0]
        return {"prompt_ids": prompt_ids, "completion_ids": [row["completion_ids"] for row in generation],
                "logprobs": None}

    step_losses: list[float] = []
    advantages: list[list[float]] = []

    class Replaying(recording_losses(GRPOTrainer, step_losses)):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            advantages.append(out["advantages"].tolist())
            return out

    import trl.trainer.grpo_trainer as grpo_trainer

    lora = case.startswith("lora")
    model = peft_twin(launched["hf_dir"], config, LORA) if lora else LlamaForCausalLM.from_pretrained(
        launched["hf_dir"], dtype=torch.float32)
    (model.base_model.model if lora else model).generation_config.eos_token_id = STOP_IDS
    batch = config.batch.global_batch_size
    opt = config.optimizer
    args = GRPOConfig(
        output_dir=str(work / "trainer"), report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, max_steps=STEPS,
        learning_rate=opt.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=opt.clip_grad, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch",
        save_strategy="no", logging_steps=1, seed=7, shuffle_dataset=False, num_generations=per_group,
        max_completion_length=config.grpo.max_completion_length, temperature=config.grpo.temperature,
        reward_weights=[1.0, 0.5], **{k: v for k, v in settings.items() if k != "stop_ids"})
    reward_module = {}
    exec(compile(REWARDS, "rewards", "exec"), reward_module)
    assert grpo_trainer  # the trainer module is imported before the trainer is made (its rollout hook)
    trainer = Replaying(model=model, args=args, train_dataset=dataset,
                        processing_class=AutoTokenizer.from_pretrained(TOKENIZER),
                        reward_funcs=[reward_module["id_parity"], reward_module["says_answer"]],
                        rollout_func=rollout)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "entropy" in entry]
    assert len(step_losses) == STEPS and len(logged) == STEPS
    return {"losses": dict(enumerate(step_losses, start=1)), "metrics": dict(enumerate(logged, start=1)),
            "advantages": advantages, "generations": generations}


def _assert_losses(got: dict[int, float], want: dict[int, float], steps, later_pass_abs: float = LOSS_ABS,
                   iterations: int = 1) -> None:
    """Each step's loss within REL, or the absolute bound of its pass (a generation's first: LOSS_ABS)."""
    for step in steps:
        bound = LOSS_ABS if (step - 1) % iterations == 0 else later_pass_abs
        assert got[step] == pytest.approx(want[step], rel=REL, abs=bound), f"step {step}"


TRL_METRICS = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@pytest.mark.parametrize("case", CASES)
def test_steps_equal_trl_grpo_trainer(case, launched) -> None:
    want = _trl_replay(launched, case)
    run_dir = launched["work"] / case
    got, metrics = losses(str(run_dir)), _metrics(run_dir)
    print(f"{case}: largest relative difference from GRPOTrainer's loss "
          f"{max(abs(got[s] - want['losses'][s]) / max(abs(want['losses'][s]), 1e-12) for s in want['losses']):.2g}")
    iterations = CASES[case].get("num_iterations", 1)
    _assert_losses(got, want["losses"], range(1, STEPS + 1), LATER_PASS_ABS, iterations)
    for step, trl in want["metrics"].items():
        ours = metrics[step]
        names = ("entropy", "cispo_clip_ratio") if case.startswith("cispo") else TRL_METRICS
        for name in names + (("kl",) if "beta" in CASES[case] else ()):  # beta > 0: TRL's reference model
            mine = ours["clip_ratio/high_mean"] if name == "cispo_clip_ratio" else ours[name]
            assert mine == pytest.approx(trl[name], rel=KL_REL if name == "kl" else REL, abs=1e-6), f"step {step} {name}"
        if (step - 1) % iterations == 0:  # a generation's first step: TRL logs its rollout then
            for name in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                         "completions/clipped_ratio", "rewards/id_parity/mean", "rewards/says_answer/mean"):
                assert ours[name] == pytest.approx(trl[name], rel=REL, abs=1e-6), f"step {step} {name}"
            # on-policy: the first pass over fresh completions has ratio 1 (TRL's old log-probabilities are its own;
            # ours a training-layout pass right after generation where num_iterations > 1: 1 within float32 rounding)
            assert ours["clip_ratio/region_mean"] == 0.0
            assert ours["ratio_gap"] == 0.0 if iterations == 1 else ours["ratio_gap"] < 1e-6
        assert ours["sampler_logprob_diff"] < 1e-5  # fp32 incremental decoding against the training pass
    for generation, trl_advantages in zip(want["generations"], want["advantages"], strict=True):
        assert [row["advantage"] for row in generation] == pytest.approx(trl_advantages, rel=REL, abs=1e-6)
    assert len({round(a, 6) for g in want["advantages"] for a in g}) > 2, "the advantages should vary"
    if iterations > 1 and not case.startswith(("cispo", "lora")):  # the second pass moves the ratio off 1
        assert any(metrics[s]["clip_ratio/region_mean"] > 0 for s in range(2, STEPS + 1, iterations)), case
    if case == "dr_grpo-masked":
        truncated = [m["completions/clipped_ratio"] for m in metrics.values()]
        assert all(0 < share < 1 for share in truncated), truncated


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_sample_and_train_like_one_process(name, launched) -> None:
    case = LAYOUTS[name][0]
    work = launched["work"]
    assert _generations(work / name) == _generations(work / case)
    iterations = CASES.get(case, {}).get("num_iterations", 1)
    _assert_losses(losses(str(work / name)), losses(str(work / case)), range(1, STEPS + 1), LATER_PASS_ABS, iterations)
    mine, one = _metrics(work / name), _metrics(work / case)
    for step in range(1, STEPS + 1):
        for metric in ("entropy", "clip_ratio/region_mean", "reward"):
            assert mine[step][metric] == pytest.approx(one[step][metric], rel=REL, abs=1e-6), (step, metric)
        assert ("kl" in mine[step]) == ("beta" in CASES.get(case, {}))  # TRL logs a KL only against a reference
        if "kl" in mine[step]:
            assert mine[step]["kl"] == pytest.approx(one[step]["kl"], rel=KL_REL, abs=1e-6), step
        assert mine[step]["sampler_logprob_diff"] < 1e-5  # the rollout/training gap under this layout, fp32
        if (step - 1) % iterations == 0:  # a generation's first pass: on-policy
            assert mine[step]["ratio_gap"] < 1e-6, (step, mine[step]["ratio_gap"])
        assert 0 < mine[step]["generation_s"] and 0 < mine[step]["train_s"]


def test_tensorboard_receives_the_rollout_and_loss_metrics(launched) -> None:
    """The rewards, advantages, lengths, KL, clip fractions and the sampler gap reach TensorBoard under train/ with
    metrics.jsonl's values at every step (the MoE run: its expert load too)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = launched["work"] / "moe"
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    logged = _metrics(run)
    for metric in ("reward", "rewards/id_parity/mean", "advantages/std", "completions/mean_length",
                   "clip_ratio/region_mean", "entropy", "sampler_logprob_diff", "generation_s"):
        scalars = {event.step: event.value for event in events.Scalars(f"train/{metric}")}
        assert scalars == pytest.approx({s: r[metric] for s, r in logged.items()}, rel=1e-6, abs=1e-7), metric


@pytest.mark.parametrize("case", RESUMED)
def test_a_resumed_run_samples_and_trains_as_the_uninterrupted_one(case, launched) -> None:
    """From a generation's end (dapo, step 2: the next generation is sampled as the uninterrupted run samples it) and
    from within one (two passes per generation, step 1: the checkpoint's rollout, its old log-probabilities made by
    the weights of step 0, is trained on again)."""
    work = launched["work"]
    step = int(RESUMED[case].removeprefix("global_step"))
    first_generation = -(-step // CASES[case].get("num_iterations", 1))
    assert _generations(work / f"resumed-{case}") == _generations(work / case)[first_generation:]
    _assert_losses(losses(str(work / f"resumed-{case}")), losses(str(work / case)), range(step + 1, STEPS + 1))
    resumed = _metrics(work / f"resumed-{case}")
    assert resumed[step + 1]["reward"] == _metrics(work / case)[step + 1]["reward"]
    if "beta" in CASES[case]:  # the held reference went with it into its new save directory, as it was read
        held, copied = (directory / case / "grpo_reference" for directory in (work / "ckpt", work / "ckpt-resumed"))
        assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in held.iterdir())
        for path in held.glob("*.pt"):
            assert all(torch.equal(a, b) for a, b in zip(torch.load(path, weights_only=True),
                                                         torch.load(copied / path.name, weights_only=True),
                                                         strict=True))
        assert (copied / "layout.json").read_text() == (held / "layout.json").read_text()


# the test file's rewards, the first raising at its second call (the second generation) unless the grader is back
RAISES_LATER = REWARDS.replace("def id_parity(completion_ids, **kwargs):\n", '''def id_parity(completion_ids, **kwargs):
    CALLS.append(1)
    if len(CALLS) == 2 and not os.path.exists(os.path.join(os.path.dirname(__file__), "grader-is-back")):
        raise RuntimeError("the grader's cache is gone")
''')


def _one_error(result) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


@pytest.mark.launched
def test_a_reward_raising_mid_run_stops_it_with_the_last_checkpoint_intact(launched, tmp_path) -> None:
    """A reward function raises at the second generation: one line naming it, exit 2; the checkpoint of step 1 is
    `latest`, whole (its manifest verifies), and nothing of step 2 was written. Resumed from it once the function
    works, the run samples and trains steps 2-4 as the uninterrupted run."""
    from launch_utils import launch

    from llama_megatron.checkpoint.manifest import verify_tag

    work = launched["work"]
    rewards = tmp_path / "flaky.py"
    rewards.write_text("import os\n\nCALLS = []\n" + RAISES_LATER, encoding="utf-8")
    save = tmp_path / "ckpt"
    functions = f"grpo.reward_funcs={json.dumps([f'{rewards}:id_parity', f'{rewards}:says_answer'])}"
    result = launch(1, CONFIG, [*_overrides(work, "dapo", 1), functions, f"checkpoint.save={save}",
                                "checkpoint.interval=1", f"output_dir={tmp_path / 'run'}"], check=False)
    assert "reward function 'id_parity' raised RuntimeError: the grader's cache is gone" in _one_error(result)
    assert (save / "latest").read_text().strip() == "global_step1"
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("global_step")) == ["global_step1"]
    assert verify_tag(str(save / "global_step1"))
    assert max(losses(str(tmp_path / "run"))) == 1
    (tmp_path / "grader-is-back").touch()
    launch(1, CONFIG, [*_overrides(work, "dapo", 1), functions, f"checkpoint.load={save}", "checkpoint.finetune=false",
                       f"output_dir={tmp_path / 'resumed'}"])
    assert _generations(tmp_path / "resumed") == _generations(work / "dapo")[1:]
    _assert_losses(losses(str(tmp_path / "resumed")), losses(str(work / "dapo")), range(2, STEPS + 1))


def _tree(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.launched
def test_a_resume_without_what_the_generation_needs_stops_with_one_line(launched, tmp_path) -> None:
    """Exit 2, one line, before step 1 trains, the checkpoint untouched: a full fine-tuning run with beta > 0 whose
    save directory lost its held reference weights, or holds those of another layout (they cannot be made again from
    weights that have moved); a checkpoint of one generation per step resumed with two passes per generation (its
    step is then within a generation, and it kept no rollout to finish it on); one saved within a generation,
    resumed with other micro batches (its rows were cut for the save's)."""
    import shutil

    from launch_utils import launch

    work = launched["work"]
    save = tmp_path / "beta"
    shutil.copytree(work / "ckpt" / "beta-iter2", save)
    shutil.rmtree(save / "grpo_reference")
    resume = [*_overrides(work, "beta-iter2", 1), f"checkpoint.load={save}", "checkpoint.finetune=false",
              "checkpoint.tag=global_step2"]
    before = _tree(save)
    result = launch(1, CONFIG, [*resume, f"output_dir={tmp_path / 'gone'}"], check=False)
    assert "grpo_reference/layout.json is missing or unreadable" in _one_error(result)
    assert _tree(save) == before and _metrics(tmp_path / "gone") == {}

    shutil.copytree(work / "ckpt" / "beta-iter2" / "grpo_reference", save / "grpo_reference")
    layout = json.loads((save / "grpo_reference" / "layout.json").read_text())
    (save / "grpo_reference" / "layout.json").write_text(json.dumps({**layout, "tensor": 2}))
    before = _tree(save)
    result = launch(1, CONFIG, [*resume, f"output_dir={tmp_path / 'other'}"], check=False)
    assert "holds the reference weights of a run at {'tensor': 2" in _one_error(result)
    assert _tree(save) == before and _metrics(tmp_path / "other") == {}

    before = _tree(work / "ckpt" / "dapo")
    result = launch(1, CONFIG, [*_overrides(work, "dapo", 1), "grpo.num_iterations=2",
                                f"checkpoint.load={work / 'ckpt' / 'dapo'}", "checkpoint.finetune=false",
                                "checkpoint.tag=global_step1", f"output_dir={tmp_path / 'within'}"], check=False)
    assert ("global_step1 was saved within a generation (step 1, grpo.num_iterations 2) and holds no rollout of rank 0"
            in _one_error(result))
    assert _tree(work / "ckpt" / "dapo") == before and _metrics(tmp_path / "within") == {}

    # within a generation at another layout: its rows were cut for the save's micro batches
    before = _tree(work / "ckpt" / "grpo-iter2-batch")
    result = launch(1, CONFIG, [*_overrides(work, "grpo-iter2-batch", 1), "batch.micro_batch_size=4",
                                f"checkpoint.load={work / 'ckpt' / 'grpo-iter2-batch'}", "checkpoint.finetune=false",
                                "checkpoint.tag=global_step1", f"output_dir={tmp_path / 'recut'}"], check=False)
    assert "global_step1 was saved within a generation at {'tensor': 1" in _one_error(result)
    assert "'micro_batch_size': 8}, and this run is at" in _one_error(result)
    assert _tree(work / "ckpt" / "grpo-iter2-batch") == before and _metrics(tmp_path / "recut") == {}


# bf16 keeps 8 significant bits (a relative rounding of 2^-9, 2e-3): the incremental decoding and the training pass
# round their bf16 activations in other orders, and their log-probabilities' mean gap stays within that one rounding
# (observed 1.9e-4 to 6.4e-4 per step, one process and TP2 x PP2, on an AMX Xeon; fp32's is about 2e-7)
BF16_SAMPLER_GAP = 2e-3


def test_bf16_rollouts_train_on_policy_within_the_sampler_gap_stated(launched) -> None:
    """bf16 at one process and TP2 x PP2: each step trains (finite losses, rewards logged), the first pass's ratio is
    exactly 1 (no token clipped), and the sampler's log-probabilities (bf16 incremental decoding) stay within
    BF16_SAMPLER_GAP of the training pass's."""
    work = launched["work"]
    for name in BF16:
        metrics = _metrics(work / name)
        assert sorted(metrics) == list(range(1, STEPS + 1)), name
        gaps = [metrics[s]["sampler_logprob_diff"] for s in metrics]
        print(f"{name}: sampler gap per step {[f'{g:.2g}' for g in gaps]}")
        for step, m in metrics.items():
            assert m["ratio_gap"] == 0.0 and m["clip_ratio/region_mean"] == 0.0, (name, step)
            assert torch.isfinite(torch.tensor(m["loss"])) and 0 <= m["reward"], (name, step)
        assert 0 < max(gaps) < BF16_SAMPLER_GAP, (name, gaps)


@pytest.mark.launched
def test_a_reward_that_does_not_import_stops_train_before_launch(launched, tmp_path) -> None:
    from launch_utils import launch

    work = launched["work"]
    result = launch(1, CONFIG, [*_overrides(work, "dapo", 1), "grpo.reward_funcs=[\"no_such_module_here:score\"]",
                                "grpo.reward_weights=null", f"output_dir={tmp_path / 'run'}"], check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "no_such_module_here" in errors[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, message", [
    (["grpo.num_generations=3"], "batch.global_batch_size 8 \\(completions per step\\) is not whole groups of "
                                 "grpo.num_generations 3"),
    (["grpo.loss_type=ppo"], "grpo.loss_type 'ppo' is not one of"),
    (["grpo.reward_weights=[1.0]"], "grpo.reward_weights has 1 weights for 2 reward functions"),
    (["grpo.max_completion_length=48"], "grpo.max_completion_length 48 leaves no room for a prompt"),
    (["grpo.num_iterations=0"], "grpo.num_iterations must be a positive integer"),
    (["grpo.top_entropy_quantile=1.5"], "grpo.top_entropy_quantile must be in \\[0, 1\\]"),
    (["train.loss_spike_factor=3"], "train.loss_spike_factor compares a step's loss with its recent mean"),
    (["data.type=sft", "data.path=data/chat/chat_messages.jsonl"], "the grpo section sets the loss of the grpo objective"),
])
def test_the_config_refuses_what_cannot_run(overrides, message) -> None:
    from llama_megatron.errors import ConfigError

    base = [f"data.path={os.path.join(ROOT, 'data', 'chat', 'sample_prompts.jsonl')}",
            'grpo.reward_funcs=["a:b","c:d"]']
    with pytest.raises(ConfigError, match=message):
        TrainingConfig.from_file(CONFIG, [*base, *overrides])


def test_a_prompt_longer_than_the_context_leaves_is_refused_before_any_process(tmp_path) -> None:
    from llama_megatron.errors import ConfigError
    from llama_megatron.training.run.setup import preflight

    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "word " * 60}) + "\n", encoding="utf-8")
    config = TrainingConfig.from_file(CONFIG, [f"data.path={tmp_path / 'prompts.jsonl'}",
                                               "grpo.reward_funcs=[\"llama_megatron.data.reward_functions:think_format\"]"])
    with pytest.raises(ConfigError, match="prompt 1 is .* tokens, and seq_length 48 leaves 37 beside "
                                          "grpo.max_completion_length 12"):
        preflight(config, world_size=1)


def test_a_full_disk_while_the_reference_is_written_is_one_line_and_leaves_no_file(tmp_path, monkeypatch) -> None:
    """The held reference weights are written at a run's start: a write that fails (ENOSPC injected into the file
    writer) is a SaveFailed of one line naming the directory and the OS's reason, and neither the file nor its temp
    is left; a write that succeeds leaves the file, the layout, no temp, and reads back."""
    import errno
    import types

    from llama_megatron.errors import SaveFailed
    from llama_megatron.training.run import held_reference

    module = torch.nn.Linear(3, 2)
    reference = held_reference.HeldReference(module)
    pctx = types.SimpleNamespace(rank=0, tp_size=1, pp_size=1, dp_size=1, cp_size=1, ep_size=1)
    real = held_reference.save_direct

    def full(obj, path, *args, **kwargs):
        with open(path, "wb") as fh:
            fh.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(held_reference, "save_direct", full)
    with pytest.raises(SaveFailed) as caught:
        held_reference.store(reference, str(tmp_path), pctx, zero=0)
    message = str(caught.value)
    assert "\n" not in message and f"{tmp_path / 'grpo_reference'} (rank 0): No space left on device" in message
    assert os.listdir(tmp_path / "grpo_reference") == []
    monkeypatch.setattr(held_reference, "save_direct", real)
    held_reference.store(reference, str(tmp_path), pctx, zero=0)
    assert sorted(os.listdir(tmp_path / "grpo_reference")) == ["layout.json", "rank00000.pt"]
    with torch.no_grad():
        module.weight.add_(1.0)
    back = held_reference.load(module, str(tmp_path), pctx, zero=0)
    assert all(torch.equal(a, b) for a, b in zip(back.tensors, reference.tensors, strict=True))
