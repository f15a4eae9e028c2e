"""``llama-megatron plot``: one PNG of several runs, layouts in the legend, one-line errors, nothing half-written."""

from __future__ import annotations

import json
import os

import pytest

from llama_megatron.cli import main as cli
from llama_megatron.errors import ConfigError
from llama_megatron.training.diagnostics.plot import legend_label, plot_runs, read_run

INFO = {"world_size": 4, "tensor": 2, "pipeline": 2, "data_parallel": 1, "sequence_parallel": True,
        "zero_stage": 1, "precision": "bf16", "micro_batch_size": 2, "global_batch_size": 8, "seq_length": 32,
        "model": {}}


def _run_dir(path, info: dict | None, steps: int = 6) -> str:
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as fh:
        for step in range(1, steps + 1):
            record = {"step": step, "loss": 8.0 - 0.1 * step, "lr": 1e-3, "tokens_per_s": 900.0 + step,
                      "consumed_samples": 8 * step}
            if step % 3 == 0:
                record.update(val_loss=8.1 - 0.1 * step, val_ppl=3000.0)
            fh.write(json.dumps(record) + "\n")
    if info:
        (path / "run.json").write_text(json.dumps(info))
    return str(path)


def test_plot_of_two_runs(tmp_path) -> None:
    a = _run_dir(tmp_path / "tp2-pp2", INFO)
    b = _run_dir(tmp_path / "old-run", None)
    assert legend_label(read_run(a)) == "tp2-pp2 (TP2 PP2 DP1 SP, ZeRO-1 bf16)"
    assert legend_label(read_run(b)) == "old-run"
    assert cli(["plot", a, b]) == 0
    png = os.path.join(a, "metrics.png")
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width > height / 2 > 0  # 4 panels x 2 columns
    out = str(tmp_path / "steps.png")
    assert plot_runs([a], out, "step") == out and os.path.getsize(out) > 0


def test_a_preference_run_adds_its_reward_panels(tmp_path) -> None:
    """Reward margin and accuracy panels when a run logged them; a padded pair's two rows count as its tokens."""
    import matplotlib.image

    plain = str(tmp_path / "plain.png")
    plot_runs([_run_dir(tmp_path / "sft", INFO)], plain, "step")
    run = _run_dir(tmp_path / "dpo", {**INFO, "rows_per_sample": 2})
    with open(os.path.join(run, "metrics.jsonl"), "a") as fh:
        fh.write(json.dumps({"step": 7, "loss": 0.5, "rewards/margins": 0.8, "rewards/accuracies": 0.75}) + "\n")
    assert read_run(run).tokens_per_sample == 2 * INFO["seq_length"]
    out = str(tmp_path / "dpo.png")
    plot_runs([run], out, "step")
    assert matplotlib.image.imread(out).shape[0] == matplotlib.image.imread(plain).shape[0] * 6 // 4


def test_a_run_with_eval_tasks_adds_their_panel(tmp_path) -> None:
    """eval.tasks' metrics (tasks/<task>/<metric>): one more panel, a line per task and metric."""
    import matplotlib.image

    from llama_megatron.training.diagnostics.plot import series

    plain = str(tmp_path / "plain.png")
    plot_runs([_run_dir(tmp_path / "plain", INFO)], plain, "step")
    run = _run_dir(tmp_path / "tasks", INFO)
    with open(os.path.join(run, "metrics.jsonl"), "a") as fh:
        for step in (7, 9):
            fh.write(json.dumps({"step": step, "loss": 7.0, "tasks/arc/acc": step / 8, "tasks_s": 2.0,
                                 "tasks/gen/exact_match": 0.0}) + "\n")
    assert series(read_run(run), "tasks:") == {"tasks arc/acc": [(7, 0.875, None), (9, 1.125, None)],
                                               "tasks gen/exact_match": [(7, 0.0, None), (9, 0.0, None)]}
    out = str(tmp_path / "tasks.png")
    plot_runs([run], out, "step")
    assert matplotlib.image.imread(out).shape[0] == matplotlib.image.imread(plain).shape[0] * 5 // 4


def test_bad_inputs_are_one_line_errors_and_write_nothing(tmp_path) -> None:
    with pytest.raises(ConfigError, match="has no metrics.jsonl"):
        plot_runs([str(tmp_path / "missing")], str(tmp_path / "x.png"))
    bad = _run_dir(tmp_path / "bad", INFO)
    with open(os.path.join(bad, "metrics.jsonl"), "a") as fh:
        fh.write("{not json\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl:7: not JSON"):
        plot_runs([bad], str(tmp_path / "y.png"))
    assert cli(["plot", bad, "--output", str(tmp_path / "z.png")]) == 2
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".png") or n.startswith(".tmp")]


def test_a_grpo_run_adds_its_reward_and_length_panels(tmp_path) -> None:
    """A GRPO run's mean reward and completion length are two more panels; a run without them adds none."""
    import matplotlib.image

    plain = str(tmp_path / "plain.png")
    plot_runs([_run_dir(tmp_path / "sft", INFO)], plain, "step")
    run = _run_dir(tmp_path / "grpo", INFO)
    with open(os.path.join(run, "metrics.jsonl"), "a") as fh:
        for step, reward in ((7, 0.1), (8, 0.6)):
            fh.write(json.dumps({"step": step, "loss": 0.0, "reward": reward, "completions/mean_length": 12.0}) + "\n")
    out = str(tmp_path / "grpo.png")
    plot_runs([run], out, "step")
    assert matplotlib.image.imread(out).shape[0] == matplotlib.image.imread(plain).shape[0] * 6 // 4
