"""One linear per group of rows, as one grouped matrix product: the routed experts of a mixture of experts.

``rows`` [M, in] are sorted by group (an expert), ``offsets`` [G] (int32, on the rows' device) end each group's
block, and group g's rows are multiplied by ``weights[g]`` [out, in] as ``F.linear`` would: ``rows_g weights[g]^T``.
The product is ``torch._grouped_mm`` (one kernel for every group: cuBLAS's grouped GEMM on CUDA, a loop of the
same ``mm`` per group on the CPU, so there it equals a per-expert loop bit for bit). Nothing about the groups is
read on the host: the offsets stay on the device, so a layer built on it runs without a device synchronisation and
compiles without a graph break.

The weights stay separate parameters (one per expert, named by its global expert id, as every checkpoint, converter
and expert-parallel re-cut knows them). Where they lie evenly spaced in one storage (a layer's experts packed by
:func:`pack_evenly`, or a ZeRO-1/2 flat buffer, which holds them in the same order) the ``[G, out, in]`` operand is
a strided view of that storage (:func:`as_one_tensor`); elsewhere each call stacks them into a transient copy, freed
after the product (the backward stacks them again rather than keep a copy alive for the whole step). The copy is
what made the grouped path slower than the loop on a CPU: at hidden 256, intermediate 896 and 8 experts the gate/up
weights alone are 14.7 MB, copied twice a step. The weight gradient, ``[G, out, in]`` from one grouped product
``grad^T rows``, is handed back per parameter. Under a
zero-bubble schedule that product is deferred to W like every TP linear's (:class:`WeightGradStore`): the group's
first parameter computes it for all, the others take their slice.

``torch._grouped_mm`` asks every stride but the innermost to be a multiple of 16 bytes (in, out and the LoRA rank
times the element size) and, on CUDA, a dtype its kernel takes: :func:`grouped_mm_supported` says where it runs;
elsewhere :func:`grouped_linear` computes the same products group by group, which reads the offsets on the host.
"""

from __future__ import annotations

import functools

import torch

from llama_megatron.parallel.weight_grad import WeightGradStore

_ALIGNMENT = 16  # bytes: torch._grouped_mm's rule for its operands' strides


@functools.cache
def _kernel_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on this device and dtype: a probe of two groups in the two forms
    :class:`_GroupedLinear` calls (rows x transposed weights; a transposed gradient x rows). No autograd through
    the kernel: ours computes its own backward from these two forms."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        rows = torch.ones(8, 8, device=device_type, dtype=dtype)
        weights = torch.ones(2, 8, 8, device=device_type, dtype=dtype)
        offsets = torch.tensor([3, 8], device=device_type, dtype=torch.int32)
        torch._grouped_mm(rows, weights.transpose(1, 2), offs=offsets)
        torch._grouped_mm(rows.t(), rows, offs=offsets)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, *features: int) -> bool:
    """Whether the grouped kernel takes rows and weights of these feature sizes (in, out, a LoRA rank...)."""
    size = dtype.itemsize
    return all(f * size % _ALIGNMENT == 0 for f in features) and _kernel_runs(torch.device(device).type, dtype)


def _even_step(weights: list[torch.Tensor]) -> int | None:
    """The storage distance (elements) between consecutive weights when each is contiguous and they lie evenly
    spaced, without overlap, in one storage, at the kernel's alignment; else None."""
    if torch.compiler.is_compiling() or len(weights) < 2:  # traced: no storage to read (the graph stacks)
        return None
    first = weights[0]
    if first.device.type == "meta" or torch._subclasses.fake_tensor.is_fake(first) or not first.is_contiguous():
        return None
    step = weights[1].storage_offset() - first.storage_offset()
    if step < first.numel() or (step * first.element_size()) % _ALIGNMENT or first.data_ptr() % _ALIGNMENT:
        return None
    storage = first.untyped_storage().data_ptr()
    for g, weight in enumerate(weights):
        if (weight.shape != first.shape or weight.dtype != first.dtype or not weight.is_contiguous()
                or weight.untyped_storage().data_ptr() != storage
                or weight.storage_offset() != first.storage_offset() + g * step):
            return None
    return step


def as_one_tensor(weights: list[torch.Tensor]) -> torch.Tensor:
    """The weights as one ``[G, out, in]`` tensor: a view of their storage where they lie evenly spaced in one,
    else a stacked copy. The view is read-only by contract (the products only read it)."""
    step = _even_step(weights)
    if step is None:
        return torch.stack(weights)
    first = weights[0].detach()
    return first.as_strided((len(weights), *first.shape), (step, *first.stride()))


def pack_evenly(parameters: list[torch.nn.Parameter], dtype: torch.dtype | None = None) -> bool:
    """Move ``parameters`` (one expert's after another's, each expert's in the same order) into one buffer, each
    parameter a view of it at a 16-byte boundary, so that every kind of them lies evenly spaced
    (:func:`as_one_tensor`); values (cast to ``dtype`` where given), names and ``requires_grad`` unchanged. False
    (nothing moved) where they differ in dtype (``dtype`` not given) or device, are not materialised, or are packed
    so already. Done before an optimizer or DeepSpeed's engine holds them: in the dtype the engine trains in, its
    cast leaves them be, and ZeRO-1/2 flatten them in the same order (evenly spaced still)."""
    if not parameters or len({(dtype or p.dtype, p.device) for p in parameters}) != 1:
        return False
    if parameters[0].device.type == "meta" or any(hasattr(p, "ds_id") or p.numel() == 0 for p in parameters):
        return False  # not materialised, or ZeRO-3's partitioned placeholders
    dtype = dtype or parameters[0].dtype
    size = dtype.itemsize
    sizes = [-(-p.numel() * size // _ALIGNMENT) * _ALIGNMENT // size for p in parameters]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    base = parameters[0]
    if all(p.dtype == dtype and p.is_contiguous() and p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
           and p.storage_offset() - base.storage_offset() == start for p, start in zip(parameters, starts)):
        return False
    buffer = torch.empty(sum(sizes), dtype=dtype, device=base.device)
    with torch.no_grad():
        for param, start in zip(parameters, starts):
            view = buffer[start:start + param.numel()].view(param.shape)
            view.copy_(param)
            param.data = view
    return True


def expert_offsets(counts: torch.Tensor) -> torch.Tensor:
    """The end of each group's rows (int32, on the counts' device): the ``offs`` of ``torch._grouped_mm``."""
    return counts.cumsum(0).to(torch.int32)


# One operator to torch.compile: the kernel's own meta function takes bf16 only (its CUDA kernel's rule), and the
# products group by group read the offsets; as an opaque operator with its shapes given, the layer compiles whole
# (fullgraph) in every dtype, and the choice between the two runs when the graph does.
@torch.library.custom_op("llama_megatron::grouped_mm", mutates_args=())
def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, weight_grad: bool) -> torch.Tensor:
    return _by_group(a, b, offsets, weight_grad)


@_grouped_mm.register_fake
def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, weight_grad: bool) -> torch.Tensor:
    if weight_grad:
        return a.new_empty(offsets.shape[0], a.shape[0], b.shape[-1])
    return a.new_empty(a.shape[0], b.shape[-1])


def _by_group(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, weight_grad: bool) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offsets)`` where the kernel runs, else its products group by group (host offsets):
    ``a`` [M, k] x ``b`` [G, k, n] -> [M, n]; with ``weight_grad``, ``a`` [k, M] x ``b`` [M, n] -> [G, k, n]."""
    # the strides the kernel checks: the operands' feature sizes (a transposed gradient's rows in W)
    features = (a.shape[0], b.shape[-1]) if weight_grad else (a.shape[-1], b.shape[-1], b.shape[-2])
    # On the CPU the kernel is this same loop of mm per group (a host read costs nothing there), but for the weight
    # gradient it stacks the groups' products afterwards: written in place, 8.1 ms instead of 10.0 at Mixtral-like
    # CPU shapes (8 groups, 1792 x 256), bit for bit the same
    if grouped_mm_supported(a.device, a.dtype, *features) and not (weight_grad and a.device.type == "cpu"):
        return torch._grouped_mm(a, b, offs=offsets).contiguous()
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    if weight_grad:
        grads = a.new_empty(len(ends), a.shape[0], b.shape[-1])
        for g, (s, e) in enumerate(zip(starts, ends)):
            torch.mm(a[:, s:e], b[s:e], out=grads[g])  # over no row: zeros
        return grads
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for g, (s, e) in enumerate(zip(starts, ends)):
        torch.mm(a[s:e], b[g], out=out[s:e])
    return out


def _zero_tail(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out`` with the rows past the last group zeroed (a kernel may leave them unwritten), on the device."""
    inside = torch.arange(out.shape[0], device=out.device) < offsets[-1]
    return torch.where(inside.unsqueeze(-1), out, 0.0)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, offsets, store, tail, *weights):
        ctx.save_for_backward(rows, offsets, *weights)
        ctx.store, ctx.tail = store, tail
        out = _grouped_mm(rows, as_one_tensor(weights).transpose(1, 2), offsets, False)
        return _zero_tail(out, offsets) if tail else out

    @staticmethod
    def backward(ctx, grad):
        rows, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_rows = None
        if ctx.needs_input_grad[0]:
            grad_rows = _grouped_mm(grad, as_one_tensor(weights), offsets, False)
            grad_rows = _zero_tail(grad_rows, offsets) if ctx.tail else grad_rows
        if not any(ctx.needs_input_grad[4:]):
            return grad_rows, None, None, None, *([None] * len(weights))
        stacked: list[torch.Tensor] = []

        def all_weight_grads() -> torch.Tensor:  # [G, out, in], computed once for the whole group
            if not stacked:
                stacked.append(_grouped_mm(grad.t(), rows, offsets, True))
            return stacked[0]

        grads: list[torch.Tensor | None] = []
        for g, weight in enumerate(weights):
            # the first deferred piece keeps the operands alive (the store's memory meter counts them once)
            keeps = (grad, rows) if g == 0 else ()
            deferred = ctx.store is not None and ctx.store.defer(weight, lambda g=g: all_weight_grads()[g], keeps)
            grads.append(None if deferred else all_weight_grads()[g])
        return grad_rows, None, None, None, *grads


def grouped_linear(rows: torch.Tensor, weights: list[torch.Tensor], offsets: torch.Tensor,
                   store: WeightGradStore | None = None, tail: bool = False) -> torch.Tensor:
    """``rows_g weights[g]^T`` for each group g of ``rows`` (ending at ``offsets[g]``), [M, out]. With ``tail``
    rows may follow the last group (assignments dropped over capacity): their output and gradient are zero. Each
    weight's gradient is its group's ``grad_g^T rows_g`` (zero for a group with no row)."""
    return _GroupedLinear.apply(rows, offsets, store, tail, *weights)
