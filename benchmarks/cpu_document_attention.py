"""Packed-document attention on CPU, inference (no grad): our fast path vs FlexAttention, eager and compiled.

Why the CPU fast path takes SDPA with a dense document mask and never FlexAttention: eager ``flex_attention``
(CPU has no FlexAttention backward, so inference is its only use here) is several times slower, and the
compiled one returned wrong values on AVX2-only CPUs with torch 2.13. One JSON line per sequence length: time
of each variant, ratios against ours, and each variant's largest absolute difference from the reference
attention (HF's path: K/V repeated, dense mask).

    python benchmarks/cpu_document_attention.py                    # seq 264, 1024, 2048; 16 heads, 4 KV heads
    python benchmarks/cpu_document_attention.py --lengths 512 --no-compiled

Then, unless ``--check-lengths ""``, the same at small shapes (4 heads, 2 KV heads, head_dim 8) where compiled
FlexAttention returned wrong values or NaN on an AVX2-only AMD EPYC (sequence lengths of 8 mod 16).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llama_megatron.model.kernels.attention import (  # noqa: E402
    FastAttention,
    ReferenceAttention,
    document_block_mask,
)


def _mean_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return round((time.perf_counter() - start) / repeats * 1e3, 3)


def bench(seq: int, args) -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, seq, n, args.head_dim, generator=gen)
               for n in (args.heads, args.kv_heads, args.kv_heads))
    # documents of doc_len tokens, the last row shifted so boundaries differ between rows
    segments = torch.stack([(torch.arange(seq) + row * args.doc_len // 3) // args.doc_len
                            for row in range(args.batch)])
    block_mask = document_block_mask(segments)

    def flex_with(fn):
        return lambda: fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                          enable_gqa=True).transpose(1, 2)

    variants = {"ours_fast": lambda: FastAttention()(q, k, v, segments), "flex_eager": flex_with(flex_attention)}
    if not args.no_compiled:
        variants["flex_compiled"] = flex_with(torch.compile(flex_attention, dynamic=False))
    result: dict = {"benchmark": "cpu_document_attention", "seq": seq, "batch": args.batch, "heads": args.heads,
                    "kv_heads": args.kv_heads, "head_dim": args.head_dim, "doc_len": args.doc_len,
                    "threads": torch.get_num_threads()}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is the slow path
        want = ReferenceAttention()(q, k, v, segments)
        for label, fn in variants.items():
            got = fn()
            result[label] = {"ms": _mean_ms(fn, args.repeats),
                             "max_abs_error": float((got - want).abs().nan_to_num(float("inf")).max())}
    for label in variants:
        if label != "ours_fast":
            result[f"{label}_time_vs_ours"] = round(result[label]["ms"] / result["ours_fast"]["ms"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="264,1024,2048", help="comma-separated sequence lengths")
    parser.add_argument("--check-lengths", default="24,56", help="small-shape lengths (head_dim 8); empty: none")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--doc-len", type=int, default=200, help="tokens per packed document")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compiled", action="store_true", help="skip compiled FlexAttention (saves its compile)")
    args = parser.parse_args()
    for seq in (int(n) for n in args.lengths.split(",") if n):
        print(json.dumps(bench(seq, args)), flush=True)
    small = copy.copy(args)
    small.heads, small.kv_heads, small.head_dim, small.doc_len = 4, 2, 8, 7
    for seq in (int(n) for n in args.check_lengths.split(",") if n):
        print(json.dumps(bench(seq, small)), flush=True)


if __name__ == "__main__":
    main()
