"""What DeepSpeed 0.19.8 allocates for a rank's parameters, from its config (the memory estimate's model states and
communication buffers; training/diagnostics/memory_estimate.py composes them with the activations): which optimizer
its engine picks, the bytes of parameters, gradients and optimizer states, and the buffers it allocates whole
whatever the model's size (:func:`zero_buffers`), with the line `estimate` and `plan` print where those dwarf it.

A rank's parameters are ``(numel, decayed, trains, expert)`` tuples in forward order (memory_estimate's layer
table per TP rank).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from llama_megatron.errors import ConfigError
from llama_megatron.training.engine.deepspeed_config import precision, zero_stage

GiB = 1024**3
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # a parameter or activation element, by the run's precision


def optimizer_wrapper(ds: dict, pp: int) -> str:
    """The optimizer DeepSpeed's engine picks (``_do_optimizer_sanity_check``)."""
    prec, stage = precision(ds), zero_stage(ds)
    accum = ds.get("data_types", {}).get("grad_accum_dtype")
    accum_fp32 = accum in ("fp32", "float32", "float")
    offload = offloaded(ds, "offload_optimizer")
    if stage >= 1:
        return "bf16" if prec == "bf16" and accum_fp32 and stage == 1 and not offload else f"zero{stage}"
    if prec == "fp32":
        return "basic"
    if accum_fp32:
        raise ConfigError(f"DeepSpeed refuses ZeRO-0 with {prec} parameters and fp32 gradient accumulation: "
                          "use ZeRO-1")
    return "bf16" if prec == "bf16" and pp > 1 else "fp16_wrapper"


def offloaded(ds: dict, key: str) -> bool:
    return ds.get("zero_optimization", {}).get(key, {}).get("device") in ("cpu", "nvme")


def _aligned(numel: int, dp: int) -> int:
    """A flat group padded to a multiple of 2 x DP (DeepSpeed's nccl_start_alignment_factor)."""
    return math.ceil(numel / (2 * dp)) * 2 * dp


def model_states(params: list[tuple[int, bool, bool, bool]], ds: dict, wrapper: str, dp: int, e: int,
                 ep: int = 1) -> dict[str, int]:
    """Parameter, gradient and optimizer bytes of one rank holding ``params`` ((numel, decayed, trains, expert)
    each: a frozen one is held in the run's precision, without gradient or optimizer state; ZeRO partitions an
    expert's over DP x CP / EP ranks, in groups of its own); keys with a ``cpu_`` prefix."""
    frozen = sum(n for n, _, trains, _ in params if not trains)
    groups = [(sum(n for n, decay, trains, expert in params if decay == d and trains and expert == x),
               dp // ep if x else dp) for x in (False, True) for d in (True, False)]
    groups = [(g, parts) for g, parts in groups if g]  # DeepSpeed drops empty parameter groups
    total = sum(g for g, _ in groups)
    zero = ds.get("zero_optimization", {})
    out = dict.fromkeys(("parameters", "gradients", "optimizer", "cpu_parameters", "cpu_gradients",
                         "cpu_optimizer"), 0)
    opt = "cpu_optimizer" if offloaded(ds, "offload_optimizer") else "optimizer"
    if wrapper == "basic":  # torch AdamW on the fp32 parameters: exp_avg + exp_avg_sq
        out.update(parameters=4 * (total + frozen), gradients=4 * total, optimizer=8 * total)
    elif wrapper == "fp16_wrapper":  # whole fp32 master copy and its gradients, Adam on top
        out.update(parameters=e * (total + frozen), gradients=(e + 4) * total, optimizer=12 * total)
    elif wrapper in ("bf16", "zero1", "zero2"):
        flat = sum(_aligned(g, parts) for g, parts in groups)
        owned = sum(_aligned(g, parts) // parts for g, parts in groups)  # this rank's partitions
        out["parameters"] = e * (flat + frozen)
        out[opt] = 12 * owned  # fp32 master partition + exp_avg + exp_avg_sq
        if wrapper == "bf16":  # fp32 gradient accumulation buffer over the whole flat group
            out["gradients"] = 4 * flat
        else:  # ZeRO-1 keeps whole gradients, ZeRO-2 its partition (the reduce buckets: zero_buffers)
            kept = flat if wrapper == "zero1" else owned
            out["gradients"] = e * kept
            out["cpu_gradients" if opt == "cpu_optimizer" else "gradients"] += 4 * owned
    else:  # zero3: every parameter partitioned, frozen or not; gradients and optimizer for the trained ones
        part = sum(math.ceil(n / dp) for n, _, _, _ in params)
        trained = sum(math.ceil(n / dp) for n, _, trains, _ in params if trains)
        # gathered into a DP-padded buffer each
        persistent = sum(math.ceil(params[i][0] / dp) * dp for i in _persistent(params, zero))
        out["cpu_parameters" if offloaded(ds, "offload_param") else "parameters"] = e * part
        out["parameters"] += e * persistent
        out[opt] = 12 * trained
        out["gradients"] = e * trained
        out["cpu_gradients" if opt == "cpu_optimizer" else "gradients"] += 4 * trained
    return out


# DeepSpeed's names of a dtype (runtime/config.py DtypeEnum, communication_data_type) -> ours
_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
                "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
                "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16"}
DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size (runtime/zero/config.py:113)


def _dtype_bytes(name: str | None, default: int) -> int:
    return ELEMENT_BYTES[_DTYPE_NAMES[name.lower()]] if name else default


@dataclass
class ZeroBuffers:
    """What :func:`zero_buffers` counts on one rank, in bytes, and the bucket's size in elements."""

    reduce_buckets: int = 0
    gathered_parameters: int = 0
    bucket_elements: int = 0


def zero_buffers(params: list[tuple[int, bool, bool, bool]], ds: dict, wrapper: str, dp: int, e: int,
                 pp: int) -> ZeroBuffers:
    """DeepSpeed 0.19.8's communication buffers on a rank holding ``params`` (in forward order), counted as if alive
    with the activations (the estimate's sum), each allocated whole whatever the model's size.

    ZeRO-1/2 (``stage_1_and_2.py``): with ``contiguous_gradients`` (default true; forced by CPU offload, :300) the
    first gradient hook of a backward allocates a buffer of ``reduce_bucket_size`` elements (``setup_buckets``,
    :3256), and a second one under ``overlap_comm`` (default false below ZeRO-3, runtime/zero/config.py:384;
    DeepSpeed turns it off under pipeline parallelism, engine.py:2666), in the gradients' dtype, or the accumulation
    dtype where ZeRO-1 accumulates apart (:402, :1253). ZeRO-2 frees them at each backward's end
    (``independent_gradient_partition_epilogue`` -> ``_release_ipg_buffers``, :1016, :924); ZeRO-1 keeps them from
    the step's first backward to its reduction at the accumulation boundary, where under PP ``reduce_gradients``
    allocates one more (:958). Without ``contiguous_gradients`` the reduction flattens up to a bucket of gradients
    instead. The all-gather of the updated parameters writes into the flat groups in place (runtime/utils.py:1008):
    ``allgather_bucket_size`` allocates nothing.

    ZeRO-3 (``stage3.py``): one buffer of ``reduce_bucket_size`` elements in the communication dtype, allocated with
    the optimizer and kept (:782); never doubled by ``overlap_comm``. Parameters the forward gathers stay whole while
    their next use lies within ``stage3_max_reuse_distance`` elements of parameters fetched
    (``partitioned_param_coordinator.py`` ``__params_to_release``, :634): at the forward's end the trailing ones
    whose remaining forward and backward span less than it (every one of a small model), each padded to a multiple
    of DP; each fetch prefetches up to ``stage3_prefetch_bucket_size`` elements (and the parameter that crosses it)
    of the ones released, bounded by ``stage3_max_live_parameters`` (:453). Persistent parameters are
    ``parameters`` already. The parameters are taken one by one in the layer table's order, as if each were a module
    of its own (ours hold one each, but for the norms).

    ZeRO-0 and the BF16 optimizer get no buckets: the engine's all-reduce (``buffered_allreduce_fallback``,
    engine.py:3921) flattens up to 5e8 gradient elements at a time after the backward, when the activations it
    would sit beside are gone.
    """
    zero = ds.get("zero_optimization", {})
    out = ZeroBuffers()
    if wrapper not in ("zero1", "zero2", "zero3"):
        return out
    size = int(zero.get("reduce_bucket_size", DEFAULT_BUCKET))
    out.bucket_elements = size
    trained = sum(n for n, _, trains, _ in params if trains)
    if wrapper == "zero3":
        comm = _dtype_bytes(ds.get("communication_data_type"), e)
        out.reduce_buckets = comm * size if zero.get("contiguous_gradients", True) else 0
        out.gathered_parameters = e * _zero3_gathered(params, zero, dp)
        return out
    accum = _dtype_bytes(ds.get("data_types", {}).get("grad_accum_dtype"), e)
    element = accum if wrapper == "zero1" else e  # ZeRO-1 buckets the accumulated gradient (its own dtype or ours)
    if not (zero.get("contiguous_gradients", True) or offloaded(ds, "offload_optimizer")):
        out.reduce_buckets = element * min(size, trained)  # the reduction's flattened copy of one bucket
        return out
    count = 2 if zero.get("overlap_comm", False) and pp == 1 else 1
    if wrapper == "zero1" and pp > 1:
        count += 1  # reduce_gradients(pipeline_parallel=True) appends one to the hooks' bucket
    out.reduce_buckets = count * element * size
    return out


def _stage3(zero: dict, name: str, default: float) -> int:
    """A ZeRO-3 setting DeepSpeed takes as ``stage3_NAME`` or ``NAME`` (its config's aliases, runtime/zero/config.py)."""
    return int(zero.get(f"stage3_{name}", zero.get(name, default)))


def _persistent(params: list[tuple[int, bool, bool, bool]], zero: dict) -> set[int]:
    """Indices of the ZeRO-3 parameters kept whole on every rank (DeepSpeed's mark_persistent_parameters, in
    parameter order: at most ``stage3_param_persistence_threshold`` elements each, up to
    ``stage3_model_persistence_threshold`` in all)."""
    threshold = _stage3(zero, "param_persistence_threshold", 1e5)
    budget = _stage3(zero, "model_persistence_threshold", 2**63 - 1)
    persistent, counted = set(), 0
    for i, (n, _, _, _) in enumerate(params):
        if n <= threshold and counted + n <= budget:
            counted += n
            persistent.add(i)
    return persistent


class BucketStage(Protocol):
    """What :func:`bucket_note` reads of a stage's estimate (memory_estimate.StageEstimate)."""

    reduce_buckets: int
    bucket_elements: int
    trained_elements: int

    @property
    def gpu_total(self) -> int: ...


def bucket_note(stages: Sequence[BucketStage]) -> str | None:
    """One line when much of DeepSpeed's reduce bucket, allocated whole, is never filled: the part no stage's
    gradients reach is over a tenth of that stage's peak. It names ``zero_optimization.reduce_bucket_size`` and
    a value that fits (the largest stage's trained elements on a rank, rounded up to two significant digits: every
    gradient of a backward in one bucket, so nothing is lost but the unused memory)."""
    need = max((s.trained_elements for s in stages), default=0)
    wasted = [s for s in stages if s.reduce_buckets and s.bucket_elements > need
              and s.reduce_buckets * (1 - need / s.bucket_elements) > 0.1 * s.gpu_total]
    if not wasted or need == 0:
        return None
    worst = max(wasted, key=lambda s: s.reduce_buckets)
    digits = 10 ** max(0, len(str(need)) - 2)
    fits = -(-need // digits) * digits
    return (f"note: DeepSpeed allocates its reduce bucket whole: zero_optimization.reduce_bucket_size "
            f"{worst.bucket_elements} elements ({worst.reduce_buckets / GiB:.3f} GiB per rank) for {need} "
            f"gradient elements per rank; set zero_optimization.reduce_bucket_size to {fits}")


def _zero3_gathered(params: list[tuple[int, bool, bool, bool]], zero: dict, dp: int) -> int:
    """Elements of the whole (DP-padded) parameters a ZeRO-3 rank holds gathered at the forward's end and the
    backward's first prefetch, beside the persistent ones (see :func:`zero_buffers`)."""
    reuse = _stage3(zero, "max_reuse_distance", 1e9)
    live = _stage3(zero, "max_live_parameters", 1e9)
    prefetch = _stage3(zero, "prefetch_bucket_size", 5e7)
    persistent = _persistent(params, zero)
    kept, released, after = 0, [], 0
    for i in reversed(range(len(params))):  # from the forward's last parameter: what follows it is used twice more
        n = params[i][0]
        padded = math.ceil(n / dp) * dp
        if i not in persistent:
            if 2 * after < reuse:
                kept += padded
            else:
                released.append(padded)
        after += n
    if not released:
        return kept
    # a fetch prefetches the parameters after it up to the bucket, and the one that crosses it: at the backward's
    # start beside the kept ones; in the forward beside the parameter in use (the kept ones not fetched yet)
    ahead = max(0, min(prefetch, live - kept))
    largest = max(released)
    return max(kept + min(sum(released), largest + ahead), min(sum(released), 2 * largest + ahead))
