"""Generation from a checkpoint through the one setup path: a config made from the checkpoint's metadata ->
preflight (tokenizer, checkpoint and files checked) -> process groups -> model with the checkpoint's weights.

The weights are read per (layer, TP rank) as for fine-tuning, so a checkpoint of any PP decodes as one stage, or
over any number of stages (``pipeline``: the stages run one after another, model/staged_inference.py), an MoE
model's experts over ``expert`` ranks; every process is one rank of that layout, and a world of several such
layouts holds replicas of the model (the lm-eval backend gives each a share of the requests; ``generate`` runs every
prompt on each). A LoRA checkpoint decodes with its adapters on the base it records (checked against the base's
fingerprint).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llama_megatron.checkpoint.directory import read_meta
from llama_megatron.errors import CheckpointError, ConfigError
from llama_megatron.model.generation import Sampling, generate
from llama_megatron.model.moe import pack_experts
from llama_megatron.model.staged_inference import StagedCausalLM
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.placement import placement
from llama_megatron.parallel.process_groups import end_process_groups
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.run.setup import (
    load_model,
    preflight,
    start_process_groups,
    verify_checkpoint_files,
)


@dataclass
class GenerationRequest:
    checkpoint: str
    prompts: list  # str (text) or a list of {role, content} messages
    tag: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    raw: bool = False
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    use_cache: bool = True
    kernels: str = "auto"
    dtype: str | None = None
    pipeline: int = 1  # pipeline stages to spread the layers over (any, whatever the checkpoint's PP)
    expert: int = 1  # expert-parallel ranks to spread an MoE model's experts over


def _tokenizer_dir(request: GenerationRequest) -> str:
    """``--tokenizer``, or the one a converted checkpoint carries (``hf_config/``): what is missing said first."""
    if request.tokenizer is not None:
        if not os.path.isdir(request.tokenizer):
            raise ConfigError(f"--tokenizer {request.tokenizer} is not a directory")
        return request.tokenizer
    if not os.path.isdir(request.checkpoint):
        raise CheckpointError(f"checkpoint directory not found: {request.checkpoint}")
    path = os.path.join(request.checkpoint, "hf_config")
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint {request.checkpoint} carries no tokenizer (no hf_config/, which converted "
                          "checkpoints have): pass --tokenizer DIR")
    return path


def generation_config(request: GenerationRequest, tokenizer_dir: str) -> TrainingConfig:
    """A run of the checkpoint's model at its TP over ``request.pipeline`` stages and ``request.expert`` expert
    ranks, its weights loaded for inference."""
    meta = read_meta(request.checkpoint, request.tag)
    world, ranks = placement().world_size, meta.tensor * request.pipeline * request.expert
    if world % ranks:
        raise ConfigError(f"checkpoint {request.checkpoint}/{meta.tag} is tensor parallel {meta.tensor}, read over "
                          f"{request.pipeline} pipeline stage(s) and {request.expert} expert rank(s): run with {ranks} "
                          f"process(es) (deepspeed --num_gpus {ranks}) or a multiple of it, not {world}")
    data = world // (meta.tensor * request.pipeline)  # replicas x expert ranks
    adapters = meta.adapters()
    return TrainingConfig.from_dict({
        "model": meta.model,
        # an adapter checkpoint: its base (recorded in it) is read first, then the adapters
        **({"lora": dataclasses.asdict(adapters)} if adapters else {}),
        "parallel": {"tensor": meta.tensor, "pipeline": request.pipeline, "expert": request.expert,
                     # reproduces the checkpoint's padded vocab: padded / TP rows per rank
                     "make_vocab_size_divisible_by": meta.padded_vocab_size // meta.tensor},
        "data": {"type": "synthetic"},
        # replicas and expert ranks are data-parallel ranks of the layout: a (never drawn) batch of one row each
        "batch": {"micro_batch_size": 1, "global_batch_size": data},
        "tokenizer": tokenizer_dir,
        "checkpoint": {"load": request.checkpoint, "tag": meta.tag, "finetune": True},
        "kernels": request.kernels,
        "output_dir": os.path.join(request.checkpoint, "generate"),
    })


def stop_ids(config: TrainingConfig, tokenizer, tokenizer_dir: str) -> set[int]:
    """EOS of the model config, of the tokenizer and of generation_config.json (LLaMA-3's end of turn)."""
    ids = set()
    sources = [config.model.eos_token_id, tokenizer.eos_token_id]
    generation_file = os.path.join(tokenizer_dir, "generation_config.json")
    if os.path.isfile(generation_file):
        with open(generation_file, encoding="utf-8") as fh:
            sources.append(json.load(fh).get("eos_token_id"))
    for source in sources:
        ids.update(source if isinstance(source, list) else [] if source is None else [source])
    return ids


def _encode(request: GenerationRequest, prompt, encoder, tokenizer) -> list[int]:
    if request.raw:
        if not isinstance(prompt, str):
            raise ConfigError("--raw takes text prompts, not messages")
        return tokenizer(prompt)["input_ids"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = encoder.render(messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class InferenceModel:
    """A checkpoint's model loaded on this rank for inference, with what decoding it needs."""

    config: TrainingConfig
    pctx: ParallelContext
    model: torch.nn.Module
    tokenizer_dir: str
    tokenizer: object

    @property
    def stop_ids(self) -> set[int]:
        return stop_ids(self.config, self.tokenizer, self.tokenizer_dir)


def open_checkpoint(request: GenerationRequest, before_groups: Callable[[TrainingConfig, object], None] | None = None,
                    ) -> InferenceModel:
    """The setup path up to the weights: config from the checkpoint, preflight, the tokenizer, then (after
    ``before_groups(config, tokenizer)``, the caller's checks that need no process group) process groups, the
    checksums and the model at ``request.dtype`` (bf16 on CUDA, else fp32) in eval mode."""
    from deepspeed.accelerator import get_accelerator

    from llama_megatron.data.sft.chat_template import load_hf_tokenizer

    tokenizer_dir = _tokenizer_dir(request)
    config = generation_config(request, tokenizer_dir)
    pre = preflight(config, mode="generate")
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    if before_groups is not None:
        before_groups(config, tokenizer)
    pctx = start_process_groups(pre)
    pre = verify_checkpoint_files(pre, pctx, None)
    device = torch.device(get_accelerator().current_device_name())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[request.dtype or ("bf16" if device.type == "cuda"
                                                                               else "fp32")]
    model = load_model(pre, pctx).to(device=device, dtype=dtype).eval()
    pack_experts(model)  # the move copied each expert's parameters apart: grouped experts read them as one again
    if pctx.pp_size > 1:
        model = StagedCausalLM(model, config.model, pctx, config.parallel.local_shapes(config.model))
    return InferenceModel(config, pctx, model, tokenizer_dir, tokenizer)


def run_generation(request: GenerationRequest) -> list[dict] | None:
    """Completions of every prompt (on global rank 0; None on the others)."""
    from llama_megatron.data.sft.chat_template import ChatEncoder

    prompts: list[list[int]] = []
    budgets: list[int] = []

    def encode_prompts(config: TrainingConfig, tokenizer) -> None:  # bad prompts fail before any process group
        encoder = None if request.raw else ChatEncoder(config.tokenizer, request.chat_template)
        prompts.extend(_encode(request, p, encoder, tokenizer) for p in request.prompts)
        budgets.extend(_new_token_budgets(prompts, request.max_new_tokens, config.model.max_position_embeddings))

    loaded = open_checkpoint(request, encode_prompts)
    pctx, model, tokenizer = loaded.pctx, loaded.model, loaded.tokenizer
    sampling = Sampling(request.temperature, request.top_k, request.top_p, request.seed)
    stop = loaded.stop_ids
    results = []
    for prompt, ids, budget in zip(request.prompts, prompts, budgets):
        new = generate(model, ids, budget, stop, sampling, request.use_cache)
        text = tokenizer.decode([t for t in new if t not in stop], skip_special_tokens=True).strip()
        results.append({"prompt": prompt, "completion": text, "prompt_tokens": len(ids), "tokens": new})
    end_process_groups()
    return results if pctx.rank == 0 else None


def _new_token_budgets(prompts: list[list[int]], max_new_tokens: int, context: int) -> list[int]:
    """``max_new_tokens`` per prompt, capped so prompt and completion fit the model's context (positions past it
    were never trained, and RoPE scaling, if any, is defined up to it); a prompt that fills the context already is
    refused before any process group starts."""
    budgets = []
    for number, ids in enumerate(prompts, start=1):
        room = context - len(ids)
        if room < 1:
            raise ConfigError(f"prompt {number} has {len(ids)} tokens: nothing fits after it in the model's context "
                              f"of {context} (max_position_embeddings)")
        if room < max_new_tokens and int(os.environ.get("RANK", "0")) == 0:
            print(f"note: prompt {number}: --max-new-tokens {max_new_tokens} capped to {room} (context {context}, "
                  f"prompt {len(ids)} tokens)", file=sys.stderr, flush=True)
        budgets.append(min(room, max_new_tokens))
    return budgets
