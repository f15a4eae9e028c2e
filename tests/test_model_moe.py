"""Mixture of experts (Mixtral, Qwen3-MoE, Qwen2-MoE) is the same function as transformers' MixtralForCausalLM,
Qwen3MoeForCausalLM and Qwen2MoeForCausalLM: logits, the loss with its load-balancing term (``output_router_logits``)
and every gradient, fp32, in every layout of the model.

Expert parallelism puts different samples on the ranks of an EP group (it lives in the data axis), so each data
rank's reference is HF on that rank's own samples, and the gradients to compare are summed over the data ranks: the
replicated weights' over DP x CP (what DeepSpeed's average does, times the rank count), the experts' over their
expert-data-parallel group (their EP rank already holds the gradients of every rank's tokens, which the all-to-all
brought to it). Under context parallelism the CP ranks' losses (the loss rule's shares) add up to CP x HF's.
Gradients of every TP shard are gathered and merged with the code that exports checkpoints.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from family_cases import MIXTRAL, MOE_PARITY
from launch_utils import PRETRAIN_CONFIG
from model_utils import gather_shards, hf_model, tiny_config

from llama_megatron.config import ModelConfig
from llama_megatron.data.batch import MicroBatch
from llama_megatron.errors import ConfigError
from llama_megatron.model.build import build_model
from llama_megatron.model.kernels import REFERENCE
from llama_megatron.model.llama import logits_of
from llama_megatron.model.lora_layout import EXPERT_TARGETS, LoraConfig
from llama_megatron.model.moe import MoEMLP
from llama_megatron.model.moe_section import ExpertCapacity
from llama_megatron.model.param_layout import ParamLayout, as_checkpoint_tensors
from llama_megatron.model.tp_slicing import hf_to_rank_state_dict, merge_shards
from llama_megatron.parallel.collectives import gather_from_tp_region
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.cross_entropy import IGNORE_INDEX
from llama_megatron.parallel.degrees import ParallelConfig
from llama_megatron.parallel.process_groups import init_distributed

CASES = MOE_PARITY  # every MoE family's cases (tests/family_cases.py)
LLAMA4 = ("llama4-chunked-nope-moe", "llama4-top2-bias-tied")
DEEPSEEK = ("deepseek-v3", "deepseek-v3-plain-q-yarn")
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
LOGITS_ATOL = 1e-5
GROUPED = dataclasses.replace(REFERENCE, grouped_experts=True)  # the reference kernels, the experts grouped
# the grouped experts against the loop: the same products per expert, so on the CPU (whose grouped kernel runs the
# same mm per group) equal; 1e-6 is the bound a GPU's grouped GEMM is held to against cuBLAS's per-expert ones
GROUPED_TOL = dict(rtol=1e-6, atol=1e-9)
EXPERT_LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", *EXPERT_TARGETS))


def _expert_lora(case: dict) -> LoraConfig:
    """EXPERT_LORA, but on the experts alone where the attention takes no adapter (DeepSeek-V3's latent attention)."""
    if case.get("model_type") == "deepseek_v3":
        return dataclasses.replace(EXPERT_LORA, targets=EXPERT_TARGETS)
    return EXPERT_LORA


def _sum_over(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    if size > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
    return tensor


def check_moe_parity(overrides: dict, pctx: ParallelContext, seq: int = 16, kernels=None) -> None:
    config = tiny_config(**overrides)
    parallel = ParallelConfig(tensor=pctx.tp_size, context=pctx.cp_size, expert=pctx.ep_size,
                              sequence_parallel=pctx.sequence_parallel, make_vocab_size_divisible_by=8)
    hf = hf_model(config)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, config.vocab_size, (pctx.dp_size, 2, seq), generator=gen)
    labels = ids.clone()
    labels[:, 0, 3:6] = IGNORE_INDEX
    refs = [hf(input_ids=ids[d], labels=labels[d]) for d in range(pctx.dp_size)]
    sum(ref.loss for ref in refs).backward()  # every data rank's loss: the gradients the ranks add up to

    model = build_model(config, parallel, pctx, initialize=False, **({"kernels": kernels} if kernels else {}))
    hf_state = as_checkpoint_tensors(hf.state_dict(), config)
    state = hf_to_rank_state_dict(hf_state, config, pctx.tp_rank, pctx.tp_size,
                                  parallel.padded_vocab_size(config.vocab_size), pctx.ep_rank, pctx.ep_size)
    model.load_state_dict({name: state[name] for name in model.state_dict()})  # a pipeline stage: its layers'
    mine = labels[pctx.dp_rank]
    next_labels = torch.cat([mine[:, 1:], torch.full_like(mine[:, :1], IGNORE_INDEX)], dim=1)  # HF's shift
    positions = torch.arange(seq).expand(2, seq)
    mb = MicroBatch(ids[pctx.dp_rank], positions, next_labels).context_shard(pctx.cp_rank, pctx.cp_size)
    divisor = torch.tensor(int((next_labels != IGNORE_INDEX).sum()) / pctx.cp_size)  # the loss rule's N / CP
    if pctx.pp_size > 1:
        loss, logits = _two_stages(model, pctx, (mb.input_ids, mb.position_ids), (mb.labels, divisor))
    else:
        loss = model(mb.input_ids, mb.position_ids, labels=(mb.labels, divisor))
        loss.backward()
        logits = model.full_logits(model(mb.input_ids, mb.position_ids)).detach()

    ref = refs[pctx.dp_rank]
    shard = seq // pctx.cp_size
    if pctx.is_last_stage:
        torch.testing.assert_close(logits, ref.logits[:, pctx.cp_rank * shard:(pctx.cp_rank + 1) * shard],
                                   rtol=0, atol=LOGITS_ATOL)
        torch.testing.assert_close(_sum_over(loss.detach(), pctx.cp_group, pctx.cp_size) / pctx.cp_size, ref.loss,
                                   rtol=1e-5, atol=1e-6)

    hf_grads = as_checkpoint_tensors({n: p.grad for n, p in hf.named_parameters()}, config)
    if config.tie_word_embeddings:
        hf_grads["model.embed_tokens.weight"] = hf.model.embed_tokens.weight.grad
    params = dict(model.named_parameters())
    for spec in ParamLayout(config).held_by(pctx.ep_rank, pctx.ep_size):
        if spec.module_name not in params or not params[spec.module_name].requires_grad:
            continue  # held by the other pipeline stage; or no gradient's (DeepSeek-V3's routing bias)
        group = pctx.edp_group if spec.expert is not None else pctx.dp_cp_group
        size = pctx.dp_cp_size // (pctx.ep_size if spec.expert is not None else 1)
        grad = _sum_over(params[spec.module_name].grad, group, size) / pctx.cp_size
        if spec.module_name.startswith("tied_modules.") and pctx.pp_size > 1:  # both stages' uses of the embedding
            grad = _sum_over(grad, pctx.pp_group, pctx.pp_size)
        for hf_name, merged in merge_shards(spec, gather_shards(grad, pctx), config).items():
            expected = hf_grads[hf_name]
            expected = torch.zeros_like(merged) if expected is None else expected  # an expert no token chose
            torch.testing.assert_close(merged, expected, **GRAD_TOL, msg=lambda m, n=hf_name: f"{n}: {m}")


def _starve_first_expert(model) -> None:
    """No token chooses expert 0 in any MoE layer (its router column out of the top-k, through the routing seam):
    the layer must still run it, on no row, and give its weights a zero gradient."""
    for moe in (m for m in model.modules() if isinstance(m, MoEMLP)):
        choose = moe.choose

        def without_first(logits, probs, choose=choose):
            first = torch.tensor([0])
            return choose(logits.index_fill(-1, first, float("-inf")), probs.index_fill(-1, first, -1.0))

        moe.choose = without_first


def check_grouped_equals_loop(overrides: dict, pctx: ParallelContext, lora: LoraConfig | None = None,
                              seq: int = 16, capacity: ExpertCapacity | None = None) -> None:
    """The model with grouped experts against the same model running its experts one after another (the same seeded
    weights; LoRA adapters on the experts drawn nonzero): loss, logits and every gradient, fp32, with expert 0
    starved in every layer (and ``capacity`` dropping assignments where given)."""
    config = tiny_config(**overrides)
    parallel = ParallelConfig(tensor=pctx.tp_size, context=pctx.cp_size, expert=pctx.ep_size,
                              sequence_parallel=pctx.sequence_parallel, make_vocab_size_divisible_by=8)
    ids = torch.randint(0, config.vocab_size, (pctx.dp_size, 2, seq), generator=torch.Generator().manual_seed(7))[
        pctx.dp_rank]
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
    mb = MicroBatch(ids, torch.arange(seq).expand(2, seq), labels).context_shard(pctx.cp_rank, pctx.cp_size)
    results = []
    for kernels in (REFERENCE, GROUPED):
        model = build_model(config, parallel, pctx, kernels=kernels, lora=lora, capacity=capacity)
        if lora is not None:  # B starts at zero: draw every adapter so that the deltas and all gradients count
            gen = torch.Generator().manual_seed(11 + pctx.tp_rank)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if ".lora." in name:
                        param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        _starve_first_expert(model)
        loss = model(mb.input_ids, mb.position_ids, labels=(mb.labels, torch.tensor(30.0)))
        loss.backward()
        logits = model.full_logits(model(mb.input_ids, mb.position_ids)).detach()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), logits, grads))
    (loss, logits, grads), (grouped_loss, grouped_logits, grouped_grads) = results
    torch.testing.assert_close(grouped_loss, loss, **GROUPED_TOL)
    torch.testing.assert_close(grouped_logits, logits, **GROUPED_TOL)
    assert grads.keys() == grouped_grads.keys() and any(".experts." in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, **GROUPED_TOL, msg=lambda m, n=name: f"{n}: {m}")
    starved = [g for n, g in grouped_grads.items() if ".experts.0." in n]  # held by EP rank 0
    assert bool(starved) == (pctx.ep_rank == 0)
    assert all(g is not None and not g.any() for g in starved)  # run on no row: zero, not None
    if lora is not None:
        assert any(g.any() for n, g in grouped_grads.items() if ".lora." in n and ".experts." in n)


@pytest.mark.parametrize("name", list(CASES))
def test_grouped_experts_equal_the_loop(name: str) -> None:
    """Every MoE family (shared experts gated or not, Llama 4's top-1 sigmoid on the inputs, Qwen's unnormalised
    top-k), with and without LoRA on the experts, one process; EP2 and TP2 x EP2 with SP in the 4-process test."""
    check_grouped_equals_loop(CASES[name], ParallelContext.single())
    check_grouped_equals_loop(CASES[name], ParallelContext.single(), lora=_expert_lora(CASES[name]))
    for pad in (False, True):  # assignments dropped over capacity: their rows run nowhere, or pad nothing
        check_grouped_equals_loop(CASES[name], ParallelContext.single(),
                                  capacity=ExpertCapacity(capacity_factor=0.5, pad_to_capacity=pad))


@pytest.mark.parametrize("name", list(CASES))
def test_grouped_experts_read_nothing_on_the_host(name: str) -> None:
    """At EP 1 the grouped layer's forward and backward read no routing data on the host (no ``.item()``,
    ``.tolist()``, ``nonzero``): run on fake tensors, which refuse any such read (the loop, which reads its counts,
    is refused the same way), and compiled whole with ``fullgraph=True`` (a host read is a graph break)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    config = tiny_config(**CASES[name])
    layers = {}
    for kernels in (REFERENCE, GROUPED):
        model = build_model(config, ParallelConfig(make_vocab_size_divisible_by=8), ParallelContext.single(),
                            kernels=kernels)
        layers[kernels.grouped_experts] = next(m for m in model.modules() if isinstance(m, MoEMLP))

    def step(layer, x):
        out, stats = layer(x)
        (out.square().sum() + stats[1].sum()).backward()
        return out

    with pytest.raises(DataDependentOutputException), FakeTensorMode(allow_non_fake_inputs=True):
        step(layers[False], torch.randn(2, 16, config.hidden_size, requires_grad=True))
    with FakeTensorMode(allow_non_fake_inputs=True):
        step(layers[True], torch.randn(2, 16, config.hidden_size, requires_grad=True))

    torch._dynamo.reset()
    x = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(0))
    compiled = step(torch.compile(layers[True], fullgraph=True, backend="aot_eager"), x.clone().requires_grad_())
    torch.testing.assert_close(compiled, step(layers[True], x.clone().requires_grad_()), rtol=0, atol=0)


def _hand_kept(chosen: torch.Tensor, weights: torch.Tensor, capacity: int, policy: str) -> torch.Tensor:
    """Which assignments ([tokens, k]) an expert keeps, counted one by one: per expert, its assignments by weight
    (highest first) or by position, ties by position, the first ``capacity``."""
    kept = torch.zeros_like(chosen, dtype=torch.bool)
    for expert in chosen.unique().tolist():
        mine = [(t, j) for t in range(chosen.shape[0]) for j in range(chosen.shape[1]) if chosen[t, j] == expert]
        if policy == "probs":
            mine.sort(key=lambda tj: -float(weights[tj]))  # stable: ties keep their position
        for t, j in mine[:capacity]:
            kept[t, j] = True
    return kept


@pytest.mark.parametrize("pad", [False, True], ids=["dropped", "padded"])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_what_a_hand_count_drops(policy: str, pad: bool) -> None:
    """Mixtral's layer (4 experts, top 2) at capacity factor 0.5 (capacity ceil(32 x 2 / 4 x 0.5) = 8 of a
    layer's 64 assignments per expert): the dropped count per expert equals a hand count, the output equals the sum
    of each token's kept experts' weighted outputs computed expert by expert, the loop and grouped paths agree, and
    a factor that drops nothing gives the dropless layer (bit for bit without padding, within 1e-6 with it: padding
    rows change how a GEMM blocks its rows)."""
    config = tiny_config(**MIXTRAL)
    layers = {}
    for kernels in (REFERENCE, GROUPED):
        model = build_model(config, ParallelConfig(make_vocab_size_divisible_by=8), ParallelContext.single(),
                            kernels=kernels)
        layers[kernels.grouped_experts] = next(m for m in model.modules() if isinstance(m, MoEMLP))
    x = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(3))
    dropless = layers[True](x)[0]
    tokens = x.reshape(-1, config.hidden_size)
    layer = layers[False]
    with torch.no_grad():
        probs = torch.softmax(layer.router(tokens).float(), dim=-1)
    weights, chosen = layer.choose(None, probs)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    order = chosen.argsort(dim=-1)
    chosen, weights = chosen.gather(-1, order), weights.gather(-1, order)
    kept = _hand_kept(chosen, weights, 8, policy)
    assert 0 < int((~kept).sum()) < kept.numel()
    want = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(2):
            if kept[t, j]:
                expert = layer.experts[str(int(chosen[t, j]))]
                want[t] += (expert(tokens[t:t + 1])[0] * weights[t, j]).to(tokens.dtype)
    for grouped, moe in layers.items():
        moe.capacity = ExpertCapacity(capacity_factor=0.5, pad_to_capacity=pad, drop_policy=policy)
        out, stats = moe(x)
        hand = torch.bincount(chosen[~kept], minlength=config.num_local_experts).float()
        assert torch.equal(stats[2], hand), (grouped, stats[2], hand)
        torch.testing.assert_close(out.reshape(-1, config.hidden_size), want, rtol=1e-6, atol=1e-6)
        moe.capacity = ExpertCapacity(capacity_factor=2.0, pad_to_capacity=pad, drop_policy=policy)
        out, stats = moe(x)
        assert not stats[2].any()
        torch.testing.assert_close(out, dropless, **(GROUPED_TOL if pad else dict(rtol=0, atol=0)))
    with pytest.raises(ConfigError, match="moe.capacity_factor must be > 0"):
        ExpertCapacity(capacity_factor=0).check()
    with pytest.raises(ConfigError, match="moe.drop_policy 'random': choose probs or position"):
        ExpertCapacity(capacity_factor=1.0, drop_policy="random").check()
    with pytest.raises(ConfigError, match="moe.pad_to_capacity pads each expert's input to its capacity"):
        ExpertCapacity(pad_to_capacity=True).check()


def _two_stages(model, pctx: ParallelContext, inputs: tuple, labels: tuple) -> tuple:
    """Forward and backward of a two-stage PipelineModule by hand, as the pipeline engine runs a micro batch: the
    first stage's output (hidden states, positions, router statistics) sent to the last, the gradients of its
    floating-point tensors sent back. On the last stage: (loss, full logits); on the first: (None, None)."""
    peer = dist.get_global_rank(pctx.pp_group, 1 - pctx.pp_rank)
    if pctx.is_first_stage:
        out = model(inputs)
        dist.send_object_list([[t.detach() for t in out]], dst=peer)
        received: list = [None]
        dist.recv_object_list(received, src=peer)
        # (the router statistics of a stage of dense layers only, DeepSeek-V3's first: zeros without a graph)
        pairs = [(t, g) for t, g in zip((t for t in out if t.is_floating_point()), received[0]) if t.requires_grad]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return None, None
    received = [None]
    dist.recv_object_list(received, src=peer)
    stage_input = tuple(t.requires_grad_() if t.is_floating_point() else t for t in received[0])
    loss = model.loss_fn(model(stage_input), labels)
    loss.backward()
    dist.send_object_list([[t.grad for t in stage_input if t.is_floating_point()]], dst=peer)
    with torch.no_grad():
        logits = gather_from_tp_region(logits_of(model(stage_input)), pctx)[..., :model.loss_fn.vocab_size]
    return loss, logits


@pytest.mark.parametrize("name", list(CASES))
def test_moe_parity_one_process(name: str) -> None:
    check_moe_parity(CASES[name], ParallelContext.single())


def _four_process_worker(rank: int, world_size: int) -> None:
    init_distributed()  # DeepSpeed's comm layer, which context parallelism's all-to-all goes through
    dp_lane = (rank % 2, rank % 2 + 2)  # TP2: a TP lane's data coordinates
    layouts = [  # (cases, layout, this rank's EP group: consecutive data coordinates within its TP lane)
        (("top2-of-4-window", "top3-of-8-tied", "qwen3-moe", "qwen2-moe", *LLAMA4, *DEEPSEEK),
         dict(tensor=2, sequence_parallel=True), (rank,)),
        (("top2-of-4-window", "top3-of-8-tied", *LLAMA4, "deepseek-v3"), dict(expert=2),
         (rank - rank % 2, rank - rank % 2 + 1)),
        (("top3-of-8-tied",), dict(expert=4), (0, 1, 2, 3)),
        (("top3-of-8-tied", "llama4-chunked-nope-moe", "deepseek-v3"), dict(tensor=2, expert=2, sequence_parallel=True),
         dp_lane),
        # the Qwen families' EP2 is this one's (their experts are Mixtral's, the all-to-all the same); Llama 4's
        # chunks of 5 cross the CP shards of 8
        (("top2-of-4-window", "qwen3-moe", "qwen2-moe", *LLAMA4, *DEEPSEEK), dict(context=2, expert=2),
         (rank - rank % 2, rank - rank % 2 + 1)),
        # Llama 4 in two stages (DP2): the layers' kinds (chunked or NoPE, MoE or dense) follow their global index;
        # DeepSeek-V3's dense first layer and MoE second likewise
        ((*LLAMA4, "deepseek-v3"), dict(pipeline=2), (rank,)),
    ]
    for names, layout, ep_ranks in layouts:
        pctx = ParallelContext.build(**layout)
        assert pctx.ep_group_ranks == ep_ranks, (layout, pctx.ep_group_ranks)
        for name in names:
            check_moe_parity(CASES[name], pctx)
        if layout.get("expert") == 2 and pctx.cp_size == 1:  # the grouped experts on what arrives from each rank
            for name in ("top3-of-8-tied", "qwen2-moe", "llama4-chunked-nope-moe", "deepseek-v3"):
                check_grouped_equals_loop(CASES[name], pctx, lora=_expert_lora(CASES[name]))
            for pad in (False, True):  # dropped assignments never sent; padded inputs of fixed split sizes
                check_grouped_equals_loop(CASES["top3-of-8-tied"], pctx,
                                          capacity=ExpertCapacity(capacity_factor=0.5, pad_to_capacity=pad))
    _check_engines_read_packed_experts_as_one_tensor(world_size)


def _check_engines_read_packed_experts_as_one_tensor(world_size: int) -> None:
    """Under DeepSpeed's engines (ZeRO-1 bf16 at EP2, whose experts are in param groups of their own; ZeRO-2 fp32
    and ZeRO-0 bf16 at DP4) each layer's grouped experts are still one strided tensor per kind (no copy per call)
    before and after a step (packed in the dtype the engine trains in, which its cast leaves alone; ZeRO-1/2 flatten
    them in the order they were packed in), and the step's loss is the loop's. Under ZeRO-3 (DP4), whose gathered
    parameters lie apart, the grouped path stacks them and its loss is the loop's too."""
    from llama_megatron.data.batch import collate
    from llama_megatron.parallel.grouped_linear import as_one_tensor
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config
    from llama_megatron.training.engine.training_engine import TrainingEngine

    def read_as_views(model) -> bool:
        layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
        kinds = [[e.gate_up_proj.weight for e in m.experts.values()] for m in layers] + [
            [e.down_proj.weight for e in m.experts.values()] for m in layers]
        return bool(layers) and all(as_one_tensor(kind).data_ptr() == kind[0].data_ptr() for kind in kinds)

    gen = torch.Generator().manual_seed(3)
    for ds, expert in (("ds_configs/zero1_bf16.json", 2), ("ds_configs/zero2_fp32.json", 1),
                       ("ds_configs/zero0_bf16.json", 1), ("ds_configs/zero3_fp32.json", 1)):
        views = "zero3" not in ds
        config = TrainingConfig.from_file(PRETRAIN_CONFIG, [
            'data={"type": "synthetic"}', "model.model_type=mixtral", "model.num_local_experts=4",
            "model.num_experts_per_tok=2", f"parallel.expert={expert}", "batch.micro_batch_size=2",
            f"batch.global_batch_size={2 * world_size}", "optimizer.warmup_steps=0"])
        tokens = torch.randint(0, config.model.vocab_size, (2, config.seq_length + 1), generator=gen)
        batch = collate([{"tokens": row.numpy()} for row in tokens])
        losses = {}
        for kernels in (GROUPED, REFERENCE):
            pctx = ParallelContext.build(expert=expert)
            model = build_model(config.model, config.parallel, pctx, seed=config.seed, kernels=kernels)
            engine = TrainingEngine(config, build_deepspeed_config(config, ds, world_size), pctx, model)
            if kernels.grouped_experts and views:
                assert read_as_views(model), f"{ds}: the experts are copied every call"
            losses[kernels.grouped_experts] = float(engine.train_step([batch]))
            if kernels.grouped_experts and views:
                assert read_as_views(model), f"{ds}: the experts are copied every call after a step"
            del engine
        # the same products per expert in the same order (CPU): equal whatever the dtype
        assert losses[True] == losses[False], (ds, losses)


@pytest.mark.launched
def test_moe_parity_tp2_sp_ep2_ep4_tp2xep2_cp2xep2_pp2() -> None:
    """One 4-process launch: TP2 with SP (DP2), EP2 (DP4: two EP groups), EP4, TP2 x EP2 with SP, CP2 x EP2; the
    Qwen MoE families at TP2 with SP and CP2 x EP2; Llama 4 at TP2 with SP, EP2, TP2 x EP2 with SP, CP2 x EP2 and
    PP2 (two stages run by hand: activations sent forward, their gradients back). At EP2 and TP2 x EP2 with SP the
    grouped experts (with LoRA on them) equal the loop."""
    run_distributed(_four_process_worker, 4)


@pytest.mark.launched  # torch.compile's first compilation starts worker processes
def test_llama4_with_compiled_kernels_matches_hf() -> None:
    """`kernels: compiled` on Llama 4: the compiled RoPE on the chunked layers, the plain split on NoPE ones, the
    chunks through the fast attention's document path (the dense mask on CPU)."""
    from llama_megatron.model.kernels import resolve_kernels

    check_moe_parity(CASES["llama4-chunked-nope-moe"], ParallelContext.single(),
                     kernels=resolve_kernels("compiled", "cpu"))


def test_llama4_packed_documents_attend_in_their_own_chunks() -> None:
    """A packed row of three documents (lengths 7, 11, 6; positions restart at each) with per-document attention
    computes each document as transformers computes it alone: chunks counted from the document's start, the NoPE
    layers' temperature from its own positions."""
    config = tiny_config(**CASES["llama4-chunked-nope-moe"])
    hf = hf_model(config)
    model = build_model(config, ParallelConfig(make_vocab_size_divisible_by=1), ParallelContext.single(),
                        initialize=False)
    model.load_state_dict(hf_to_rank_state_dict(as_checkpoint_tensors(hf.state_dict(), config), config, 0, 1,
                                                config.vocab_size))
    lengths = (7, 11, 6)
    ids = torch.randint(0, config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    with torch.no_grad():
        got = model.full_logits(model(ids, positions, segments))
        want = torch.cat([hf(input_ids=part).logits for part in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_moe_flops_count_the_active_experts() -> None:
    """MFU's model FLOPs count the router and the k experts a token passes through (and a shared expert), not the
    experts it skips."""
    from llama_megatron.training.diagnostics.flops import forward_flops_per_token

    shape = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)
    dense = forward_flops_per_token(ModelConfig(**shape, model_type="mistral"), 100)
    moe = ModelConfig(**shape, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    assert forward_flops_per_token(moe, 100) - dense == 4 * 2 * (3 * 64 * 96 + 64 * 8)  # one more expert, router
    assert moe.num_active_parameters() == moe.num_parameters() - 4 * 6 * 3 * 64 * 96
    # Qwen2-MoE with MoE on layers 1 and 3 only: each adds its router, 2 experts of 32, the shared expert (48) and its
    # gate, and drops the dense MLP (96); its q/k/v biases are no matmul
    qwen = ModelConfig(**shape, model_type="qwen2_moe", attention_bias=True, num_local_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       decoder_sparse_step=2)
    routed = 2 * 3 * 64 * 32 + 64 * 8 + 3 * 64 * 48 + 64
    assert [qwen.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert forward_flops_per_token(qwen, 100) - dense == 2 * 2 * (routed - 3 * 64 * 96)
    assert qwen.num_active_parameters() == qwen.num_parameters() - 2 * 6 * 3 * 64 * 32


def test_moe_config_checks() -> None:
    config = tiny_config(**MIXTRAL)
    assert config.num_active_parameters() < config.num_parameters()
    assert sum(p.numel() for p in hf_model(config).parameters()) == config.num_parameters()
    with pytest.raises(ConfigError, match="num_experts_per_tok 5 exceeds num_local_experts 4"):
        tiny_config(**{**MIXTRAL, "num_experts_per_tok": 5})
    with pytest.raises(ConfigError, match="router_jitter_noise must be 0"):
        tiny_config(**{**MIXTRAL, "router_jitter_noise": 0.1})
    with pytest.raises(ConfigError, match="num_local_experts is not a key of the llama family"):
        tiny_config(num_local_experts=4)
    with pytest.raises(ConfigError, match="expert parallel degree 3 does not divide num_local_experts 4"):
        ParallelConfig(expert=3).validate(config)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        ParallelConfig(expert=2).validate(tiny_config())
    with pytest.raises(ConfigError, match="expert parallel degree 4 does not divide the data axis"):
        ParallelConfig(tensor=2, expert=4).check_world_size(4)



def test_qwen_moe_config_keys() -> None:
    """HF's names are read and written back (``num_experts``, Qwen2-MoE's ``qkv_bias``), the family defaults are
    transformers', and the new keys are checked in one line."""
    config = ModelConfig.from_dict({"model_type": "qwen2_moe", "num_experts": 8, "num_attention_heads": 4,
                                    "hidden_size": 64, "moe_intermediate_size": 24, "sliding_window": 0})
    assert (config.num_local_experts, config.attention_bias, config.norm_topk_prob) == (8, True, False)
    assert config.shared_expert_intermediate_size == 5632 and config.layer_windows() == [None] * 32
    hf = config.to_hf_dict()
    assert hf["num_experts"] == 8 and hf["qkv_bias"] is True and "num_local_experts" not in hf
    assert ModelConfig.from_dict(config.to_dict()) == config == ModelConfig.from_dict(hf)
    qwen3 = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
    for bad, message in (({"num_local_experts": 8}, "num_local_experts and model.num_experts name the same key"),
                         ({"moe_intermediate_size": 0}, "moe_intermediate_size must be a positive integer"),
                         ({"mlp_only_layers": [32]}, r"mlp_only_layers must list layer indices in \[0, 32\)"),
                         ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
                         ({"shared_expert_intermediate_size": 8}, "unknown model config keys for the qwen3_moe")):
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_dict({**qwen3, **bad})
    with pytest.raises(ConfigError, match="norm_topk_prob is not a key of the mixtral family"):
        tiny_config(**MIXTRAL, norm_topk_prob=True)
    with pytest.raises(ConfigError, match="tensor parallel degree 2 does not divide moe_intermediate_size 25"):
        ParallelConfig(tensor=2).validate(ModelConfig.from_dict({**qwen3, "moe_intermediate_size": 25}))


@pytest.mark.parametrize("overrides, message", [
    (['lora={"rank": 2, "targets": ["q_proj", "down_proj"]}'], "lora.targets down_proj: the mixtral model has no MLP module PEFT adapts"),
    (['lora={"rank": 2, "dropout": 0.1, "targets": ["q_proj", "mlp.experts.down_proj"]}'],
     r"lora.dropout 0.1 with the expert targets mlp.experts.down_proj: .* set lora.dropout 0"),
    (['lora={"rank": 2, "targets": ["mlp.experts.up_proj"]}'], "unknown target 'mlp.experts.up_proj'"),
])
def test_training_refuses_what_moe_runs_cannot_do_yet(overrides: list[str], message: str) -> None:

    from llama_megatron.training.config import TrainingConfig

    moe = [f"model.{k}={str(v).lower()}" for k, v in MIXTRAL.items()]
    with pytest.raises(ConfigError, match=message):
        TrainingConfig.from_file(PRETRAIN_CONFIG, ['data={"synthetic": true}', *moe,
                                                                             *overrides])


def test_expert_parallel_zero_needs_experts_on_every_pipeline_rank() -> None:
    """Llama 4 with MoE on layers 1 and 3 at EP2 x PP2: 1F1B and ZB-V give each rank an MoE layer; interleaved 1F1B
    (one layer per chunk) leaves rank 0 dense layers only, which ZeRO-1 refuses (its experts' norm all-reduce would
    hang) and ZeRO-0 takes."""
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.run.setup import check_experts_on_every_stage

    llama4 = [f"model.{k}={json.dumps(v)}" for k, v in CASES["llama4-chunked-nope-moe"].items() if k != "rope_scaling"]
    base = ['data={"synthetic": true}', *llama4, "model.num_local_experts=4", "parallel.expert=2",
            "parallel.pipeline=2"]
    for schedule in (["pipeline.schedule=1f1b"], ["pipeline.schedule=zb-v", "pipeline.virtual_stages=2"]):
        check_experts_on_every_stage(TrainingConfig.from_file(PRETRAIN_CONFIG, [*base, *schedule]), 1)
    interleaved = TrainingConfig.from_file(PRETRAIN_CONFIG, [*base, "pipeline.schedule=interleaved-1f1b",
                                                            "pipeline.virtual_stages=2"])
    with pytest.raises(ConfigError, match="^expert parallelism under ZeRO-1 needs an MoE layer on every pipeline rank, "
                                          "and pipeline rank 0 holds dense layers only"):
        check_experts_on_every_stage(interleaved, 1)
    check_experts_on_every_stage(interleaved, 0)


def test_expert_lora_targets_need_experts() -> None:
    """The experts' targets on a dense model are refused; on a mixture of experts they load, with EP too."""

    from llama_megatron.training.config import TrainingConfig

    lora = 'lora={"rank": 2, "targets": ["q_proj", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}'
    with pytest.raises(ConfigError, match="the llama model has no experts; its targets are q_proj"):
        TrainingConfig.from_file(PRETRAIN_CONFIG, ['data={"synthetic": true}', lora])
    moe = [f"model.{k}={str(v).lower()}" for k, v in MIXTRAL.items()]
    config = TrainingConfig.from_file(PRETRAIN_CONFIG,
                                      ['data={"synthetic": true}', *moe, "parallel.expert=2", lora])
    assert config.lora.expert_targets == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config.lora.module_targets == ["q_proj"]


def test_lora_mlp_targets_are_the_modules_peft_adapts_on_the_class() -> None:
    """gate_proj/up_proj/down_proj: on Qwen2-MoE the shared expert's and the dense layers' linears (PEFT's name match);
    refused on Mixtral (w1/w3/w2) and Qwen3-MoE, where PEFT maps them onto the experts and no module takes them."""
    from llama_megatron.model.lora_layout import (
        LoraConfig,
        adapter_layout,
        check_targets,
        peft_key,
        peft_target_parameters,
    )

    lora = LoraConfig(rank=2, targets=("q_proj", "up_proj", "down_proj"))
    qwen2 = tiny_config(**CASES["qwen2-moe"], num_hidden_layers=3, mlp_only_layers=[1])
    mlp = sorted(n for spec in adapter_layout(qwen2, lora) for n in spec.hf_names if ".mlp." in n)
    assert mlp == sorted(f"base_model.model.model.layers.{i}.mlp.{m}.lora_{ab}.weight" for i, m in
                         ((0, "shared_expert.up_proj"), (0, "shared_expert.down_proj"), (1, "up_proj"),
                          (1, "down_proj"), (2, "shared_expert.up_proj"), (2, "shared_expert.down_proj")) for ab in "AB")
    for config in (tiny_config(**MIXTRAL), tiny_config(**CASES["qwen3-moe"])):
        with pytest.raises(ConfigError, match=f"lora.targets up_proj, down_proj: the {config.model_type} model has "
                                              "no MLP module PEFT adapts under these names"):
            check_targets(config, lora)
    # Llama 4: under feed_forward, the shared expert's (MoE layer 1) and the dense layer's (0); its experts' adapters
    # under PEFT's keys and target_parameters of its class (feed_forward.experts)
    llama4 = tiny_config(**{**CASES["llama4-chunked-nope-moe"], "num_hidden_layers": 2})
    mlp = sorted(n for spec in adapter_layout(llama4, lora) for n in spec.hf_names if ".feed_forward." in n)
    assert mlp == sorted(f"base_model.model.model.layers.{i}.feed_forward.{m}.lora_{ab}.weight" for i, m in
                         ((0, "up_proj"), (0, "down_proj"), (1, "shared_expert.up_proj"),
                          (1, "shared_expert.down_proj")) for ab in "AB")
    experts = LoraConfig(rank=2, targets=("q_proj", "mlp.experts.down_proj"))
    check_targets(llama4, experts)
    assert peft_target_parameters(llama4, experts) == ["feed_forward.experts.down_proj"]
    assert peft_key(llama4, 1, "mlp.experts.down_proj", "A", experts.targets) == (
        "base_model.model.model.layers.1.feed_forward.experts.lora_A.weight")


def test_deepspeed_settings_expert_parallelism_refuses() -> None:
    """ZeRO-3 (DeepSpeed partitions its own AutoEP experts only), and checkpoints under ZeRO-0 (DeepSpeed saves the
    optimizer state of data-parallel rank 0 only); a fine-tuning start, which reads weights only, is fine."""

    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config

    moe = [f"model.{k}={str(v).lower()}" for k, v in MIXTRAL.items()]

    def build(zero: int, *overrides: str) -> dict:
        config = TrainingConfig.from_file(PRETRAIN_CONFIG,
                                          ['data={"synthetic": true}', *moe, "parallel.expert=2", *overrides])
        return build_deepspeed_config(config, {"zero_optimization": {"stage": zero}}, 2)

    with pytest.raises(ConfigError, match="ZeRO stage 3 cannot be combined with expert parallelism"):
        build(3)
    for overrides in (["checkpoint.save=ckpt"], ["checkpoint.load=ckpt"]):
        with pytest.raises(ConfigError, match=r"checkpoints of an expert-parallel run \(expert=2\) need ZeRO-1/2"):
            build(0, *overrides)
    assert build(0, "checkpoint.load=ckpt", "checkpoint.finetune=true")["zero_optimization"]["stage"] == 0
    assert build(1, "checkpoint.save=ckpt")["zero_optimization"]["stage"] == 1


def test_expert_parallel_resume_at_other_degrees_goes_through_a_universal_checkpoint() -> None:
    """Another expert degree, as another DP x CP, loads a universal checkpoint (the experts' ZeRO partitions cut
    anew: whole runs in tests/test_model_families.py); a ZeRO-0 checkpoint (only EP 1 saves one) keeps its EP. Its
    loaders copy the saved param groups' settings onto this run's by position: each group keeps its weight decay and
    DeepSpeed's expert-group name and mark, a group more than saved takes the saved learning rate, and the LR
    schedule's per-group lists fit this run's groups."""
    from llama_megatron.checkpoint.directory import CheckpointMeta
    from llama_megatron.errors import CheckpointError
    from llama_megatron.training import checkpointing as ckpt
    from llama_megatron.training import resume

    def meta(expert: int, dp: int, zero: int = 1) -> CheckpointMeta:
        return CheckpointMeta(step=3, consumed_samples=24, tensor=1, pipeline=1, data_parallel=dp, zero_stage=zero,
                              model={}, padded_vocab_size=64, expert=expert, tag="global_step3")

    assert not resume.needs_universal(meta(2, 4), 4, None, 2)
    assert resume.needs_universal(meta(2, 4), 4, None, 4) and resume.needs_universal(meta(2, 4), 4, None, 1)
    assert resume.needs_universal(meta(2, 4), 2, None, 2) and resume.needs_universal(meta(1, 2), 2, None, 2)
    assert not resume.needs_universal(meta(1, 2, zero=0), 2, None, 2)
    for saved, expert in ((meta(2, 4), 4), (meta(2, 4), 1), (meta(1, 2), 2), (meta(1, 2, zero=0), 1)):
        resume.check_resume_experts(saved, expert, "ckpt")
    with pytest.raises(CheckpointError, match=r"saved with expert=1 under ZeRO-0, this run uses expert=2: a resume "
                                              r"at another expert degree needs a ZeRO-1/2 checkpoint"):
        resume.check_resume_experts(meta(1, 2, zero=0), 2, "ckpt")

    # an EP 1 save (two groups) loaded at EP 4 (DeepSpeed's expert group a third), as its universal loader leaves it
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    optimizer = torch.optim.AdamW([{"params": [params[0]], "name": "group0", "weight_decay": 0.1},
                                   {"params": [params[1]], "name": "group1", "weight_decay": 0.0},
                                   {"params": [params[2]], "name": "ep_size_4", "moe": True, "weight_decay": 0.1}],
                                  lr=3e-3)
    built = [{k: g[k] for k in ckpt._GROUP_STRUCTURE if k in g} for g in optimizer.param_groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scheduler.load_state_dict({**scheduler.state_dict(), "base_lrs": [3e-3] * 2, "_last_lr": [2e-3] * 2})
    for group, saved in zip(optimizer.param_groups, [{"weight_decay": 0.1, "lr": 2e-3, "eps": 1e-6},
                                                     {"weight_decay": 0.0, "lr": 2e-3, "eps": 1e-6}]):
        group.update(saved)
        group.pop("name")
    wrapper = type("Zero", (), {"param_groups": optimizer.param_groups, "optimizer": optimizer})()
    ckpt._repair_universal_optimizer(wrapper, built)
    ckpt._fit_scheduler(scheduler, len(built))
    assert [(g["lr"], g["eps"], g["weight_decay"], g.get("name"), g.get("moe")) for g in optimizer.param_groups] == [
        (2e-3, 1e-6, 0.1, "group0", None), (2e-3, 1e-6, 0.0, "group1", None), (2e-3, 1e-6, 0.1, "ep_size_4", True)]
    assert scheduler.base_lrs == [3e-3] * 3 and scheduler.get_last_lr() == [2e-3] * 3
