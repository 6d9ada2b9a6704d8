"""What 1-bit Adam and 1-bit LAMB share: buckets, communication, the two stages, checkpoints.

A step of a data-parallel run over n ranks, with local gradients g_r and step count t:

    agree:        one tiny all-reduce of a "some gradient is NaN/Inf" flag; if any rank
                  raised it, every rank returns without touching anything.
    warm-up       (t <= freeze_step)
                  g = (1/n) sum_r g_r            uncompressed all-reduce, one per bucket
                  the subclass applies its plain (Adam / LAMB) update with g.
    compression   (t > freeze_step)
                  m_r = beta1 m + (1 - beta1) g_r          local momentum, local gradient
                  m_r <- m_r * s_l                          optional per-layer scale (LAMB)
                  m = compressed_allreduce(m_r) / s_l       1-bit, error feedback per bucket
                  the subclass applies its update with the averaged momentum m and the
                  second moment frozen at t = freeze_step.

Every quantity an update reads (parameters, averaged gradient or momentum, frozen moments)
is bitwise identical on every rank, so parameters stay bitwise identical after every step.
Tensors travel through `compcomm.layout.Bucketer` buffers in fp32: one collective per
bucket, never one per parameter, and `_allreduce_buckets` is the single place that issues them.
"""
from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..allreduce import compressed_allreduce
from ..backends import Backend, resolve
from ..error_feedback import ErrorFeedback
from ..layout import DEFAULT_BUCKET_BYTES, Bucketer
from ..ordering import wait_all

PARAM_DTYPES = (torch.float32, torch.bfloat16)
_EXTRA_KEY = "compcomm"


def check_range(name: str, value: Any, low: float, high: float = math.inf, *,
                low_open: bool = False, high_open: bool = False) -> None:
    """ValueError unless `value` is a finite real number within the given bounds."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        raise ValueError(f"invalid {name}: {value!r} (must be a finite number in {lo}{low}, {high}{hi})")


class OnebitOptimizer(torch.optim.Optimizer):
    """Base class of the 1-bit optimizers; subclasses supply the update rules.

    Subclass hooks, each called once per step under `torch.no_grad()` with fp32 tensors
    listed in parameter order (`self._params()`):
      `_warmup_update(t, grads)`              plain update from the averaged gradients;
      `_freeze()`                             end of warm-up (after the update of t = freeze_step);
      `_momentum_scales()`                    per-parameter scale s_l applied before compression,
                                              or None;
      `_compressed_update(t, momenta)`        update from the averaged momenta.

    The communication layout is built on first use: all parameters, in group order, are
    packed into fp32 buckets of at most `bucket_bytes` (a class attribute, 25 MiB as in DDP;
    set it on the instance before the first step to change it). Parameters whose `.grad` is
    None count as a zero gradient, so that every rank always sends the same buckets.
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    freeze_step: int
    last_step_skipped: bool
    _backend_arg: Backend | str | None
    _step_count: int

    def __init__(self, params: Iterable, defaults: dict[str, Any], freeze_step: int,
                 backend: Backend | str | None) -> None:
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, numbers.Integral) or freeze_step < 1:
            raise ValueError(f"invalid freeze_step: {freeze_step!r} (must be an integer >= 1: the "
                             "compression stage needs a second moment estimated during warm-up)")
        if backend is not None and not isinstance(backend, (str, Backend)):
            raise TypeError(f"backend must be a name, a compcomm Backend or None, got {type(backend).__name__}")
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self._backend_arg = backend
        self._backend: Backend | None = None
        self._bucketer: Bucketer | None = None
        self._error_feedback: list[ErrorFeedback] = []
        self._step_count = 0
        self.last_step_skipped = False

    # ----------------------------------------------------------------- parameters and layout

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_bucketer", None) is not None:
            raise RuntimeError("cannot add a parameter group after the first step: the communication "
                               "buckets (and their error feedback) are already laid out")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._check_group(group)
        for p in group["params"]:
            if p.dtype not in PARAM_DTYPES:
                raise ValueError(f"parameters must be float32 or bfloat16, got {p.dtype}")

    def _check_group(self, group: dict[str, Any]) -> None:
        """ValueError for invalid hyperparameters of one group (subclasses extend it)."""
        check_range("lr", group["lr"], 0.0)
        check_range("eps", group["eps"], 0.0)
        check_range("weight_decay", group["weight_decay"], 0.0)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"invalid betas: {betas!r} (must be a pair)")
        check_range("betas[0]", betas[0], 0.0, 1.0, high_open=True)
        check_range("betas[1]", betas[1], 0.0, 1.0, high_open=True)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _groups_of_params(self) -> list[dict[str, Any]]:
        return [group for group in self.param_groups for _ in group["params"]]

    @property
    def backend(self) -> Backend:
        """The transport, resolved on first use like `compressed_allreduce`'s `backend`."""
        if self._backend is None:
            params = self._params()
            self._backend = resolve(self._backend_arg, params[0] if params else None)
        return self._backend

    def _layout(self) -> Bucketer:
        """The fp32 buckets (and one ErrorFeedback per bucket), built once."""
        if self._bucketer is None:
            params = self._params()
            if not params:
                raise ValueError("the optimizer has no parameters")
            self._bucketer = Bucketer(params, self.bucket_bytes, self.backend.world_size, dtype=torch.float32)
            self._error_feedback = [ErrorFeedback() for _ in self._bucketer]
        return self._bucketer

    @property
    def step_count(self) -> int:
        """Steps taken so far (skipped steps do not count)."""
        return self._step_count

    @property
    def compressing(self) -> bool:
        """Whether the next step is in the compression stage."""
        return self._step_count >= self.freeze_step

    # ----------------------------------------------------------------- communication

    def _allreduce_buckets(self, tensors: Sequence[torch.Tensor], compressed: bool) -> list[torch.Tensor]:
        """Average `tensors` (one per parameter, any float dtype) over all ranks, bucket by bucket.

        Uncompressed: `backend.all_reduce(mean)`; compressed: `compressed_allreduce` with the
        bucket's ErrorFeedback, all buckets in flight at once (async_op), then waited. Returns fp32
        views (into the bucket buffers) of the averages, in parameter order, valid until the next
        call. Every collective of the optimizer's payload is issued here, one per bucket.
        """
        bucketer, be = self._layout(), self.backend
        out: list[torch.Tensor | None] = [None] * len(tensors)
        in_flight = []
        for bucket, ef in zip(bucketer, self._error_feedback):
            flat = bucket.gather(tensors)  # overlaps the previous bucket's compressed allreduce
            if compressed:
                in_flight.append(compressed_allreduce(flat, ef, backend=be, op="mean", async_op=True))
            else:
                be.all_reduce(flat, op="mean")
            for i, view in zip(bucket.indices, bucket.views):
                out[i] = view
        wait_all(in_flight)
        return out  # type: ignore[return-value]

    def _all_finite(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Whether every rank's gradients are finite: one 1-element all-reduce of a flag."""
        bad = any(g is not None and not bool(torch.isfinite(g).all()) for g in grads)
        flag = torch.tensor([1.0 if bad else 0.0], dtype=torch.float32, device=self.backend.device)
        self.backend.all_reduce(flag, op="sum")
        return float(flag.item()) == 0.0

    # ----------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step on every rank (all ranks must call it together).

        Returns the closure's loss, if a closure was given. When any rank's gradients hold
        NaN/Inf, every rank skips the step and `last_step_skipped` is True: parameters,
        moments, error buffers and the step count are left exactly as they were.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        self._layout()
        grads = [p.grad for p in params]
        if any(g is not None and g.is_sparse for g in grads):
            raise RuntimeError("1-bit optimizers do not support sparse gradients")
        self.last_step_skipped = not self._all_finite(grads)
        if self.last_step_skipped:
            return loss
        local = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        t = self._step_count + 1
        if t <= self.freeze_step:
            self._warmup_update(t, self._allreduce_buckets(local, compressed=False))
            if t == self.freeze_step:
                self._freeze()
        else:
            momenta = self._local_momenta(local)
            scales = self._momentum_scales()
            if scales is not None:
                for m, s in zip(momenta, scales):
                    m.mul_(s)
            averaged = self._allreduce_buckets(momenta, compressed=True)
            if scales is not None:
                for m, s in zip(averaged, scales):
                    m.div_(s)
            self._compressed_update(t, averaged)
        self._step_count = t
        return loss

    def _local_momenta(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """m_r = beta1 m + (1 - beta1) g_r, in new fp32 tensors (the state is not touched yet)."""
        out = []
        for p, g, group in zip(self._params(), grads, self._groups_of_params()):
            beta1 = group["betas"][0]
            out.append(self.state[p]["exp_avg"].lerp(g.float(), 1 - beta1))
        return out

    def _moments(self, p: torch.Tensor) -> dict[str, Any]:
        """The parameter's state, with fp32 zero moments on first use."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        return state

    # ----------------------------------------------------------------- subclass hooks

    def _warmup_update(self, t: int, grads: Sequence[torch.Tensor]) -> None:
        raise NotImplementedError

    def _freeze(self) -> None:
        """End of warm-up; the second moments are frozen from now on."""

    def _momentum_scales(self) -> list[float] | None:
        return None

    def _compressed_update(self, t: int, momenta: Sequence[torch.Tensor]) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus, under "compcomm", the step count, the world size and
        the error feedback of every bucket (what exact resumption needs)."""
        sd = super().state_dict()
        bucketer = self._layout()
        sd[_EXTRA_KEY] = {
            "step": self._step_count,
            "freeze_step": self.freeze_step,
            "world_size": self.backend.world_size,
            "bucket_numels": [b.numel for b in bucketer],
            "error_feedback": [ef.state_dict() for ef in self._error_feedback],
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from `state_dict()`: bit for bit on the same world size.

        A checkpoint from another world size is a ValueError (the carried compression errors
        belong to another split of the buckets); `drop_error_feedback(sd)` gives a copy that
        loads on any world size, with zero error buffers.
        """
        extra = state_dict.get(_EXTRA_KEY)
        if extra is None:
            raise ValueError(f"not a {type(self).__name__} state dict (no {_EXTRA_KEY!r} entry)")
        bucketer = self._layout()
        world = self.backend.world_size
        if extra["world_size"] is not None and extra["world_size"] != world:
            raise ValueError(
                f"this checkpoint was saved on {extra['world_size']} ranks and cannot resume on {world}: "
                "its error-feedback buffers belong to another split of the buckets. To resume anyway "
                "with the errors reset to zero, load OnebitOptimizer.drop_error_feedback(state_dict)")
        numels = [b.numel for b in bucketer]
        if list(extra["bucket_numels"]) != numels:
            raise ValueError(f"the checkpoint's buckets ({extra['bucket_numels']} elements) do not match "
                             f"this optimizer's ({numels}): different parameters or bucket_bytes")
        plain = {k: v for k, v in state_dict.items() if k != _EXTRA_KEY}
        super().load_state_dict(plain)
        # torch casts floating state to the parameter dtype; keep ours exactly as saved (fp32).
        params = self._params()
        index = [i for g in plain["param_groups"] for i in g["params"]]
        for i, p in zip(index, params):
            saved = plain["state"].get(i)
            if saved is not None:
                self.state[p] = {k: v.detach().clone().to(p.device) if torch.is_tensor(v) else copy.deepcopy(v)
                                 for k, v in saved.items()}
        self._step_count = int(extra["step"])
        for ef, saved in zip(self._error_feedback, extra["error_feedback"]):
            ef.load_state_dict(saved)

    @staticmethod
    def drop_error_feedback(state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state_dict` without error-feedback buffers, loadable on any world size
        (a documented reset: the compression errors carried so far are forgotten)."""
        out = dict(state_dict)
        extra = dict(out[_EXTRA_KEY])
        extra["world_size"] = None
        extra["error_feedback"] = [{"worker_error": None, "server_error": None, "numel": None,
                                    "world_size": None} for _ in extra["error_feedback"]]
        out[_EXTRA_KEY] = extra
        return out


def apply_to_param(p: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
    """Run the in-place fp32 update `fn(w)` on parameter `p` (bf16 parameters through an fp32 copy)."""
    w = p.detach()
    if w.dtype == torch.float32:
        fn(w)
    else:
        w32 = w.float()
        fn(w32)
        w.copy_(w32)


def update_moments(state: dict[str, Any], grad: torch.Tensor, betas: tuple[float, float]) -> None:
    """m <- beta1 m + (1 - beta1) g;  v <- beta2 v + (1 - beta2) g^2  (fp32, in place)."""
    beta1, beta2 = betas
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def adam_denominator(exp_avg_sq: torch.Tensor, beta2: float, step: int, eps: float) -> torch.Tensor:
    """sqrt(v / (1 - beta2^step)) + eps, as torch.optim.Adam computes it (a new tensor)."""
    return (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
