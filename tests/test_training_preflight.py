"""Invalid training setups fail before any process group or engine exists, with one clear line."""

from __future__ import annotations

import json
import os

import pytest
from launch_utils import PRETRAIN_CONFIG, run_python

from llama_megatron.errors import CheckpointError, ConfigError, LlamaMegatronError
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.config_sections import apply_override
from llama_megatron.training.run.setup import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = PRETRAIN_CONFIG


def _config(*overrides: str) -> TrainingConfig:
    return TrainingConfig.from_file(CONFIG, ['data={"type": "synthetic"}', *overrides])


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize(
    "overrides, ds, world, error, message",
    [
        (["parallel.pipeline=2"], {"zero_optimization": {"stage": 3}}, 2, ConfigError,
         "ZeRO stage 3 cannot be combined with pipeline parallelism"),
        (["parallel.pipeline=2"], "ds_configs/zero2_bf16.json", 2, ConfigError,
         "ZeRO stage 2 cannot be combined with pipeline parallelism"),
        (["parallel.tensor=2", "parallel.pipeline=2"], None, 6, ConfigError,
         "world size 6 is not divisible by tensor x pipeline = 2 x 2"),
        (["parallel.tensor=3"], None, 3, ConfigError, "tensor parallel degree 3 does not divide num_attention_heads"),
        ([], {"train_batch_size": 16}, 1, ConfigError, "train_batch_size=16 disagrees with the training config"),
        (["batch.micro_batch_size=3"], None, 1, ConfigError, "global_batch_size 8 is not divisible by micro"),
        (["batch.global_batch_size=6"], None, 4, ConfigError, "global_batch_size 6 is not divisible"),
        ([], "ds_configs/zero1_fp16.json", 1, ConfigError, "fp16 is not supported on CPU"),
        ([], {"optimizer": {"type": "Adam"}}, 1, ConfigError, "has an 'optimizer' section"),
        (['data={"prefix": "no/such/prefix"}'], None, 1, ConfigError, "no/such/prefix"),
        (['data={"type": "dpo"}'], None, 1, ConfigError, "data.type 'dpo' is not one of preference, pretrain, prompts, sft, synthetic"),
        (['data={"type": "sft"}'], None, 1, ConfigError, "data.type sft needs exactly one of path"),
        (['data={"type": "synthetic", "prefix": "x"}'], None, 1, ConfigError,
         "unknown keys for data.type 'synthetic': prefix"),
        (["model.vocab_size=1000"], None, 1, LlamaMegatronError, "1000"),
        (["checkpoint.load=/no/such/dir"], None, 1, CheckpointError, "checkpoint directory not found"),
        (["parallel.sequence_parallel=true", "parallel.tensor=2", "seq_length=33"], None, 2, ConfigError,
         "seq_length 33 divisible by tensor 2"),
        (["parallel.sequence_parallel=true", "parallel.tensor=2", "parallel.pipeline=2"],
         {"pipeline": {"grad_partitioned": True}}, 4, ConfigError,
         "pipeline.grad_partitioned=True cannot be combined with sequence_parallel"),
        (["parallel.tensor=2", "parallel.context=2"], None, 6, ConfigError,
         "world size 6 is not divisible by tensor x pipeline x context = 2 x 1 x 2"),
        (["parallel.context=2", "batch.global_batch_size=6", "batch.micro_batch_size=2"], None, 4, ConfigError,
         "global_batch_size 6 is not divisible by micro_batch_size 2 x data parallel 2"),
        (["parallel.context=2"], {"train_batch_size": 8}, 2, ConfigError,
         r"train_batch_size=8 disagrees with the training config \(16\)"),
    ],
)
def test_invalid_setups(overrides, ds, world, error, message) -> None:
    with pytest.raises(error, match=message):
        if any(o.startswith("model.") for o in overrides):
            data = json.load(open(CONFIG))
            for o in ['data={"type": "synthetic"}', *overrides]:
                apply_override(data, o)
            config = TrainingConfig.from_dict(data)
        else:
            config = _config(*overrides)
        preflight(config, ds, world)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_pipeline_payload_partitioning_follows_sequence_parallelism(sequence_parallel) -> None:
    """Under SP each TP rank sends its own sequence shard between stages; without SP DeepSpeed's default
    (send 1/TP of the replicated activation, all-gather it on the next stage) stays."""
    config = _config("parallel.tensor=2", "parallel.pipeline=2",
                     f"parallel.sequence_parallel={str(sequence_parallel).lower()}")
    ds = preflight(config, "ds_configs/zero1_fp32.json", 4).ds_config
    if sequence_parallel:
        assert ds["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    else:
        assert "pipeline" not in ds


def _fake_checkpoint(path, **meta) -> str:
    config = _config()
    tag = path / "global_step3"
    tag.mkdir(parents=True)
    record = dict(step=3, consumed_samples=24, tensor=1, pipeline=1, data_parallel=1, zero_stage=0,
                  model=config.model.to_dict(), padded_vocab_size=4160, format_version=1)
    record.update(meta)
    (tag / "llama_megatron.json").write_text(json.dumps(record))
    (path / "latest").write_text("global_step3")
    return str(path)


def test_resume_with_other_tensor_or_pipeline_degree_points_at_reshard(tmp_path) -> None:
    ckpt = _fake_checkpoint(tmp_path / "ckpt", tensor=2)
    with pytest.raises(CheckpointError, match="tensor=2 pipeline=1.*llama-megatron reshard"):
        preflight(_config(f"checkpoint.load={ckpt}"), None, 1)


def test_finetune_with_other_vocab_padding(tmp_path) -> None:
    ckpt = _fake_checkpoint(tmp_path / "ckpt", padded_vocab_size=4224)
    with pytest.raises(ConfigError, match="pads the vocab to 4224, this run to 4160"):
        preflight(_config(f"checkpoint.load={ckpt}", "checkpoint.finetune=true"), None, 1)


@pytest.mark.launched
def test_a_zero0_fp32_run_cannot_take_a_universal_checkpoint(tmp_path) -> None:
    """A ZeRO-1 checkpoint of 2 data-parallel ranks resumed by one rank goes through a universal checkpoint, which
    only DeepSpeed's ZeRO and bf16 optimizers read: a ZeRO-0 fp32 run is refused before any process group; under
    ZeRO-1 the same resume passes preflight, and so does a ZeRO-0 fp32 resume at the saved degree."""
    ckpt = _fake_checkpoint(tmp_path / "ckpt", zero_stage=1, data_parallel=2)
    with pytest.raises(CheckpointError, match=r"\(ZeRO-1, 2 data-parallel x context partitions, expert=1\) resumes "
                                              r"in this layout through a universal checkpoint, .* ZeRO-0 fp32"):
        preflight(_config(f"checkpoint.load={ckpt}"), None, 1)
    assert preflight(_config(f"checkpoint.load={ckpt}"), "ds_configs/zero1_fp32.json", 1).checkpoint.data_parallel == 2
    assert preflight(_config(f"checkpoint.load={ckpt}"), None, 2).checkpoint.zero_stage == 1
    # the command: exit 2, the one line, no output directory and the checkpoint as it was (no universal conversion)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = tmp_path / "out"
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    result = run_python(["-m", "llama_megatron.train", "--config", CONFIG, "--set", 'data={"type": "synthetic"}',
                         "--set", f"checkpoint.load={ckpt}", "--set", f"output_dir={out}"], env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "through a universal checkpoint" in errors[0] and "ZeRO-0 fp32" in errors[0], errors
    assert "Traceback" not in result.stderr
    assert not out.exists() and sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before


def test_resume_with_other_model_or_corrupt_metadata(tmp_path) -> None:
    ckpt = _fake_checkpoint(tmp_path / "a", model={"vocab_size": 3})
    with pytest.raises(ConfigError, match="different model config"):
        preflight(_config(f"checkpoint.load={ckpt}"), None, 1)
    ckpt = _fake_checkpoint(tmp_path / "b")
    (tmp_path / "b" / "global_step3" / "llama_megatron.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="is corrupt"):
        preflight(_config(f"checkpoint.load={ckpt}"), None, 1)
    (tmp_path / "b" / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match="global_step9 not found"):
        preflight(_config(f"checkpoint.load={ckpt}"), None, 1)


def test_window_keys_are_compared_by_the_windows_they_give() -> None:
    """transformers 5 writes a Qwen model's ``layer_types`` into config.json (and HF's max_window_layers beside it):
    a checkpoint converted from it loads into a run naming the same windows by ``max_window_layers``, not one whose
    windows differ."""
    from llama_megatron.config import ModelConfig
    from llama_megatron.training.resume import _model_differences

    shape = dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                 num_attention_heads=8, use_sliding_window=True, sliding_window=12, max_window_layers=2)
    run = ModelConfig(**shape).to_dict()
    kinds = ["full_attention", "sliding_attention"]
    converted = ModelConfig(**{**shape, "max_window_layers": 28, "layer_types": [kinds[0]] * 2 + [kinds[1]] * 2})
    assert _model_differences(converted.to_dict(), run, finetune=True) == []
    other = ModelConfig(**{**shape, "max_window_layers": 28, "layer_types": [kinds[0]] * 3 + [kinds[1]]})
    assert _model_differences(other.to_dict(), run, finetune=True) == ["layer_types", "max_window_layers"]


def test_context_extension_sets_rope_over_a_model_file_and_finetunes_from_the_checkpoint(tmp_path) -> None:
    """``model: {"path": ..., overrides}`` replaces keys of the file; a fine-tuning start may change the RoPE keys
    and max_position_embeddings (context extension), a resume may not, nor may fine-tuning change anything else."""
    model_file = tmp_path / "config.json"
    model_file.write_text(json.dumps(_config().model.to_dict()))
    ckpt = _fake_checkpoint(tmp_path / "ckpt")
    longer = json.dumps({"path": str(model_file), "max_position_embeddings": 1024,
                         "rope_scaling": {"type": "linear", "factor": 8.0}})
    config = _config(f"model={longer}", f"checkpoint.load={ckpt}", "checkpoint.finetune=true")
    assert config.model.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.model.max_position_embeddings == 1024 and config.model.hidden_size == 64
    assert preflight(config, None, 1).weights_only
    with pytest.raises(ConfigError, match="different model config"):
        preflight(_config(f"model={longer}", f"checkpoint.load={ckpt}"), None, 1)
    wider = json.dumps({"path": str(model_file), "rms_norm_eps": 1e-6})
    with pytest.raises(ConfigError, match="different model config"):
        preflight(_config(f"model={wider}", f"checkpoint.load={ckpt}", "checkpoint.finetune=true"), None, 1)


def test_auto_load_resumes_from_the_save_dir_or_starts_fresh(tmp_path) -> None:
    save = tmp_path / "ckpt"
    pre = preflight(_config(f"checkpoint.save={save}", "checkpoint.load=auto"), None, 1)
    assert pre.load_dir is None and pre.checkpoint is None  # nothing saved yet (the dir need not exist)
    _fake_checkpoint(save)
    pre = preflight(_config(f"checkpoint.save={save}", "checkpoint.load=auto"), None, 1)
    assert pre.load_dir == str(save) and (pre.checkpoint.tag, pre.checkpoint.step) == ("global_step3", 3)
    with pytest.raises(ConfigError, match='"auto" resumes from checkpoint.save, which is not set'):
        _config("checkpoint.load=auto")
    for extra in ("checkpoint.finetune=true", "checkpoint.tag=global_step3"):
        with pytest.raises(ConfigError, match="takes no checkpoint.tag and no checkpoint.finetune"):
            _config(f"checkpoint.save={save}", "checkpoint.load=auto", extra)


@pytest.mark.launched
def test_command_line_error_is_one_line_and_nonzero() -> None:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE"):
        env.pop(key, None)
    result = run_python(["-m", "llama_megatron.train", "--config", CONFIG, "--set", "parallel.tensor=3"], env=env,
                        timeout=120)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: tensor parallel degree 3 does not divide num_attention_heads 4"]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("overrides, message", [
    (["parallel.context=8"], "context parallel degree 8 does not divide the 4 attention heads per tensor-parallel "
                             "rank (num_attention_heads 4 / tensor 1)"),
    (["parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "seq_length=34"],
     "context parallelism with sequence_parallel needs seq_length 34 divisible by context x tensor = 2 x 2"),
])
@pytest.mark.launched
def test_bad_context_parallel_layout_is_one_line_before_any_process_group(overrides, message) -> None:
    """Launched as 4 ranks would be (WORLD_SIZE 4, no launcher): the config is refused before torch.distributed."""
    env = dict(os.environ, WORLD_SIZE="4", RANK="0")
    result = run_python(["-m", "llama_megatron.train", "--config", CONFIG, *(a for o in overrides for a in ("--set", o))],
                        env=env, timeout=120)
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [f"error: {message}"]
    assert "Traceback" not in result.stderr and "process group" not in result.stderr.lower()


def test_overrides_and_unknown_keys() -> None:
    config = _config("optimizer.betas=[0.9, 0.99]", "logging.tensorboard_dir=runs/x/tb")
    assert config.optimizer.betas == (0.9, 0.99) and config.logging.tensorboard_dir == "runs/x/tb"
    with pytest.raises(ConfigError, match="unknown keys in 'optimizer': lrr"):
        _config("optimizer.lrr=1")
    with pytest.raises(ConfigError, match="unknown training config keys: stepz"):
        _config("stepz=1")
    with pytest.raises(ConfigError, match="--set expects key=value"):
        _config("train.steps")


def _saved_run(save, config: TrainingConfig, step: int, start: str | None = None) -> None:
    """A save of ``config``'s run at ``step`` in ``save``, its record as the loop writes it."""
    tag = save / f"global_step{step}"
    tag.mkdir(parents=True)
    record = dict(step=step, consumed_samples=8 * step, tensor=1, pipeline=1, data_parallel=1, zero_stage=0,
                  model=config.model.to_dict(), padded_vocab_size=4160, format_version=1,
                  run=config.run_record(start))
    (tag / "llama_megatron.json").write_text(json.dumps(record))
    (save / "latest").write_text(f"global_step{step}")


def test_a_finished_run_started_again_trains_nothing_and_another_run_is_named(tmp_path) -> None:
    from llama_megatron.training.resume import check_save_dir, finished_run, resolve_load_dir

    save = tmp_path / "ckpt"
    run = _config(f"checkpoint.save={save}", "checkpoint.interval=5")
    _saved_run(save, run, 10)
    # the same config (train.steps 10, and a checkpoint at 10): finished, whether it resumes or starts fresh
    assert finished_run(run).step == 10
    assert finished_run(_config(f"checkpoint.save={save}", "checkpoint.load=auto")).step == 10
    # what does not make a run another one: its layout, logging, evaluation
    assert finished_run(_config(f"checkpoint.save={save}", "logging.interval=5", "eval.interval=5",
                                "batch.micro_batch_size=4")).step == 10
    # not finished: more steps asked for, starting again, or another run
    assert finished_run(_config(f"checkpoint.save={save}", "train.steps=20")) is None
    assert finished_run(_config(f"checkpoint.save={save}", "checkpoint.overwrite=true")) is None
    # overwrite starts again even where load auto would resume: nothing loaded, the saves there replaced
    again = _config(f"checkpoint.save={save}", "checkpoint.load=auto", "checkpoint.overwrite=true")
    assert finished_run(again) is None and resolve_load_dir(again.checkpoint) is None
    assert resolve_load_dir(_config(f"checkpoint.save={save}", "checkpoint.load=auto").checkpoint) == str(save)
    assert finished_run(_config(f"checkpoint.save={save}", "seed=7")) is None
    longer = _config(f"checkpoint.save={save}", "train.steps=20")
    with pytest.raises(ConfigError) as same:
        check_save_dir(longer, None, None)
    assert str(same.value) == (
        f"checkpoint.save {save} holds this run's checkpoints (global_step10: the same config, seed and start) up to "
        "step 10 of 20: continue it with checkpoint.load auto, or start it again with checkpoint.overwrite true")
    with pytest.raises(ConfigError) as other:
        check_save_dir(_config(f"checkpoint.save={save}", "seed=7", "optimizer.lr=0.01"), None, None)
    assert str(other.value) == (
        f"checkpoint.save {save} already holds checkpoints (global_step10) of another run (it differs in "
        "optimizer.lr, seed): save this one elsewhere, or replace them with checkpoint.overwrite true (that run "
        "continues with its own config and checkpoint.load auto)")
    # a fine-tuning run's start is part of it: another base is another run; the same one says how to continue
    base = _fake_checkpoint(tmp_path / "base")
    tuned = tmp_path / "tuned"
    finetune = _config(f"checkpoint.save={tuned}", f"checkpoint.load={base}", "checkpoint.finetune=true")
    _saved_run(tuned, finetune, 6, start=base)
    assert finished_run(finetune) is None
    with pytest.raises(ConfigError, match="up to step 6 of 10: continue it with checkpoint.load auto and "
                                          "checkpoint.finetune false"):
        check_save_dir(finetune, base, base)
    with pytest.raises(ConfigError, match=r"of another run \(it differs in the checkpoint it started from\)"):
        check_save_dir(finetune, base, str(tmp_path / "other-base"))
    assert finished_run(_config(f"checkpoint.save={tuned}", f"checkpoint.load={base}", "checkpoint.finetune=true",
                                "train.steps=6")).step == 6
