"""The part of an optimizer checkpoint that belongs to compcomm, and which rank it belongs to.

A state dict carries, under "compcomm": the step count, the bucket layout, and the state of one
rank alone (its rank, each bucket's error feedback, any other per-rank state). Saved per rank,
it resumes only that rank; `gathered` holds every rank's part under "ranks", so that one file
saved from rank 0 resumes every rank exactly; `drop_error_feedback` is the explicit reset that
loads on any rank and world size. Loading another rank's or another layout's state is refused
(the caller raises the refusal on every rank), never a silent wrong resume.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from typing import Any

import torch

from ..backends import Backend
from ..error_feedback import ErrorFeedback, Served
from ..gather_objects import agree_on_values, all_gather_object
from ..layout import is_integer
from .buckets import BucketLayout
from .shards import local

EXTRA_KEY = "compcomm"
PER_RANK = ("rank", "error_feedback", "rank_local")


def compcomm_entry(
    optimizer: str, step: int, be: Backend, layout: BucketLayout, scalars: dict[str, Any], rank_local: dict[str, Any]
) -> dict[str, Any]:
    """This rank's "compcomm" entry of a state dict (`optimizer`: the compcomm optimizer class
    that saved it, or that the saving class derives from)."""
    return {
        "optimizer": optimizer,
        "step": step,
        "rank": be.rank,
        "world_size": be.world_size,
        "bucket_order": list(layout.order),
        "bucket_numels": layout.sizes(),
        "scalars": scalars,
        "error_feedback": [ef.state_dict() for ef in layout.error_feedback],
        "rank_local": rank_local,
    }


def gathered(state_dict: dict[str, Any], be: Backend) -> dict[str, Any]:
    """`state_dict` with every rank's per-rank part under "compcomm"/"ranks" (a collective)."""
    extra = state_dict[EXTRA_KEY]
    mine = {key: extra.pop(key) for key in PER_RANK}
    extra["ranks"] = all_gather_object(mine, be)
    return state_dict


def saved_order(extra: dict[str, Any], count: int) -> list[int] | None:
    """The bucket order a checkpoint was saved with, if it is one for `count` parameters."""
    order = extra.get("bucket_order")
    return order if isinstance(order, list) and sorted(order) == list(range(count)) else None


def own_part(
    extra: dict[str, Any], be: Backend, layout: BucketLayout, causes: str = "different parameters or bucket_bytes"
) -> tuple[dict[str, Any], str | None]:
    """This rank's share of a checkpoint's "compcomm" entry, and why it cannot be loaded here
    (None if it can); `causes` names what makes the caller's buckets differ from the saved ones."""
    world, rank = be.world_size, be.rank
    saved_world = extra.get("world_size")
    if saved_world is not None and saved_world != world:
        return {}, (
            f"this checkpoint was saved on {saved_world} ranks and cannot resume on {world}: "
            "its error-feedback buffers belong to another split of the buckets. To resume "
            "anyway with the errors reset to zero, load "
            "OnebitOptimizer.drop_error_feedback(state_dict)"
        )
    numels = layout.sizes()
    if list(extra.get("bucket_numels", [])) != numels:
        return {}, (
            f"the checkpoint's buckets ({extra.get('bucket_numels')} elements) do not match "
            f"this optimizer's ({numels}): {causes}"
        )
    if list(extra.get("bucket_order") or layout.order) != list(layout.order):
        return {}, f"the checkpoint's parameters were bucketed in another order than this optimizer's: {causes}"
    if "ranks" in extra:
        return extra["ranks"][rank], None
    saved_rank = extra.get("rank")
    if saved_rank is not None and saved_rank != rank:
        return {}, (
            f"this checkpoint holds the state of rank {saved_rank}, not of rank {rank}: its "
            "error feedback (and any local state) belongs to that rank. Save one file per "
            "rank, or one file for all ranks with gathered_state_dict()"
        )
    return extra, None


def crc32_of(tensors: Iterable[torch.Tensor]) -> int:
    """A digest of the tensors' values, in order: the crc32 of their bytes (dense, row-major)."""
    digest = 0
    for t in tensors:
        dense = t.detach().to_dense() if t.is_sparse else t.detach()
        data = dense.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest = zlib.crc32(data, digest)  # type: ignore[arg-type]  # an ndarray is a buffer: no copy
    return digest


def agree_on_position(position: dict[str, Any], be: Backend) -> None:
    """ValueError on every rank when the ranks load states of different saves (per-rank files of
    different steps: one rank's latest save failed): resumed, they would pair collectives of
    different steps, or switch from exact to 1-bit at different calls. `position`: what must
    be equal on every rank (the step count, a digest of state that is)."""
    agree_on_values(
        position,
        be,
        "the ranks loaded states of different saves; load files saved at the same step on every rank, "
        "or one file from gathered_state_dict()",
    )


def error_feedback_problem(saved: list[Any], served: list[Served], remedy: str) -> str | None:
    """Why a checkpoint's error-feedback states cannot load (None if every one can): each is
    loaded into a fresh ErrorFeedback first, so that a refused one (malformed, non-finite) is
    found, and agreed, before anything is loaded, and must hold the errors of what its bucket's
    calls serve here (`served[b]`: elements, ranks, layout, rank; see `schedules.serves`), which
    another layout of the same ranks (flat, hierarchical) splits otherwise; `remedy` says what to
    do then."""
    if not isinstance(saved, list) or len(saved) != len(served):
        count = len(saved) if isinstance(saved, list) else type(saved).__name__
        return f"the checkpoint holds error feedback for {count} buckets, this optimizer has {len(served)}"
    for b, (state, serves) in enumerate(zip(saved, served)):
        errors = ErrorFeedback()
        try:
            errors.load_state_dict(state)
        except ValueError as exc:
            return f"bucket {b}'s error feedback: {exc}"
        why = errors.mismatch(*serves)
        if why is not None:
            return (
                f"bucket {b}'s error feedback does not fit its calls here ({why.split(';')[0]}): it was saved "
                "over another layout of the ranks (a flat backend and a hierarchical one split the buckets "
                f"otherwise). {remedy}"
            )
    return None


def state_problem(
    optimizer: str,
    extra: dict[str, Any],
    state: dict[str, Any],
    params: list[torch.Tensor],
    moments: tuple[str, ...],
    held: tuple[str, ...],
    scalars: dict[str, int],
) -> str | None:
    """Why a checkpoint's optimizer state cannot load into `optimizer` over `params` (None if it
    can), found before anything is loaded: a state saved by another optimizer class; a step
    count that is not a count; per-parameter `moments` (all or none) and `held` tensors (filled
    in when missing, as in a state saved before they were kept) that are not fp32 of the
    parameter's local shape, or not finite; other numbers that are not finite; `scalars`
    (name: least value) missing or out of range, or others besides them. torch's own load would
    take such a state and fail, or train on it wrongly, at a later step. `optimizer`: the
    compcomm optimizer class this one is or derives from."""
    saved_by = extra.get("optimizer")
    if saved_by is not None and saved_by != optimizer:
        return f"this checkpoint was saved by {saved_by}, not {optimizer}: their states hold other quantities"
    problem = step_problem(extra.get("step"))
    if problem is not None:
        return problem
    saved_scalars = extra.get("scalars", {})
    unknown = sorted(map(str, set(saved_scalars) - set(scalars))) if isinstance(saved_scalars, dict) else []
    if unknown:  # the load sets each as an attribute: only this optimizer's own counters
        return f"the checkpoint's scalars {unknown} are none of this optimizer's ({sorted(scalars)})"
    for name, least in scalars.items():
        value = saved_scalars.get(name) if isinstance(saved_scalars, dict) else None
        if not is_integer(value) or value < least:
            return f"the checkpoint's {name} must be an integer >= {least}, got {value!r}"
    for i, entry in state.items():
        if not is_integer(i) or not 0 <= i < len(params) or not isinstance(entry, dict):
            return f"the checkpoint's state names parameter {i!r}, and this optimizer has {len(params)}"
        shape = tuple(local(params[i]).shape)
        missing = [name for name in moments if name not in entry]
        if missing and len(missing) < len(moments):
            return f"parameter {i}'s state lacks {missing} of its moments {list(moments)}"
        for name, value in entry.items():
            problem = fp32_problem(f"parameter {i}'s {name}", value, shape if name in (*moments, *held) else None)
            if problem is not None:
                return problem
    return None


def freeze_problem(extra: dict[str, Any], setting: str, current: int) -> str | None:
    """Why a checkpoint's state cannot go on under `setting` = `current`, the step at which the
    variance freezes (None if it can). Saved at or past its own freeze step, the state holds what
    the freeze formed (and the frozen stage's moments, errors, local steps): it goes on only
    under the same step. Saved before, it goes on under any freeze step still ahead of it: one
    at or behind its step would start the frozen stage from what the freeze never formed. A
    state saved without its schedule (by compcomm before it recorded one) is taken as it is."""
    schedule = extra.get("schedule")
    if schedule is None:
        return None
    saved = schedule.get(setting) if isinstance(schedule, dict) else None
    if not is_integer(saved) or saved < 1:
        return f"the checkpoint's schedule must name {setting} as an integer >= 1, got {saved!r}"
    step = extra["step"]
    if saved == current or step < min(saved, current):
        return None
    if step >= saved:
        return (
            f"this checkpoint was saved at step {step}, at or after the variance froze ({setting}={saved}); "
            f"this optimizer's {setting}={current} would go on from it as from another stage: resume with "
            f"{setting}={saved}"
        )
    return (
        f"this checkpoint was saved at step {step}, before the variance froze ({setting}={saved}); with "
        f"{setting}={current} it would have frozen at step {current}, which this state never went through: "
        f"resume with {setting} > {step}"
    )


def step_problem(step: Any) -> str | None:
    """Why a checkpoint's step count cannot be loaded (None if it can)."""
    return (
        None if is_integer(step) and step >= 0 else f"the checkpoint's step count must be an integer >= 0, got {step!r}"
    )


def fp32_problem(what: str, value: Any, shape: tuple[int, ...] | None, finite_only: bool = True) -> str | None:
    """Why saved state `what` cannot be loaded as kept (None if it can): with a `shape`, not an
    fp32 tensor of that shape; with `finite_only` (values that a sound run keeps finite), a
    tensor or float that is not finite."""
    if shape is not None and (not torch.is_tensor(value) or value.dtype != torch.float32 or value.shape != shape):
        described = f"{value.dtype} {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__
        return f"{what} must be float32 of shape {shape}, got {described}"
    if not finite_only:
        return None
    finite = (
        bool(torch.isfinite(value).all())
        if torch.is_tensor(value) and value.is_floating_point()
        else not isinstance(value, float) or math.isfinite(value)
    )
    return None if finite else f"{what} holds NaN or Inf"


def unreadable(kind: str, exc: Exception) -> str:
    """Why a `kind` state dict too malformed to read (a key missing, a value of another type)
    cannot load: refused on every rank like any other reason, never raised on one alone."""
    return f"a malformed {kind} state dict ({type(exc).__name__}: {exc})"


def state_digest(state: dict[str, Any], scalars: Any, values: bool) -> int:
    """A digest of what every rank's torch per-parameter state holds alike: which parameters
    have state and under which names, the scalars, and with `values` (an optimizer whose ranks
    keep the same moments) every value too. Equal on every rank unless one rank's file differs
    (a parameter's state missing or changed)."""
    held = {i: entry for i, entry in state.items() if entry}  # reading opt.state[p] saves an empty entry
    names = sorted((i, sorted(entry)) for i, entry in held.items())
    if not values:
        return zlib.crc32(repr((names, scalars)).encode())
    tensors = [v for i in sorted(held) for _, v in sorted(held[i].items()) if torch.is_tensor(v)]
    numbers = [v for i in sorted(held) for _, v in sorted(held[i].items()) if not torch.is_tensor(v)]
    return zlib.crc32(repr((names, numbers, scalars)).encode(), crc32_of(tensors))


def sharded_entry(
    optimizer: str, step: int, be: Backend, scalars: dict[str, Any], rank_local: dict[str, Any]
) -> dict[str, Any]:
    """This rank's "compcomm" entry of an optimizer on FSDP2-sharded parameters: its state is
    its shards', so the whole state dict belongs to this rank."""
    return {
        "optimizer": optimizer,
        "step": step,
        "rank": be.rank,
        "world_size": be.world_size,
        "sharded": True,
        "scalars": scalars,
        "rank_local": rank_local,
    }


def gathered_sharded(state_dict: dict[str, Any], be: Backend) -> dict[str, Any]:
    """Every rank's whole sharded state dict, under "compcomm"/"ranks" (a collective)."""
    return {EXTRA_KEY: {"sharded": True, "world_size": be.world_size, "ranks": all_gather_object(state_dict, be)}}


def own_sharded(state_dict: dict[str, Any], be: Backend) -> tuple[dict[str, Any], str | None]:
    """This rank's sharded state dict (its own, or its part of a gathered one), and why it cannot
    be loaded here (None if it can)."""
    extra = state_dict[EXTRA_KEY]
    if not extra.get("sharded"):
        return state_dict, "this checkpoint is of an optimizer on whole parameters, not FSDP2-sharded ones"
    if extra.get("world_size") != be.world_size:
        return state_dict, (
            f"this checkpoint was saved on {extra.get('world_size')} ranks and cannot resume on {be.world_size}: "
            "its state holds other shards"
        )
    if "ranks" in extra:
        state_dict = extra["ranks"][be.rank]
        extra = state_dict[EXTRA_KEY]
    if extra.get("rank") != be.rank:
        return state_dict, (
            f"this checkpoint holds the shards of rank {extra.get('rank')}, not of rank {be.rank}. Save one file per "
            "rank, or one file for all ranks with gathered_state_dict()"
        )
    return state_dict, None


def drop_error_feedback(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of `state_dict` without per-rank state, loadable on any rank and world size (a
    documented reset: the compression errors carried so far are forgotten). A ValueError for
    an optimizer on FSDP2-sharded parameters: its whole state (moments too) is its shards'."""
    out = dict(state_dict)
    extra = dict(out[EXTRA_KEY])
    if extra.get("sharded"):
        raise ValueError(
            "drop_error_feedback: this is the state of an optimizer on FSDP2-sharded parameters, whose moments "
            "are this rank's shards as well as its errors: no part of it loads on another rank or world size"
        )
    extra.pop("ranks", None)
    extra["world_size"] = extra["rank"] = None
    extra["rank_local"] = {}
    extra["error_feedback"] = [
        {"worker_error": None, "server_error": None, "numel": None, "world_size": None} for _ in extra["bucket_numels"]
    ]
    out[EXTRA_KEY] = extra
    return out
