"""GRPO runs (``data.type: "prompts"`` + the ``grpo`` section) under the real launcher, against TRL 1.16's
``GRPOTrainer``.

A random HF LLaMA (the e2e model) converted to TP1 and TP2 is trained on four arithmetic prompts (chat messages with
an ``answer`` column) with two reward functions of a file (one reads the completion ids, one the text and the
column; weights 1 and 0.5): two prompts x four completions per step, four steps, completions of at most twelve
tokens ending at any of 301 stop ids (so some end and some are truncated). Our runs sample their completions on their
own weights and log them; ``GRPOTrainer`` replays them through its ``rollout_func`` (prompts in the same order), and
each step's loss (``compute_loss``), KL, entropy, clip fractions, rewards and advantages must be TRL's within 1e-4
relative, for each ``loss_type`` (dapo, grpo, bnpo, dr_grpo, cispo, luspo), ``num_iterations`` 1 and 2,
``scale_rewards`` group, batch and none, ``mask_truncated_completions``, GSPO's sequence-level ratio, and ``beta`` >
0 with LoRA against TRL + PEFT (its reference: the adapters disabled) and in full fine-tuning (TRL's reference: a
copy of the start; ours the starting weights each rank holds, also under ZeRO-3 and TP2 x PP2, and read back on
resume).

On-policy means on-policy: with ``num_iterations`` 1 no token is clipped; with 2 the first pass's ratio is 1 (its
clip fractions are 0 where the second's are not). The sampler's log-probabilities (incremental, KV cache) against
the training pass's: their mean gap is logged, and held under 1e-5 in fp32.

Layouts: TP2 with SP, PP2 (1F1B, and interleaved over virtual stages), DP2 under ZeRO-2 and ZeRO-3, TP2 x PP2
sample the one-process run's completions and train its losses; LoRA with beta at TP2; a mixture of experts (Mixtral's
routing) at EP2 against its one-process run; CP2 (each rank training its shard of every row) for the per-row
losses (grpo's token means, GSPO's sequence ratio). TensorBoard receives the step's metrics. Runs resumed from a generation's end and from within one equal the uninterrupted ones.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
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
    "dapo-tp2-pp2": ("dapo", 2, 4, ["parallel.tensor=2", "parallel.pipeline=2", "batch.micro_batch_size=4", ZERO1]),
    "dapo-dp2-zero3": ("dapo", 1, 2, ["batch.micro_batch_size=4", "deepspeed_config=ds_configs/zero3_fp32.json"]),
    "grpo-iter2-batch-pp2-interleaved": ("grpo-iter2-batch", 1, 2, [
        "parallel.pipeline=2", "pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2",
        "batch.micro_batch_size=4", ZERO1]),
    "moe-ep2": ("moe", 1, 2, ["parallel.expert=2", "batch.micro_batch_size=4", ZERO1]),
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
# a mixture of experts (Mixtral's routing, 4 experts, top 2) from the seeded start: its one-process run is the
# reference of its EP2 run
MOE = ["model.model_type=mixtral", "model.num_local_experts=4", "model.num_experts_per_tok=2",
       "checkpoint.load=null", "checkpoint.finetune=false"]


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
    for case, tag in RESUMED.items():
        by_procs[1].append(train_args(CONFIG, [*_overrides(work, case, 1), f"output_dir={work / f'resumed-{case}'}",
                                               f"checkpoint.load={work / 'ckpt' / case}", "checkpoint.finetune=false",
                                               f"checkpoint.tag={tag}"]))
    by_procs[1].append(train_args(CONFIG, [*_overrides(work, "dapo", 1), *MOE, f"output_dir={work / 'moe'}",
                                           f"logging.tensorboard_dir={work / 'moe' / 'tb'}"]))
    for name, (case, tp, procs, overrides) in LAYOUTS.items():
        base = [*_overrides(work, "dapo", tp), *MOE] if case == "moe" else _overrides(work, case, tp)
        by_procs.setdefault(procs, []).append(train_args(CONFIG, [*base, *overrides, f"output_dir={work / name}"]))
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


def _assert_losses(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=REL, abs=LOSS_ABS), f"step {step}"


TRL_METRICS = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@pytest.mark.parametrize("case", CASES)
def test_steps_equal_trl_grpo_trainer(case, launched) -> None:
    want = _trl_replay(launched, case)
    run_dir = launched["work"] / case
    got, metrics = losses(str(run_dir)), _metrics(run_dir)
    print(f"{case}: largest relative difference from GRPOTrainer's loss "
          f"{max(abs(got[s] - want['losses'][s]) / max(abs(want['losses'][s]), 1e-12) for s in want['losses']):.2g}")
    _assert_losses(got, want["losses"], range(1, STEPS + 1))
    iterations = CASES[case].get("num_iterations", 1)
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
    _assert_losses(losses(str(work / name)), losses(str(work / case)), range(1, STEPS + 1))
    mine, one = _metrics(work / name), _metrics(work / case)
    for step in range(1, STEPS + 1):
        for metric in ("entropy", "clip_ratio/region_mean", "kl", "reward"):
            assert mine[step][metric] == pytest.approx(one[step][metric], rel=REL, abs=1e-6), (step, metric)
        assert mine[step]["sampler_logprob_diff"] < 1e-5  # the rollout/training gap under this layout, fp32
        if (step - 1) % CASES.get(case, {}).get("num_iterations", 1) == 0:  # a generation's first pass: on-policy
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


RAISES_LATER = '''
CALLS = []


def flaky(completions, **kwargs):
    CALLS.append(1)
    if len(CALLS) == 2:
        raise RuntimeError("the grader's cache is gone")
    return [float(len(c[0]["content"])) for c in completions]
'''


@pytest.mark.launched
def test_a_reward_raising_mid_run_stops_it_with_the_last_checkpoint_intact(launched, tmp_path) -> None:
    """The reward function raises at the second generation: one line naming it, exit 2; the checkpoint of step 1 is
    `latest`, whole (its manifest verifies), and nothing of step 2 was written."""
    from launch_utils import launch

    from llama_megatron.checkpoint.manifest import verify_tag

    work = launched["work"]
    (tmp_path / "flaky.py").write_text(RAISES_LATER, encoding="utf-8")
    save = tmp_path / "ckpt"
    result = launch(1, CONFIG, [*_overrides(work, "dapo", 1), f"grpo.reward_funcs=[\"{tmp_path / 'flaky.py'}:flaky\"]",
                                "grpo.reward_weights=null", f"checkpoint.save={save}", "checkpoint.interval=1",
                                f"output_dir={tmp_path / 'run'}"], check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "reward function 'flaky' raised RuntimeError: the grader's cache is gone" in errors[0]
    assert (save / "latest").read_text().strip() == "global_step1"
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("global_step")) == ["global_step1"]
    assert verify_tag(str(save / "global_step1"))
    assert max(losses(str(tmp_path / "run"))) == 1


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
