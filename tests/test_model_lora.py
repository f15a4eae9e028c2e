"""LoRA on the tensor-parallel linears, against PEFT on transformers.LlamaForCausalLM (fp32, real gloo groups).

- Model: logits, loss and every adapter gradient equal PEFT's on the same base and adapter weights (TP 1/2, sequence
  parallelism on and off, dropout masks included); adapters start at the base model, alike at every TP degree.
- Engines (in process): only adapters train, the base stays bit-identical, ZeRO 0-3 and TP2 give TP1's adapters.
- Whole runs (launcher, from a converted base): TP2 layouts reproduce TP1's losses, resume is exact, the exported
  PEFT adapter loads in PEFT and gives our loss, the merged export gives PEFT's logits.
- Bad input: one line, exit code 2, nothing written.
"""

from __future__ import annotations

import json
import os
import re

import peft
import pytest
import torch
from dist_utils import run_distributed
from launch_utils import PRETRAIN_CONFIG, ROOT, assert_losses_close, launch_many, losses, train_args
from model_utils import gather_shards, hf_model, tiny_config

from llama_megatron.checkpoint.manifest import write_manifest_for
from llama_megatron.cli import main as cli_main
from llama_megatron.model.build import build_model
from llama_megatron.model.lora_layout import (
    EXPERT_TARGETS,
    LORA_TARGETS,
    LoraConfig,
    adapter_layout,
    from_peft,
    is_adapter_parameter,
    peft_target_parameters,
    saved_module_specs,
    ties_embeddings,
    to_peft,
    trained_module_names,
)
from llama_megatron.model.param_layout import as_checkpoint_tensors
from llama_megatron.model.tp_slicing import hf_to_rank_state_dict, merge_shards, shard_for_rank
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import ParallelConfig
from llama_megatron.training.engine.optimizer import parameter_groups

CONFIG = PRETRAIN_CONFIG

LOGITS_ATOL = 1e-4
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
CASES = {
    "gqa-all-targets": (dict(num_key_value_heads=4), LoraConfig(rank=4, alpha=8.0)),
    "bias-some-targets-dropout": (dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True),
                                  LoraConfig(rank=3, alpha=5.0, dropout=0.25, targets=("v_proj", "q_proj",
                                                                                       "down_proj", "up_proj"))),
    "tied-mlp-only": (dict(tie_word_embeddings=True, vocab_size=250), LoraConfig(rank=2, alpha=2.0, dropout=0.1,
                                                                                 targets=("gate_proj", "o_proj"))),
    # the families (PEFT on Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM)
    "qwen2-windows-dropout": (dict(model_type="qwen2", num_key_value_heads=2, use_sliding_window=True,
                                   sliding_window=5, max_window_layers=1), LoraConfig(rank=4, alpha=8.0, dropout=0.1)),
    "qwen3-qk-norm": (dict(model_type="qwen3", num_key_value_heads=4, head_dim=12),
                      LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "k_proj", "o_proj"))),
    "mistral-window": (dict(model_type="mistral", num_key_value_heads=2, sliding_window=5),
                       LoraConfig(rank=2, alpha=4.0)),
    # attention adapters on a mixture of experts (PEFT on MixtralForCausalLM, its aux loss in the loss)
    "mixtral-attention": (dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                               output_router_logits=True, router_aux_loss_coef=0.02),
                          LoraConfig(rank=2, alpha=4.0, dropout=0.1, targets=("q_proj", "v_proj", "o_proj"))),
    # and on its experts (PEFT's target_parameters: both parameters, PEFT's nested wrappers, or one)
    "mixtral-experts": (dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             output_router_logits=True, router_aux_loss_coef=0.02),
                        LoraConfig(rank=2, alpha=4.0, targets=("q_proj", *EXPERT_TARGETS))),
    "mixtral-down-experts": (dict(model_type="mixtral", num_key_value_heads=4, num_local_experts=4,
                                  num_experts_per_tok=3, tie_word_embeddings=True),
                             LoraConfig(rank=3, alpha=5.0, targets=("o_proj", "mlp.experts.down_proj"))),
    # Qwen's experts (the dense layer 0 has none), and Qwen2-MoE's beside the MLP targets, which PEFT finds by name
    # on its shared expert and on the dense layer 1 (Qwen3-MoE's it maps onto the experts: refused, test_model_moe.py)
    "qwen3-moe-experts": (dict(model_type="qwen3_moe", num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                               mlp_only_layers=[0], output_router_logits=True, router_aux_loss_coef=0.02),
                          LoraConfig(rank=2, alpha=4.0, targets=("k_proj", *EXPERT_TARGETS))),
    "qwen2-moe-experts": (dict(model_type="qwen2_moe", attention_bias=True, num_key_value_heads=2,
                               num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48, mlp_only_layers=[1], output_router_logits=True,
                               router_aux_loss_coef=0.02),
                          LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "up_proj", "down_proj",
                                                                 "mlp.experts.gate_up_proj"))),
    # dropout on the shared expert's adapters (and the attention's), PEFT's masks in its order of modules
    "qwen2-moe-shared-dropout": (dict(model_type="qwen2_moe", num_key_value_heads=4, num_local_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48),
                                 LoraConfig(rank=3, alpha=6.0, dropout=0.2, targets=("o_proj", "gate_proj", "up_proj",
                                                                                     "down_proj"))),
    # Llama 4 (PEFT on Llama4ForCausalLM): q and k adapters on interleaved RoPE rows (their B permuted as the base
    # rows are), the shared expert's and the dense layers' MLP found by name under feed_forward, dropout
    "llama4-attention-shared-dense": (dict(model_type="llama4", num_key_value_heads=4, num_local_experts=4,
                                           num_experts_per_tok=1, interleave_moe_layer_step=2,
                                           intermediate_size_mlp=80, attention_chunk_size=6,
                                           no_rope_layer_interval=2, use_qk_norm=True, attn_temperature_tuning=True,
                                           floor_scale=4),
                                      LoraConfig(rank=2, alpha=4.0, dropout=0.1)),
    # and on its routed experts: PEFT adapts its [E, in, out] expert tensors as [E, out, in] (A on the outputs, B on
    # the inputs: ours transposed and swapped), both parameters (nested wrappers) beside the shared expert's MLP
    "llama4-experts": (dict(model_type="llama4", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1,
                            intermediate_size_mlp=80, attention_chunk_size=6, use_qk_norm=True),
                       LoraConfig(rank=3, alpha=6.0, targets=("k_proj", "down_proj", *EXPERT_TARGETS))),
    # modules trained in full beside the adapters (PEFT's modules_to_save): both vocab tables over a vocab the TP
    # degrees pad (250), and "norm", which PEFT matches as a suffix: every norm of the class
    "saved-tables-norms": (dict(num_key_value_heads=2, vocab_size=250),
                           LoraConfig(rank=2, alpha=4.0, dropout=0.1, targets=("q_proj", "down_proj"),
                                      modules_to_save=("lm_head", "embed_tokens", "norm"))),
    # a tied table trained as one (PEFT's ensure_weight_tying), the final norm alone
    "tied-saved-head": (dict(tie_word_embeddings=True, vocab_size=250),
                        LoraConfig(rank=2, alpha=2.0, targets=("v_proj", "o_proj"),
                                   modules_to_save=("lm_head", "model.norm"))),
    # Qwen3's per-head q/k norms (each TP rank holds a share of the heads) and the MLP's input norm
    "qwen3-saved-qk-norms": (dict(model_type="qwen3", num_key_value_heads=4, head_dim=12),
                             LoraConfig(rank=2, alpha=4.0, targets=("k_proj",),
                                        modules_to_save=("q_norm", "k_norm", "post_attention_layernorm"))),
    # an MoE model's embedding and per-layer norms beside its experts' adapters
    "mixtral-saved-embed": (dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4,
                                 num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02),
                            LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "mlp.experts.down_proj"),
                                       modules_to_save=("embed_tokens", "input_layernorm"))),
}


def peft_config(config, lora: LoraConfig) -> peft.LoraConfig:
    """PEFT's config of ``lora`` on the class of ``config``: a tied table trained as one (``ensure_weight_tying``)."""
    return peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.module_targets,
        target_parameters=peft_target_parameters(config, lora), modules_to_save=list(lora.modules_to_save) or None,
        ensure_weight_tying=ties_embeddings(config, lora))


def peft_model(config, lora: LoraConfig, seed: int = 0):
    """PEFT's LoRA on the HF twin, with random (non-zero) A and B so every path of the adapter is exercised, and
    the modules to save moved off the base (so the trained copy is what counts)."""
    model = peft.get_peft_model(hf_model(config), peft_config(config, lora))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
            elif ".modules_to_save." in name:
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def peft_state(model) -> dict[str, torch.Tensor]:
    return peft.get_peft_model_state_dict(model)


def peft_trainable(model, attribute: str = "grad") -> dict[str, torch.Tensor]:
    """The trainable tensors' ``attribute`` (grad) under the keys PEFT saves them with (adapter name stripped)."""
    return {re.sub(r"\.(modules_to_save\.)?default\.", ".", n): getattr(p, attribute)
            for n, p in model.named_parameters() if p.requires_grad}


def peft_base_state(model) -> dict[str, torch.Tensor]:
    """The base weights of a PEFT model under transformers' names (wrapped modules' ``base_layer`` removed, the
    modules to save as the base had them: their ``original_module``)."""
    state = {k.removeprefix("base_model.model."): v for k, v in model.state_dict().items()
             if "lora_" not in k and ".modules_to_save." not in k}
    return {re.sub(r"(\.base_layer|\.original_module)+\.", ".", k): v for k, v in state.items()}


def our_model(config, lora: LoraConfig, pctx: ParallelContext, hf_state: dict, adapters: dict):
    """Our model at ``pctx`` with the HF base weights and the PEFT adapters, sliced for this rank."""
    parallel = ParallelConfig(tensor=pctx.tp_size, sequence_parallel=pctx.sequence_parallel,
                              make_vocab_size_divisible_by=8)
    padded = parallel.padded_vocab_size(config.vocab_size)
    model = build_model(config, parallel, pctx, initialize=False, lora=lora)
    state = hf_to_rank_state_dict(as_checkpoint_tensors(hf_state, config), config, pctx.tp_rank, pctx.tp_size, padded)
    for spec in adapter_layout(config, lora):
        state[spec.module_name] = shard_for_rank(spec, adapters.__getitem__, config, pctx.tp_rank, pctx.tp_size,
                                                 padded)
    model.load_state_dict(state)
    return model


def check_peft_parity(overrides: dict, lora: LoraConfig, pctx: ParallelContext, seq: int = 16) -> None:
    config = tiny_config(**overrides)
    ref = peft_model(config, lora)
    model = our_model(config, lora, pctx, peft_base_state(ref), from_peft(peft_state(ref), config, lora))
    if pctx.tp_size == 1:  # what an export writes (the experts' per-expert rows fused back): PEFT's own tensors
        back = to_peft(from_peft(peft_state(ref), config, lora), config, lora)
        assert back.keys() == peft_state(ref).keys()
        assert all(torch.equal(back[k], v) for k, v in peft_state(ref).items())
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, config.vocab_size, (2, seq), generator=gen)
    labels = ids.clone()
    labels[0, 3:6] = -100
    next_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)  # HF's shift

    ref.eval()
    model.eval()
    with torch.no_grad():
        logits = model.full_logits(model(ids))
        assert (logits - ref(input_ids=ids).logits).abs().max().item() <= LOGITS_ATOL

    # training mode: dropout masks drawn from the same RNG state on both sides (and on every TP rank)
    ref.train()
    model.train()
    torch.manual_seed(11)
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    torch.manual_seed(11)
    loss = model(ids, labels=next_labels)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)

    ref_grads = from_peft(peft_trainable(ref), config, lora)
    params = dict(model.named_parameters())
    layout = adapter_layout(config, lora)
    trained = trained_module_names(config, lora)
    assert {s.module_name for s in layout} == trained
    saved = {s.module_name for s in saved_module_specs(config, lora)}
    assert saved == trained - {n for n in params if is_adapter_parameter(n)}
    assert len(saved) == sum(1 for n in peft_state(ref) if "lora_" not in n) - ties_embeddings(config, lora)
    for name, param in params.items():
        assert param.requires_grad == (name in trained), name
        if not param.requires_grad:
            assert param.grad is None, f"frozen {name} got a gradient"
    for spec in layout:
        shards = gather_shards(params[spec.module_name].grad, pctx)
        if spec.split == "replicated":  # every rank holds the whole (TP-summed) gradient
            for shard in shards[1:]:
                torch.testing.assert_close(shard, shards[0], rtol=0, atol=0)
        for key, merged in merge_shards(spec, shards, config).items():
            torch.testing.assert_close(merged, ref_grads[key], **GRAD_TOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_peft_parity_tp1(name: str) -> None:
    check_peft_parity(*CASES[name], ParallelContext.single())


# the Qwen MoE cases add nothing TP-specific to Mixtral's but the shared expert (tests/test_model_moe.py has both families
# at TP2 with SP): one of them, with SP only, keeps the launch short
TP1_ONLY, SP_ONLY = {"qwen3-moe-experts"}, {"qwen2-moe-experts", "qwen2-moe-shared-dropout", "llama4-experts"}


def _parity_worker(rank: int, world_size: int) -> None:
    for sp in (False, True):
        pctx = ParallelContext.build(tensor=world_size, sequence_parallel=sp)
        for name, (overrides, lora) in CASES.items():
            if name not in TP1_ONLY and (sp or name not in SP_ONLY):
                check_peft_parity(overrides, lora, pctx)


@pytest.mark.launched
def test_peft_parity_tensor_parallel() -> None:
    run_distributed(_parity_worker, 2)


@pytest.mark.parametrize("overrides, targets", [
    ({}, LORA_TARGETS),
    (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2), ("q_proj", "o_proj", *EXPERT_TARGETS)),
], ids=["llama", "mixtral-experts"])
def test_adapters_start_at_the_base_model_and_alike_at_every_tp(overrides: dict, targets: tuple[str, ...]) -> None:
    """B = 0: logits equal the base model's bit for bit; A is PEFT's kaiming-uniform, drawn whole per (seed, name)
    and sliced, so TP 2 and 4 hold exactly TP 1's adapters; each parameter's split is the adapter table's."""
    config = tiny_config(num_key_value_heads=4, num_hidden_layers=2, **overrides)
    lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
    parallel = ParallelConfig(make_vocab_size_divisible_by=8)
    base = build_model(config, parallel, ParallelContext.single(), seed=5)
    adapted = build_model(config, parallel, ParallelContext.single(), seed=5, lora=lora)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(base(ids), adapted(ids))
    layout = adapter_layout(config, lora)
    reference = {}
    for spec in layout:
        tensor = adapted.state_dict()[spec.module_name]
        reference.update(merge_shards(spec, [tensor], config))
        if spec.init == "zeros":
            assert not tensor.any()
        else:
            bound = 1 / spec.hf_shapes[0][1] ** 0.5  # kaiming_uniform(a=sqrt(5)) on [rank, in]
            assert tensor.abs().max() <= bound and tensor.std() > bound / 3
    for tp in (2, 4):
        states = []
        for rank in range(tp):
            pctx = ParallelContext(tp_size=tp, tp_rank=rank, world_size=tp, rank=rank)
            model = build_model(config, ParallelConfig(tensor=tp, make_vocab_size_divisible_by=8), pctx, seed=5,
                                lora=lora)
            params = dict(model.named_parameters())
            for spec in layout:
                assert params[spec.module_name].tp_split == spec.split, spec.module_name
            states.append(model.state_dict())
        for spec in layout:
            merged = merge_shards(spec, [s[spec.module_name] for s in states], config)
            for key, tensor in merged.items():
                assert torch.equal(tensor, reference[key]), f"tp={tp} {key}"


# --- through DeepSpeed's engines, in process: frozen base, adapter-only optimizer, ZeRO 0-3, TP1 == TP2 ---------

ENGINE_LORA = ('{"rank": 4, "alpha": 8, "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", '
               '"down_proj"], "modules_to_save": ["embed_tokens", "lm_head", "norm"]}')
ENGINE_RUNS = {  # name: (tensor, sequence_parallel, DeepSpeed config); DP = 2 / tensor, every DP rank the same data
    "tp1-zero0": (1, False, "ds_configs/zero0_fp32.json"),
    "tp2-sp-zero1": (2, True, "ds_configs/zero1_fp32.json"),
    "dp2-zero2": (1, False, "ds_configs/zero2_fp32.json"),
    "dp2-zero3": (1, False, "ds_configs/zero3_fp32.json"),
}
ENGINE_STEPS = 3


def _micro_batches(config, steps: int) -> list:
    """One random micro batch, every step (its loss must fall)."""
    import numpy as np

    from llama_megatron.data.batch import collate

    rng = np.random.default_rng(3)
    return [collate([{"tokens": rng.integers(0, config.model.vocab_size, config.seq_length + 1)}
                     for _ in range(config.batch.micro_batch_size)])] * steps


def _full_parameters(model, pctx) -> dict[str, torch.Tensor]:
    """Every parameter of this rank, gathered from its ZeRO-3 partitions when it has any."""
    import deepspeed

    params = dict(model.named_parameters())
    partitioned = [p for p in params.values() if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(partitioned):
        return {name: p.detach().clone() for name, p in params.items()}


def _engine_config(tp: int, sp: bool, world_size: int):
    from llama_megatron.training.config import TrainingConfig

    dp = world_size // tp
    return TrainingConfig.from_file(CONFIG, [
        'data={"type": "synthetic"}', f"lora={ENGINE_LORA}", f"parallel.tensor={tp}",
        f"parallel.sequence_parallel={str(sp).lower()}", "batch.micro_batch_size=2",
        f"batch.global_batch_size={2 * dp}", "optimizer.warmup_steps=0"])


def _engine_worker(rank: int, world_size: int, out_dir: str) -> None:
    from test_training_estimate import _measure

    from llama_megatron.parallel.process_groups import init_distributed
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config
    from llama_megatron.training.engine.training_engine import TrainingEngine

    init_distributed()
    results = {}
    for name, (tp, sp, ds) in ENGINE_RUNS.items():
        config = _engine_config(tp, sp, world_size)
        pctx = ParallelContext.build(tensor=tp, sequence_parallel=sp)
        model = build_model(config.model, config.parallel, pctx, seed=config.seed, lora=config.lora)
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        saved = {n: p.detach().clone() for n, p in model.named_parameters()
                 if p.requires_grad and not is_adapter_parameter(n)}
        batches = _micro_batches(config, ENGINE_STEPS)
        if name == "tp1-zero0":  # the base model's loss on the first batch, for step 1 of the adapted one
            plain = build_model(config.model, config.parallel, pctx, seed=config.seed)
            with torch.no_grad():
                results["base_loss"] = float(plain(batches[0].input_ids, batches[0].position_ids,
                                                   labels=batches[0].labels))
        trained = trained_module_names(config.model, config.lora)
        optimized = {id(p) for group in parameter_groups(model, 0.1) for p in group["params"]}
        assert optimized == {id(p) for n, p in model.named_parameters() if n in trained}
        engine = TrainingEngine(config, build_deepspeed_config(config, ds, world_size), pctx, model)
        losses = [float(engine.train_step([mb])) for mb in batches]
        states = _measure(engine)  # before gathering: ZeRO-3's gather and release drop its persistent parameters
        after = _full_parameters(model, pctx)
        changed = [n for n, t in base.items() if not torch.equal(after[n], t)]
        assert not changed, f"{name}: frozen base weights changed: {changed[:3]}"
        unmoved = [n for n, t in saved.items() if torch.equal(after[n], t)]
        assert not unmoved, f"{name}: modules to save did not train: {unmoved[:3]}"
        adapters = {}
        for spec in adapter_layout(config.model, config.lora):
            shards = gather_shards(after[spec.module_name], pctx)
            adapters.update(merge_shards(spec, shards, config.model))
        results[name] = {"losses": losses, "adapters": adapters, "states": states}
        del engine
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "engine.pt"))


@pytest.mark.launched
def test_engines_train_adapters_only_and_tp_does_not_change_them(tmp_path, monkeypatch) -> None:
    """ZeRO 0/1/2/3 and TP2 with SP, 3 AdamW steps, the vocab tables and norms trained in full beside the adapters:
    step 1's loss is the base model's, the frozen base is bit for bit the same after training, every run's adapters
    and trained modules equal the TP1 run's (1e-5), and `estimate` counts the parameter and optimizer bytes each
    engine holds (the trained modules' as the adapters': fp32 masters and Adam's moments, partitioned by ZeRO)."""
    from llama_megatron.training.diagnostics.memory_estimate import estimate
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config

    monkeypatch.chdir(ROOT)
    run_distributed(_engine_worker, 2, str(tmp_path))
    results = torch.load(tmp_path / "engine.pt", weights_only=True)
    reference = results["tp1-zero0"]
    assert reference["losses"][0] == results["base_loss"]
    assert reference["losses"][-1] < reference["losses"][0]
    assert all(v.any() for k, v in reference["adapters"].items() if "lora_B" in k), "B stayed zero"
    saved = [k for k in reference["adapters"] if "lora_" not in k]
    assert len(saved) == 2 + 2 * 4 + 1  # embed_tokens, lm_head, every norm ("norm" as PEFT matches it)
    for name, (tp, sp, ds) in ENGINE_RUNS.items():
        run = results[name]
        for got, want in zip(run["losses"], reference["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (name, run["losses"], reference["losses"])
        for key, want in reference["adapters"].items():
            torch.testing.assert_close(run["adapters"][key], want, rtol=0, atol=1e-5,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        config = _engine_config(tp, sp, 2)
        stage = estimate(config, build_deepspeed_config(config, ds, 2), 2).stages[0]
        assert (run["states"]["parameters"], run["states"]["optimizer"]) == (
            stage.parameters + stage.cpu_parameters, stage.optimizer + stage.cpu_optimizer), (name, run["states"])


@pytest.mark.parametrize("overrides", [
    ['lora={"rank": 4, "alpha": 8, "modules_to_save": ["lm_head", "norm"]}'],
    ['lora={"rank": 4, "alpha": 8, "targets": ["q_proj"], "modules_to_save": ["input_layernorm", "model.norm"]}'],
    ["model.tie_word_embeddings=true", 'lora={"rank": 4, "alpha": 8, "targets": ["q_proj"], "modules_to_save": ["lm_head"]}'],
    ["model.model_type=qwen3", "model.head_dim=24",
     'lora={"rank": 4, "alpha": 8, "targets": ["q_proj"], "modules_to_save": ["q_norm", "embed_tokens"]}'],
], ids=["head-norms", "some-norms", "tied-table", "qwen3-qk-norm-embed"])
def test_estimate_of_what_a_weight_pass_keeps_for_modules_to_save(overrides: list[str]) -> None:
    """ZB-H1's W passes keep, for the modules to save, what they keep in full training (the norms' weight
    gradients, the head's input and output gradient on the reference path): the estimate's bytes per micro batch
    are those the weight-gradient store holds after one B (the helpers of tests/test_training_estimate.py)."""
    from test_training_estimate import _config, _deferred_estimate, _measure_deferred

    config = _config(overrides)
    assert _measure_deferred(config, ParallelContext.single(), False) == _deferred_estimate(config, False) > 0


def test_estimate_counts_modules_to_save_as_trained() -> None:
    """At TP2 x PP2 (ZeRO-0, fp32: torch's AdamW on the parameters), training the tables and every norm beside the
    adapters adds their gradients (4 bytes an element) and Adam's two moments (8) per stage, and nothing to the
    parameters, which are held either way: the first stage the embedding's vocab shard and its layers' norms, the
    last the head's shard, its layers' norms and the final norm."""
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.diagnostics.memory_estimate import estimate
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config

    def stages(lora: dict) -> list:
        config = TrainingConfig.from_file(CONFIG, ['data={"type": "synthetic"}', "tokenizer=null", "parallel.tensor=2",
                                                   "parallel.pipeline=2", f"lora={json.dumps(lora)}"])
        return estimate(config, build_deepspeed_config(config, {"zero_optimization": {"stage": 0}}, 4), 4).stages

    lora = {"rank": 4, "alpha": 8}
    plain, saved = stages(lora), stages({**lora, "modules_to_save": ["embed_tokens", "lm_head", "norm"]})
    model = _engine_config(1, False, 1).model
    shard = 4224 // 2 * model.hidden_size  # the vocab padded to a multiple of 64 x TP, split over TP
    layer_norms = 2 * 2 * model.hidden_size  # two layers per stage, two norms each
    for stage, trained in ((0, shard + layer_norms), (1, shard + layer_norms + model.hidden_size)):
        assert saved[stage].parameters == plain[stage].parameters
        assert saved[stage].gradients - plain[stage].gradients == 4 * trained
        assert saved[stage].optimizer - plain[stage].optimizer == 8 * trained


# --- whole runs under the launcher: layouts agree, resume, export to PEFT and merged HF weights -------------------

# all seven targets, both vocab tables and every norm trained in full (PEFT's modules_to_save)
RUN_MODULES = ["embed_tokens", "lm_head", "norm"]
RUN_LORA = json.dumps({"rank": 4, "alpha": 8, "dropout": 0.0, "modules_to_save": RUN_MODULES})
DROPOUT_LORA = '{"rank": 4, "alpha": 8, "dropout": 0.2}'
# on a tied base: the one table of embedding and head trained (PEFT's ensure_weight_tying), the final norm and the
# MLPs' input norms
TIED_LORA = ('{"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"], '
             '"modules_to_save": ["lm_head", "model.norm", "post_attention_layernorm"]}')
TIED = "model.tie_word_embeddings=true"
RUN_STEPS = 10


@pytest.fixture(scope="module")
def data_prefix(shakespeare_prefix) -> str:
    return shakespeare_prefix


def _hf_base(config, out: str, seed: int) -> str:
    """A random HF LLaMA of the run's shape, saved as a HF directory would be released."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**config.to_hf_dict())).float().save_pretrained(out)
    return out


def _run_model(*overrides: str):
    from llama_megatron.training.config import TrainingConfig

    return TrainingConfig.from_file(CONFIG, ['data={"type": "synthetic"}', *overrides]).model


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    """The base model as HF weights, converted to TP1 and TP2 checkpoints, another model of the same shape, and the
    model with tied embeddings (TP1)."""
    out = tmp_path_factory.mktemp("bases")
    model = _run_model()
    paths = {"hf": _hf_base(model, str(out / "hf"), 0), "other-hf": _hf_base(model, str(out / "other-hf"), 1),
             "tied-hf": _hf_base(_run_model(TIED), str(out / "tied-hf"), 2)}
    for name, hf, tp in (("tp1", "hf", 1), ("tp2", "hf", 2), ("other", "other-hf", 1), ("tied", "tied-hf", 1)):
        paths[name] = str(out / name)
        assert cli_main(["convert", "hf-to-megatron", "--hf-dir", paths[hf], "--output", paths[name], "--tp",
                         str(tp), "--make-vocab-size-divisible-by", "64"]) == 0
    return paths


def _lora_run(prefix: str, out: str, base: str, *extra: str, lora: str = RUN_LORA) -> list[str]:
    return [f"data.prefix={prefix}", f"output_dir={out}", f"lora={lora}", f"checkpoint.load={base}",
            "checkpoint.finetune=true", f"checkpoint.save={out}/ckpt", f"train.steps={RUN_STEPS}", *extra]


LORA_LAYOUTS = {  # name: (the TP1 run it must equal, base, lora, overrides)
    # TP2 from the base converted at TP2
    "tp2-pp2-sp-recompute": ("tp1", "tp2", RUN_LORA, ["parallel.tensor=2", "parallel.pipeline=2",
                                                      "parallel.sequence_parallel=true",
                                                      "activation_checkpointing.interval=1", "checkpoint.interval=10"]),
    "tp2-dp2-sp-zero3": ("tp1", "tp2", RUN_LORA, ["parallel.tensor=2", "parallel.sequence_parallel=true",
                                                  "checkpoint.interval=10", "deepspeed_config=ds_configs/zero3_fp32.json",
                                                  "batch.micro_batch_size=1"]),
    # the tied table trained at both ends of the pipeline (DeepSpeed's tied-weight gradient sum), context parallel
    "tied-pp2-cp2-zero1": ("tied", "tied", TIED_LORA, [TIED, "parallel.pipeline=2", "parallel.context=2",
                                                       "checkpoint.interval=10",
                                                       "deepspeed_config=ds_configs/zero1_fp32.json"]),
}


@pytest.fixture(scope="module")
def lora_runs(data_prefix, bases, tmp_path_factory) -> dict[str, str]:
    """TP1 (checkpoints at 5 and 10, validation at 10), the TP1 run resumed from step 5, the same two TP1 runs with
    adapter dropout (no modules to save), TP1 on the tied base (validation at 10), and the layouts in one
    4-process launch."""
    work = tmp_path_factory.mktemp("lora-runs")
    dirs = {name: str(work / name) for name in ("tp1", "resumed", "dropout", "dropout-resumed", "tied",
                                                *LORA_LAYOUTS)}
    single = [_lora_run(data_prefix, dirs["tp1"], bases["tp1"], "checkpoint.interval=5", "eval.interval=10"),
              _lora_run(data_prefix, dirs["dropout"], bases["tp1"], "checkpoint.interval=5", lora=DROPOUT_LORA),
              _lora_run(data_prefix, dirs["tied"], bases["tied"], TIED, "checkpoint.interval=10", "eval.interval=10",
                        lora=TIED_LORA)]
    for run, resumed, lora in (("tp1", "resumed", RUN_LORA), ("dropout", "dropout-resumed", DROPOUT_LORA)):
        single.append([f"data.prefix={data_prefix}", f"output_dir={dirs[resumed]}", f"lora={lora}",
                       f"checkpoint.load={dirs[run]}/ckpt", "checkpoint.tag=global_step5", f"train.steps={RUN_STEPS}"])
    # one process runs them in order (the resumes after the runs they resume)
    launch_many(1, [train_args(CONFIG, overrides) for overrides in single], str(work / "single.json"))
    launch_many(4, [train_args(CONFIG, _lora_run(data_prefix, dirs[name], bases[base], *extra, lora=lora))
                    for name, (_, base, lora, extra) in LORA_LAYOUTS.items()], str(work / "runs.json"))
    return dirs


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_layouts_match_tp1(name, lora_runs) -> None:
    reference = losses(lora_runs[LORA_LAYOUTS[name][0]])
    assert reference[RUN_STEPS] < reference[1] - 0.05, "the adapters must learn"
    assert_losses_close(losses(lora_runs[name]), reference, 1e-5, range(1, RUN_STEPS + 1))


def test_lora_resume_with_dropout_is_exact(lora_runs) -> None:
    """Dropout masks come from each rank's RNG, which the checkpoint saves and the resume restores: the resumed run
    draws the masks the uninterrupted one drew (and dropout did change the run)."""
    uninterrupted = losses(lora_runs["dropout"])
    assert_losses_close(losses(lora_runs["dropout-resumed"]), uninterrupted, 1e-6, range(6, RUN_STEPS + 1))
    assert abs(uninterrupted[RUN_STEPS] - losses(lora_runs["tp1"])[RUN_STEPS]) > 1e-4
    assert os.path.isfile(os.path.join(lora_runs["dropout"], "ckpt", "global_step5", "rng_state_rank00000.pt"))


def test_lora_resume_is_exact(lora_runs) -> None:
    """Resume: the base from the path the adapter checkpoint records, then adapters, optimizer and LR state."""
    assert_losses_close(losses(lora_runs["resumed"]), losses(lora_runs["tp1"]), 1e-6, range(6, RUN_STEPS + 1))
    meta = json.load(open(os.path.join(lora_runs["tp1"], "ckpt", "global_step5", "llama_megatron.json")))
    assert meta["lora"]["rank"] == 4 and meta["lora"]["base"]["fingerprint"].startswith("sha256:")
    assert meta["lora"]["modules_to_save"] == RUN_MODULES


def _export(*args: str) -> int:
    return cli_main(["export", *args])


def _base_of(run: str) -> str:
    """The exported base (HF) that a run's adapters belong to."""
    return "tied-base" if run.startswith("tied") else "base"


@pytest.fixture(scope="module")
def exported(lora_runs, bases, tmp_path_factory) -> dict[str, str]:
    """PEFT adapters of every run, the bases exported to HF, and the TP2-PP2 and tied adapters merged into theirs."""
    out = tmp_path_factory.mktemp("exported")
    paths = {"base": str(out / "base"), "tied-base": str(out / "tied-base")}
    assert _export("--input", bases["tp2"], "--output", paths["base"]) == 0
    assert _export("--input", bases["tied"], "--output", paths["tied-base"]) == 0
    for name in ("tp1", "tied", *LORA_LAYOUTS):
        paths[name] = str(out / name)
        assert _export("--input", f"{lora_runs[name]}/ckpt", "--output", paths[name], "--base-model",
                       paths[_base_of(name)]) == 0
    for name in ("tp2-pp2-sp-recompute", "tied"):
        paths[f"{name}-merged"] = str(out / f"{name}-merged")
        assert _export("--input", f"{lora_runs[name]}/ckpt", "--output", paths[f"{name}-merged"], "--merge") == 0
    return paths


def test_exported_adapters_agree_across_layouts(exported) -> None:
    """TP2-PP2 (pipeline layer files), TP2-DP2 ZeRO-3 (fp32 partitions) and, on the tied base, PP2 x CP2 adapters
    and trained modules after 10 AdamW steps equal TP1's: each tensor within 1e-4 relative (observed <= 2.4e-5),
    adapter and norm elements within 5e-5 (observed <= 1.4e-5, norms <= 8.3e-7), the vocab tables' within 5e-4
    (observed 1.3e-4 at TP2, 6.0e-6 on the tied base). Adam divides by the gradient's own scale, so reduction-order
    noise grows over steps, most in the table rows of tokens seen once or twice, whose gradients are near Adam's
    eps; the 3-step engine test above holds 1e-5. The vocab tables are exported at the true vocab (the TP2 runs'
    padding stripped)."""
    from safetensors.torch import load_file

    references = {name: load_file(os.path.join(exported[name], "adapter_model.safetensors")) for name in ("tp1", "tied")}
    # 7 targets x 4 layers x (A, B); the tables, 2 norms x 4 layers and the final norm; on the tied base 3 targets,
    # the table under both of PEFT's keys, the final norm and one norm per layer
    assert (len(references["tp1"]), len(references["tied"])) == (4 * 7 * 2 + 2 + 2 * 4 + 1, 4 * 3 * 2 + 2 + 1 + 4)
    vocab = _run_model().vocab_size
    assert references["tp1"]["base_model.model.lm_head.weight"].shape[0] == vocab
    assert torch.equal(references["tied"]["base_model.model.lm_head.weight"],
                       references["tied"]["base_model.model.model.embed_tokens.weight"])
    for name, (ref_run, *_) in LORA_LAYOUTS.items():
        reference = references[ref_run]
        got = load_file(os.path.join(exported[name], "adapter_model.safetensors"))
        assert got.keys() == reference.keys()
        for key, tensor in reference.items():
            assert (got[key] - tensor).norm() <= 1e-4 * tensor.norm(), f"{name} {key}"
            table = tensor.shape[0] == vocab
            torch.testing.assert_close(got[key], tensor, rtol=0, atol=5e-4 if table else 5e-5,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")


def _validation_batches(prefix: str) -> list:
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.run.batches import build_datasets, step_batches

    config = TrainingConfig.from_file(CONFIG, [f"data.prefix={prefix}", f"train.steps={RUN_STEPS}", "eval.interval=10"])
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        _, valid_ds, _ = build_datasets(config)
    finally:
        os.chdir(cwd)
    return [mb for batch in step_batches(valid_ds, config, ParallelContext.single(), 0, 1) for mb in batch]


def _peft_loaded(base_dir: str, adapter_dir: str):
    """``PeftModel.from_pretrained`` of the adapter on the base, checked to hold exactly the adapter file's tensors:
    PEFT warns of missing LoRA keys only, so every adapter and module to save (a tied table under both of its
    names) is compared with the file, and every key of the file must have been used."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    model = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    loaded = {re.sub(r"\.(modules_to_save\.)?default\.", ".", n): p
              for n, p in model.named_parameters(remove_duplicate=False)
              if "lora_" in n or ".modules_to_save." in n}
    assert loaded.keys() == saved.keys()  # no missing, no unexpected keys
    for key, tensor in saved.items():
        assert torch.equal(loaded[key], tensor), key
    return model


@pytest.mark.parametrize("run, merged_run", [("tp1", "tp2-pp2-sp-recompute"), ("tied", "tied")])
def test_peft_loads_the_adapter_and_gives_our_loss(run, merged_run, exported, lora_runs, data_prefix, tmp_path) -> None:
    """The exported adapter holds the keys and config PEFT's own `save_pretrained` writes for these adapters and
    modules to save on the class (on the tied base with `ensure_weight_tying`), PEFT loads it on the exported base
    with no missing or unexpected keys, and its validation loss is the one our run logged at the last step (1e-4);
    the merged export (the trained modules' weights in place of the base's) gives PEFT's logits."""
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    base_dir, adapter_dir = exported[_base_of(run)], exported[run]
    config = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        "LORA", 4, 8, base_dir)
    lora = LoraConfig.from_dict(json.loads(TIED_LORA if run == "tied" else RUN_LORA))
    reference = peft.get_peft_model(LlamaForCausalLM.from_pretrained(base_dir),
                                    peft_config(_run_model(*[TIED] * (run == "tied")), lora))
    reference.save_pretrained(str(tmp_path / "peft"))
    want = json.load(open(tmp_path / "peft" / "adapter_config.json"))
    for key in ("modules_to_save", "ensure_weight_tying", "target_modules", "target_parameters", "r", "lora_alpha"):
        got = config[key]
        assert (sorted(got) if key == "target_modules" else got) == (
            sorted(want[key]) if key == "target_modules" else want[key]), key
    assert (load_file(os.path.join(adapter_dir, "adapter_model.safetensors")).keys()
            == load_file(tmp_path / "peft" / "adapter_model.safetensors").keys())
    model = _peft_loaded(base_dir, adapter_dir)

    records = [json.loads(line) for line in open(os.path.join(lora_runs[run], "metrics.jsonl"))]
    (ours,) = [r["val_loss"] for r in records if "val_loss" in r]
    batches = _validation_batches(data_prefix)
    with torch.no_grad():
        peft_losses = [F.cross_entropy(model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits.flatten(0, 1),
                                       mb.labels.flatten()).item() for mb in batches]
    assert abs(sum(peft_losses) / len(peft_losses) - ours) <= 1e-4 * ours

    adapted = _peft_loaded(base_dir, exported[merged_run])
    merged = LlamaForCausalLM.from_pretrained(exported[f"{merged_run}-merged"]).eval()
    with torch.no_grad():
        ids = batches[0].input_ids
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (got - want).abs().max().item() <= 1e-5


# --- bad input: one line, exit code 2, nothing written ------------------------------------------------------------

def _refused(capsys, argv: list[str], output: str, message: str) -> None:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err
    assert not os.path.exists(output), f"{output} was written"


@pytest.fixture
def in_repo(monkeypatch):
    """Commands run in process from the repo root (conftest undoes the single-process rendezvous they set up)."""
    monkeypatch.chdir(ROOT)


def _train(out: str, *overrides: str) -> list[str]:
    return ["train", "--config", CONFIG, "--set", 'data={"type": "synthetic"}', "--set", f"output_dir={out}",
            *[a for item in overrides for a in ("--set", item)]]


def test_lora_misconfigurations_are_refused(bases, tmp_path, capsys, in_repo) -> None:
    out = str(tmp_path / "run")
    base = [f"checkpoint.load={bases['tp1']}", "checkpoint.finetune=true"]
    for overrides, message in [
        (['lora={"targets": ["q_proj", "qkv_proj"]}', *base], "lora.targets: unknown target 'qkv_proj'"),
        (['lora={"rank": 0}', *base], "lora.rank must be an integer >= 1, got 0"),
        (['lora={"dropout": 1.0}', *base], "lora.dropout must lie in [0, 1)"),
        (['lora={"rank": 4, "alpah": 8}', *base], "unknown keys in 'lora': alpah"),
        (["lora={}"], "set checkpoint.load to the base checkpoint"),
        (["lora={}", f"checkpoint.save={tmp_path}/empty", "checkpoint.load=auto"],
         "checkpoint.save holds no checkpoint yet"),
        (["lora={}", f"checkpoint.load={bases['tp1']}"], "is a full model: a LoRA run starts from it with "
                                                         "checkpoint.finetune true"),
        (["lora={}", *base, "model.num_hidden_layers=2"], "holds a different model config"),
        (['lora={"modules_to_save": ["score"]}', *base],
         "lora.modules_to_save: 'score' is not a module trained beside the adapters here; names are PEFT's: "
         "embed_tokens, lm_head, norm, model.norm"),
        (['lora={"modules_to_save": "lm_head"}', *base], "lora.modules_to_save must be a list of module names"),
        (['lora={"modules_to_save": ["norm", "norm"]}', *base], "lora.modules_to_save names a module twice"),
        (['lora={"modules_to_save": ["lm_head", "q_norm"]}', *base],
         "lora.modules_to_save q_norm: the llama model has no such module; it has embed_tokens, lm_head, norm"),
    ]:
        _refused(capsys, _train(out, *overrides), out, message)


def test_final_norm_alone_at_pp2_zero1_is_refused(tmp_path, capsys, in_repo) -> None:
    """The final norm trained alone is a parameter group on the last stage only, on which DeepSpeed's ZeRO-1
    optimizer at PP > 1 would hang (it reduces each group's gradient norm across the stages): refused in one line;
    with the layers' norms every stage has the same groups, and ZeRO-0 and bf16 do not reduce per group."""
    def argv(lora: str, ds: str) -> list[str]:
        return ["estimate", "--config", CONFIG, "--world-size", "2", "--deepspeed-config", f"ds_configs/{ds}.json",
                "--set", 'data={"type": "synthetic"}', "--set", "parallel.pipeline=2", "--set", f"lora={lora}"]

    alone = '{"modules_to_save": ["lm_head", "model.norm"]}'
    _refused(capsys, argv(alone, "zero1_fp32"), str(tmp_path / "none"),
             "lora.modules_to_save trains the final norm (no weight decay: a parameter group of its own) on the last "
             "pipeline stage only, and ZeRO-1 at pipeline=2 needs the same parameter groups on every stage")
    for lora, ds in ((alone, "zero0_fp32"), (alone, "zero1_bf16"),
                     ('{"modules_to_save": ["model.norm", "input_layernorm"]}', "zero1_fp32")):
        assert cli_main(argv(lora, ds)) == 0, (lora, ds)


def _edited_lora_checkpoint(src: str, dst: str, **lora: object) -> str:
    """A copy of a LoRA checkpoint whose llama_megatron.json's lora section says ``lora`` (``base``: its path)."""
    import shutil

    shutil.copytree(src, dst)
    tag = open(os.path.join(dst, "latest")).read().strip()
    meta_path = os.path.join(dst, tag, "llama_megatron.json")
    meta = json.load(open(meta_path))
    for key, value in lora.items():
        if key == "base":
            meta["lora"]["base"]["path"] = value
        else:
            meta["lora"][key] = value
    with open(meta_path, "w") as fh:
        json.dump(meta, fh)
    # a checkpoint really trained so: its manifest matches its files
    write_manifest_for(os.path.dirname(meta_path))
    return dst


def test_adapter_checkpoint_misuse_is_refused(lora_runs, bases, tmp_path, capsys, in_repo) -> None:
    """Adapters on another base (swapped or missing), without their lora section, at another rank; export and
    reshard misuse."""
    ckpt = f"{lora_runs['tp1']}/ckpt"
    out = str(tmp_path / "out")
    swapped = _edited_lora_checkpoint(ckpt, str(tmp_path / "swapped"), base=bases["other"])
    missing = _edited_lora_checkpoint(ckpt, str(tmp_path / "missing"), base=str(tmp_path / "no-such-base"))
    # a record naming a module to save that the run did not train (its files hold the adapters only)
    unsaved = _edited_lora_checkpoint(f"{lora_runs['dropout']}/ckpt", str(tmp_path / "unsaved"),
                                      modules_to_save=["lm_head"])
    other_modules = json.dumps({**json.loads(RUN_LORA), "modules_to_save": ["lm_head"]})
    for overrides, message in [
        ([f"checkpoint.load={ckpt}"], "holds LoRA adapters only (rank 4"),
        ([f"checkpoint.load={ckpt}", 'lora={"rank": 8}'], "holds LoRA adapters of rank 4, alpha 8"),
        ([f"checkpoint.load={ckpt}", f"lora={other_modules}"],
         "modules_to_save embed_tokens, lm_head, norm; this run's lora section has rank 4, alpha 8 on q_proj, k_proj, "
         "v_proj, o_proj, gate_proj, up_proj, down_proj, modules_to_save lm_head"),
        ([f"checkpoint.load={swapped}", f"lora={RUN_LORA}"], "is another model"),
        ([f"checkpoint.load={missing}", f"lora={RUN_LORA}"], "no-such-base/converted, is missing"),
    ]:
        _refused(capsys, _train(out, "train.steps=20", *overrides), out, message)
    for argv, message in [
        (["export", "--input", ckpt, "--output", out, "--merge", "--base", bases["other"]], "is another model"),
        (["export", "--input", swapped, "--output", out, "--merge"], "is another model"),
        (["export", "--input", ckpt, "--output", out, "--base", bases["tp1"]], "use it with --merge"),
        (["export", "--input", bases["tp1"], "--output", out, "--merge"], "holds a full model"),
        (["reshard", "--input", ckpt, "--output", out, "--tp", "2"], "holds LoRA adapters only"),
        (["export", "--input", unsaved, "--output", out], "no tensor '6.lm_head.weight' (lm_head.weight, TP rank 0)"),
        (["export", "--input", unsaved, "--output", out, "--merge"], "no tensor '6.lm_head.weight'"),
    ]:
        _refused(capsys, argv, out, message)
    # the base resharded to TP2 is the same model: merging onto it is allowed
    assert cli_main(["export", "--input", swapped, "--output", out, "--merge", "--base", bases["tp2"]]) == 0


@pytest.mark.launched
def test_generate_decodes_an_adapter_checkpoint_as_peft(exported, lora_runs, tmp_path) -> None:
    """`generate` on a LoRA checkpoint (its base read from the recorded path, then the adapters) decodes greedily
    what PEFT's model of the exported base + adapter generates."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer_dir = os.path.join(ROOT, "data", "tokenizer")
    prompt = "Now is the winter of our discontent"
    out_file = str(tmp_path / "out.jsonl")
    assert cli_main(["generate", "--checkpoint", f"{lora_runs['tp1']}/ckpt", "--tokenizer", tokenizer_dir, "--raw",
                     "--prompt", prompt, "--max-new-tokens", "16", "--output", out_file]) == 0
    ours = json.loads(open(out_file, encoding="utf-8").readline())["tokens"]
    model = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(exported["base"]), exported["tp1"]).eval()
    ids = AutoTokenizer.from_pretrained(tokenizer_dir)(prompt, return_tensors="pt")["input_ids"]
    want = model.generate(input_ids=ids, do_sample=False, max_new_tokens=16, eos_token_id=2, pad_token_id=2)
    assert ours == want[0, ids.shape[1]:].tolist()
