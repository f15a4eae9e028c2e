"""lm-evaluation-harness log-likelihood requests per second: ours at TP2 on 2 processes (the checkpoint where it
lives) against lm-eval's HF backend on the exported model in one process with the same cores, the same task.

A random model of llama-50m's shape (the shipped tokenizer's 4,096-token vocabulary) is saved as HF and converted to
TP2; ``shakespeare_next_line`` (4 log-likelihood requests a document) runs with ``--limit`` documents and
``--batch-size`` on both sides; each side's time is the evaluation alone (model loading left out), and the
requests' log-likelihoods are checked to agree. One JSON line.

    python benchmarks/lm_eval_throughput.py [--limit 100] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "tokenizer")
TASK = "shakespeare_next_line"


def _timed(lm, limit: int) -> tuple[float, list[float]]:
    from llama_megatron.training.run.lm_harness import evaluate_tasks

    start = time.perf_counter()
    results = evaluate_tasks(lm, [TASK], limit, 0, log_samples=True)
    seconds = time.perf_counter() - start
    if results is None:
        return seconds, []
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return seconds, [r[0][0] for s in samples for r in s["resps"]]


def worker(checkpoint: str, limit: int, batch_size: int, out: str) -> None:
    """One rank of the TP2 side (under the deepspeed launcher): rank 0 writes its time and log-likelihoods."""
    from llama_megatron.training.run.lm_harness import LlamaMegatronLM

    lm = LlamaMegatronLM(checkpoint=checkpoint, batch_size=batch_size)
    seconds, logprobs = _timed(lm, limit)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump({"seconds": seconds, "logprobs": logprobs}, fh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=100, help="documents (4 requests each; default 100)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--worker", nargs=2, metavar=("CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.limit, args.batch_size, args.worker[1])
        return
    import torch
    from lm_eval.models.huggingface import HFLM

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from model_utils import hf_model, save_and_convert

    from llama_megatron.config import ModelConfig

    with open(os.path.join(ROOT, "configs", "models", "llama-50m.json"), encoding="utf-8") as fh:
        shape = {**json.load(fh), "vocab_size": 4096, "max_position_embeddings": 512}
    with tempfile.TemporaryDirectory() as work:
        hf_dir = save_and_convert(hf_model(ModelConfig.from_dict(shape), seed=0), work, TOKENIZER, (2,))
        checkpoint = os.path.join(work, "tp2")
        from llama_megatron.parallel.placement import free_port

        out = os.path.join(work, "ours.json")
        result = subprocess.run([os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2",
                                 "--master_port", str(free_port()), "--log_level", "warning", os.path.abspath(__file__),
                                 "--limit", str(args.limit), "--batch-size", str(args.batch_size), "--worker",
                                 checkpoint, out],
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"the TP2 side failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
        with open(out, encoding="utf-8") as fh:
            ours = json.load(fh)
        torch.set_num_threads(2)  # the two cores the two ranks had
        hf_seconds, hf_logprobs = _timed(HFLM(pretrained=hf_dir, device="cpu", dtype="float32",
                                              batch_size=args.batch_size), args.limit)
    requests = len(hf_logprobs)
    worst = max(abs(a - b) for a, b in zip(ours["logprobs"], hf_logprobs, strict=True))
    print(json.dumps({"benchmark": "lm_eval_throughput", "task": TASK, "requests": requests,
                      "batch_size": args.batch_size, "model": "llama-50m shape, vocab 4096, fp32",
                      "ours_tp2_requests_per_s": round(requests / ours["seconds"], 2),
                      "hf_one_process_requests_per_s": round(requests / hf_seconds, 2),
                      "ratio_ours_vs_hf": round(hf_seconds / ours["seconds"], 3),
                      "max_logprob_difference": worst}))


if __name__ == "__main__":
    main()
