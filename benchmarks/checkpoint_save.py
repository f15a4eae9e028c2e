"""What a checkpoint save costs training, synchronous against ``checkpoint.async_save``, per rank.

For each layout (DP2 ZeRO-1 and PP2, fp32, a 0.5B-parameter LLaMA shape by default) three runs of the real
trainer in one launch of the deepspeed launcher, from the same seed on synthetic tokens: no saves, a synchronous save every
``--interval`` steps, an asynchronous one. Each rank times, around the trainer's own calls:

* the stall: how long the training loop is stopped by a save during training (the synchronous save whole; for an
  asynchronous one, the capture of its state, the next optimizer step's wait for the host copy the writer makes
  meanwhile, every later wait for its writer and the step boundaries' agreement on it; the save at the last step,
  whose writer the end of the run waits for, is left out);
* the time to a complete tag (an asynchronous save: from its start until the tag is renamed and ``latest``);
* the bytes of its host copy (what ``estimate`` reports as the async save's host memory, per stage).

Next to them: the tag's bytes, this disk's write rate (a file written and fsynced) and tokens/s of each run over its
steps after the ``--warmup`` first (saves included). One JSON line; the issue's targets are an async stall at most
15% of the synchronous one and tokens/s with async saves within 5% of the run that never saves. The background
writer shares the ranks' cores: on a machine with a core per rank and none spare (2 ranks on this 2-core CPU) its
hashing and serialisation slow the steps it overlaps, which a GPU run's idle host cores absorb.

    python benchmarks/checkpoint_save.py                   # 0.5B, DP2 ZeRO-1 and PP2, 30 steps, saves every 10
    python benchmarks/checkpoint_save.py --layouts pp2 --steps 30 --dir /mnt/nvme/tmp
    python benchmarks/checkpoint_save.py --smoke           # a tiny model: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainer_throughput import launch_logged, tokens_per_s_after  # noqa: E402  (this directory is on the path)

_LLAMA_1024 = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
               "num_key_value_heads": 16, "max_position_embeddings": 256, "tie_word_embeddings": False}
SHAPES = {  # decoder layers of 12.85M parameters and 65.5M of untied embedding and head
    "0.5b": {**_LLAMA_1024, "num_hidden_layers": 34},  # 0.50B
    "0.25b": {**_LLAMA_1024, "num_hidden_layers": 14},  # 0.25B
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
             "tie_word_embeddings": False},
}
LAYOUTS = {"dp2-zero1": {"tensor": 1, "pipeline": 1}, "pp2": {"tensor": 1, "pipeline": 2}}
MODES = ("none", "sync", "async")
DISK_PROBE_BYTES = 256 * 2**20
STALL_TARGET, THROUGHPUT_TARGET = 0.15, 0.95


def _config(args, layout: str, mode: str, work: str) -> dict:
    out = os.path.join(work, f"{layout}-{mode}")
    checkpoint = {} if mode == "none" else {"save": os.path.join(out, "checkpoints"), "interval": args.interval,
                                            "keep_last": 1, "async_save": mode == "async"}
    return {
        "model": SHAPES[args.shape],
        "parallel": LAYOUTS[layout],
        "data": {"type": "synthetic"},
        "seq_length": args.seq_length,
        "batch": {"micro_batch_size": 1, "global_batch_size": 2},
        "train": {"steps": args.steps},
        "optimizer": {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 2, "decay_style": "cosine"},
        "eval": {"interval": 0},
        "checkpoint": checkpoint,
        "logging": {"interval": 1},
        "kernels": "reference",
        # ZeRO-1 fp32 with a smaller reduce bucket than DeepSpeed's default (a transient buffer of the gradients'
        # size at 0.5B): two 0.5B ranks and their host copies fit this machine's 24 GiB
        "deepspeed_config": os.path.join(work, "ds_zero1_fp32.json"),
        "output_dir": out,
        "seed": 1234,
    }


def worker(timings_dir: str, config_paths: list[str]) -> int:
    """One rank of a launch: the trainer run on each config in turn, its save calls timed (the library untouched:
    the wrappers only read the clock around the calls the training loop makes)."""
    import gc

    from llama_megatron import train
    from llama_megatron.training import background_save
    from llama_megatron.training import checkpointing as ckpt

    saves: list[dict] = []
    where: dict = {}
    backgrounds: list = []
    save_checkpoint, complete = ckpt.save_checkpoint, ckpt.PendingSave.complete
    background_init = background_save.BackgroundSaves.__init__
    wait_copied = background_save.BackgroundWriter.wait_copied

    def timed_save(engine, save_dir, meta, keep_last, pctx, *args, **kwargs):
        where.update(rank=pctx.rank, pp_rank=pctx.pp_rank, dp_rank=pctx.dp_rank)
        start = time.perf_counter()
        result = save_checkpoint(engine, save_dir, meta, keep_last, pctx, *args, **kwargs)
        end = time.perf_counter()
        saves.append({"step": meta.step, "start": start, "stall": end - start,
                      "complete": None if isinstance(result, ckpt.PendingSave) else end - start})
        return result

    def timed_complete(self, wait: bool) -> bool:
        start = time.perf_counter()
        done = complete(self, wait)
        end = time.perf_counter()
        saves[-1]["stall"] += end - start  # the loop waits here (and agrees at each step boundary) for the writer
        if done:
            saves[-1]["complete"] = end - saves[-1]["start"]
        return done

    def timed_wait_copied(self) -> None:
        start = time.perf_counter()
        wait_copied(self)
        if saves:  # the optimizer step waits here for the host copy of the save in flight
            saves[-1]["stall"] += time.perf_counter() - start

    def kept_init(self) -> None:
        background_init(self)
        backgrounds.append(self)

    ckpt.save_checkpoint, ckpt.PendingSave.complete = timed_save, timed_complete
    background_save.BackgroundSaves.__init__ = kept_init
    background_save.BackgroundWriter.wait_copied = timed_wait_copied
    for config_path in config_paths:
        saves.clear()
        backgrounds.clear()
        rc = train.main(["--config", config_path])
        if rc:
            return rc
        host = backgrounds[0].snapshots.nbytes if backgrounds else 0
        record = {**where, "saves": [{k: v for k, v in s.items() if k != "start"} for s in saves],
                  "host_copy_bytes": host}
        name = f"{os.path.splitext(os.path.basename(config_path))[0]}-rank{os.environ.get('RANK', '0')}.json"
        with open(os.path.join(timings_dir, name), "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        backgrounds.clear()
        gc.collect()  # the next run's model in this process
    return 0


def disk_write_gib_per_s(directory: str) -> float:
    path = os.path.join(directory, "disk-probe")
    block = os.urandom(2**24)
    start = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(DISK_PROBE_BYTES // len(block)):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return DISK_PROBE_BYTES / 2**30 / seconds


def _estimated_host_copy(config_path: str) -> list[int]:
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.diagnostics.memory_estimate import estimate
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config

    config = TrainingConfig.from_file(config_path, [])
    world = 2
    ds = build_deepspeed_config(config, config.deepspeed_config, world)
    return [stage.async_save_host for stage in estimate(config, ds, world).stages]


def _tag_bytes(save_dir: str) -> int:
    with open(os.path.join(save_dir, "latest"), encoding="utf-8") as fh:
        tag = os.path.join(save_dir, fh.read().strip())
    return sum(os.path.getsize(os.path.join(tag, name)) for name in os.listdir(tag))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def measure(args, layout: str, work: str) -> dict:
    """The three runs of ``layout`` in one launch (one start-up), each from the same seed."""
    paths = {}
    for mode in MODES:
        paths[mode] = os.path.join(work, f"{layout}-{mode}.json")
        with open(paths[mode], "w", encoding="utf-8") as fh:
            json.dump(_config(args, layout, mode, work), fh)
    timings = os.path.join(work, f"{layout}-timings")
    os.makedirs(timings)
    launch_logged(2, [os.path.abspath(__file__), "--worker", timings, *paths.values()],
                  os.path.join(work, f"{layout}.log"))
    runs = {}
    for mode in MODES:
        ranks = []
        for rank in range(2):
            with open(os.path.join(timings, f"{layout}-{mode}-rank{rank}.json"), encoding="utf-8") as fh:
                ranks.append(json.load(fh))
        runs[mode] = {"config": paths[mode], "ranks": ranks,
                      # logged every step: a window is a step, holding the save before it (the loop logs, then
                      # saves)
                      "tokens_per_s": tokens_per_s_after(os.path.join(work, f"{layout}-{mode}"), args.warmup,
                                                         2 * args.seq_length)}
    estimated = _estimated_host_copy(runs["async"]["config"])
    per_rank = []
    for sync, background in zip(runs["sync"]["ranks"], runs["async"]["ranks"], strict=True):
        # the stall of the saves during training: the last step's save is followed by the end of the run, which
        # waits for its writer (training is over; that wait is its time to a complete tag, reported below)
        sync_stall = _mean([s["stall"] for s in sync["saves"] if s["step"] < args.steps])
        async_stall = _mean([s["stall"] for s in background["saves"] if s["step"] < args.steps])
        per_rank.append({
            "rank": sync["rank"], "pp_rank": sync["pp_rank"], "dp_rank": sync["dp_rank"],
            "saves": len(background["saves"]),
            "saves_during_training": sum(s["step"] < args.steps for s in background["saves"]), "sync_stall_s": round(sync_stall, 3),
            "async_stall_s": round(async_stall, 3), "async_stall_vs_sync": round(async_stall / sync_stall, 4),
            "async_complete_s": round(_mean([s["complete"] for s in background["saves"]]), 3),
            # each save during training: the first allocates the host buffers the later ones reuse
            "sync_stalls_s": [round(s["stall"], 3) for s in sync["saves"] if s["step"] < args.steps],
            "async_stalls_s": [round(s["stall"], 3) for s in background["saves"] if s["step"] < args.steps],
            "host_copy_bytes": background["host_copy_bytes"],
            "estimated_host_copy_bytes": estimated[background["pp_rank"]] if background["dp_rank"] == 0 else None})
    save_dir = os.path.join(work, f"{layout}-sync", "checkpoints")
    tokens = {mode: round(run["tokens_per_s"], 2) for mode, run in runs.items()}
    return {"ranks": per_rank, "tag_bytes": _tag_bytes(save_dir), "tokens_per_s": tokens,
            "async_stall_vs_sync": max(r["async_stall_vs_sync"] for r in per_rank),
            "async_tokens_per_s_vs_none": round(tokens["async"] / tokens["none"], 4),
            "sync_tokens_per_s_vs_none": round(tokens["sync"] / tokens["none"], 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b",
                        help="model shape (0.5b at DP2 ZeRO-1 fp32: about 9 GiB per rank, plus its host copy)")
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=sorted(LAYOUTS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=10, help="steps between saves")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s")
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--dir", default=None, help="where the runs write (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 4 steps, a save every 2")
    parser.add_argument("--worker", nargs="+", metavar="TIMINGS_DIR CONFIG", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()  # the launcher appends --local_rank=N to a worker's arguments
    if args.worker:
        return worker(args.worker[0], args.worker[1:])
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank: the ranks share the cores
    if args.smoke:
        args.shape, args.steps, args.interval, args.warmup, args.seq_length = "tiny", 4, 2, 1, 16
    work = tempfile.mkdtemp(prefix="checkpoint-save-", dir=args.dir)
    try:
        with open(os.path.join(work, "ds_zero1_fp32.json"), "w", encoding="utf-8") as fh:
            json.dump({"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e7}}, fh)
        result = {"benchmark": "checkpoint_save", "shape": args.shape, "steps": args.steps,
                  "interval": args.interval, "seq_length": args.seq_length,
                  "disk_write_gib_per_s": round(disk_write_gib_per_s(work), 3)}
        for layout in args.layouts:
            result[layout] = measure(args, layout, work)
        result["targets"] = {"async_stall_vs_sync_at_most": STALL_TARGET,
                             "async_tokens_per_s_vs_none_at_least": THROUGHPUT_TARGET}
        result["met"] = {layout: {"stall": result[layout]["async_stall_vs_sync"] <= STALL_TARGET,
                                  "throughput": result[layout]["async_tokens_per_s_vs_none"] >= THROUGHPUT_TARGET}
                         for layout in args.layouts}
        print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
