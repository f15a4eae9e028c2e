"""``llama-megatron plot --profile DIR``: a profiled pipeline step per rank, from ``profile``'s traces.

Each rank's ``rank{R}.trace.json`` holds the ranges ``profile`` runs every pipeline instruction in
(``pipeline: ForwardPass mb 3``, :func:`~llama_megatron.training.pipeline.timeline.label_instructions`). The figure
draws a row per rank on one time axis (the ranks of one machine share the trace clock): F, B (input gradients, or
the whole backward where the schedule does not split it) and W passes as coloured bars, sends and receives as thin
grey ones, the rest of the row (waiting, the optimizer step) empty: the pipeline's idle. Below it, each rank's
allocated bytes over the same steps (``rank{R}.memory.json``).
"""

from __future__ import annotations

import json
import os

from llama_megatron.errors import ConfigError
from llama_megatron.training.diagnostics.profiling import busy_share, pipeline_ranges

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "comm": "#b0b0b0"}


def plot_profile(profile_dir: str, output: str) -> str:
    """One PNG: the pipeline timeline of every profiled rank and their memory; the path written."""
    path = os.path.join(profile_dir, "summary.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{profile_dir} holds no summary.json: give the --output directory of llama-megatron profile")
    with open(path, encoding="utf-8") as fh:
        ranks = json.load(fh)["ranks"]
    timelines = {r["rank"]: pipeline_ranges(os.path.join(profile_dir, r["trace"])) for r in ranks}
    if not any(timelines.values()):
        raise ConfigError(f"the traces in {profile_dir} hold no pipeline passes: profile a run with "
                          "parallel.pipeline > 1")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llama_megatron.training.diagnostics.plot import save_figure

    origin = min(r[2] for ranges in timelines.values() for r in ranges)
    end = max(r[3] for ranges in timelines.values() for r in ranges)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 2 + 0.6 * len(timelines) + 3),
                                      gridspec_kw={"height_ratios": [max(2, len(timelines)), 3]})
    for row, (_, ranges) in enumerate(sorted(timelines.items())):
        for kind, _, start, stop in ranges:
            if kind == "other":
                continue
            height = 0.8 if kind in "FBW" else 0.2
            top.barh(row, stop - start, left=start - origin, height=height, color=COLOURS[kind], linewidth=0)
        share = busy_share(ranges, origin, end)
        top.text(end - origin, row, f"  idle {100 * (1 - share):.0f}%", va="center", fontsize=8)
    top.set_yticks(range(len(timelines)), [f"rank {r}" for r in sorted(timelines)])
    top.invert_yaxis()
    top.set_xlabel("ms")
    top.set_title("pipeline passes per rank (F blue, B orange, W green, send/recv grey; white: idle)")
    for r in ranks:
        memory = os.path.join(profile_dir, r.get("memory", {}).get("timeline", ""))
        if os.path.isfile(memory):
            with open(memory, encoding="utf-8") as fh:
                points = json.load(fh)["points"]
            if points:
                bottom.plot([p[0] for p in points], [p[1] / 2**20 for p in points], label=f"rank {r['rank']}")
    bottom.set_xlabel("ms from the rank's first allocation")
    bottom.set_ylabel("MiB allocated")
    bottom.set_title("memory over the profiled steps")
    if bottom.has_data():
        bottom.legend(fontsize=7)
    return save_figure(fig, output)
