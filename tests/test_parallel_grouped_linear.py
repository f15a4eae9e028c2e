"""The grouped linear of a mixture of experts' experts (llama_megatron/parallel/grouped_linear.py) against one
``F.linear`` per group: outputs, the rows' gradient and every weight's gradient, on the kernel's path and on the
group-by-group path it takes where the kernel's 16-byte stride rule fails, with an empty group and rows past the
last group (dropped assignments: zero output, zero gradient), with the weights apart or packed in one buffer (read
as one strided view, no copy). One process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llama_megatron.parallel.grouped_linear import (
    as_one_tensor,
    expert_offsets,
    grouped_linear,
    grouped_mm_supported,
    pack_evenly,
)


@pytest.mark.parametrize("packed", [False, True], ids=["apart", "packed"])
@pytest.mark.parametrize("features", [(8, 12), (6, 10)], ids=["kernel", "group-by-group"])
def test_grouped_linear_equals_a_linear_per_group(features, packed) -> None:
    inputs, outputs = features
    assert grouped_mm_supported("cpu", torch.float32, inputs, outputs) == (features == (8, 12))
    gen = torch.Generator().manual_seed(0)
    counts, tail = [3, 0, 5], 2  # an empty group; two rows after the last group
    rows = torch.randn(sum(counts) + tail, inputs, generator=gen, requires_grad=True)
    weights = [torch.nn.Parameter(torch.randn(outputs, inputs, generator=gen)) for _ in counts]
    if packed:  # as a layer's experts: each group's weight followed by another parameter (an expert's down)
        others = [torch.nn.Parameter(torch.randn(3, 5, generator=gen)) for _ in counts]
        assert pack_evenly([p for pair in zip(weights, others) for p in pair])
        assert as_one_tensor(weights).data_ptr() == weights[0].data_ptr()  # a view, not a copy
    got = grouped_linear(rows, weights, expert_offsets(torch.tensor(counts)), tail=True)
    grad = torch.randn(got.shape, generator=gen)
    got.backward(grad)

    ref_rows = rows.detach().clone().requires_grad_(True)
    ref_weights = [w.detach().clone().requires_grad_(True) for w in weights]
    pieces = ref_rows.split([*counts, tail])
    want = torch.cat([*(F.linear(p, w) for p, w in zip(pieces, ref_weights)), torch.zeros(tail, outputs)])
    want.backward(grad)
    # on the CPU both paths run the same mm per group: equal, not close
    assert torch.equal(got, want) and not got[-tail:].any()
    assert torch.equal(rows.grad, ref_rows.grad) and not rows.grad[-tail:].any()
    for weight, ref in zip(weights, ref_weights):
        assert torch.equal(weight.grad, ref.grad)
    assert not weights[1].grad.any()  # the empty group's weight: a zero gradient, not None


def test_packing_keeps_values_and_is_done_once() -> None:
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen), requires_grad=grad)
              for shape, grad in (((4, 6), True), ((6, 3), False)) * 3]  # three experts, one frozen part each
    values = [p.detach().clone() for p in params]
    assert pack_evenly(params) and not pack_evenly(params)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert [p.requires_grad for p in params] == [True, False] * 3
    for kind in (params[0::2], params[1::2]):
        one = as_one_tensor(kind)
        assert one.data_ptr() == kind[0].data_ptr() and torch.equal(one, torch.stack(kind))
    # apart again (as after a move to another device, each parameter copied alone): a stacked copy, equal
    params[2].data = params[2].detach().clone()
    assert as_one_tensor(params[0::2]).data_ptr() != params[0].data_ptr()
    assert torch.equal(as_one_tensor(params[0::2]), torch.stack(params[0::2]))
    assert not pack_evenly([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))])
    # in the dtype an engine will train in (DeepSpeed's cast then leaves them be): values cast as .to() casts them
    assert pack_evenly(params, torch.bfloat16) and not pack_evenly(params, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, v.to(torch.bfloat16)) for p, v in zip(params, values))
    assert as_one_tensor(params[1::2]).data_ptr() == params[1].data_ptr()
