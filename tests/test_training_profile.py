"""`llama-megatron profile`: per-rank torch.profiler traces and time by category (training/diagnostics/profiling.py).

One launch of 2 processes (tests/scripts/train_many.py) runs the same PP2 run under `profile` (steps 2-3) and under
`train`: the losses are equal bit for bit (profiling changes no number), each rank writes a trace that parses as
Chrome trace JSON, and the summary names the pipeline's send/recv and the GEMMs. Bad input is one line, exit 2,
before any process group.
"""

from __future__ import annotations

import json
import os

import pytest
from family_cases import RUNS
from launch_utils import PRETRAIN_CONFIG, launch_many, losses, train_args

from llama_megatron.cli import main as cli_main
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.diagnostics.collective_traffic import (
    decoder_layer_transfers,
    end_layer_transfers,
)
from llama_megatron.training.diagnostics.profile_plot import busy_share, pipeline_ranges
from llama_megatron.training.diagnostics.profiling import ProfileRequest, category, time_by_category

# the cosine decay spans train.steps (6), of which profile runs 4 (steps 2-3 traced, step 4 the call graph's)
SYNTHETIC = ['data={"type": "synthetic"}', "tokenizer=null", "train.steps=6", "optimizer.decay_steps=null"]
PP2 = ["parallel.pipeline=2", "batch.micro_batch_size=1"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    work = tmp_path_factory.mktemp("profile")
    profile = {"verb": "profile", "args": [*train_args(PRETRAIN_CONFIG, [*SYNTHETIC, *PP2]), "--steps", "2:3",
                                          "--output", str(work / "profile")]}
    train = train_args(PRETRAIN_CONFIG, [*SYNTHETIC, *PP2, f"output_dir={work / 'train'}"])
    launch_many(2, [profile, train], str(work / "runs.json"))
    return work


# one 4-process launch: TP2 x PP2 with and without SP, CP2 (x DP2) and Mixtral at EP2 (x DP4), the call graph's step
# each (steps 2 traced, 3 under the recorder); fp32, micro batches of 1 row (4 per step at PP2, 2 at DP2 and DP4...)
LAYOUTS = {
    "tp2-pp2-sp": ["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true"],
    "tp2-pp2": ["parallel.tensor=2", "parallel.pipeline=2"],
    # and the quickstart's checkpoint section: "auto" resumes nothing under profile, which saves nothing
    "cp2": ["parallel.context=2", 'checkpoint={"load": "auto", "save": "SAVES", "interval": 1}'],
    "mixtral-ep2": [*RUNS["mixtral"], "parallel.expert=2"],
}


@pytest.fixture(scope="module")
def profiled_layouts(tmp_path_factory):
    work = tmp_path_factory.mktemp("profile-layouts")
    layouts = {name: [o.replace("SAVES", str(work / "saves")) for o in overrides] for name, overrides in LAYOUTS.items()}
    runs = [{"verb": "profile", "args": [*train_args(PRETRAIN_CONFIG, [*SYNTHETIC, "batch.micro_batch_size=1",
                                                                     *overrides]),
                                         "--steps", "2", "--output", str(work / name)]}
            for name, overrides in layouts.items()]
    launch_many(4, runs, str(work / "runs.json"))
    assert not (work / "saves").exists()
    return {name: TrainingConfig.from_file(PRETRAIN_CONFIG, [*SYNTHETIC, "batch.micro_batch_size=1", *overrides])
            for name, overrides in layouts.items()}, work


def _layer_index(module: str) -> int | None:
    """The pipeline layer a module of the call graph belongs to (PipelineModule.3.mlp..., LlamaEngine.module.3.mlp...
    at PP1: 3), None outside the layers (the loss, the engine)."""
    return next((int(part) for part in module.split(".") if part.isdigit()), None)


def _layer_bytes(graph: dict, group: str) -> dict[int, int]:
    """Pipeline layer index -> the bytes of the collectives of ``group`` its modules issued (forward and backward)."""
    out: dict[int, int] = {}
    for module, entry in graph["modules"].items():
        index = _layer_index(module)
        if index is not None and entry.get("collective_bytes", {}).get(group):
            out[index] = out.get(index, 0) + entry["collective_bytes"][group]
    return out


def _layer_formula(config: TrainingConfig, index: int, group: str) -> float:
    """The formula's bytes of ``group`` for one micro batch of one row through pipeline layer ``index`` (0 the
    embedding, 1..L the decoder layers, then the final norm and the head), fp32."""
    layers = config.model.num_hidden_layers
    if 1 <= index <= layers:
        forward, backward = decoder_layer_transfers(config, index - 1, 1, 4)
    else:
        kind = "EmbeddingPipe" if index == 0 else "FinalNormPipe" if index == layers + 1 else "LMHeadPipe"
        forward, backward = end_layer_transfers(config, kind, 1, 4)
    return sum(t.bytes for t in forward + backward if t.group == group)


@pytest.mark.parametrize("name", ["tp2-pp2-sp", "tp2-pp2", "cp2"])
def test_each_layers_collectives_are_the_layouts_formula(profiled_layouts, name) -> None:
    """Every pipeline layer's TP (all-reduce; under SP all-gather, reduce-scatter and the norms' all-reduces, the
    final norm's too) or CP (Ulysses' all-to-alls) bytes in the call graph's step equal collective_traffic's formula
    exactly, per rank: the decoder layers', the embedding's and the head's; the summary sets each collective beside
    the formula, the pipeline's sends and recvs too."""
    configs, work = profiled_layouts
    config = configs[name]
    group = "CP" if name == "cp2" else "TP"
    micro_batches = config.gradient_accumulation_steps(4)
    layers_in_model = config.model.num_hidden_layers
    summary = json.loads((work / name / "summary.json").read_text())
    assert len(summary["ranks"]) == 4
    for rank in summary["ranks"]:
        graph = rank["call_graph"]
        layers = {i: b for i, b in _layer_bytes(graph, group).items() if 0 <= i <= layers_in_model + 2}
        decoders = [i for i in layers if 1 <= i <= layers_in_model]
        held = 2 if config.parallel.pipeline == 2 else 4  # layers 1-2 on pipeline rank 0, 3-4 on rank 1
        assert len(decoders) == held, (rank["rank"], layers)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):  # with GEMMs
            assert sum(m.endswith(name) and e["flops"] > 0 for m, e in graph["modules"].items()) == held, name
        first, last = rank["pipeline_rank"] == 0, rank["pipeline_rank"] == config.parallel.pipeline - 1
        ends = [0] * first + [layers_in_model + 1, layers_in_model + 2] * last  # embedding; final norm, head
        want = {i: micro_batches * _layer_formula(config, i, group) for i in [*decoders, *ends]}
        assert layers == {i: b for i, b in want.items() if b}, (rank["rank"], layers, want)
        if config.parallel.sequence_parallel and last:  # the final norm's weight-gradient all-reduce, [hidden]
            assert layers[layers_in_model + 1] == micro_batches * config.model.hidden_size * 4
        table = graph["bytes_vs_formula"]
        for key, pair in table.items():
            if key.endswith(f" {group}") and not key.startswith("all_reduce"):  # the loss's all-reduces aside
                assert pair["counted"] == pair["formula"], (rank["rank"], key, pair)
            if key in ("send PP", "recv PP"):  # and DeepSpeed's shape header (a few small tensors) once a step
                assert 0 <= pair["counted"] - pair["formula"] < 4096, (rank["rank"], key, pair)
        if group == "TP":  # the rank's all-reduces: the formula's (every layer's, above) and the loss's, outside
            outside = sum(e.get("collective_bytes", {}).get("TP", 0) for m, e in graph["modules"].items()
                          if _layer_index(m) is None)
            assert table["all_reduce TP"]["counted"] == table["all_reduce TP"]["formula"] + outside, rank["rank"]


LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "router", "shared_expert_gate", "lm_head")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_linears_backward_flops_are_twice_its_forward(profiled_layouts, name) -> None:
    """In the call graph's step every linear's backward FLOPs (its input's and its weight's gradient, one GEMM each)
    are twice its forward's, on every rank: through our TP linears' autograd Functions with SP and without, under
    CP, and for Mixtral's router and experts at EP2 (each module's backward is its own, not a module that ran after
    it on the same input)."""
    configs, work = profiled_layouts
    summary = json.loads((work / name / "summary.json").read_text())
    for rank in summary["ranks"]:
        linears = {m: e for m, e in rank["call_graph"]["modules"].items() if m.endswith(LINEAR_NAMES)}
        # every linear multiplies its rank's tokens (an expert those routed to it: maybe none)
        assert linears and all(e["forward_flops"] > 0 for k, e in linears.items() if ".experts." not in k), rank["rank"]
        for module, entry in linears.items():
            assert entry["backward_flops"] == 2 * entry["forward_flops"], (rank["rank"], module, entry)


def test_an_expert_parallel_call_graph_shows_the_expert_all_to_alls(profiled_layouts) -> None:
    """Mixtral at EP2: each MoE layer's dispatch and combine all-to-alls of the EP group, each way; summed over an
    EP group's two ranks their bytes are the formula's (a rank's share depends on where its tokens were routed)."""
    configs, work = profiled_layouts
    config = configs["mixtral-ep2"]
    summary = json.loads((work / "mixtral-ep2" / "summary.json").read_text())
    ranks = {r["rank"]: r["call_graph"] for r in summary["ranks"]}
    per_step = config.gradient_accumulation_steps(4) * sum(
        t.bytes for layer in range(config.model.num_hidden_layers)
        for t in sum(decoder_layer_transfers(config, layer, 1, 4), []) if t.group == "EP")
    for pair in ((0, 1), (2, 3)):  # the EP groups: consecutive data ranks
        counted = [ranks[r]["collectives"]["all_to_all EP"]["bytes"] for r in pair]
        assert min(counted) > 0 and sum(counted) == 2 * per_step, (pair, counted, per_step)
        assert all(ranks[r]["bytes_vs_formula"]["all_to_all EP"]["formula"] == per_step for r in pair)


def test_an_expert_parallel_call_graph_credits_the_router_and_the_experts(profiled_layouts) -> None:
    """Mixtral at EP2: each MoE layer's router multiplies the rank's own tokens by [experts, hidden] (2 n h E FLOPs a
    micro batch, exactly); its experts run the tokens the EP group routed to them, so over an EP group's two ranks a
    layer's experts count the k assignments of every token of both ranks, 2 x (2 h 2I + 2 I h) FLOPs each."""
    configs, work = profiled_layouts
    config = configs["mixtral-ep2"]
    m = config.model
    micro_batches, n = config.gradient_accumulation_steps(4), config.seq_length
    width = config.local_shapes.expert_intermediate
    summary = json.loads((work / "mixtral-ep2" / "summary.json").read_text())
    ranks = {r["rank"]: r["call_graph"]["modules"] for r in summary["ranks"]}
    for modules in ranks.values():
        routers = {_layer_index(k): e["forward_flops"] for k, e in modules.items() if k.endswith("mlp.router")}
        assert routers == {i: micro_batches * 2 * n * m.hidden_size * m.num_local_experts
                           for i in range(1, m.num_hidden_layers + 1)}
    for pair in ((0, 1), (2, 3)):  # the EP groups: consecutive data ranks
        for layer in range(1, m.num_hidden_layers + 1):
            experts = sum(e["forward_flops"] for r in pair for k, e in ranks[r].items()
                          if _layer_index(k) == layer and ".mlp.experts." in k)
            assert experts == 2 * micro_batches * n * m.num_experts_per_tok * 2 * 3 * m.hidden_size * width, (
                pair, layer)


def test_profiling_changes_no_number(profiled) -> None:
    got, want = losses(str(profiled / "profile")), losses(str(profiled / "train"))
    # steps 2-3 traced, step 4 under the call graph's recorder, then it stops; the learning rates are the 6-step run's
    assert list(got) == [1, 2, 3, 4] and got == {s: want[s] for s in got}


def test_every_rank_writes_a_trace_and_the_summary_says_where_time_went(profiled) -> None:
    out = profiled / "profile"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    for rank in summary["ranks"]:
        trace = json.loads((out / rank["trace"]).read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "aten::mm" in names or "aten::addmm" in names
        assert rank["steps"] == [2, 3] and set(rank["step_seconds"]) == {"2", "3"}
        seconds = rank["seconds_by_category"]
        assert seconds["gemm"] > 0 and seconds.get("collective:send", 0) + seconds.get("collective:recv", 0) > 0, seconds
        total = sum(v for k, v in seconds.items() if not k.startswith("device:"))
        assert total == pytest.approx(sum(rank["step_seconds"].values()), rel=0.05)  # the steps' wall time, split


def test_the_call_graph_names_the_layers_operators_and_collectives(profiled) -> None:
    """Step 4 under the call-graph recorder: on every rank its layers' attention and MLP linears with their GEMMs and
    FLOPs, the stages' activations sent between them (a collective of the PP group with its bytes), an SVG that
    parses as XML and names them; the ranks' FLOPs summed against the formula's."""
    import xml.etree.ElementTree as ElementTree

    out = profiled / "profile"
    summary = json.loads((out / "summary.json").read_text())
    for rank in summary["ranks"]:
        graph = rank["call_graph"]
        assert graph["step"] == 4 and graph["flops"] > 0
        modules = graph["modules"]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            assert any(m.endswith(name) and modules[m]["flops"] > 0 for m in modules), (name, sorted(modules))
        # 8 micro batches of [1, 32, 64] fp32 activations forward, their gradients back (and DeepSpeed's shape
        # header once): 65,536 bytes each way at least
        for kind in ("send PP", "recv PP"):
            assert 8 * 32 * 64 * 4 <= graph["collectives"][kind]["bytes"] < 8 * 32 * 64 * 4 + 4096, graph["collectives"]
        dot = (out / graph["dot"]).read_text()
        assert "aten.mm" in dot and "qkv_proj" in dot
        svg = ElementTree.parse(out / graph["svg"]).getroot()
        text = " ".join(t.text or "" for t in svg.iter("{http://www.w3.org/2000/svg}text"))
        assert "aten.mm" in text and "qkv_proj" in text
    counted, formula = summary["flops_of_a_step"]["counted"], summary["flops_of_a_step"]["formula"]
    assert 0.9 * formula < counted < 1.1 * formula  # exact with SDPA's math kernel: tests/test_training_mfu.py


def test_the_trace_shows_every_pipeline_pass_and_plot_draws_them(profiled, capsys) -> None:
    """Each rank's trace holds a range per pipeline instruction of the profiled steps (2 steps x 8 micro batches of
    F and B; the first stage sends activations, the last receives them), each rank's allocations over the steps are
    a timeline with its peak; `plot --profile` draws both into one PNG, and refuses a directory without a profile."""
    out = profiled / "profile"
    summary = json.loads((out / "summary.json").read_text())
    for rank in summary["ranks"]:
        ranges = pipeline_ranges(str(out / rank["trace"]))
        names = [name.split(" ")[0] for _, name, _, _ in ranges]
        assert names.count("ForwardPass") == 16 and names.count("BackwardPass") == 16, sorted(set(names))
        assert ("SendActivation" if rank["pipeline_rank"] == 0 else "RecvActivation") in names
        assert all(end >= start for _, _, start, end in ranges)
        memory = json.loads((out / rank["memory"]["timeline"]).read_text())
        assert memory["device"] == "cpu" and rank["memory"]["peak_bytes"] == memory["peak_bytes"] > 0
        assert max(b for _, b in memory["points"]) == memory["peak_bytes"]
        # what the steps allocate on top of the states held before them (activations, gradients, the optimizer's
        # temporaries) beside the estimate's gradients, activations and logits of the stage (1.8 / 3.2 MB here)
        guess = rank["memory"]["estimate"]["gradients, activations and logits"]
        assert 0.5 * guess < memory["peak_bytes"] < 5 * guess, (rank["rank"], memory["peak_bytes"], guess)
        assert 0 < busy_share(ranges, ranges[0][2], ranges[-1][3]) < 1
        pipeline = rank["pipeline"]  # the two steps' schedules: passes, sends and receives, idle
        assert 0 < pipeline["passes_s"] < pipeline["span_s"] <= sum(rank["step_seconds"].values())
        assert pipeline["send_recv_s"] > 0 and 0 < pipeline["idle_share"] < 1
    assert cli_main(["plot", "--profile", str(out)]) == 0
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert cli_main(["plot", "--profile", str(profiled)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert errors == [f"error: {profiled} holds no summary.json: give the --output directory of llama-megatron "
                      "profile"]


@pytest.mark.parametrize("name, ancestors, kind", [
    ("aten::mm", (), "gemm"), ("aten::addmm", ("Optimizer.step#AdamW.step",), "gemm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", (), "attention"),
    ("c10d::allreduce_", (), "collective:all_reduce"), ("c10d::_allgather_base_", (), "collective:all_gather"),
    ("c10d::_reduce_scatter_base_", (), "collective:reduce_scatter"), ("c10d::alltoall_base_", (), "collective:all_to_all"),
    ("c10d::send", (), "collective:send"), ("c10d::recv_", (), "collective:recv"), ("gloo:all_to_all", (), "collective:all_to_all"),
    ("nccl:reduce_scatter", (), "collective:reduce_scatter"), ("c10d::recv_any_source_", (), "collective:recv"),
    ("aten::add_", ("Optimizer.step#AdamW.step", "x"), "optimizer"), ("aten::mul", (), "elementwise, norms, copies"),
])
def test_categories(name: str, ancestors: tuple, kind: str) -> None:
    assert category(name, ancestors) == kind


def test_the_categories_split_the_wall_time_and_count_nothing_twice() -> None:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        a = torch.randn(64, 64, requires_grad=True)
        with torch.profiler.record_function("llama_megatron: data"):
            b = torch.randn(64, 64) * 2
        (a @ b).relu().sum().backward()
    seconds = time_by_category(prof.events(), 10.0)
    assert sum(seconds.values()) == pytest.approx(10.0)
    assert seconds["gemm"] > 0 and seconds["data"] > 0 and seconds["host (Python, launches)"] > 9


@pytest.mark.parametrize("args, environment, message", [
    (["--steps", "5:6"], {}, "--steps 5:6 lies outside the run: train.steps is 6, and the call graph takes the step "
                             "after the last asked (ask up to step 5)"),
    (["--steps", "0:2"], {}, "--steps 0:2: the first step must be >= 1 and <= the last"),
    (["--steps", "two"], {}, "--steps 'two': give a step (3) or a range of steps (3:5), counted from 1"),
    (["--ranks", "1,4"], {"WORLD_SIZE": "2", "RANK": "0"}, "--ranks 4 outside the world of 2 processes (ranks 0-1)"),
    (["--ranks", "x"], {}, "--ranks 'x': 'all' or global ranks separated by commas (0,3)"),
    (["--output", "EXISTING"], {}, "--output EXISTING exists and is not empty: pass --overwrite to replace it"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_process_group(args, environment, message, tmp_path,
                                                                   monkeypatch, capsys) -> None:
    import torch.distributed as dist

    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "rank0.trace.json").write_text("{}")
    args = [a.replace("EXISTING", str(existing)) for a in args]
    message = message.replace("EXISTING", str(existing))
    base = ["--output", str(tmp_path / "out")] if "--output" not in args else []
    code = cli_main(["profile", *train_args(PRETRAIN_CONFIG, SYNTHETIC), *base, *args])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(errors) == 1 and errors[0] == f"error: {message}", errors
    assert not dist.is_initialized() and not os.path.exists(tmp_path / "out")
    assert (existing / "rank0.trace.json").read_text() == "{}"


def test_request_parse() -> None:
    assert ProfileRequest.parse("3", "all", "o") == ProfileRequest(3, 3, None, "o")
    assert ProfileRequest.parse("2:5", "0,3", "o") == ProfileRequest(2, 5, frozenset({0, 3}), "o")
    assert not ProfileRequest.parse("2", "1", "o").profiles(0) and ProfileRequest.parse("2", "all", "o").profiles(7)
