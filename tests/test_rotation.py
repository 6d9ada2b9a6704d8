"""compcomm.optim.rotation (DiLoCo's rotate=True) against a float64 matrix of the same rotation,
and what it is for: one 1-bit code loses less of a vector whose magnitudes differ widely."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compcomm.optim.rotation import rotate_, signs, unrotate_, windows

from reference import reference_allreduce, reference_rotation, reference_signs

PINNED = "+++-+-+++---+---+-----+--+-+++-+"  # signs(32): a checkpoint's rotated errors depend on them


@pytest.mark.parametrize("m", [1, 2, 3, 7, 64, 100, 1000, 4160])
def test_windows_are_a_power_of_two_at_each_end_overlapping(m):
    head, *rest = windows(m)
    p = head.stop
    assert head.start == 0 and p & (p - 1) == 0 and m / 2 < p <= m
    assert rest == ([] if p == m else [slice(m - p, m), head])


@pytest.mark.parametrize("m", [1, 5, 24, 40, 64, 100, 257])
def test_rotation_matches_float64_matrix_and_inverts(m):
    x = torch.randn(m, generator=torch.Generator().manual_seed(m))
    y, z = x.clone(), signs(m, x.device)
    rotate_(y, z)
    r = reference_rotation(m)
    assert np.allclose(r @ r.T, np.eye(m)), "the reference is orthogonal"
    want = r @ x.double().numpy()
    assert np.abs(y.double().numpy() - want).max() <= 1e-6 * np.abs(want).max()
    unrotate_(y, z)
    assert torch.allclose(y, x, rtol=0, atol=1e-6 * float(x.abs().max()))


def test_signs_are_a_fixed_balanced_pattern():
    """The pattern is part of a checkpoint's format (its error feedback is rotated): pinned here
    against the reference's pure-Python hash, and about half of each sign."""
    z = signs(4096, torch.device("cpu"))
    assert z.dtype == torch.int8 and np.array_equal(z.double().numpy(), reference_signs(4096))
    assert "".join("+" if v > 0 else "-" for v in z[:32].tolist()) == PINNED
    assert abs(int(z.sum())) < 4 * math.sqrt(4096)


def one_call_error(vectors: list[np.ndarray], rotate: bool) -> float:
    """Energy of (1-bit mean - exact mean) over the exact mean's, one call from zero errors."""
    n, m = len(vectors), vectors[0].size
    r = reference_rotation(m) if rotate else np.eye(m)
    padded = math.ceil(m / (8 * n)) * 8 * n
    out, _, _ = reference_allreduce([r @ v for v in vectors], np.zeros((n, padded)), np.zeros((n, padded // n)))
    exact = sum(vectors) / n
    return float(np.sum((r.T @ out - exact) ** 2) / np.sum(exact**2))


@pytest.mark.parametrize(
    "m,loud",
    [
        (1536, slice(1024, 1536)),
        (1536, slice(0, 512)),
        (1025, slice(1024, 1025)),
        (1025, slice(0, 1)),
        (1100, slice(500, 501)),
        (1100, slice(0, 76)),
    ],
)
def test_every_element_is_mixed_where_m_is_no_power_of_two(m, loud):
    """Energy in one end of the bucket only, or in one element: rotated, one call's error is
    about a Gaussian vector's (0.40) whichever part of the bucket holds the energy (two windows,
    or no signs between the passes, leave 0.7-1.9 on some of these)."""
    rng = np.random.default_rng(1)
    magnitude = np.zeros(m)
    magnitude[loud] = 1.0
    mean = magnitude * rng.standard_normal(m)
    vectors = [mean + 0.1 * magnitude * rng.standard_normal(m) for _ in range(4)]
    assert one_call_error(vectors, True) < 0.5


def test_rotation_cuts_the_one_bit_error_of_uneven_magnitudes():
    """Four ranks' vectors sharing a mean whose magnitudes span three decades (a few large
    elements, many small): unrotated, one call's error exceeds the mean's energy (1.66 here);
    rotated, it is near a Gaussian vector's 2 (1 - sqrt(2/pi)) = 0.40 (0.43 here)."""
    rng = np.random.default_rng(0)
    m = 1024
    magnitude = np.where(np.arange(m) % 32 == 0, 10.0, 0.01)
    mean = magnitude * rng.standard_normal(m)
    vectors = [mean + 0.1 * magnitude * rng.standard_normal(m) for _ in range(4)]
    plain, rotated = one_call_error(vectors, False), one_call_error(vectors, True)
    assert plain > 1.5 and rotated < 0.5, (plain, rotated)
