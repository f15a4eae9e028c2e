"""Tiny configs and HF twins shared by the model tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from transformers import PreTrainedModel

from llama_megatron.config import ModelConfig
from llama_megatron.model import released_tensors
from llama_megatron.model.param_layout import ParamLayout
from llama_megatron.model.tp_slicing import merge_shards
from llama_megatron.parallel.context import ParallelContext

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=8, max_position_embeddings=64, rms_norm_eps=1e-5)
    base.update(overrides)
    return ModelConfig(**base)


def hf_config(config: ModelConfig, **extra) -> transformers.PretrainedConfig:
    """The family's transformers config class (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config) for ``config``."""
    return transformers.CONFIG_MAPPING[config.family.hf_type](**config.to_hf_dict(), **extra)


def hf_class(config: ModelConfig) -> type[PreTrainedModel]:
    """The transformers class of the family (LlamaForCausalLM, MistralForCausalLM, ...)."""
    return getattr(transformers, config.family.architecture)


def hf_model(config: ModelConfig, seed: int = 0) -> PreTrainedModel:
    """A random HF model of the family with non-trivial norms and biases, identical in every process for the same
    seed."""
    torch.manual_seed(seed)
    model = hf_class(config)(hf_config(config, attn_implementation="sdpa")).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: a buffer, moved by loads
                buffer.copy_(0.05 * torch.randn_like(buffer))
    return model


def to_transformers(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of ``param_layout.as_checkpoint_tensors``: checkpoint-named tensors as a transformers 5 model's state
    dict (an MoE layer's experts stacked into its fused 3-D tensors, the router as ``mlp.gate``)."""
    family = config.family.moe
    if released_tensors.differs(config) and (family is None or family.fused_expert_files):
        # Llama 4: its files' layout is its class's (model/released_tensors.py)
        shapes = released_tensors.file_shapes(ParamLayout(config).hf_shapes(), config)
        out = {name: released_tensors.file_tensor(name, tensors.__getitem__, config) for name in shapes
               if name in tensors or name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        return out | {name: t for name, t in tensors.items() if name not in ParamLayout(config).hf_shapes()}
    if family is None:
        return tensors
    gate, up, down = family.leaves
    out = dict(tensors)
    if released_tensors.differs(config):  # DeepSeek-V3: its rotated q/k rows interleaved again, as HF holds them
        out = {name: released_tensors.file_tensor(name, tensors.__getitem__, config) for name in out}
    for i in filter(config.is_moe_layer, range(config.num_hidden_layers)):
        moe, mlp = f"model.layers.{i}.{family.block}", f"model.layers.{i}.mlp"
        experts = range(config.num_local_experts)
        out[f"{mlp}.gate.weight"] = out.pop(f"{moe}.gate.weight")
        out[f"{mlp}.experts.gate_up_proj"] = torch.stack([
            torch.cat([out.pop(f"{moe}.experts.{e}.{gate}.weight"), out.pop(f"{moe}.experts.{e}.{up}.weight")])
            for e in experts])
        out[f"{mlp}.experts.down_proj"] = torch.stack([out.pop(f"{moe}.experts.{e}.{down}.weight") for e in experts])
    return out


def gather_shards(t: torch.Tensor, pctx: ParallelContext) -> list[torch.Tensor]:
    if pctx.tp_size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(pctx.tp_size)]
    dist.all_gather(out, t.contiguous(), group=pctx.tp_group)
    return out


def assert_grads_match_hf(model: torch.nn.Module, hf: PreTrainedModel, config: ModelConfig, pctx: ParallelContext,
                          **tol) -> None:
    """Every parameter gradient of ``model`` (TP shards gathered and merged as export merges them) equals HF's."""
    params = dict(model.named_parameters())
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    if config.tie_word_embeddings:
        hf_grads["model.embed_tokens.weight"] = hf.model.embed_tokens.weight.grad
    for spec in ParamLayout(config):
        shards = gather_shards(params[spec.module_name].grad, pctx)
        if spec.split == "vocab":
            assert not torch.cat(shards)[config.vocab_size:].any(), "padded vocab rows got gradient"
        for hf_name, merged in merge_shards(spec, shards, config).items():
            torch.testing.assert_close(merged, hf_grads[hf_name], **tol, msg=lambda m, n=hf_name: f"{n}: {m}")


def recording_losses(trainer_class: type, step_losses: list[float]) -> type:
    """``trainer_class`` (a TRL trainer) appending each loss its ``compute_loss`` returns to ``step_losses``."""

    class Recording(trainer_class):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            step_losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
            return loss

    return Recording


def peft_twin(hf_dir, config, lora_section: dict):
    """PEFT's LoRA on the HF model in ``hf_dir``, its adapters the ones our run of ``config`` draws with the ``lora``
    section ``lora_section`` (A seeded per name, B zero): TRL + PEFT's start."""
    import peft
    from transformers import AutoModelForCausalLM

    from llama_megatron.model.init import initial_hf_tensor
    from llama_megatron.model.lora_layout import LoraConfig, adapter_layout

    lora = LoraConfig(rank=lora_section["rank"], alpha=lora_section["alpha"], targets=tuple(lora_section["targets"]))
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                                                target_modules=list(lora.module_targets)))
    tensors = {spec.hf_names[0]: initial_hf_tensor(spec.hf_names[0], spec.hf_shapes[0], spec.init,
                                                   config.model.initializer_range, config.seed)
               for spec in adapter_layout(config.model, lora)}
    result = peft.set_peft_model_state_dict(model, tensors)
    assert not result.unexpected_keys
    return model


def save_and_convert(model: PreTrainedModel, out_dir, tokenizer_dir: str, tps=(1,), divisible_by: int | None = None):
    """``model`` saved as a Hugging Face directory ``out_dir/hf`` beside the tokenizer's files, converted to our
    format at each TP degree of ``tps`` (``out_dir/tp<N>``); the HF directory."""
    import os
    import shutil

    from llama_megatron.cli import main as cli_main

    hf_dir = os.path.join(str(out_dir), "hf")
    model.save_pretrained(hf_dir)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(hf_dir, name))
    for tp in tps:
        divisible = [] if divisible_by is None else ["--make-vocab-size-divisible-by", str(divisible_by)]
        assert cli_main(["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--output",
                         os.path.join(str(out_dir), f"tp{tp}"), "--tp", str(tp), *divisible]) == 0
    return hf_dir
