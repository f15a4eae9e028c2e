"""Every layout the engine runs for one model, sequence, batch and cluster; each checked by the training config's
own validation and the DeepSpeed config builder (what ``train`` would refuse, the planner refuses with the same
words), sized by the memory estimate and timed by the cost model; ranked by tokens per second per GPU."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from llama_megatron.errors import ConfigError
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.diagnostics.memory_estimate import (
    Estimate,
    estimate,
    optimizer_wrapper,
    rank_parameter_counts,
)
from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config
from llama_megatron.training.pipeline.schedules import SCHEDULES, micro_batch_rule, schedule_record
from llama_megatron.training.planner.cost import CostModel, StepTime
from llama_megatron.training.planner.devices import DeviceProfile

GiB = 2**30
LAYOUT_KEYS = ("tp", "pp", "vp", "cp", "ep", "mbs", "schedule", "zero", "recompute", "sp", "offload")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vp: int = 1  # virtual stages (chunks) per pipeline rank
    cp: int = 1
    ep: int = 1
    mbs: int = 1
    schedule: str = "1f1b"
    zero: int = 1
    recompute: bool = False  # every decoder layer recomputed in the backward (activation_checkpointing 1)
    sp: bool = True  # sequence parallelism where TP > 1 (the search never turns it off: it only saves memory)
    offload: bool = False  # the optimizer's states and step on the host (ZeRO-Offload: offload_optimizer cpu)

    @property
    def sequence_parallel(self) -> bool:
        return self.sp and self.tp > 1

    def dp(self, gpus: int) -> int:
        return gpus // (self.tp * self.pp * self.cp)

    def label(self, gpus: int) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"] + ([f"vp{self.vp}"] if self.vp > 1 else []) + \
            ([f"cp{self.cp}"] if self.cp > 1 else []) + ([f"ep{self.ep}"] if self.ep > 1 else []) + \
            [f"dp{self.dp(gpus)}", f"mbs{self.mbs}"] + ([self.schedule] if self.pp > 1 else []) + \
            [f"zero{self.zero}"] + (["recompute"] if self.recompute else []) + \
            (["no-sp"] if self.tp > 1 and not self.sp else []) + (["offload"] if self.offload else [])
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``tp=4,pp=8,vp=5,cp=1,ep=1,mbs=1,schedule=interleaved-1f1b,zero=1,recompute=1`` (any subset)."""
        values: dict = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in LAYOUT_KEYS:
                raise ConfigError(f"--layout {text!r}: expected KEY=VALUE items with KEY one of "
                                  f"{', '.join(LAYOUT_KEYS)}, got {item!r}")
            if key == "schedule":
                values[key] = value
            elif key in ("recompute", "sp", "offload"):
                values[key] = value.lower() in ("1", "true", "yes", "full")
            else:
                try:
                    values[key] = int(value)
                except ValueError:
                    raise ConfigError(f"--layout {text!r}: {key} must be an integer, got {value!r}") from None
        if values.get("schedule") is None and values.get("vp", 1) > 1:
            values["schedule"] = "interleaved-1f1b"
        return cls(**values)


@dataclass
class Planned:
    layout: Layout
    config: TrainingConfig
    ds: dict
    memory: Estimate
    time: StepTime | None = None


@dataclass
class Refused:
    layout: Layout
    reason: str
    over: float = 0.0  # bytes over the budget (memory refusals), for showing the nearest first
    offloadable: float = 0.0  # the optimizer states' bytes that offload would take off the GPU


def layout_dict(base: dict, layout: Layout) -> dict:
    """The training JSON of ``layout``: ``base`` with its parallel, pipeline, batch, recomputation and DeepSpeed
    sections replaced."""
    data = copy.deepcopy(base)
    data["parallel"] = {**data.get("parallel", {}), "tensor": layout.tp, "pipeline": layout.pp, "context": layout.cp,
                        "expert": layout.ep, "sequence_parallel": layout.sequence_parallel}
    data["pipeline"] = {**{k: v for k, v in data.get("pipeline", {}).items() if k != "stage_layers"},
                        "schedule": layout.schedule, "virtual_stages": layout.vp}
    data["batch"] = {**data.get("batch", {}), "micro_batch_size": layout.mbs}
    data["activation_checkpointing"] = {"interval": 1 if layout.recompute else 0}
    data["deepspeed_config"] = deepspeed_dict(layout)
    return data


def deepspeed_dict(layout: Layout) -> dict:
    """bf16 with the layout's ZeRO stage (under FP8 too: it changes the GEMMs' rate, not the states' bytes) and,
    offloaded, the optimizer on the host."""
    zero: dict = {"stage": layout.zero}
    if layout.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"zero_optimization": zero, "bf16": {"enabled": True}}


class Planner:
    def __init__(self, base: dict, gpus: int, device: DeviceProfile, gpus_per_node: int | None = None,
                 precision: str = "bf16", schedules: list[str] | None = None, tp_across_nodes: bool = False,
                 max_micro_batch: int = 8, memory_margin: float = 0.05) -> None:
        if precision == "fp8" and base.get("fp8") is None:  # what a written layout trains with, and what the
            base = {**base, "fp8": {"recipe": "tensorwise"}}  # estimate counts (the float8 operands of a GEMM)
        self.base = base
        self.base_config = TrainingConfig.from_dict(base)  # the base itself must be valid
        self.gpus, self.device, self.precision = gpus, device, precision
        self.gpus_per_node = gpus_per_node or device.gpus_per_node
        self.schedules = schedules or list(SCHEDULES)
        for name in self.schedules:
            schedule_record(name)
        self.tp_across_nodes, self.max_micro_batch = tp_across_nodes, max_micro_batch
        self.budget = device.memory_bytes * (1 - memory_margin)
        self.cost = CostModel(device, precision, gpus, self.gpus_per_node)
        device.peak(precision)

    # --- one layout ---------------------------------------------------------------------------------------------
    def check(self, layout: Layout) -> Planned | Refused:
        """The layout sized and timed, or the one-line reason it cannot run or fit."""
        if layout.tp > self.gpus_per_node and not self.tp_across_nodes:
            return Refused(layout, f"TP {layout.tp} > {self.gpus_per_node} GPUs per node")
        if layout.offload and not self.device.host_link:
            return Refused(layout, f"device {self.device.name} has no host figures: offload is not planned on it")
        try:
            config = self._config(layout)
            config.check_world_size(self.gpus)
            ds = build_deepspeed_config(config, config.deepspeed_config, self.gpus, "cuda")
            optimizer_wrapper(ds, layout.pp)  # the optimizer DeepSpeed would refuse, before any sizing
            params = max(rank_parameter_counts(config))
            partitions = layout.dp(self.gpus) * layout.cp
            # Adam's fp32 master copy and moments on the busiest rank: what offload takes off the GPU
            states = 12 * params / (partitions if layout.zero >= 1 else 1)
            # its bf16 weights (1/(DP x CP) under ZeRO-3) and the states: a floor of what the estimate counts
            floor = 2 * params / (partitions if layout.zero == 3 else 1) + (0 if layout.offload else states)
            if floor > self.budget:  # no need to size the activations
                return self._too_big(layout, "the weights and Adam states alone need", floor, states)
            memory = estimate(config, ds, self.gpus)
        except (ConfigError, ValueError) as error:
            return Refused(layout, str(error))
        worst = max(memory.stages, key=lambda s: s.gpu_total)
        if worst.gpu_total > self.budget:
            return self._too_big(layout, f"stage {worst.stage} needs", worst.gpu_total, states)
        planned = Planned(layout, config, ds, memory)
        planned.time = self.cost.step_time(config, self.gpus, ds)
        return planned

    def _too_big(self, layout: Layout, what: str, nbytes: float, states: float) -> Refused:
        return Refused(layout, f"{what} {nbytes / GiB:.2f} GiB > {self.budget / GiB:.2f} GiB usable of "
                               f"{self.device.memory_bytes / GiB:.2f}", nbytes - self.budget,
                       0.0 if layout.offload else states)

    def gemm_shapes(self, layouts: list[Layout] | None = None) -> set[tuple[int, int, int]]:
        """The GEMMs of ``layouts`` (default: every candidate the engine accepts), for the calibration to time."""
        configs = []
        for layout in layouts if layouts is not None else (one for group in self.candidates() for one in group):
            try:
                configs.append(self._config(layout))
            except (ConfigError, ValueError):
                continue
        return CostModel.gemm_shapes(configs)

    def _config(self, layout: Layout) -> TrainingConfig:
        base = self.base_config
        config = dataclasses.replace(
            base,
            parallel=dataclasses.replace(base.parallel, tensor=layout.tp, pipeline=layout.pp, context=layout.cp,
                                         expert=layout.ep, sequence_parallel=layout.sequence_parallel),
            pipeline=dataclasses.replace(base.pipeline, schedule=layout.schedule, virtual_stages=layout.vp,
                                         stage_layers=None),
            batch=dataclasses.replace(base.batch, micro_batch_size=layout.mbs),
            activation_checkpointing=dataclasses.replace(base.activation_checkpointing,
                                                         interval=1 if layout.recompute else 0),
            deepspeed_config=deepspeed_dict(layout))
        config.validate()
        return config

    # --- the search ---------------------------------------------------------------------------------------------
    def candidates(self) -> Iterator[tuple[Layout, ...]]:
        """Layouts grouped by everything but the micro batch (ascending within a group: memory grows with it)."""
        model, gpus = self.base_config.model, self.gpus
        layers = model.num_hidden_layers
        experts = model.num_local_experts if model.family.moe else 1
        global_batch = self.base_config.batch.global_batch_size
        for tp in _divisors(gpus):
            for cp in _divisors(gpus // tp):
                for pp in _divisors(gpus // (tp * cp)):
                    if pp > layers:
                        continue
                    dp = gpus // (tp * cp * pp)
                    if global_batch % dp:
                        continue
                    per_rank = global_batch // dp
                    sizes = [b for b in _divisors(per_rank) if b <= self.max_micro_batch]
                    for ep in _divisors(experts):
                        if (dp * cp) % ep:
                            continue
                        for schedule, vp in self._schedules(pp, layers):
                            for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                                for recompute in (False, True):
                                    yield tuple(Layout(tp, pp, vp, cp, ep, b, schedule, zero, recompute)
                                                for b in sizes)

    def _schedules(self, pp: int, layers: int) -> list[tuple[str, int]]:
        if pp == 1:
            return [("1f1b", 1)]
        out = []
        for name in self.schedules:
            record = schedule_record(name)
            if record.chunks is None:  # any v >= 2: those that split the layers evenly, as Megatron's need
                out += [(name, v) for v in range(2, layers // pp + 1) if layers % (pp * v) == 0]
            else:
                out += [(name, v) for v in record.chunks]
        return out

    def _micro_batches_refused(self, layout: Layout) -> bool:
        """Whether the schedule cannot run this layout's micro batches per step: the one refusal a larger micro
        batch (fewer of them) may lift."""
        global_batch = self.base_config.batch.global_batch_size
        micro_batches = global_batch // (layout.dp(self.gpus) * layout.mbs)
        return layout.pp > 1 and micro_batch_rule(layout.schedule, layout.pp, layout.vp, micro_batches) is not None

    def search(self, progress: Callable[[int, int], None] | None = None) -> tuple[list[Planned], list[Refused]]:
        """Every candidate group, smallest micro batch first; a group that does not fit on the GPU by less than
        its optimizer states is tried again with them on the host (offload, where the device has host figures:
        never faster, so only where nothing else fits the group)."""
        groups = list(self.candidates())
        planned, refused = [], []
        for done, group in enumerate(groups, 1):
            first = self._search_group(group, planned, refused)
            if self._offload_may_fit(first):
                self._search_group(tuple(dataclasses.replace(one, offload=True) for one in group), planned, refused)
            if progress is not None:
                progress(done, len(groups))
        planned.sort(key=lambda p: -p.time.tokens_per_s_per_gpu)
        refused.sort(key=lambda r: (r.over == 0, r.over))
        return planned, refused

    def _offload_may_fit(self, first: Planned | Refused) -> bool:
        """Whether a group whose first layout did not fit might with its optimizer states on the host: they
        would free at least what it is over by."""
        return (isinstance(first, Refused) and 0 < first.over <= first.offloadable and first.layout.zero >= 1
                and self.device.host_link is not None)

    def _search_group(self, group: tuple[Layout, ...], planned: list[Planned],
                      refused: list[Refused]) -> Planned | Refused:
        """The group's layouts up to the first that does not fit; the first layout's result."""
        results = []
        for layout in group:
            results.append(self.check(layout))
            if isinstance(results[-1], Refused):
                refused.append(results[-1])
                if not self._micro_batches_refused(layout):
                    break  # a larger micro batch needs more memory, or fails the same rule
            else:
                planned.append(results[-1])
        return results[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def write_layout(path: str, base: dict, layout: Layout) -> tuple[str, str]:
    """The winner as a training JSON (``path``) and the DeepSpeed JSON it names (``PATH`` with ``.deepspeed.json``),
    each written to a temporary file and renamed."""
    data = layout_dict(base, layout)
    ds_path = os.path.splitext(path)[0] + ".deepspeed.json"
    ds, data["deepspeed_config"] = data["deepspeed_config"], ds_path
    for target, content in ((ds_path, ds), (path, data)):
        temp = f"{target}.tmp-{os.getpid()}"
        with open(temp, "w", encoding="utf-8") as fh:
            json.dump(content, fh, indent=2)
            fh.write("\n")
        os.replace(temp, target)
    return path, ds_path
