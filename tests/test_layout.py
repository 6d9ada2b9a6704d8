"""Layout helpers and the Bucketer (no ranks needed)."""

import numpy as np
import pytest
import torch

from compcomm.layout import (
    Bucketer,
    bucket_groups,
    chunk_range,
    chunk_size,
    flatten,
    padded_size,
    real_count,
    unflatten,
)


@pytest.mark.parametrize(
    "numel, world, expected",
    [(1, 1, 8), (7, 1, 8), (8, 1, 8), (9, 1, 16), (1, 4, 32), (33, 4, 64), (64, 4, 64), (0, 3, 0)],
)
def test_padded_size(numel, world, expected):
    assert padded_size(numel, world) == expected
    assert chunk_size(numel, world) * world == expected


def test_chunk_ranges_cover_padded_buffer_and_count_real_elements():
    numel, world = 70, 4
    ranges = [chunk_range(r, numel, world) for r in range(world)]
    assert ranges == [(0, 24), (24, 48), (48, 72), (72, 96)]
    assert [real_count(r, numel, world) for r in range(world)] == [24, 24, 22, 0]
    with pytest.raises(ValueError):
        chunk_range(4, numel, world)


def test_flatten_unflatten_round_trip():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 1, 3)]
    flat = flatten(tensors, numel=32)
    assert flat.shape == (32,) and torch.equal(flat[23:], torch.zeros(9))
    views = unflatten(flat, [t.shape for t in tensors])
    assert all(torch.equal(v, t) for v, t in zip(views, tensors))
    views[1][0] = 42.0
    assert flat[12] == 42.0, "unflatten gives views, not copies"
    with pytest.raises(ValueError):
        flatten([torch.randn(2), torch.randn(2, dtype=torch.float64)])


def test_bucketer_groups_by_size_and_dtype_and_round_trips():
    tensors = [
        torch.randn(100),
        torch.randn(100),
        torch.randn(300),
        torch.randn(10, dtype=torch.bfloat16),
        torch.randn(10, dtype=torch.bfloat16),
        torch.randn(50),
    ]
    bucketer = Bucketer(tensors, bucket_bytes=1000, world_size=4)
    assert [b.indices for b in bucketer] == [[0, 1], [2], [3, 4], [5]]
    assert [b.padded_numel for b in bucketer] == [224, 320, 32, 64]
    for bucket in bucketer:
        flat = bucket.gather(tensors)
        assert flat.numel() == bucket.numel and flat.dtype == tensors[bucket.indices[0]].dtype
    originals = [t.clone() for t in tensors]
    for bucket in bucketer:
        bucket.flat.mul_(2)
        bucket.scatter(tensors)
    assert all(torch.equal(t, 2 * o) for t, o in zip(tensors, originals))


def test_buckets_of_parameters_gather_and_scatter_their_data():
    """Parameters (tensors that require grad) go in and come back as data, outside no_grad,
    without an autograd graph (copy_ into a leaf that requires grad raised)."""
    params = [torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.randn(3, 2))]
    (bucket,) = Bucketer(params, world_size=2)
    flat = bucket.gather(params)
    assert not flat.requires_grad and torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in params]))
    bucket.flat.add_(1.0)
    before = [p.detach().clone() for p in params]
    bucket.scatter(params)
    assert all(torch.equal(p.detach(), b + 1.0) and p.grad_fn is None for p, b in zip(params, before))


def test_bucketer_takes_model_parameters_as_they_come():
    """Bucketer(model.parameters()) raised "'generator' object is not subscriptable": the
    grouping read the generator, then the buckets indexed it."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    buckets = Bucketer(model.parameters(), bucket_bytes=64, world_size=2).buckets
    assert [b.indices for b in buckets] == [a.indices for a in Bucketer(list(model.parameters()), 64, 2)]
    flat = torch.cat([b.gather(model.parameters()) for b in buckets])
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def test_a_bucket_reads_only_its_own_tensors_of_the_list():
    """Each gather/scatter type-checked and copied the whole list: a step over every bucket cost
    buckets x tensors. Entries of other buckets are not looked at."""
    tensors = [torch.ones(4), torch.full((4,), 2.0)]
    first, second = Bucketer(tensors, bucket_bytes=16).buckets
    assert torch.equal(second.gather([None, tensors[1]]), tensors[1])
    with pytest.raises(TypeError, match="takes tensors, got NoneType at index 0"):
        first.gather([None, tensors[1]])


def test_bucketer_casts_to_a_common_dtype_when_asked():
    tensors = [torch.randn(4, dtype=torch.bfloat16), torch.randn(4)]
    bucketer = Bucketer(tensors, world_size=2, dtype=torch.float32)
    assert len(bucketer) == 1 and bucketer.buckets[0].buffer.dtype == torch.float32
    assert torch.equal(bucketer.buckets[0].gather(tensors)[:4], tensors[0].float())


@pytest.mark.parametrize(
    "call", [lambda: padded_size(10.5, 2), lambda: chunk_size(10, 2.0), lambda: chunk_range(0.0, 8, 1)]
)
def test_sizes_that_are_not_integers_are_refused(call):
    """A float size gave float padded sizes and offsets (padded_size(10.5, 2) was 16.0)."""
    with pytest.raises(TypeError, match="must be an integer"):
        call()


def test_numpy_integer_sizes_give_python_ints_that_cannot_wrap():
    """numpy integers are taken as counts, but the sizes were computed in their width: padded_size
    of np.int16(32767) was np.int16(-32768), of np.uint8(250) np.uint8(0) (from a probe)."""
    cases = [
        (padded_size(np.int16(32767), 1), 32768),
        (padded_size(np.uint8(250), 1), 256),
        (padded_size(np.int32(2**31 - 1), np.int8(1)), 2**31),
        (padded_size(300, np.uint8(200)), 1600),
        (chunk_size(np.int16(32767), np.int64(2)), 16384),
        (chunk_range(np.int16(0), np.int16(32767), 1), (0, 32768)),
        (real_count(np.int8(1), np.int16(32767), np.int8(2)), 16383),
    ]
    for got, expected in cases:
        assert got == expected
        assert {type(v) for v in (got if isinstance(got, tuple) else (got,))} == {int}
    bucketer = Bucketer([torch.ones(3)], bucket_bytes=np.int16(32767), world_size=np.uint8(250))
    assert type(bucketer.world_size) is int and bucketer.buckets[0].buffer.numel() == 2000


def test_bucket_refuses_a_tensor_shaped_unlike_its_slot():
    """A (1,) tensor was broadcast into a 3-element slot by gather, and scatter broadcast the
    other way; both now raise before copying anything, the buffer and the tensors as they were."""
    tensors = [torch.arange(5.0), torch.arange(3.0)]
    (bucket,) = Bucketer(tensors, world_size=2).buckets
    bucket.gather(tensors)
    before = bucket.buffer.clone()
    with pytest.raises(ValueError, match="laid out for"):
        bucket.gather([tensors[0], torch.ones(1)])
    wide = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="laid out for"):
        bucket.scatter([wide, tensors[1]])
    assert torch.equal(bucket.buffer, before) and not wide.any()


def test_flatten_copies_parameters_as_data():
    """flatten of parameters (leaves that require grad) raised RuntimeError from autograd's
    in-place check; it copies their data, as Bucket.gather does."""
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    flat = flatten(params, numel=8)
    assert torch.equal(flatten(iter(params), numel=8), flat)  # e.g. model.parameters()
    assert not flat.requires_grad and flat.grad_fn is None
    assert torch.equal(flat, torch.cat([params[0].detach(), params[1].detach().reshape(-1), torch.zeros(1)]))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: unflatten(torch.zeros(4), [(-1,)]), ValueError, "sizes >= 0"),  # gave 3 of the 4 elements
        (lambda: unflatten(torch.zeros(4, 4), [(4,)]), ValueError, "1-D buffer"),
        (lambda: flatten(torch.ones(3)), TypeError, "flatten takes tensors"),
        (lambda: unflatten([0.0] * 4, [(4,)]), TypeError, "1-D tensor"),
        (lambda: flatten([torch.ones(3)], numel=-1), ValueError, "numel must be >= 3"),
        (lambda: flatten([torch.ones(3)], numel=2), ValueError, "numel must be >= 3"),
        (lambda: bucket_groups([torch.ones(3)], None), TypeError, "bucket_bytes must be an integer"),
        (lambda: bucket_groups([torch.ones(3)], 1.5), TypeError, "bucket_bytes must be an integer"),
        (lambda: Bucketer([torch.ones(3)], bucket_bytes=0), ValueError, "bucket_bytes must be >= 1"),
        (lambda: Bucketer([1, 2]), TypeError, "Bucketer takes tensors, got int at index 0"),
        (lambda: Bucketer([torch.ones(3)], dtype="float32"), TypeError, "dtype must be a torch.dtype"),
        (lambda: Bucketer([torch.ones(3)], world_size=0), ValueError, "world_size must be >= 1"),
        (lambda: Bucketer([torch.ones(3), torch.ones(2)]).buckets[0].gather([torch.ones(3)]), ValueError, "whole list"),
    ],
)
def test_layout_helpers_refuse_what_they_cannot_lay_out(call, error, message):
    """A -1 in a shape took a stretch one element short, silently; the others raised torch's or
    Python's errors from inside (a 2-D buffer, a tensor for a list, None bytes), or took 1.5 bytes."""
    with pytest.raises(error, match=message):
        call()
