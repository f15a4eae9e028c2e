"""Device profiles: what the cost model knows of an accelerator and its links, as data.

A profile is a JSON file (``configs/devices/NAME.json``, or a user's own through ``--device-file``) with each figure's
public source. The ``cpu`` profile is never a constant: ``plan --calibrate`` measures this machine (planner/
calibrate.py) and writes one, which ``--device-file`` then reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from llama_megatron.errors import ConfigError

DEVICES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "configs", "devices")
_KEYS = ("name", "description", "memory_bytes", "peak_tflops", "hbm_bandwidth_gb_s", "gpus_per_node", "intra_node",
         "inter_node", "gemm", "attention", "sources")


@dataclass(frozen=True)
class Link:
    """One direction of a link as one GPU drives it: bytes per second and the latency of one message."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    memory_bytes: int
    peak_flops: dict[str, float | None]  # precision -> dense tensor FLOP/s (None: the device has no such unit)
    hbm_bandwidth: float  # bytes/s
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    gemm_efficiency: float  # the share of the peak large GEMMs reach
    gemm_half_flops: float  # the FLOPs of one GEMM at which half of that share is reached
    attention_efficiency: float  # the share of the bf16 peak fused attention (forward and backward) reaches
    sources: dict[str, str] = field(default_factory=dict)
    # measured seconds of bf16 GEMMs by (m, k, n) (plan --calibrate --model): these shapes are not read off the
    # roll-off, which sees only a GEMM's FLOPs and not how skinny it is
    gemm_measured: dict[tuple[int, int, int], float] = field(default_factory=dict)
    # compute units a node's ranks share (a CPU's cores); None: each rank has its own device
    cores_per_node: int | None = None
    # one GPU's share of its host, for optimizer offload: the GPU-host link (bytes/s, one direction) and host
    # memory bandwidth (bytes/s); None: offload is not planned on this device
    host_link: float | None = None
    host_memory_bandwidth: float | None = None

    @property
    def torch_device(self) -> str:
        """The torch device type its ranks train on (what ``kernels: auto`` resolves by): a CPU host's share cores."""
        return "cpu" if self.cores_per_node else "cuda"

    def peak(self, precision: str) -> float:
        peak = self.peak_flops.get(precision)
        if not peak:
            raise ConfigError(f"device {self.name} has no {precision} peak (its profile lists "
                              f"{', '.join(k for k, v in self.peak_flops.items() if v)})")
        return peak

    def gemm_seconds(self, m: int, k: int, n: int, precision: str, count: float = 1.0) -> float:
        """Seconds of ``count`` GEMMs [m, k] x [k, n]: measured where the profile has that shape (bf16), else
        the roll-off ``efficiency x g / (g + g_half)`` of the peak, ``g`` one GEMM's FLOPs."""
        measured = self.gemm_measured.get((m, k, n)) if precision == "bf16" else None
        if measured is not None:
            return count * measured
        flops = 2.0 * m * k * n
        share = self.gemm_efficiency * flops / (flops + self.gemm_half_flops)
        return count * flops / (self.peak(precision) * share)

    def attention_seconds(self, flops: float) -> float:
        """Seconds for ``flops`` of fused attention (the FLOPs it really does: half the square when causal)."""
        return flops / (self.peak("bf16") * self.attention_efficiency)

    def memory_seconds(self, nbytes: float) -> float:
        return nbytes / self.hbm_bandwidth

    def link(self, crosses_nodes: bool) -> Link:
        return self.inter_node if crosses_nodes else self.intra_node

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "memory_bytes": self.memory_bytes,
                "peak_tflops": {k: None if v is None else v / 1e12 for k, v in self.peak_flops.items()},
                "hbm_bandwidth_gb_s": self.hbm_bandwidth / 1e9, "gpus_per_node": self.gpus_per_node,
                "intra_node": {"bandwidth_gb_s": self.intra_node.bandwidth / 1e9,
                               "latency_us": self.intra_node.latency * 1e6},
                "inter_node": {"bandwidth_gb_s": self.inter_node.bandwidth / 1e9,
                               "latency_us": self.inter_node.latency * 1e6},
                "gemm": {"efficiency": self.gemm_efficiency, "half_efficiency_gflop": self.gemm_half_flops / 1e9,
                         **({"measured_mkn_seconds": [[*shape, seconds] for shape, seconds in
                                                      sorted(self.gemm_measured.items())]}
                            if self.gemm_measured else {})},
                "attention": {"efficiency": self.attention_efficiency}, "sources": self.sources,
                **({"cores_per_node": self.cores_per_node} if self.cores_per_node else {}),
                **({"host": {"link_gb_s": self.host_link / 1e9,
                             "memory_bandwidth_gb_s": self.host_memory_bandwidth / 1e9}}
                   if self.host_link and self.host_memory_bandwidth else {})}

    @classmethod
    def from_dict(cls, data: dict, where: str) -> DeviceProfile:
        missing = [key for key in _KEYS if key not in data]
        if missing:
            raise ConfigError(f"device profile {where}: missing {', '.join(missing)}")
        try:
            def link(section: str) -> Link:
                return Link(float(data[section]["bandwidth_gb_s"]) * 1e9, float(data[section]["latency_us"]) * 1e-6)

            profile = cls(
                name=str(data["name"]), description=str(data["description"]), memory_bytes=int(data["memory_bytes"]),
                peak_flops={k: None if v is None else float(v) * 1e12 for k, v in data["peak_tflops"].items()},
                hbm_bandwidth=float(data["hbm_bandwidth_gb_s"]) * 1e9, gpus_per_node=int(data["gpus_per_node"]),
                intra_node=link("intra_node"), inter_node=link("inter_node"),
                gemm_efficiency=float(data["gemm"]["efficiency"]),
                gemm_half_flops=float(data["gemm"]["half_efficiency_gflop"]) * 1e9,
                attention_efficiency=float(data["attention"]["efficiency"]), sources=dict(data["sources"]),
                gemm_measured={(int(m), int(k), int(n)): float(t)
                               for m, k, n, t in data["gemm"].get("measured_mkn_seconds", [])},
                cores_per_node=int(data["cores_per_node"]) if data.get("cores_per_node") else None,
                host_link=float(data["host"]["link_gb_s"]) * 1e9 if "host" in data else None,
                host_memory_bandwidth=float(data["host"]["memory_bandwidth_gb_s"]) * 1e9 if "host" in data else None)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ConfigError(f"device profile {where}: {type(error).__name__} {error}") from None
        positive = [profile.memory_bytes, profile.hbm_bandwidth, profile.gpus_per_node, profile.gemm_efficiency,
                    profile.attention_efficiency, profile.intra_node.bandwidth, profile.inter_node.bandwidth,
                    profile.peak_flops.get("bf16") or 0]
        if min(positive) <= 0 or profile.gemm_efficiency > 1 or profile.attention_efficiency > 1:
            raise ConfigError(f"device profile {where}: sizes, bandwidths and the bf16 peak must be > 0 and the "
                              "efficiencies in (0, 1]")
        return profile


# figures of 1: for walking a model's passes where only their shapes matter (the GEMMs a calibration times)
UNIT_PROFILE = DeviceProfile("unit", "figures of 1, for shapes only", 1, {"bf16": 1.0, "fp8": 1.0}, 1.0, 1,
                             Link(1.0, 0.0), Link(1.0, 0.0), 1.0, 1.0, 1.0)


# torch.cuda.get_device_name() (CUDA and ROCm) -> the shipped profile: the first entry the name contains, the
# specific ones first ("NVIDIA H100 PCIe" before any other H100, which is the SXM part: "NVIDIA H100 80GB HBM3")
_DEVICE_NAME_PROFILES = (("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("H200", "h200"), ("B200", "b200"),
                         ("A100", "a100-80gb"), ("L40S", "l40s"), ("MI300X", "mi300x"))


def profile_for_device(device_name: str) -> DeviceProfile | None:
    """The shipped profile of the accelerator ``device_name`` names (its peaks: MFU's denominator), or None."""
    return next((load_device(profile) for part, profile in _DEVICE_NAME_PROFILES if part in device_name), None)


def device_names() -> list[str]:
    return sorted(name[:-5] for name in os.listdir(DEVICES_DIR) if name.endswith(".json"))


def load_device(name: str | None = None, path: str | None = None) -> DeviceProfile:
    """A shipped profile by name, or a profile file."""
    if path is None:
        if name not in device_names():
            hint = " (the cpu profile is measured: plan --calibrate, then --device-file)" if name == "cpu" else ""
            raise ConfigError(f"unknown device {name!r}: one of {', '.join(device_names())}, or --device-file "
                              f"PATH{hint}")
        path = os.path.join(DEVICES_DIR, f"{name}.json")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"device profile {path}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"device profile {path}: expected a JSON object")
    return DeviceProfile.from_dict(data, path)
