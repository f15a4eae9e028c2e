"""MFU and HFU (training/run/metrics.py, training/diagnostics/flops.py): the peak MFU is against, found by the device's
name in the shipped device profiles (configs/devices: each figure with its source), never a constant; hardware FLOPs
add the forward passes recomputation repeats; an MoE model's FLOPs are its active parameters'."""

from __future__ import annotations

import pytest
from launch_utils import PRETRAIN_CONFIG

from llama_megatron.config import ModelConfig
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.diagnostics.flops import (
    forward_flops_per_token,
    recomputed_flops_per_token,
    training_flops_per_token,
)
from llama_megatron.training.planner.devices import load_device
from llama_megatron.training.run.metrics import StepMeter, mfu_peak


@pytest.mark.parametrize("device, fp8, peak, profile", [
    ("NVIDIA H100 80GB HBM3", False, 989.4, "h100-sxm"),
    ("NVIDIA H100 80GB HBM3", True, 1978.9, "h100-sxm"),
    ("NVIDIA H100 PCIe", False, 756.5, "h100-pcie"),
    ("NVIDIA H200", True, 1978.9, "h200"),
    ("NVIDIA B200", False, 2250.0, "b200"),
    ("NVIDIA A100-SXM4-80GB", False, 312.0, "a100-80gb"),
    ("NVIDIA L40S", True, 733.0, "l40s"),
    ("AMD Instinct MI300X", False, 1307.4, "mi300x"),
])
def test_the_peak_is_the_device_profiles(device, fp8, peak, profile) -> None:
    got, source = mfu_peak(None, fp8, device)
    assert got == pytest.approx(peak)
    assert source == f"{device}'s dense {'fp8' if fp8 else 'bf16'} peak (configs/devices/{profile}.json)"


def test_unknown_peaks_say_how_to_give_one() -> None:
    assert mfu_peak(None, True, "NVIDIA A100-SXM4-80GB") == (
        None, "no known dense fp8 peak for NVIDIA A100-SXM4-80GB: set logging.peak_tflops")
    assert mfu_peak(None, False, "Tesla T4")[0] is None
    assert mfu_peak(123.0, True, "NVIDIA H100 80GB HBM3") == (123.0, "logging.peak_tflops")


def _config(*overrides: str) -> TrainingConfig:
    return TrainingConfig.from_file(PRETRAIN_CONFIG, ['data={"synthetic": true}', "tokenizer=null", *overrides])


@pytest.mark.parametrize("overrides, recomputed_layers", [
    ((), 0),
    (("activation_checkpointing.interval=1",), 4),
    (("activation_checkpointing.interval=3",), 4),  # spans of 3 and 1 decoder layers
    # PipelineModule's windows of 2 layers per stage: a window holding the embedding, the norm or the head is not
    # recomputed, so some decoder layers are and some not
    (("parallel.pipeline=2", "activation_checkpointing.interval=2"), None),
])
def test_hfu_adds_the_forward_passes_recomputation_repeats(overrides, recomputed_layers) -> None:
    config = _config(*overrides)
    meter = StepMeter(config, world_size=config.parallel.pipeline, start_step=0)
    m = config.model
    decoder_forward = forward_flops_per_token(m, config.seq_length) - 2 * m.hidden_size * m.vocab_size
    extra = meter.hardware_flops_per_step - meter.flops_per_step
    assert meter.flops_per_step == training_flops_per_token(m, config.seq_length) * meter.tokens_per_step
    if recomputed_layers is not None:
        assert extra == decoder_forward * recomputed_layers // m.num_hidden_layers * meter.tokens_per_step
    else:  # whatever PipelineModule recomputes, some but not every layer here
        assert 0 < extra < decoder_forward * meter.tokens_per_step
        assert extra == recomputed_flops_per_token(config) * meter.tokens_per_step


def test_moe_flops_are_the_active_parameters() -> None:
    """Doubling the experts at a fixed top-k adds only the router's FLOPs (h x experts per token and MoE layer)."""
    shape = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)
    few, many = (ModelConfig(**shape, model_type="mixtral", num_local_experts=e, num_experts_per_tok=2) for e in (8, 16))
    assert forward_flops_per_token(many, 128) - forward_flops_per_token(few, 128) == 2 * 4 * 64 * 8
    assert many.num_parameters() > 1.9 * few.num_parameters() - shape["vocab_size"] * 64 * 2


FLOP_CASES = {
    "llama": dict(num_key_value_heads=4),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=4),  # q/k/v biases: no matmul
    "mixtral": dict(model_type="mixtral", num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, mlp_only_layers=[0]),
    "llama4": dict(model_type="llama4", num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=1,
                   intermediate_size_mlp=80, attention_chunk_size=64),
}


@pytest.mark.parametrize("family", list(FLOP_CASES))
def test_the_flop_formula_is_what_torch_counts(family) -> None:
    """One training micro batch (forward and backward) of each family under torch.utils.flop_counter's
    FlopCounterMode, SDPA on its math path (the CPU's fused kernel has no FLOP formula registered): the count equals
    the formula's 3 x forward FLOPs exactly: GQA's k/v widths, the head, an MoE layer's router and the experts each
    token visits (Qwen3-MoE's dense layer its own MLP). Windows and chunks are left out here: the formula counts the
    keys a query attends (Megatron's convention), where the dense mask computes them all."""
    import torch
    from model_utils import tiny_config
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from llama_megatron.model.build import build_model
    from llama_megatron.parallel.context import ParallelContext
    from llama_megatron.parallel.degrees import ParallelConfig

    config = tiny_config(vocab_size=512, **FLOP_CASES[family])
    model = build_model(config, ParallelConfig(make_vocab_size_divisible_by=1), ParallelContext.single())
    b, s = 4, 64
    ids = torch.randint(0, config.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids[:, :-1], labels=ids[:, 1:]).backward()
    assert counter.get_total_flops() == training_flops_per_token(config, s) * b * s


def _layout_flops_worker(rank: int, world_size: int) -> None:
    """Each layout's ranks count their own FLOPs of one micro batch (their data rank's rows); summed over the ranks
    they are the formula's for the rows of every data rank."""
    import torch
    import torch.distributed as dist
    from model_utils import tiny_config
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from llama_megatron.data.batch import MicroBatch
    from llama_megatron.model.build import build_model
    from llama_megatron.parallel.context import ParallelContext
    from llama_megatron.parallel.degrees import ParallelConfig
    from llama_megatron.parallel.process_groups import init_distributed

    init_distributed()  # DeepSpeed's comm layer, which context parallelism's all-to-all goes through
    b, s = 2, 32
    cases = [(family, layout) for family in ("llama", "qwen2", "mixtral", "qwen3_moe")
             for layout in (dict(tensor=2, sequence_parallel=True), dict(context=2), dict(expert=2))
             if "expert" not in layout or family in ("mixtral", "qwen3_moe")]
    for family, layout in [*cases, ("mixtral", dict(tensor=2)), ("llama4", dict(expert=2))]:
        config = tiny_config(vocab_size=512, **FLOP_CASES[family])
        pctx = ParallelContext.build(**layout)
        parallel = ParallelConfig(tensor=pctx.tp_size, context=pctx.cp_size, expert=pctx.ep_size,
                                  sequence_parallel=pctx.sequence_parallel, make_vocab_size_divisible_by=8)
        model = build_model(config, parallel, pctx)
        gen = torch.Generator().manual_seed(pctx.dp_rank)  # each data rank its own rows
        ids = torch.randint(0, config.vocab_size, (b, s + 1), generator=gen)
        mb = MicroBatch(ids[:, :-1], torch.arange(s).expand(b, s), ids[:, 1:]).context_shard(pctx.cp_rank,
                                                                                              pctx.cp_size)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(mb.input_ids, mb.position_ids, labels=(mb.labels, torch.tensor(b * s / pctx.cp_size))).backward()
        total = torch.tensor(float(counter.get_total_flops()), dtype=torch.float64)
        dist.all_reduce(total)
        tokens = b * s * pctx.dp_size
        want = training_flops_per_token(config, s) * tokens
        if config.family.moe is not None:  # the router is replicated over TP: every TP rank computes its logits
            moe_layers = sum(map(config.is_moe_layer, range(config.num_hidden_layers)))
            want += (pctx.tp_size - 1) * 3 * 2 * config.hidden_size * config.num_local_experts * tokens * moe_layers
        assert total.item() == want, (family, layout, total.item(), want)
    for family in ("llama", "qwen2", "mixtral", "qwen3_moe"):
        _pipeline_flops(family, b, s)


def _pipeline_flops(family: str, b: int, s: int) -> None:
    """PP2: stage 0 runs the embedding and its layers, stage 1 the rest and the loss; the activations and their
    gradient cross between the ranks (objects over gloo, outside the counted regions). Summed: the formula's."""
    import torch
    import torch.distributed as dist
    from model_utils import tiny_config
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from llama_megatron.model.build import build_model
    from llama_megatron.parallel.context import ParallelContext
    from llama_megatron.parallel.degrees import ParallelConfig

    config = tiny_config(vocab_size=512, **FLOP_CASES[family])
    pctx = ParallelContext.build(pipeline=2)
    model = build_model(config, ParallelConfig(pipeline=2, make_vocab_size_divisible_by=8), pctx)
    ids = torch.randint(0, config.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    if pctx.pp_rank == 0:  # one counted region (entering a FlopCounterMode again starts its count anew)
        with counter:
            with sdpa_kernel(SDPBackend.MATH):
                outputs = model((ids[:, :-1], torch.arange(s).expand(b, s)))
            dist.send_object_list([tuple(t.detach() for t in outputs)], dst=1)
            grads = [None]
            dist.recv_object_list(grads, src=1)
            pairs = [(t, g) for t, g in zip([t for t in outputs if t.is_floating_point()], grads[0])
                     if g is not None and t.requires_grad]  # a float the stage passes on unchanged: no graph
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    else:
        received = [None]
        dist.recv_object_list(received, src=0)
        inputs = tuple(t.requires_grad_() if t.is_floating_point() else t for t in received[0])
        with sdpa_kernel(SDPBackend.MATH), counter:
            loss = model.loss_fn(model(inputs), (ids[:, 1:], torch.tensor(float(b * s))))
            loss.backward()
        dist.send_object_list([[t.grad for t in inputs if t.is_floating_point()]], dst=0)
    total = torch.tensor(float(counter.get_total_flops()), dtype=torch.float64)
    dist.all_reduce(total)
    assert total.item() == training_flops_per_token(config, s) * b * s, (family, total.item(), pctx.pp_rank)


@pytest.mark.launched
def test_the_flop_formula_is_what_the_ranks_of_a_layout_count_together() -> None:
    """Llama, Qwen2, Mixtral and Qwen3-MoE at TP2 with SP, CP2 (Ulysses: each rank attends over whole sequences for
    half the heads) and PP2 (the stages' passes, the activations and their gradient sent between them), the MoE
    families and Llama 4 at EP2 (two data ranks, the experts' tokens exchanged), Mixtral at TP2 without SP: the
    ranks' FlopCounterMode counts, summed,
    are the formula's FLOPs of the step exactly, plus under TP the router's, which every TP rank computes (hardware
    FLOPs the model FLOPs of MFU count once)."""
    from dist_utils import run_distributed

    run_distributed(_layout_flops_worker, 2)


def test_the_documented_hand_examples_are_the_formula() -> None:
    """docs/training-loop.md's table of every family's preset: forward and training FLOPs per token at sequence 8192
    and the tokens/s per H100 SXM that make 40% MFU, each recomputed here."""
    import json
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "training-loop.md"), encoding="utf-8") as fh:
        rows = re.findall(r"^\| `([\w.-]+)` \| (\w+)[^|]* \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|$", fh.read(), re.M)
    families = set()
    peak = load_device("h100-sxm").peak("bf16")
    for preset, family, forward, training, tokens in rows:
        with open(os.path.join(root, "configs", "models", f"{preset}.json"), encoding="utf-8") as fh:
            config = ModelConfig.from_dict(json.load(fh))
        number = lambda text: int(text.replace(",", ""))  # noqa: E731
        assert config.model_type == family
        assert number(forward) == forward_flops_per_token(config, 8192), preset
        assert number(training) == training_flops_per_token(config, 8192), preset
        assert number(tokens) == round(0.4 * peak / training_flops_per_token(config, 8192)), preset
        families.add(family)
    assert families == {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "llama4"}
