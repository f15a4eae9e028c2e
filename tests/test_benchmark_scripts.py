"""Benchmark scripts run end to end (tiny shapes on CPU): the GPU one cannot be exercised otherwise here, and the
context-parallel byte count is a claim of docs/benchmarks.md."""

from __future__ import annotations

import json
import os

import pytest
from launch_utils import ROOT, run_python


@pytest.mark.launched
def test_gpu_throughput_smoke() -> None:
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "gpu_throughput.py"), "--smoke", "--steps", "1",
         "--warmup", "1", "--attention-repeats", "1", "--kernels", "reference", "--profile", "--fp8", "rowwise"],
        timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    *models, attention = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [m["model_type"] for m in models] == ["llama", "mixtral"]  # a dense shape, and an MoE one against HF's
    for model in models:
        assert model["ours_reference"]["tokens_per_s"] > 0 and model["hf"]["tokens_per_s"] > 0
        assert "ratio_ours_reference_vs_hf" in model
        # FP8: ours with the recipe against ours in high precision and against torchao's float8 on the HF model
        assert {"ratio_ours_reference_fp8_vs_ours_reference", "ratio_ours_reference_fp8_vs_hf_torchao_fp8"} <= set(model)
        total, *longest = model["hf"]["top_kernels_ms"]  # the profiled step: its total and longest operators
        assert total[0] == "total" and longest and all(0 < ms <= total[1] for _, ms, _ in longest)
        assert model["ours_reference"]["host_syncs"] is None  # counted on CUDA only: a CPU has nothing to wait for
    for key in ("reference_dense_mask", "ours_fast", "causal_sdpa_no_documents"):
        assert attention[key]["ms"] > 0


@pytest.mark.launched
def test_cpu_document_attention_smoke() -> None:
    """One small length, eager FlexAttention only: the script runs and reports time and error per variant."""
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "cpu_document_attention.py"), "--lengths", "40",
         "--check-lengths", "", "--no-compiled", "--repeats", "1", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "8", "--doc-len", "9"],
        timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert line["ours_fast"]["max_abs_error"] < 1e-5 and line["flex_eager"]["max_abs_error"] < 1e-5
    assert line["flex_eager_time_vs_ours"] > 0


@pytest.mark.launched
def test_moe_layer_smoke() -> None:
    """The MoE layer benchmark at a tiny shape: every variant runs, our two paths give transformers' output."""
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "moe_layer.py"), "--hidden", "32", "--intermediate", "48", "--experts", "4",
         "--tokens", "64", "--repeats", "1"], timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    for name in ("ours_loop", "ours_grouped", "hf_grouped_mm"):
        assert line[name]["ms"] > 0 and line[name]["max_abs_error_vs_hf"] < 1e-5, (name, line[name])
    assert line["ratio_ours_loop_time_vs_ours_grouped"] > 0 and line["ratio_hf_eager_time_vs_ours_grouped"] > 0
    assert line["ratio_ours_loop_time_vs_gemm_floor"] == round(line["ours_loop"]["ms"] / line["gemm_floor"]["ms"], 3)


@pytest.mark.launched  # torch.compile's first compilation starts worker processes
def test_rope_qkv_smoke() -> None:
    """The fused QKV's RoPE at a tiny shape with grouped queries: the compiled backward is one generated kernel (the
    slices' gradients written into the fused gradient together, no separate scatter), and every variant's output
    and gradients are the reference's (transformers' on its own q and k)."""
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "rope_qkv.py"), "--seq", "8", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "8", "--repeats", "1"], timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert line["backward_kernels"] == 1, line
    # fp32, the same products in another grouping of the same elementwise ops: a last bit at most
    assert line["max_abs_error_compiled_vs_reference"] < 1e-5 and line["max_abs_error_hf_vs_reference"] < 1e-5, line
    assert line["ratio_hf_apply_rotary_pos_emb_time_vs_ours_compiled"] > 0


@pytest.mark.launched
def test_checkpoint_integrity_smoke() -> None:
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "checkpoint_integrity.py"), "--gib", "0.01", "--files", "2",
         "--repeats", "1"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert line["verify_gib_per_s"] > 0 and line["verify_time_vs_read"] > 0


@pytest.mark.launched
def test_checkpoint_save_smoke() -> None:
    """The three runs (no saves, synchronous, asynchronous) of a tiny PP2 model in one launch: each rank's stalls
    and times to a complete tag, and its host copy equal to `estimate`'s (up to Adam's step counters)."""
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "checkpoint_save.py"), "--smoke", "--layouts", "pp2"],
        timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    pp2 = line["pp2"]
    assert [(r["pp_rank"], r["dp_rank"], r["saves"], r["saves_during_training"]) for r in pp2["ranks"]] == [
        (0, 0, 2, 1), (1, 0, 2, 1)]
    for rank in pp2["ranks"]:
        assert 0 < rank["async_stall_s"] <= rank["async_complete_s"] and rank["sync_stall_s"] > 0
        assert 0 <= rank["host_copy_bytes"] - rank["estimated_host_copy_bytes"] <= 16
    assert pp2["tag_bytes"] > sum(r["host_copy_bytes"] for r in pp2["ranks"])
    assert set(pp2["tokens_per_s"]) == {"none", "sync", "async"} and line["disk_write_gib_per_s"] > 0


@pytest.mark.launched
def test_trainer_throughput_smoke() -> None:
    """Both trainers run under the deepspeed launcher on the tiny config (fp32 ZeRO-1) and are timed."""
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "trainer_throughput.py"), "--smoke"],
        timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert line["ours_tokens_per_s"] > 0 and line["hf_trainer_tokens_per_s"] > 0
    assert abs(line["ratio_vs_hf_trainer"] - line["ours_tokens_per_s"] / line["hf_trainer_tokens_per_s"]) < 2e-3
    assert (line["zero"], line["precision"], line["timed_steps"]) == (1, "fp32", 2)


@pytest.mark.launched
def test_rollout_throughput_smoke() -> None:
    """A GRPO run at TP2 under the launcher decodes its groups, HF generate and our TP1 decoding the same groups:
    every side's rate is read, and each completion is as long as asked (no stop id ends one)."""
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "rollout_throughput.py"), "--steps", "2", "--prompts", "1",
         "--generations", "2", "--new-tokens", "4"], timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    for side in ("ours_tp2_rollout_tokens_per_s", "hf_generate_one_process_tokens_per_s",
                 "ours_tp1_one_process_tokens_per_s"):
        assert line[side] > 0, line
    assert 0 < line["generation_share_of_step"] < 1 and line["completions_per_step"] == 2


@pytest.mark.launched
def test_context_parallel_all_to_all_bytes_equal_the_analytic_volume() -> None:
    """parallel_overhead.py at CP2 x TP2 with SP and one KV head per TP rank (repeated for the all-to-all), 4
    processes: the bytes the Ulysses all-to-alls send per decoder layer equal the analytic volume exactly."""
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "parallel_overhead.py"), "--only", "tp2-pp1-cp2-sp-kv2",
         "--steps", "1", "--seq", "64"],
        timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    measured = line["measured_cp_all_to_all_bytes_per_layer_per_micro_batch"]
    assert measured == line["analytic"]["cp_all_to_all_bytes_per_layer_per_micro_batch"] > 0


@pytest.mark.launched
def test_expert_parallel_all_to_all_bytes_and_throughput() -> None:
    """parallel_overhead.py --experts: an MoE model on 2 ranks at EP 1 and EP 2. The bytes the token all-to-alls
    send per MoE layer (counted row by row) come within 25% of the balanced-routing volume (a random router is near
    balanced: about half of a rank's assignments go to the other rank's experts), and EP 2 reports its tokens/s
    against EP 1's."""
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "parallel_overhead.py"), "--experts", "--steps", "1",
         "--seq", "64"],
        timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    ep1, ep2 = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert (ep1["ep"], ep2["ep"]) == (1, 2) and ep1["tokens_per_s"] > 0
    assert not any("[ep]" in key for key in ep1["measured_bytes_per_step"])  # EP 1 exchanges no tokens
    measured = ep2["measured_ep_all_to_all_bytes_per_layer_per_micro_batch"]
    analytic = ep2["analytic_ep_all_to_all_bytes_per_layer_per_micro_batch"]
    assert abs(measured - analytic) <= 0.25 * analytic, (measured, analytic)
    # from the unrounded figures: the printed tokens/s carry 0.1 (one loaded CI step: EP 1 130.4, EP 2 903.1 tokens/s,
    # whose rounding moves the ratio of the printed ones by 2.4e-3), the ratio 1e-3
    assert ep2["tokens_per_s_vs_ep1"] == pytest.approx(ep2["tokens_per_s"] / ep1["tokens_per_s"], rel=2e-3)


@pytest.mark.launched
def test_zero3_init_memory_smoke() -> None:
    """A shape of hidden 1024 and 2 layers at ZeRO-3 DP2, seeded and loaded from a converted checkpoint (the four
    phases one after another in one launch): built partitioned, a rank's peak is below the whole model's, and each
    peak is within 10% of `estimate`'s construction figure.

    The benchmark fixes glibc's mmap threshold at 1 MiB: this shape's tensors (4-12 MiB) otherwise fall under
    glibc's dynamic threshold (up to 32 MiB), and the heap holes left by each full tensor freed after partitioning
    add up to a fifth of the peak, by an amount that differs between machines (the CI's AMD EPYC: 22% above the
    estimate). A real model's tensors are above 32 MiB and are always mapped, which the fixed threshold
    reproduces."""
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "zero3_init_memory.py"), "--layers", "2", "--hidden", "1024",
         "--ranks", "2"], timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    for phase in ("init", "load"):  # built with seeded weights, and filled from a converted checkpoint
        assert line[f"partitioned_{phase}_peak_mib"] < line[f"whole_{phase}_peak_mib"]
        for key in ("whole", "partitioned"):
            assert abs(line[f"{key}_{phase}_peak_mib"] / line[f"{key}_estimate_mib"] - 1) < 0.1, line


@pytest.mark.launched
def test_pipeline_schedules_smoke(tmp_path) -> None:
    """`parallel_overhead.py --schedules` at PP2 with 4 micro batches (one timed step, a small model), the four
    schedules: each stage's busy and idle time add up to the span, each ran its passes (B and W for the split ones),
    the activation peaks are what the schedules hold (stage 0 the same under 1F1B and ZB-H1 within 2%, the last stage more
    under ZB-H1: its pending W passes) and within 10% of `estimate`'s, and the virtual stages send what their
    boundaries carry: 3 crossings of a rank boundary per micro batch and direction for interleaved 1F1B at v = 2,
    2 for ZB-V (its turn stays on the last rank), against 1F1B's 1."""
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"vocab_size": 256, "hidden_size": 128, "intermediate_size": 352,
                                 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
                                 "max_position_embeddings": 256}))
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "parallel_overhead.py"), "--schedules", "--model",
         str(model), "--seq", "128", "--steps", "1", "--schedule-stages", "2", "--schedule-micro-batches", "4"],
        timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert line["analytic_idle_share"] == {"1f1b": 0.2, "zb-h1": 0.077, "interleaved-1f1b": 0.111, "zb-v": 0.04}
    passes = {"1f1b": {"ForwardPass", "BackwardPass"}, "interleaved-1f1b": {"ChunkForward", "ChunkBackward"},
              **{name: {"ChunkForward", "ChunkBackwardInput", "ChunkWeight"} for name in ("zb-h1", "zb-v")}}
    for name, names in passes.items():
        run = line[name]
        assert set(run["pass_s"]) == names
        assert len(run["busy_s"]) == 2 and 0 < run["idle_share"] < 1 and run["tokens_per_s"] > 0
        for busy, idle in zip(run["busy_s"], run["idle_s"]):
            assert abs(busy + idle - run["span_s"]) < 1e-3
        for measured, estimated in zip(run["activation_peak_mib"], run["estimate_activation_mib"]):
            assert abs(measured / estimated - 1) < 0.1, (name, run)
    one, zero = line["1f1b"], line["zb-h1"]
    # stage 0 holds what it held under 1F1B (the engines' buffers apart: ours keeps each micro batch's own, and
    # posts its next receives ahead: up to two more [1, 128, 128] fp32 tensors)
    activation_mib = 128 * 128 * 4 / 2**20
    assert zero["activation_peak_mib"][0] == pytest.approx(one["activation_peak_mib"][0], rel=0.02,
                                                           abs=2 * activation_mib)
    assert zero["activation_peak_mib"][1] > one["activation_peak_mib"][1]
    assert line["interleaved-1f1b_over_1f1b"]["sent_bytes"] == pytest.approx(3, rel=0.02)
    assert line["zb-v_over_1f1b"]["sent_bytes"] == pytest.approx(2, rel=0.02)


@pytest.mark.launched
def test_planner_accuracy_smoke() -> None:
    """The tiny model's 2-process layouts, 3 steps: every layout predicted and measured, the summary computed."""
    result = run_python(
        [os.path.join(ROOT, "benchmarks", "planner_accuracy.py"), "--model",
         os.path.join(ROOT, "configs", "models", "tiny.json"), "--seq", "64", "--steps", "3", "--only", "2"],
        timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(line["layouts"]) == 6 and all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in line["layouts"])
    assert -1 <= line["by_processes"]["2"]["spearman"] <= 1
