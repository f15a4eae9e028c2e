"""``llama-megatron generate``: text from a checkpoint, with the chat template's generation prompt.

    llama-megatron generate --checkpoint ckpt/tiny --prompt "What is 2 + 3?"
    deepspeed --num_gpus 2 --module llama_megatron generate --checkpoint ckpt/tp2 --prompts prompts.jsonl
    llama-megatron generate --checkpoint DIR --prompt "Once upon" --raw --temperature 0.8 --top-p 0.9

One process per TP rank of the checkpoint (any PP: the weights are read per layer). Greedy unless
``--temperature`` > 0. A prompt file is JSONL: ``{"prompt": "..."}`` or ``{"messages": [{"role", "content"}]}``
per line. The tokenizer is ``--tokenizer`` or the one a converted checkpoint carries (``hf_config/``); its chat
template (or ``--chat-template``) renders the prompt unless ``--raw``.
"""

from __future__ import annotations

import argparse
import json
import os

from llama_megatron.errors import ConfigError


def add_model_arguments(parser) -> None:
    """How a checkpoint's model runs for inference (``generate`` and ``evaluate --tasks``): its kernels, its dtype,
    and over how many pipeline stages and expert ranks it is spread (processes: the checkpoint's TP x both)."""
    parser.add_argument("--kernels", default="auto", help="auto | reference | compiled | liger")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--pipeline", type=int, default=1, metavar="P",
                        help="spread the layers over P pipeline stages, run one after another (default 1)")
    parser.add_argument("--expert", type=int, default=1, metavar="E",
                        help="spread an MoE model's experts over E expert-parallel ranks (default 1)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (converted or trained)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer directory (default: CHECKPOINT/hf_config)")
    parser.add_argument("--chat-template", default=None, help="Jinja chat template (default: the tokenizer's)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument("--prompts", help="JSONL file of prompts")
    parser.add_argument("--raw", action="store_true", help="no chat template: the prompt text as is (with BOS)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set with this mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    add_model_arguments(parser)
    parser.add_argument("--output", default=None, help="also write the completions as JSONL here")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def _prompts(args: argparse.Namespace) -> list:
    if args.prompt:
        return list(args.prompt)
    if not os.path.isfile(args.prompts):
        raise ConfigError(f"prompt file {args.prompts} not found")
    out = []
    with open(args.prompts, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{args.prompts}:{number}: not JSON ({exc.msg})") from None
            if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                out.append(record["prompt"])
            elif isinstance(record, dict) and isinstance(record.get("messages"), list):
                out.append(record["messages"])
            else:
                raise ConfigError(f"{args.prompts}:{number}: expected {{\"prompt\": str}} or {{\"messages\": [...]}}")
    return out


def run(args: argparse.Namespace) -> int:
    from llama_megatron.parallel.placement import adopt_launcher_env
    from llama_megatron.training.run.generate import GenerationRequest, run_generation

    for name in ("max_new_tokens",):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ConfigError("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0")
    if args.output:  # before anything is generated
        parent = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(parent):
            raise ConfigError(f"--output {args.output}: directory {parent} does not exist")
        if os.path.lexists(args.output) and not args.overwrite:
            raise ConfigError(f"--output {args.output} exists (pass --overwrite to replace it)")
    adopt_launcher_env()
    request = GenerationRequest(
        checkpoint=args.checkpoint, tag=args.tag, tokenizer=args.tokenizer, chat_template=args.chat_template,
        prompts=_prompts(args), raw=args.raw, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, use_cache=not args.no_kv_cache, kernels=args.kernels,
        dtype=args.dtype, pipeline=args.pipeline, expert=args.expert)
    results = run_generation(request)
    if results is not None:  # rank 0
        for result in results:
            print(json.dumps(result, ensure_ascii=False), flush=True)
        if args.output:
            from llama_megatron.checkpoint.atomic import write_text_atomic

            write_text_atomic(args.output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    return 0
