"""The one exact sum: ((x_0 + x_1) + x_2) + ..., its aliasing rule and its dtype rule."""

from __future__ import annotations

import pytest
import torch

from compcomm.backends.rank_order import sum_in_rank_order


def terms(n: int, numel: int = 257) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(numel, generator=g) * 10 ** (i % 4) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_the_sum_is_in_rank_order_bitwise(n):
    xs = terms(n)
    expected = xs[0].clone()  # the old loop: clone, then add_ in order
    for x in xs[1:]:
        expected.add_(x)
    out = torch.full_like(xs[0], float("nan"))
    assert sum_in_rank_order(xs, out) is out
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


def test_out_may_be_the_first_term():
    xs = terms(4)
    expected = sum_in_rank_order(xs, torch.empty_like(xs[0])).clone()
    assert torch.equal(sum_in_rank_order(xs, xs[0]), expected)


def test_out_over_a_later_term_is_refused():
    """It would be overwritten before it is read: 1 + 2 + 4 would give 6."""
    rows = torch.tensor([[1.0], [2.0], [4.0]])
    with pytest.raises(ValueError, match="shares memory"):
        sum_in_rank_order(list(rows), rows[2])
    whole = torch.arange(8.0)
    with pytest.raises(ValueError, match="shares memory"):  # a partial overlap counts too
        sum_in_rank_order([whole[:4], whole[2:6]], whole[1:5])


def test_mixed_dtypes_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        sum_in_rank_order([torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)], torch.empty(3))
