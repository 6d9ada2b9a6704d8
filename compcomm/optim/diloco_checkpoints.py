"""What a DiLoCo checkpoint must hold to resume here, checked before anything loads.

torch's own loads of the outer SGD and of the inner optimizer take their states as saved, and
DiLoCo's parts (theta, the fragments in flight, the counters) would be copied in as they are: an
outer lr < 0 or NaN, a momentum buffer of another shape, a NaN in theta, a fragment in flight that
never lands, or a flag that makes one rank run a collective the others do not, would surface
steps later as silently wrong numbers, a crash on one rank or a hang. `problem` is asked on every
rank and the first answer raised on all of them; `position` is what every rank must hold alike,
compared across ranks once each file has passed.
"""

from __future__ import annotations

import math
import numbers
import zlib
from typing import Any

import torch

from ..layout import is_integer
from .checkpoints import crc32_of, fp32_problem, step_problem
from .outer import OuterSync
from .updates import check_range

IN_FLIGHT_KEYS = {"fragment", "apply_at", "mean", "sent", "failure"}
"""The entries of a fragment in flight (`OuterSync.in_flight_state`)."""


def check_outer(lr: Any, momentum: Any, nesterov: Any, scheduled: bool = False) -> None:
    """ValueError (TypeError for a nesterov that is not a bool) unless the outer SGD's settings
    can step theta: lr > 0 (or 0, as a scheduler on the outer SGD may have set it: `scheduled`),
    0 <= momentum < 1, Nesterov only with momentum."""
    check_range("outer_lr", lr, 0.0, low_open=not scheduled)
    check_range("outer_momentum", momentum, 0.0, 1.0, high_open=True)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
    if nesterov and momentum == 0:
        raise ValueError("nesterov=True needs outer_momentum > 0")


def problem(state_dict: dict[str, Any], mine: dict[str, Any], sync: OuterSync, start_iter: int) -> str | None:
    """Why this rank's part of a DiLoCo checkpoint (`mine`, from `state_dict`) cannot resume
    `sync` here (None if it can), past the checks of its rank, world size, schedule and layout."""
    extra, local = state_dict["compcomm"], mine["rank_local"]
    step = extra.get("step")
    why = step_problem(step)
    if why is not None:
        return why
    local_step = step - start_iter
    return (
        _theta_problem(state_dict["synced"], sync)
        or _outer_problem(state_dict["outer"], sync)
        or _counters_problem(extra["scalars"], local, len(sync.schedule), local_step)
        or _in_flight_problem(local["in_flight"], extra["scalars"]["sent_at"], sync, local_step)
        or _params_problem(local["params"], sync.params)
        or _inner_problem(local["inner"])
    )


def position(state_dict: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
    """What every rank's file must hold alike: the step, theta, the outer SGD, the fragments in
    flight (their landed means, not this rank's parameters when sent), the counts of skipped
    syncs and the fragments' steps, and the backward's agreement. One rank's differing file
    would part theta or pair other collectives."""
    extra, local = state_dict["compcomm"], mine["rank_local"]
    outer = state_dict["outer"]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in outer["param_groups"]]
    buffers = [s.get("momentum_buffer") for _, s in sorted(outer["state"].items())]
    flights = [(d["fragment"], d["apply_at"], d["failure"]) for d in local["in_flight"]]
    means = [t for d in local["in_flight"] for t in d["mean"] or []]
    return {
        "step": int(extra["step"]),
        "theta crc32": crc32_of(state_dict["synced"]),
        "outer step": zlib.crc32(
            repr((groups, [b is None for b in buffers])).encode(), crc32_of(b for b in buffers if b is not None)
        ),
        "fragments in flight": (repr(flights), crc32_of(means)),
        "counters": repr(extra["scalars"]),  # not the skipped inner steps: each rank skips its own
        "backward agreement": repr(local.get("backward_agreement")),
    }


def _theta_problem(synced: Any, sync: OuterSync) -> str | None:
    if not isinstance(synced, list) or len(synced) != len(sync.theta):
        return f"the checkpoint's synced parameters are not one tensor per bucket ({len(sync.theta)})"
    for b, (saved, theta) in enumerate(zip(synced, sync.theta)):
        why = fp32_problem(f"the checkpoint's synced parameters of bucket {b}", saved, tuple(theta.shape))
        if why is not None:
            return why
    return None


def _outer_problem(outer: Any, sync: OuterSync) -> str | None:
    """The outer SGD's state: its one group with settings the constructor accepts (the others as
    this optimizer's own), and a momentum buffer per bucket, fp32 of theta's shape and finite."""
    own = sync.outer.param_groups[0]
    groups = outer.get("param_groups") if isinstance(outer, dict) else None
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], dict):
        return "the checkpoint's outer optimizer does not hold one parameter group, as DiLoCo's does"
    group = groups[0]
    try:
        check_outer(group.get("lr"), group.get("momentum"), group.get("nesterov"), scheduled=True)
    except (TypeError, ValueError) as exc:
        return f"the checkpoint's outer optimizer: {exc}"
    # The SGD's other settings as DiLoCo builds it; a key it lacks (an older torch's) torch's
    # load fills in, one it has besides (a scheduler's initial_lr) it keeps.
    fixed = {k: group[k] for k in own if k in group and k not in ("params", "lr", "momentum", "nesterov")}
    ours = {k: own[k] for k in fixed}
    if fixed != ours:
        return f"the checkpoint's outer optimizer has {fixed}, DiLoCo's outer SGD {ours}"
    state = outer.get("state")
    if not isinstance(state, dict) or not set(state) <= set(range(len(sync.theta))):
        return f"the checkpoint's outer optimizer state names other buckets than this optimizer's {len(sync.theta)}"
    for b, entry in state.items():
        if not isinstance(entry, dict) or not set(entry) <= {"momentum_buffer"}:
            return f"the checkpoint's outer optimizer state of bucket {b} holds more than its momentum buffer"
        buffer = entry.get("momentum_buffer")
        if buffer is not None:
            why = fp32_problem(f"the outer momentum of bucket {b}", buffer, tuple(sync.theta[b].shape))
            if why is not None:
                return why
    return None


def _counters_problem(scalars: Any, local: dict[str, Any], fragments: int, local_step: int) -> str | None:
    sent_at = scalars.get("sent_at") if isinstance(scalars, dict) else None
    counts = (local["skipped_steps"], scalars.get("skipped_syncs") if isinstance(scalars, dict) else None)
    if not all(is_integer(c) and c >= 0 for c in counts):
        return f"the checkpoint's counts of skipped steps and syncs {counts} are not counts"
    if not isinstance(sent_at, list) or len(sent_at) != fragments:
        return f"the checkpoint's fragments' steps {sent_at!r} are not one per fragment ({fragments})"
    if any(s is not None and not (is_integer(s) and 1 <= s <= local_step) for s in sent_at):
        return f"the checkpoint's fragments' steps {sent_at} are not local steps up to its own ({local_step})"
    if not isinstance(local.get("last_step_skipped", False), bool):
        return "the checkpoint's last_step_skipped is not a bool"
    flags = local.get("backward_agreement", {"first_done": False, "scaler_seen": False})
    if not isinstance(flags, dict) or set(flags) != {"first_done", "scaler_seen"}:
        return f"the checkpoint's backward agreement {flags!r} does not hold first_done and scaler_seen"
    if not all(isinstance(v, bool) for v in flags.values()):
        return f"the checkpoint's backward agreement {flags} holds other values than bools"
    return None


def _in_flight_problem(saved: Any, sent_at: list[Any], sync: OuterSync, local_step: int) -> str | None:
    """Each fragment in flight: a fragment of this schedule, once, sent at its recorded step and
    landing at a step still to come; its landed mean (fp32 of each bucket's shape, finite), or
    the failure that replaced it; this rank's parameters when sent where the syncs overlap."""
    if not isinstance(saved, list):
        return f"the checkpoint's fragments in flight are a {type(saved).__name__}, not a list"
    schedule, seen = sync.schedule, set()
    for d in saved:
        if not isinstance(d, dict) or set(d) != IN_FLIGHT_KEYS:
            return f"a fragment in flight in the checkpoint is not a dict of {sorted(IN_FLIGHT_KEYS)}"
        f = d["fragment"]
        if not is_integer(f) or not 0 <= f < len(schedule) or f in seen:
            return f"the checkpoint's fragments in flight name {f!r}: not one of this schedule's {len(schedule)}, once"
        seen.add(f)
        landing = None if sent_at[f] is None else sent_at[f] + schedule.overlap
        if not is_integer(d["apply_at"]) or d["apply_at"] != landing or not local_step < landing:
            return (
                f"the checkpoint's fragment {f} in flight lands at {d['apply_at']!r}, not {schedule.overlap} step(s) "
                f"after it was sent ({sent_at[f]}) and after the checkpoint's local step {local_step}"
            )
        if not (d["failure"] is None or isinstance(d["failure"], str)) or (d["mean"] is None) == (d["failure"] is None):
            return f"the checkpoint's fragment {f} in flight holds neither its landed mean nor the failure instead"
        buckets = schedule.buckets[f]
        # The mean is finite (else the collective failed); the parameters when sent are this
        # rank's, which may be anything (a sync they failed is skipped, and they are reset).
        for name, parts, shapes, finite_only in (
            ("landed mean", d["mean"], [tuple(sync.layout.buckets[b].flat.shape) for b in buckets], True),
            ("parameters when sent", d["sent"], [tuple(sync.theta[b].shape) for b in buckets], False),
        ):
            if parts is None and (name == "landed mean" or not schedule.overlap):
                continue
            if not isinstance(parts, list) or len(parts) != len(buckets):
                return (
                    f"the checkpoint's fragment {f} in flight does not hold its {name} for its {len(buckets)} bucket(s)"
                )
            for part, shape in zip(parts, shapes):
                why = fp32_problem(f"the {name} of fragment {f} in flight", part, shape, finite_only)
                if why is not None:
                    return why
    return None


def _params_problem(saved: Any, params: list[torch.Tensor]) -> str | None:
    """This rank's parameters: as many as the model's, each of its shape and dtype (their values
    are this rank's: non-finite ones too, which the next sync resets, or a frozen one's -inf)."""
    if not isinstance(saved, list) or len(saved) != len(params):
        return (
            f"the checkpoint holds {len(saved) if isinstance(saved, list) else saved!r} parameters, not {len(params)}"
        )
    shapes = [tuple(p.shape) for p in params]
    saved_shapes = [tuple(t.shape) if torch.is_tensor(t) else None for t in saved]
    if saved_shapes != shapes:
        return f"the checkpoint's parameters have the shapes {saved_shapes}, not this model's {shapes}"
    for i, (t, p) in enumerate(zip(saved, params)):
        if t.dtype != p.dtype:
            return f"the checkpoint's parameter {i} is {t.dtype}, the model's {p.dtype}"
    return None


def _inner_problem(inner: Any) -> str | None:
    """The inner optimizer's learning rates, as far as any torch optimizer's can be checked:
    finite numbers >= 0 (its state is that optimizer's own, which may overflow in a good run,
    and its load takes as saved)."""
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list):
        return "the checkpoint's inner optimizer state has no list of parameter groups"
    for i, group in enumerate(groups):
        lr = group.get("lr") if isinstance(group, dict) else None
        real = (torch.is_tensor(lr) and lr.numel() == 1) or (isinstance(lr, numbers.Real) and not isinstance(lr, bool))
        if lr is not None and not (real and math.isfinite(float(lr)) and float(lr) >= 0):
            return f"the checkpoint's inner optimizer group {i} has the learning rate {lr!r}: not a finite number >= 0"
    return None
