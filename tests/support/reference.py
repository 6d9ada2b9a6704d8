"""A plain float64 reference of SPEC section 3, simulating all n ranks in one process."""

from __future__ import annotations

import math

import numpy as np


def assert_close(actual: object, desired: object, rtol: float = 1e-7, atol: float = 0.0, err_msg: str = "") -> None:
    """np.testing.assert_allclose (|actual - desired| <= atol + rtol |desired|, elementwise),
    checked in one vectorised pass first: numpy's builds its report's arrays before it checks,
    about 10x slower on the large calls' outputs and errors. A failure, and anything the pass
    does not settle (NaN, inf, shapes that broadcast), is numpy's own check and report."""
    a, d = np.asarray(actual), np.asarray(desired)
    if a.shape == d.shape and bool((np.abs(a - d) <= atol + rtol * np.abs(d)).all()):
        return
    np.testing.assert_allclose(a, d, rtol=rtol, atol=atol, err_msg=err_msg)


def sign(v: np.ndarray) -> np.ndarray:
    return np.where(v >= 0, 1.0, -1.0)


def reference_allreduce(
    inputs: list[np.ndarray], worker_errors: np.ndarray, server_errors: np.ndarray, op: str = "mean"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One call: inputs[r] (N,), worker_errors (n, M), server_errors (n, C), all float64.

    Returns (output (N,), new worker errors, new server errors).
    """
    n, numel = len(inputs), inputs[0].size
    m = math.ceil(numel / (8 * n)) * 8 * n
    c = m // n
    assert worker_errors.shape == (n, m) and server_errors.shape == (n, c)
    new_worker = np.zeros((n, m))
    worker_signs, scales = np.zeros((n, m)), np.zeros(n)
    for r, x in enumerate(inputs):
        xp = np.zeros(m)
        xp[:numel] = x
        xp += worker_errors[r]
        scales[r] = np.linalg.norm(xp[:numel]) / math.sqrt(numel)
        worker_signs[r] = sign(xp)
        new_worker[r, :numel] = xp[:numel] - scales[r] * worker_signs[r, :numel]
    output = np.zeros(m)
    new_server = np.zeros((n, c))
    for j in range(n):
        chunk = slice(j * c, (j + 1) * c)
        a = (scales[:, None] * worker_signs[:, chunk]).sum(0)
        if op == "mean":
            a /= n
        y = a + server_errors[j]
        k = min(max(numel - j * c, 0), c)
        t = np.linalg.norm(y[:k]) / math.sqrt(k) if k else 0.0
        new_server[j, :k] = y[:k] - t * sign(y[:k])
        output[chunk] = t * sign(y)
    return output[:numel], new_worker, new_server


def reference_reduce_scatter(
    inputs: list[np.ndarray], worker_errors: np.ndarray, op: str = "mean"
) -> tuple[np.ndarray, np.ndarray]:
    """One reduce-scatter: inputs[r] (N = n L,), worker_errors (n, n, L8) float64 (rank, row,
    padded row). Returns (outputs (n, L): row j is rank j's shard, new worker errors)."""
    n, numel = len(inputs), inputs[0].size
    length = numel // n
    padded = math.ceil(length / 8) * 8
    assert worker_errors.shape == (n, n, padded)
    scales, signs = np.zeros((n, n)), np.zeros((n, n, padded))
    new_worker = np.zeros((n, n, padded))
    for r, x in enumerate(inputs):
        for j in range(n):
            xp = np.zeros(padded)
            xp[:length] = x[j * length : (j + 1) * length]
            xp += worker_errors[r, j]
            scales[r, j] = np.linalg.norm(xp[:length]) / math.sqrt(length) if length else 0.0
            signs[r, j] = sign(xp)
            new_worker[r, j, :length] = xp[:length] - scales[r, j] * signs[r, j, :length]
    outputs = np.zeros((n, length))
    for j in range(n):
        total = (scales[:, j, None] * signs[:, j, :length]).sum(0)
        outputs[j] = total / n if op == "mean" else total
    return outputs, new_worker


def reference_signs(m: int) -> np.ndarray:
    """compcomm.optim.rotation.signs in pure Python: the top bit of murmur3's 32-bit finalizer
    of each index, as -1.0 (set) or 1.0."""
    signs = np.empty(m)
    for i in range(m):
        h = i ^ (i >> 16)
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        h ^= h >> 16
        signs[i] = -1.0 if h >> 31 else 1.0
    return signs


def reference_rotation(m: int) -> np.ndarray:
    """compcomm.optim.rotation's R as an m x m float64 matrix: the signs z of murmur3's finalizer
    of the index, then the orthonormal Sylvester-Hadamard matrix of order p (the largest power of
    two up to m) on the first p elements; where p < m, z and H on the last p, z and H on the
    first p again."""
    signs = reference_signs(m)
    if m == 0:
        return np.zeros((0, 0))
    p = 1 << (m.bit_length() - 1)
    hadamard = np.ones((1, 1))
    while hadamard.shape[0] < p:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    head, tail = np.eye(m), np.eye(m)
    head[:p, :p] = hadamard / math.sqrt(p)
    tail[m - p :, m - p :] = hadamard / math.sqrt(p)
    z = np.diag(signs)
    return head @ z @ tail @ z @ head @ z if p < m else head @ z
