"""PNG of one or more runs: training loss, validation loss, learning rate and tokens/s (and a preference run's reward
margin and accuracy, a GRPO run's mean reward and completion length), against step and tokens.

A run directory holds ``metrics.jsonl`` (one record per logged step) and, when written by this version,
``run.json`` (its layout and batch shape, :mod:`llama_megatron.training.run.setup`). The legend names each run and
its layout; without ``run.json`` it names the directory only, and the token axis is left out for that run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from llama_megatron.errors import ConfigError

PANELS = (("loss", "training loss"), ("val_loss", "validation loss"), ("lr", "learning rate"),
          ("tokens_per_s", "tokens/s"))
# drawn when some run logged them: preference runs (TRL's reward margin and accuracy), GRPO runs (the mean reward
# and completion length), FP8 runs with logging.fp8_stats (a line per linear kind and cast: its largest amax and
# smallest scale over the layers)
OPTIONAL_PANELS = (("rewards/margins", "reward margin"), ("rewards/accuracies", "reward accuracy"),
                   ("reward", "mean reward (GRPO)"), ("completions/mean_length", "completion length (GRPO)"),
                   ("fp8:amax", "FP8 amax (largest over layers)"), ("fp8:scale", "FP8 scale (smallest over layers)"),
                   ("tasks:", "lm-eval tasks (eval.tasks)"))


def series(run: Run, key: str) -> dict[str, list[tuple[int, float, int | None]]]:
    """The lines of one panel for ``run``: label -> (step, value, consumed samples) of the records holding it."""
    if key == "tasks:":  # a line per task and metric (tasks/<task>/<metric>)
        lines: dict[str, list] = {}
        for r in run.records:
            for name in sorted(k for k in r if k.startswith("tasks/")):
                lines.setdefault(f"{run.name} {name[len('tasks/'):]}", []).append(
                    (r["step"], r[name], r.get("consumed_samples")))
        return lines
    if not key.startswith("fp8:"):
        return {legend_label(run): [(r["step"], r[key], r.get("consumed_samples")) for r in run.records if key in r]}
    stat, pick = key[4:], (max if key == "fp8:amax" else min)
    lines: dict[str, list] = {}
    for r in run.records:
        for name, values in r.get("fp8", {}).items():
            present = [v for v in values[stat] if v]
            if present:
                lines.setdefault(f"{run.name} {name}", []).append((r["step"], pick(present), r.get("consumed_samples")))
    return lines


def _logged(run: Run, key: str) -> bool:
    if key == "tasks:":
        return any(k.startswith("tasks/") for r in run.records for k in r)
    return any(("fp8" if key.startswith("fp8:") else key) in r for r in run.records)


@dataclass
class Run:
    name: str
    records: list[dict]
    info: dict | None

    @property
    def tokens_per_sample(self) -> int | None:
        """Tokens of one sample: a row, or a padded preference pair's two."""
        return self.info.get("seq_length") * self.info.get("rows_per_sample", 1) if self.info else None


def read_run(run_dir: str) -> Run:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir} has no metrics.jsonl (is it a run's output_dir?)")
    records = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise ConfigError(f"{path}:{number}: not JSON") from None
    info_path = os.path.join(run_dir, "run.json")
    info = None
    if os.path.isfile(info_path):
        with open(info_path, encoding="utf-8") as fh:
            info = json.load(fh)
    return Run(os.path.basename(os.path.normpath(run_dir)), records, info)


def legend_label(run: Run) -> str:
    """``name (TP2 PP2 DP1 SP, ZeRO-1 bf16)``; the name alone without run.json."""
    if not run.info:
        return run.name
    i = run.info
    layout = f"TP{i['tensor']} PP{i['pipeline']} DP{i['data_parallel']}" + (" SP" if i.get("sequence_parallel") else "")
    if i.get("context", 1) > 1:
        layout += f" CP{i['context']}"
    return f"{run.name} ({layout}, ZeRO-{i['zero_stage']} {i['precision']})"


def plot_runs(run_dirs: list[str], output: str, x: str = "both") -> str:
    """Write one PNG (atomically) with a panel per metric; columns: against step and/or against tokens."""
    if x not in ("step", "tokens", "both"):
        raise ConfigError(f"x axis must be step, tokens or both, got {x!r}")
    runs = [read_run(d) for d in run_dirs]
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    axes_kinds = ["step", "tokens"] if x == "both" else [x]
    panels = list(PANELS) + [(key, title) for key, title in OPTIONAL_PANELS if any(_logged(run, key) for run in runs)]
    heights = [5 if key.startswith("fp8:") else 3 for key, _ in panels]  # room for the FP8 legends
    fig, axes = plt.subplots(len(panels), len(axes_kinds), figsize=(6 * len(axes_kinds), sum(heights)),
                             squeeze=False, gridspec_kw={"height_ratios": heights})
    for col, kind in enumerate(axes_kinds):
        for row, (key, title) in enumerate(panels):
            ax = axes[row][col]
            for source, (label, points) in ((r, line) for r in runs for line in series(r, key).items()):
                if kind == "tokens":
                    if source.tokens_per_sample is None:
                        continue
                    batch = source.info["global_batch_size"]
                    xs = [(c if c is not None else s * batch) * source.tokens_per_sample for s, _, c in points]
                else:
                    xs = [s for s, _, _ in points]
                if points:
                    ax.plot(xs, [v for _, v, _ in points], marker="." if len(points) < 50 else None, label=label)
            if key.startswith("fp8:"):
                ax.set_yscale("log")
            ax.set_title(f"{title} vs {kind}")
            ax.set_xlabel("tokens seen" if kind == "tokens" else "step")
            if ax.has_data() and key.startswith("fp8:"):  # a line per kind and cast: the legend below the panel
                ax.legend(fontsize=5, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.25))
            elif ax.has_data():
                ax.legend(fontsize=7)
    return save_figure(fig, output)


def save_figure(fig, output: str) -> str:
    """Write ``fig`` as a PNG at ``output`` atomically (a temp file renamed) and close it; the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_dir = os.path.dirname(os.path.abspath(output))
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".tmp-{os.getpid()}-{os.path.basename(output)}")
    try:
        fig.savefig(tmp, format="png", dpi=80)
        os.replace(tmp, output)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return output
