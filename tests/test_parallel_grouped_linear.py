"""The grouped linear of a mixture of experts' experts (llama_megatron/parallel/grouped_linear.py) against one
``F.linear`` per group: outputs, the rows' gradient and every weight's gradient, on the kernel's path and on the
group-by-group path it takes where the kernel's 16-byte stride rule fails, with an empty group and rows past the
last group (dropped assignments: zero output, zero gradient). One process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llama_megatron.parallel.grouped_linear import expert_offsets, grouped_linear, grouped_mm_supported


@pytest.mark.parametrize("features", [(8, 12), (6, 10)], ids=["kernel", "group-by-group"])
def test_grouped_linear_equals_a_linear_per_group(features) -> None:
    inputs, outputs = features
    assert grouped_mm_supported("cpu", torch.float32, inputs, outputs) == (features == (8, 12))
    gen = torch.Generator().manual_seed(0)
    counts, tail = [3, 0, 5], 2  # an empty group; two rows after the last group
    rows = torch.randn(sum(counts) + tail, inputs, generator=gen, requires_grad=True)
    weights = [torch.randn(outputs, inputs, generator=gen, requires_grad=True) for _ in counts]
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
