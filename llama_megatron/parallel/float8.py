"""Float8 matmuls of the tensor-parallel linears, with torchao's float8 training recipes (docs/fp8.md).

A linear's three GEMMs (output, input gradient, weight gradient) take their operands in float8 with the scales of
a torchao recipe (``Float8LinearConfig.from_recipe_name``: ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``):
each operand's amax (over the whole tensor, or along the contracted dimension for the rowwise recipes) is turned
into a scale, the operand is cast with torchao's ``hp_tensor_and_scale_to_float8`` and the product is torchao's
float8 ``mm`` (``torch._scaled_mm``). The operand casts and their order are those of torchao's ``Float8Linear``, so
one process computes what ``convert_to_float8_training`` computes on the same model.

Tensor, sequence and context parallelism shard operands of these GEMMs. An amax taken over a sharded dimension is
reduced (MAX) over the ranks holding the other shards, so that every rank scales by the amax of the whole tensor and
a layout computes what one process computes:

- a column-parallel linear (output features ``n`` split over TP: fused QKV, gate/up, an expert's gate/up) reduces
  over TP the amaxes that span ``n``: the weight's tensorwise amax, the output gradient's (tensorwise, and rowwise
  along ``n`` for the input gradient) and the weight's rowwise amax along ``n`` for the input gradient; its input,
  gathered over the sequence first under SP, is whole on every rank;
- a row-parallel linear (input features ``k`` split over TP: o_proj, down_proj) reduces the amaxes that span ``k``:
  the input's and the weight's, tensorwise and rowwise along ``k`` in the forward GEMM, tensorwise for the
  gradients; its output gradient is whole on every rank (the backward of the all-reduce or of SP's reduce-scatter);
- context parallelism splits the tokens ``T``: the amaxes that span them (tensorwise ones of activations and
  output gradients, and the rowwise ones along ``T`` of the weight-gradient GEMM) are reduced over CP.

Rowwise scales along a dimension that is not split need no reduction: the forward GEMM of a column-parallel linear
(along ``k``) and the weight-gradient GEMM under TP (along ``T``) run with local scales that equal one process's.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llama_megatron.errors import ConfigError

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# the linears FP8 applies to by default: every linear of attention and MLP (experts included); never the
# embedding, the output head or the router (torchao's and Megatron's defaults leave them in high precision)
DEFAULT_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
GEMM_MULTIPLE = 16  # torch._scaled_mm: both dimensions of every float8 operand a multiple of 16


@dataclass
class Float8Config:
    """The training JSON's ``fp8`` section: the recipe, which linears (module names, as the parameter names end),
    optional ``filter`` patterns (fnmatch, on the module's path inside its decoder layer) that a linear must match
    too, and ``emulate`` (float8 casts with the products in high precision: a GPU without float8 GEMMs)."""

    # torchao's recipe: tensorwise (one scale per tensor, e5m2 gradients), rowwise (a scale per row along the
    # contracted dimension, scales rounded to powers of 2), rowwise_with_gw_hp (rowwise; the weight gradient's GEMM in
    # high precision)
    recipe: str = "tensorwise"
    # which linears: qkv_proj, o_proj, gate_up_proj, down_proj (experts' too); never the embedding, head or router
    modules: list[str] = field(default_factory=lambda: list(DEFAULT_MODULES))
    # fnmatch patterns a linear's path inside its decoder layer must also match (self_attn.*, mlp.experts.*)
    filter: list[str] | None = None
    emulate: bool = False  # float8 casts with the GEMMs in high precision (a GPU without float8 GEMMs)

    @classmethod
    def from_dict(cls, data: Any) -> Float8Config:
        if not isinstance(data, dict):
            raise ConfigError(f"fp8 must be an object (recipe, modules, filter, emulate), got {data!r}")
        unknown = set(data) - {"recipe", "modules", "filter", "emulate"}
        if unknown:
            raise ConfigError(f"unknown fp8 keys: {', '.join(sorted(unknown))} (recipe, modules, filter, emulate)")
        config = cls(**data)
        config.validate()
        return config

    def validate(self) -> None:
        if self.recipe not in RECIPES:
            raise ConfigError(f"fp8.recipe {self.recipe!r} is not one of {', '.join(RECIPES)}")
        unknown = sorted(set(self.modules) - set(DEFAULT_MODULES))
        if not self.modules or unknown:
            raise ConfigError(f"fp8.modules {self.modules!r}: choose among {', '.join(DEFAULT_MODULES)}")
        if self.filter is not None and (not isinstance(self.filter, list) or not all(
                isinstance(p, str) and p for p in self.filter) or not self.filter):
            raise ConfigError(f"fp8.filter must be a non-empty list of name patterns, got {self.filter!r}")

    def selects(self, name: str) -> bool:
        """Whether the linear at module path ``name`` computes in float8. ``filter`` patterns match its path inside
        its decoder layer (``self_attn.qkv_proj``, ``mlp.experts.3.down_proj``), the same under every layout."""
        if name.rsplit(".", 1)[-1] not in self.modules:
            return False
        return self.filter is None or any(fnmatch.fnmatchcase(layer_path(name), p) for p in self.filter)

    def torchao_config(self):
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        if self.emulate:
            import dataclasses

            config = dataclasses.replace(config, emulate=True)
        return config


def layer_path(name: str) -> str:
    """A module's path inside its decoder layer: its model path without the layer's index (``3.mlp.down_proj`` ->
    ``mlp.down_proj``; the layers are numbered children of the model under PP and without it)."""
    head, _, rest = name.partition(".")
    return rest if head.isdigit() else name


def float8_gemm_supported(device: torch.device | str) -> bool:
    """Float8 GEMMs (``torch._scaled_mm``): CUDA compute capability 8.9 or newer (Ada, Hopper, Blackwell), or the
    CPU (torch >= 2.10 runs it there)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu" and hasattr(torch, "_scaled_mm")


# The six casts of a linear's three GEMMs: (name in torchao's config, tensor dims, rowwise (axiswise) dim label,
# torchao's axiswise dim, role). Dims: T tokens, k input features, n output features.
_CASTS = {
    "input": ("cast_config_input", ("T", "k"), "k", -1, "INPUT"),
    "weight": ("cast_config_weight", ("k", "n"), "k", 0, "WEIGHT"),
    "grad_output": ("cast_config_grad_output", ("T", "n"), "n", -1, "GRAD_OUTPUT"),
    "weight_for_grad_input": ("cast_config_weight_for_grad_input", ("k", "n"), "n", -1, "WEIGHT"),
    "grad_output_for_grad_weight": ("cast_config_grad_output_for_grad_weight", ("T", "n"), "T", 0, "GRAD_OUTPUT"),
    "input_for_grad_weight": ("cast_config_input_for_grad_weight", ("T", "k"), "T", 0, "INPUT"),
}


class Float8Linear:
    """What one linear needs to compute in float8: torchao's recipe config and GEMM configs, and the process groups
    over which each of its casts reduces its amax (see the module's docstring)."""

    def __init__(self, config: Float8Config, split: str, tp_group: Any = None, cp_group: Any = None,
                 parts: list[torch.Tensor] | None = None) -> None:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_linear import LinearMMConfig, ScaledMMConfig

        self.config = config.torchao_config()
        c = self.config
        # the weight gradient's GEMM contracts over the tokens, whose count the config check cannot see (an
        # expert's routed tokens, a micro batch's): torchao pads that inner dimension with zeros to the multiple of
        # 16 that torch._scaled_mm needs on a GPU; the other two contract over k or n, checked multiples of 16
        gemms = (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        self.mm_config = LinearMMConfig(*(ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim or pad)
                                          for g, pad in zip(gemms, (False, False, True))))
        sharded = {"T": cp_group, ("n" if split == "column" else "k"): tp_group}
        self.groups: dict[str, list] = {}
        for cast, (attr, dims, axis, _, _) in _CASTS.items():
            rowwise = getattr(c, attr).scaling_granularity is ScalingGranularity.AXISWISE
            over = (axis,) if rowwise else dims
            self.groups[cast] = [sharded[d] for d in over if sharded.get(d) is not None]
        # a fused linear's projections (q, k, v rows of the fused QKV; gate and up): each is scaled and multiplied
        # as its own linear, as torchao scales HF's (and torchtitan's) separate projections
        self.sizes = [len(p) for p in parts] if parts else None
        order = torch.cat(parts) if parts else None
        self._order = None if order is None or torch.equal(order, torch.arange(len(order))) else order
        self._inverse = None if self._order is None else torch.argsort(self._order)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # (cast, amax after the layout's reductions: the largest of a rowwise cast's) of every cast, in order, while
        # a list is set here: what a layout scales by, for the checks and the fp8 statistics
        self.amax_log: list[tuple[str, torch.Tensor]] | None = None
        # the largest amax of each cast since the statistics were last read (logging.fp8_stats), on the device
        self.window_amax: dict[str, torch.Tensor] | None = None

    def to_parts(self, tensor: torch.Tensor, dim: int) -> list[torch.Tensor]:
        """``tensor`` cut along ``dim`` (the output features) into the projections, in their order."""
        if self.sizes is None:
            return [tensor]
        if self._order is not None:
            tensor = tensor.index_select(dim, self._indices(tensor.device)[0])
        return list(tensor.split(self.sizes, dim))

    def from_parts(self, pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The inverse of :meth:`to_parts`."""
        if len(pieces) == 1:
            return pieces[0]
        joined = torch.cat(pieces, dim)
        return joined if self._order is None else joined.index_select(dim, self._indices(joined.device)[1])

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on:
            self._on[device] = (self._order.to(device), self._inverse.to(device))
        return self._on[device]

    def cast(self, tensor: torch.Tensor, which: str):
        """``tensor`` (2-D) as torchao's float8 training tensor for the cast ``which``, or as it is when the recipe
        keeps that operand in high precision."""
        from torchao.float8.config import ScalingType
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
        from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        attr, _, _, axiswise_dim, role = _CASTS[which]
        cast_config = getattr(self.config, attr)
        if cast_config.scaling_type is ScalingType.DISABLED:  # contiguous, as the float8 casts' outputs are
            return tensor.contiguous()
        granularity = cast_config.scaling_granularity
        dim = get_maybe_axiswise_dim(axiswise_dim, granularity)
        if tensor.numel():
            amax = tensor_to_amax(tensor, False, None, granularity, dim)
        else:  # an expert no token was routed to: it runs (its gradient is zero, not None) and joins the reductions
            shape = () if dim is None else [1 if d == dim % tensor.dim() else n for d, n in enumerate(tensor.shape)]
            amax = tensor.new_zeros(shape)
        for group in self.groups[which]:  # the amax of the whole tensor, where a layout split what it spans
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        if self.amax_log is not None:
            self.amax_log.append((which, amax.max()))
        if self.window_amax is not None:
            seen = self.window_amax.get(which)
            self.window_amax[which] = amax.max() if seen is None else torch.maximum(seen, amax.max())
        scale = amax_to_scale(amax, cast_config.target_dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(tensor, scale, cast_config.target_dtype, self.mm_config,
                                             getattr(GemmInputRole, role), dim)


def scaled_mm_cpu(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)`` (float8 operands, the inverse scales: one
    per tensor, or a column [rows, 1] and a row [1, cols]) as torch computes it on a CPU without AMX: both operands
    made contiguous and upcast to fp32, scaled, multiplied in fp32, rounded once to ``out_dtype``."""
    return torch.matmul(a.contiguous().float() * scale_a, b.contiguous().float() * scale_b).to(out_dtype)


def _emulated(a) -> bool:
    """Whether :func:`float8_mm` computes this product itself (a CPU's), or torchao's ``mm`` does (a GPU's)."""
    return a._data.device.type == "cpu"


def float8_mm(a, b) -> torch.Tensor:
    """``torch.mm`` of two operands as :meth:`Float8Linear.cast` returns them: torchao's float8 ``mm``, whose GEMM
    is ``torch._scaled_mm``, on a GPU; on a CPU the same product through :func:`scaled_mm_cpu`, on every CPU.

    On a CPU, torch runs ``_scaled_mm`` as :func:`scaled_mm_cpu` does unless the CPU has AMX and both scales are
    per-tensor: then oneDNN's float8 matmul runs it. torchao issues a rowwise GEMM without fast accumulation (the
    rowwise recipes' two backward GEMMs) with unit per-tensor scales and rescales its output, so on an AMX Xeon those
    GEMMs, and all of tensorwise's, ran in oneDNN's kernels: the one part of a rowwise FP8 step whose code depends
    on the CPU model beyond the rounding of bf16 GEMMs (docs/fp8.md: a Mixtral run's gradients turned non-finite
    there, and only there). Here every CPU computes the product torch's own fallback defines, with torchao's steps
    around it (its rescaling, its bf16 output for rowwise scales; not its zero padding of the inner dimension, which
    a GPU needs and which adds nothing here): torchao's product bit for bit wherever torch emulates it.

    A product over an empty inner dimension (the weight gradient of an expert no token reached) is zeros on every
    device, without a kernel: oneDNN's AMX kernel returned uninitialised memory for it (NaN, 49152, 2e-13: the
    non-finite gradients of docs/fp8.md), and no GEMM library is asked to define that case."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, choose_scaled_mm_config

    if not (isinstance(a, Float8TrainingTensor) and isinstance(b, Float8TrainingTensor)):
        return torch.mm(a, b)
    if a.shape[1] == 0:
        return torch.zeros(a.shape[0], b.shape[1], dtype=a._orig_dtype, device=a._data.device)
    if not _emulated(a):
        return torch.mm(a, b)
    mm_config = choose_scaled_mm_config(a._gemm_input_role, a._linear_mm_config, b._gemm_input_role,
                                        b._linear_mm_config)
    if mm_config.emulate:  # torchao's own high-precision product
        return torch.mm(a, b)
    a_data, b_data = a._data, b._data  # not padded: zeros a GPU needs add nothing here but FLOPs to count
    rows, cols = a_data.shape[0], b_data.shape[1]
    a_scale, b_scale = a._scale, b._scale
    if a._axiswise_dim is None and b._axiswise_dim is not None:  # one scale per tensor beside one per row
        a_scale = a_scale.reshape(1, 1).expand(rows, 1)
    elif a._axiswise_dim is not None and b._axiswise_dim is None:
        b_scale = b_scale.reshape(1, 1).expand(1, cols)
    a_inverse, b_inverse = a_scale.reciprocal(), b_scale.reciprocal()
    rowwise = a_inverse.shape == (rows, 1) and b_inverse.shape == (1, cols)
    rescale = None
    if rowwise and not mm_config.use_fast_accum:  # torchao: a product with unit scales, then both scales applied
        rescale = a_inverse * b_inverse
        a_inverse = b_inverse = a_inverse.new_ones(())
    out_dtype = a._orig_dtype
    gemm_dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    out = scaled_mm_cpu(a_data, b_data, a_inverse, b_inverse, gemm_dtype)
    if rescale is not None:
        out *= rescale
    return out.to(out_dtype)


class _Float8Linear(torch.autograd.Function):
    """``F.linear`` in float8 (torchao's ``matmul_with_hp_or_float8_args``, with the amax reductions of the
    layout); the weight gradient deferrable to a :class:`~llama_megatron.parallel.weight_grad.WeightGradStore`."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, spec: Float8Linear):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.spec, ctx.has_bias = store, spec, bias is not None
        x_2d = x.reshape(-1, x.shape[-1])
        x_8 = spec.cast(x_2d, "input")  # one cast serves every projection: the same input, the same scale
        out = spec.from_parts([float8_mm(x_8, spec.cast(w.t(), "weight")) for w in spec.to_parts(weight, 0)], 1)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias.to(out.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        spec = ctx.spec
        grad_2d = grad.reshape(-1, grad.shape[-1])
        x_2d = x.reshape(-1, x.shape[-1])
        grads = spec.to_parts(grad_2d, 1)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # summed over the projections as autograd sums the input gradients of separate linears: the last
            # used first (v, k, q: HF's order), so the fp32 sums match to the bit
            for g, w in reversed(list(zip(grads, spec.to_parts(weight, 0)))):
                part = float8_mm(spec.cast(g, "grad_output"), spec.cast(w.t(), "weight_for_grad_input").t())
                grad_x = part if grad_x is None else grad_x + part
            grad_x = grad_x.reshape(x.shape)
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            def compute() -> torch.Tensor:
                x_8 = spec.cast(x_2d, "input_for_grad_weight")
                pieces = [float8_mm(spec.cast(g, "grad_output_for_grad_weight").t(), x_8) for g in grads]
                return spec.from_parts(pieces, 0).to(weight.dtype)

            if ctx.store is None or not ctx.store.defer(weight, compute, (grad_2d, x_2d)):
                grad_weight = compute()
        return grad_x, grad_weight, grad_bias, None, None


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store,
                  spec: Float8Linear) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the three GEMMs in float8 (``spec``)."""
    return _Float8Linear.apply(x, weight, bias, store, spec)


def attach_float8(model: nn.Module, config: Float8Config, tp_group: Any = None, cp_group: Any = None) -> list[str]:
    """Give a :class:`Float8Linear` to every linear of ``model`` that ``config`` selects (a module with a
    ``float8`` attribute and a ``tp_split``-marked weight; a fused one names its projections' rows in
    ``output_parts``); returns their names. One place decides, as
    :func:`~llama_megatron.parallel.weight_grad.attach_weight_grad_store` does for the split backward."""
    names = []
    for name, module in model.named_modules():
        if not hasattr(module, "float8") or not config.selects(name):
            continue
        split = "row" if module.weight.tp_split == "row" else "column"
        module.float8 = Float8Linear(config, split, tp_group, cp_group, getattr(module, "output_parts", None))
        names.append(name)
    return names


def float8_linears(model: nn.Module, config: Float8Config) -> list[tuple[str, str, list[int], int]]:
    """The linears of a model built at TP 1 that ``config`` selects: (path inside its layer, split, the output rows
    of each projection, input columns)."""
    out = []
    for name, module in model.named_modules():
        if hasattr(module, "float8") and config.selects(name):
            rows, cols = module.weight.shape
            parts = [len(p) for p in getattr(module, "output_parts", None) or [range(rows)]]
            out.append((layer_path(name), module.weight.tp_split, parts, cols))
    return out


def check_float8_linears(linears: list[tuple[str, str, list[int], int]], config: Float8Config, tp_size: int) -> None:
    """What FP8 needs of the selected linears (:func:`float8_linears`) at tensor degree ``tp_size``: some are selected,
    and every GEMM operand, per TP rank and projection, has both dimensions a multiple of 16 (``torch._scaled_mm``).
    Raises ConfigError naming the first offenders."""
    if not linears:
        raise ConfigError(f"fp8 selects no linear of this model (modules {config.modules}, filter {config.filter}); "
                          "a filter matches paths inside a decoder layer, such as 'self_attn.*' or 'mlp.experts.*'")
    bad = {}
    for path, split, parts, cols in linears:
        dims = [cols // tp_size, *parts] if split == "row" else [cols, *(p // tp_size for p in parts)]
        for dim in dims:
            if dim % GEMM_MULTIPLE:
                bad.setdefault(path, dim)
    if bad:
        listed = ", ".join(f"{path} ({dim})" for path, dim in list(bad.items())[:4])
        raise ConfigError(f"fp8 at tensor parallel {tp_size}: float8 GEMMs need every dimension a multiple of "
                          f"{GEMM_MULTIPLE}, and these linears have one that is not: {listed}")


# The statistics' table: per decoder layer, per kind of linear (experts' and a shared expert's apart) and per cast,
# the largest amax of the logging window (every expert of a layer in one entry)
STAT_KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "experts.gate_up_proj", "experts.down_proj",
              "shared_expert.gate_up_proj", "shared_expert.down_proj")
_LAYER = re.compile(r"(?:^|\.)(\d+)\.(?:self_attn|mlp)\.")


def stat_key(name: str) -> tuple[int, str] | None:
    """(decoder layer, kind) of the linear at model path ``name`` (the layer's index in the model's list of layers,
    the embedding first: decoder layer = index - 1); None for a module outside a decoder layer."""
    match = _LAYER.search(name)
    if match is None:
        return None
    path = layer_path(name[match.start(1):])
    leaf = path.rsplit(".", 1)[-1]
    kind = f"experts.{leaf}" if ".experts." in path else f"shared_expert.{leaf}" if "shared_expert." in path else leaf
    return int(match.group(1)) - 1, kind


def collect_amax(model: nn.Module, layers: int, device: torch.device) -> torch.Tensor:
    """This rank's table [layers, STAT_KINDS, casts] of the window's largest amaxes (0 where it holds none), and
    the windows started again. Reduced (MAX) over the ranks, it is the model's: each rank holds its stage's layers,
    and a rowwise amax along an unsplit dimension is each TP rank's own."""
    table = torch.zeros(layers, len(STAT_KINDS), len(_CASTS), device=device)
    for name, module in model.named_modules():
        spec = getattr(module, "float8", None)
        key = stat_key(name)
        if spec is None or spec.window_amax is None or key is None:
            continue
        layer, kind = key
        for cast, amax in spec.window_amax.items():
            i, j = STAT_KINDS.index(kind), list(_CASTS).index(cast)
            table[layer, i, j] = torch.maximum(table[layer, i, j], amax.float())
        spec.window_amax = {}
    return table


def amax_record(table: torch.Tensor, config: Float8Config) -> dict[str, dict[str, list[float]]]:
    """The metrics record's ``fp8`` entry: per ``kind.cast`` that some layer computed, the amax of each decoder layer
    and its scale (the format's largest value over the amax: what the operand was multiplied by before the cast;
    a rowwise cast's smallest scale)."""
    values = table.double().cpu()
    out = {}
    torchao_config = config.torchao_config()
    for i, kind in enumerate(STAT_KINDS):
        for j, (cast, (attr, *_)) in enumerate(_CASTS.items()):
            column = values[:, i, j]
            if not column.any():
                continue
            largest = torch.finfo(getattr(torchao_config, attr).target_dtype).max
            out[f"{kind}.{cast}"] = {"amax": [float(f"{float(a):.6g}") for a in column],
                                     "scale": [float(f"{largest / float(a):.6g}") if a > 0 else None for a in column]}
    return out
