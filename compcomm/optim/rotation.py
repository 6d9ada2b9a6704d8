"""A fixed orthogonal rotation of a bucket, so that one 1-bit scale fits all of its elements.

A 1-bit call codes a vector x as s sign(x), with s the root mean square of x (docs/algorithm.md: per
rank, and per chunk on the server), which leaves an error of 2 (1 - mean|x| / rms(x)) times x's
energy: none where the elements share one magnitude, most of it where magnitudes differ widely
(the rows of an embedding that some tokens train often and others rarely, the few outputs of a
layer that move most). DiLoCo's pseudo-gradients, sums of many inner steps, are such vectors.
Rotated by

    R x = H (z * x)        z: +-1 per element (a fixed hash of its index),
                           H: the orthonormal Walsh-Hadamard transform
                           (for a power-of-two length; see below for the others),

every element becomes a sum of many of x's with pseudo-random signs, close to Gaussian whatever
x was, and each 1-bit coding (the worker's, then the server's) leaves about 2 (1 - sqrt(2/pi))
= 0.40 of its input's energy as error (the randomized Hadamard transform of DRIVE, Vargaftik et
al., NeurIPS 2021). R is linear, orthogonal and the same on every rank: the mean of the R x_r
is R times their mean, R^T (the steps undone in reverse order) maps the 1-bit mean back, and the
error feedback, which lives in the rotated coordinates, delivers there what it withheld, as
before.

H needs a power-of-two length, and padding would cost bytes on the wire: a bucket of m elements
(p the largest power of two up to m) takes the signs (over the whole bucket) then H on its first
p elements, the signs then H on its last p, the signs then H on its first p again. The windows
overlap (p > m / 2), so energy anywhere in the bucket reaches every element; the third pass
evens out what two leave uneven (energy held at one end would miss the other), and the signs
between the passes keep one pass from undoing the structure of the one before (a lone element at
the end, spread by one H, would otherwise gather again under the next). Each step is orthogonal,
so is their product. Each rank applies the same float32 operations to the same bytes, so results
stay bitwise equal across ranks; the rotation itself is exact only to float32 rounding (about
1e-7 relative).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def windows(m: int) -> list[slice]:
    """Where H applies in an m-element bucket, in order, p the largest power of two up to m: all
    of it if p = m, else its first p, its last p, its first p again."""
    if m == 0:
        return []
    p = 1 << (m.bit_length() - 1)
    return [slice(0, p)] if p == m else [slice(0, p), slice(m - p, m), slice(0, p)]


def signs(m: int, device: torch.device) -> torch.Tensor:
    """z for elements 0..m-1, +-1 as int8: the top bit of murmur3's 32-bit finalizer of the
    index, the same on every device and torch version (unlike a random generator's stream). A
    checkpoint's error feedback lives in the rotated coordinates, so this pattern is part of its
    format. Built once per bucket (numpy's uint32 arithmetic wraps, as the hash needs) and kept:
    a byte per element, cheaper than hashing again at every sync."""
    if m >= 1 << 32:
        raise ValueError(f"a rotated bucket holds fewer than 2^32 elements, got {m}")
    h = np.arange(m, dtype=np.uint32)
    h ^= h >> 16
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> 13
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> 16
    z = 1 - 2 * (h >> 31).astype(np.int8)
    return torch.from_numpy(z).to(device)


def _hadamard_(x: torch.Tensor) -> None:
    """x <- H x in place, x of power-of-two length n = 2^k: k butterfly stages of (a + b) / 2,
    (a - b) / 2, then a factor sqrt(n). Halving first (exact, as are the sums' roundings scaled
    by 2, barring underflow below 2^-126) keeps every intermediate within max |x|, where plain
    sums could overflow float32 for an x whose orthonormal transform fits, and gives the bits
    that scaling by 1/sqrt(n) at the end would."""
    n, h = x.numel(), 1
    while h < n:
        x.mul_(0.5)
        pairs = x.view(-1, 2, h)
        a = pairs[:, 0].clone()
        pairs[:, 0].add_(pairs[:, 1])
        pairs[:, 1].sub_(a).neg_()  # a - b, rounded exactly as a - b is
        h *= 2
    if n > 1:
        x.mul_(math.sqrt(n))


def rotate_(flat: torch.Tensor, z: torch.Tensor) -> None:
    """flat <- R flat (a contiguous float32 vector; z = signs(flat.numel()))."""
    for window in windows(flat.numel()):
        flat.mul_(z)
        _hadamard_(flat[window])


def unrotate_(flat: torch.Tensor, z: torch.Tensor) -> None:
    """flat <- R^T flat: rotate_'s inverse (to float32 rounding), its steps in reverse order."""
    for window in reversed(windows(flat.numel())):
        _hadamard_(flat[window])
        flat.mul_(z)
