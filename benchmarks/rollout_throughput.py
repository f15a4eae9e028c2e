"""Online RL's rollouts: tokens/s of our decoding inside a GRPO run at TP2 on 2 processes (the training weights where
they live, KV cache, a group of completions as one batch) against transformers' ``generate`` in one process with the
same cores on the same model and batch, and the share of a GRPO step spent generating.

A random model of llama-50m's shape (the shipped tokenizer's 4,096-token vocabulary) is saved as HF and converted to
TP2. Our side: a ``grpo`` run of ``--steps`` steps, ``--prompts`` prompts of ``--generations`` completions per step,
every completion ``--new-tokens`` long (no stop id ends one), its rollout tokens/s and generation seconds read from
its metrics (the first step, which builds the caches, left out). HF's side: ``generate`` of the same groups (the
prompt repeated ``--generations`` times, ``min_new_tokens`` = ``max_new_tokens``, sampling at temperature 1) with the
two cores the ranks had; and our decoding in one process at TP1 (the decoding without TP2's collectives, which on a CPU
under gloo cost about a millisecond per layer and token). One JSON line.

    python benchmarks/rollout_throughput.py [--steps 3] [--prompts 2] [--generations 8] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "tokenizer")
PROMPTS = ["What is 2 + 3?", "Name a play by Shakespeare.", "Convert 10 pounds to kilograms.", "Who wrote Hamlet?"]
REWARD = "def length(completion_ids, **kwargs):\n    return [float(len(ids)) for ids in completion_ids]\n"


def _grpo_config(work: str, checkpoint: str, args) -> str:
    model = _shape()
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w", encoding="utf-8") as fh:
        fh.write("".join(json.dumps({"prompt": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS))
    with open(os.path.join(work, "reward.py"), "w", encoding="utf-8") as fh:
        fh.write(REWARD)
    batch = args.prompts * args.generations
    config = {
        "model": model, "parallel": {"tensor": 2}, "data": {"type": "prompts", "path": prompts},
        "tokenizer": TOKENIZER, "seq_length": 32 + args.new_tokens,
        "batch": {"micro_batch_size": args.generations, "global_batch_size": batch},
        "train": {"steps": args.steps}, "optimizer": {"lr": 1e-5, "warmup_steps": 0}, "eval": {"interval": 0},
        "grpo": {"num_generations": args.generations, "max_completion_length": args.new_tokens,
                 "reward_funcs": [os.path.join(work, "reward.py") + ":length"], "stop_ids": [-1]},
        "logging": {"interval": 1}, "checkpoint": {"load": checkpoint, "finetune": True},
        "deepspeed_config": os.path.join(ROOT, "ds_configs", "zero1_fp32.json"), "output_dir": os.path.join(work, "run"),
        "seed": 1}
    path = os.path.join(work, "grpo.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    return path


def _median_rate(decode, groups: list, args) -> float:
    """Tokens per second of ``decode`` (a group's prompt -> tokens decoded) over the steps after the first (a
    warm-up), each step's prompts the next ``--prompts`` groups: the median."""
    decode(groups[0])
    rates = []
    for step in range(args.steps - 1):
        start, tokens = time.perf_counter(), 0
        for k in range(args.prompts):
            tokens += decode(groups[(step * args.prompts + k) % len(groups)])
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def _hf_tokens_per_s(hf_dir: str, args) -> float:
    """HF generate of the same groups (every prompt, its rows as one batch): tokens per second after a warm-up."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)  # the two cores the two ranks had
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    groups = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"] for p in PROMPTS]

    def decode(ids) -> int:
        out = model.generate(ids.repeat(args.generations, 1), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * args.generations

    return _median_rate(decode, groups, args)


def _shape() -> dict:
    with open(os.path.join(ROOT, "configs", "models", "llama-50m.json"), encoding="utf-8") as fh:
        return {**json.load(fh), "vocab_size": 4096, "max_position_embeddings": 512}


def _ours_tp1_tokens_per_s(hf_dir: str, args) -> float:
    """Our decoding (``generate_rows``: a group as one batch, KV cache) in this process at TP1 on the same model and
    groups: the decoding itself, without TP2's collectives (on CPU under gloo, a fixed cost per layer and token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llama_megatron.config import ModelConfig
    from llama_megatron.model.build import build_model
    from llama_megatron.model.generation import Sampling, generate_rows
    from llama_megatron.model.tp_slicing import hf_to_rank_state_dict
    from llama_megatron.parallel.context import ParallelContext
    from llama_megatron.parallel.degrees import ParallelConfig

    torch.set_num_threads(2)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = ModelConfig.from_dict(_shape())
    parallel = ParallelConfig()
    model = build_model(config, parallel, ParallelContext.single(), initialize=False)
    state = hf_to_rank_state_dict(hf.state_dict(), config, 0, 1, parallel.padded_vocab_size(config.vocab_size))
    model.load_state_dict({k: state[k] for k in model.state_dict()})
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    groups = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS]
    sampling = Sampling(temperature=1.0, seed=1)

    def decode(ids: list[int]) -> int:
        return sum(map(len, generate_rows(model, ids, args.generations, args.new_tokens, set(), sampling).tokens))

    return _median_rate(decode, groups, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from model_utils import hf_model, save_and_convert

    from llama_megatron.config import ModelConfig
    from llama_megatron.parallel.placement import free_port

    shape = _shape()
    with tempfile.TemporaryDirectory() as work:
        hf_dir = save_and_convert(hf_model(ModelConfig.from_dict(shape), seed=0), work, TOKENIZER, (2,))
        checkpoint = os.path.join(work, "tp2")
        config = _grpo_config(work, checkpoint, args)
        result = subprocess.run([os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2",
                                 "--master_port", str(free_port()), "--log_level", "warning", "--module",
                                 "llama_megatron.train", "--config", config],
                                cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"the GRPO run failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
        with open(os.path.join(work, "run", "metrics.jsonl"), encoding="utf-8") as fh:
            steps = [r for r in map(json.loads, fh) if "rollout_tokens_per_s" in r][1:]
        tokens_per_step = args.prompts * args.generations * (32 + args.new_tokens)
        ours = statistics.median(r["rollout_tokens_per_s"] for r in steps)
        share = statistics.median(r["generation_s"] / (tokens_per_step / r["tokens_per_s"]) for r in steps)
        hf = _hf_tokens_per_s(hf_dir, args)
        tp1 = _ours_tp1_tokens_per_s(hf_dir, args)
    print(json.dumps({"benchmark": "rollout_throughput", "model": "llama-50m shape, vocab 4096, fp32",
                      "completions_per_step": args.prompts * args.generations, "new_tokens": args.new_tokens,
                      "ours_tp2_rollout_tokens_per_s": round(ours, 1), "hf_generate_one_process_tokens_per_s":
                      round(hf, 1), "ratio_ours_vs_hf": round(ours / hf, 3),
                      "ours_tp1_one_process_tokens_per_s": round(tp1, 1), "ratio_ours_tp1_vs_hf": round(tp1 / hf, 3),
                      "generation_share_of_step": round(share, 3)}))


if __name__ == "__main__":
    main()
