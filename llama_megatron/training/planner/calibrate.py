"""``plan --calibrate``: a device profile of this machine, measured (the ``cpu`` profile is never a constant).

One process per rank to be (``--nproc``), each with one thread as the training launches run them. The compute
figures are measured by as many of them at once as there are cores (one rank a core; the median over them is
kept) and the profile records the cores, so the cost model can share them among more ranks than cores (each
rank's pass at one core's speed, the node no faster than its ranks' compute over its cores):

- GEMMs: square bf16 matmuls of several sizes; ``1 / rate = 1 / E + h / (E g)`` (``g`` a GEMM's FLOPs) fitted
  by least squares gives the peak ``E`` (efficiency 1 by definition) and the size ``h`` at which half of it is
  reached: the profile's ``gemm`` roll-off; and each (m, k, n) GEMM of ``shapes`` (the model's: forward, input
  and weight gradient of every linear of the layouts to be planned), timed as it is, since a GEMM's FLOPs alone
  do not say how fast it runs on a CPU (a weight gradient over few tokens is a skinny one);
- attention: causal scaled-dot-product attention, forward and backward, at the model-sized head dimension, its
  FLOPs (half the square) over ``E``: ``attention.efficiency``;
- memory: a large copy's bytes read and written per second;
- links: all-reduce between the ``nproc`` processes (gloo) of several sizes, ``t = 2 (n-1)/n S / B + 2
  (n-1) L`` fitted for the bandwidth ``B`` and latency ``L``, used for both the intra- and the inter-node link
  (one host).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llama_megatron.model.kernels.attention import sdpa_backend
from llama_megatron.parallel.placement import available_cores, free_port
from llama_megatron.training.planner.devices import DeviceProfile, Link

GEMM_SIZES = (64, 128, 256, 384, 512, 768)
ALL_REDUCE_BYTES = (2**12, 2**15, 2**18, 2**20, 2**22)


def _timed(run, repeats: int = 5) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def measure_gemm(dtype: torch.dtype = torch.bfloat16) -> tuple[float, float, list[tuple[float, float]]]:
    """(peak FLOP/s, FLOPs of a GEMM at half of it, the measured (FLOPs, FLOP/s) points)."""
    seconds = measure_shapes([(n, n, n) for n in GEMM_SIZES], dtype)
    points = [(2.0 * n**3, 2.0 * n**3 / t) for n, t in zip(GEMM_SIZES, seconds)]
    intercept, slope = _fit_line([1 / g for g, _ in points], [1 / r for _, r in points])
    best = max(r for _, r in points)
    peak = 1 / intercept if intercept > 0 else best  # the fit's asymptote (the largest rate when it has none)
    half = max(slope * peak, 0.0)
    return peak, half, points


def measure_attention(peak: float, seq: int = 512, heads: int = 4, head_dim: int = 64) -> float:
    """Causal attention's FLOP/s (forward and backward, half the square) over the GEMM peak."""
    q, k, v = (torch.randn(1, heads, seq, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def step() -> None:
        with sdpa_backend(q):  # the backend training takes on this CPU
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    flops = 3.5 * 4 * seq * seq * heads * head_dim * 0.5  # forward 1, backward 2.5 (the cost model's rule)
    return min(1.0, flops / _timed(step) / peak)


def measure_memory(nbytes: int = 2**27) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    target = torch.empty_like(source)
    return 2 * nbytes / _timed(lambda: target.copy_(source))


def measure_shapes(shapes: list[tuple[int, int, int]], dtype: torch.dtype = torch.bfloat16) -> list[float]:
    """Seconds of one [m, k] x [k, n] GEMM for each shape."""
    out = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        out.append(_timed(lambda a=a, b=b: a @ b))
    return out


def _compute_figures(shapes: list[tuple[int, int, int]]) -> dict:
    peak, half, _ = measure_gemm()
    return {"peak": peak, "half": half, "attention": measure_attention(peak), "memory": measure_memory(),
            "shapes": measure_shapes(shapes)}


def _worker(rank: int, world: int, port: int, shapes: list, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dist.barrier()
        if rank < available_cores():  # one rank a core measures the compute; the rest wait
            results[rank] = _compute_figures(shapes)
        dist.barrier()
        timings = {}
        for size in ALL_REDUCE_BYTES:
            tensor = torch.ones(size // 4)
            dist.barrier()
            timings[size] = _timed(lambda tensor=tensor: dist.all_reduce(tensor), repeats=7)
        results[f"timings{rank}"] = timings
    finally:
        dist.destroy_process_group()


def _median_figures(ranks: list[dict]) -> dict:
    merged = {key: statistics.median(r[key] for r in ranks) for key in ("peak", "half", "attention", "memory")}
    merged["shapes"] = [statistics.median(times) for times in zip(*(r["shapes"] for r in ranks))]
    return merged


def measure_ranks(nproc: int, shapes: list[tuple[int, int, int]]) -> dict:
    """Every measurement in ``nproc`` one-thread processes (the compute in one per core, at once): the median over
    them of each figure, and the all-reduce fitted to the ring formula for the link."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(nproc, free_port(), shapes, results), nprocs=nproc, join=True)
        computed = [dict(results[r]) for r in range(min(nproc, available_cores()))]
        timings = [dict(results[f"timings{r}"]) for r in range(nproc)]
    merged = _median_figures(computed)
    steps = nproc - 1
    times = [statistics.median(t[s] for t in timings) for s in ALL_REDUCE_BYTES]
    intercept, slope = _fit_line([2 * steps / nproc * s for s in ALL_REDUCE_BYTES], times)
    merged["link"] = Link(bandwidth=1 / slope if slope > 0 else float("inf"),
                          latency=max(intercept, 0.0) / (2 * steps))
    return merged


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def calibrate(nproc: int, shapes: Iterable[tuple[int, int, int]] = ()) -> DeviceProfile:
    """This machine as ``nproc`` one-thread ranks; ``shapes``: the (m, k, n) GEMMs to time as they are."""
    shapes = sorted(set(shapes))
    if nproc > 1:
        measured = measure_ranks(nproc, shapes)
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            measured = {**_compute_figures(shapes), "link": Link(float("inf"), 0.0)}
        finally:
            torch.set_num_threads(threads)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(nproc, 1)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = f"measured by `llama-megatron plan --calibrate --nproc {nproc}` on this machine, {when}"
    return DeviceProfile(
        name="cpu", description=f"{_cpu_name()}, {nproc} one-thread ranks (gloo)", memory_bytes=int(memory),
        peak_flops={"bf16": measured["peak"], "fp8": None}, hbm_bandwidth=measured["memory"], gpus_per_node=nproc,
        intra_node=measured["link"], inter_node=measured["link"], gemm_efficiency=1.0,
        gemm_half_flops=measured["half"], attention_efficiency=measured["attention"],
        gemm_measured=dict(zip(shapes, measured["shapes"])), cores_per_node=available_cores(),
        sources={key: source for key in ("peak_tflops", "memory_bytes", "hbm_bandwidth_gb_s", "intra_node",
                                         "inter_node", "gemm", "attention", "cores_per_node")})
