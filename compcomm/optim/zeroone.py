"""0/1 Adam (Lu et al. 2022, "Maximizing Communication Efficiency for Large-scale Training via
0/1 Adam", arXiv:2202.06009), with DeepSpeed's parameter names and meaning.

Two ideas cut communication beyond 1-bit Adam. The variance is not frozen at one step but
refreshed at steps whose spacing doubles (adaptive freezing), and between refreshes the
gradient itself travels in 1 bit; after `var_freeze_step` the variance is frozen for good and
the workers take local steps, synchronizing in 1 bit only every H steps, H doubling every
`local_step_scaler` steps up to `local_step_clipper`.

With lr, betas (beta1, beta2), eps, decoupled weight decay wd, b1(t) = 1 - beta1^t, k the number
of variance refreshes so far and d = sqrt(v / (1 - beta2^k)) + eps (element-wise):

    phase 1 (t <= var_freeze_step), I = 1 at first:
      refresh step (t % I == 0), g = mean of the gradients (uncompressed all-reduce):
          m <- beta1 m + (1 - beta1) g;   v <- beta2 v + (1 - beta2) g^2;   k <- k + 1
          after var_update_scaler refreshes at spacing I:  I <- 2 I
      other steps, g_r = this rank's gradient:
          m <- beta1 m + (1 - beta1) mask * d * compressed_allreduce(g_r / d)   (1 bit, error feedback)
      both:  w <- w (1 - lr wd) - lr / b1(t) * m / d
    phase 2 (t > var_freeze_step; v, k and d frozen; H = 1 at first; w_s = w at the last sync):
      every step, on each rank alone (no communication):
          m_r <- mask * (beta1 m + (1 - beta1) g_r);   w_r <- w_r (1 - lr wd) - lr / b1(t) * m_r / d
          L <- L + lr   (the learning rates summed since the last sync)
      sync step (t % H == 0), the error feedback restarted from zero at the first one:
          u = mask * compressed_allreduce(w_r - w_s)     the ranks' accumulated updates
          w <- w_s + u;   m <- -b1(t) u d / L  (0 if L = 0);   w_s <- w;   L <- 0
      after every local_step_scaler steps of phase 2:  H <- min(2 H, local_step_clipper)

    mask = 0 where sqrt(v / (1 - beta2^k)) <= eps (no real gradient reached the element while v
    was estimated: d would amplify 1-bit noise, or a late local gradient, up to 1/(2 eps)), times
    the group's `exp_avg_mask`. What is sent is masked too (g / d and w_r - w_s), so that a masked
    element's huge g / d cannot inflate the 1-bit scale its chunk shares with other elements.

Departures from DeepSpeed's implementation, on purpose: what travels in 1 bit is in the units
of the update (g / d, and w_r - w_s), not of the gradient or momentum (g, (w_r - w_s) d): one
1-bit scale serves a whole chunk of a bucket that holds many layers, and Adam makes updates
comparable across elements where gradients are not (a layer whose gradients are 1e-6 next to
one whose are 1e-2 would otherwise get the larger layer's sign noise, divided by its own tiny
d). d is identical on every rank, so this is an exact change of variables. Also: torch's bias
corrections (b1(t), and 1 - beta2^k for v) as in the other compcomm optimizers; the parameters
at the last sync are kept (w_s) rather than recovered by subtraction, so that every rank lands
on bitwise the same parameters at a sync. Between syncs the parameters differ across ranks, by design; the
state dict then holds this rank's parameters too (`gathered_state_dict()` keeps every rank's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch

from ..backends import Backend
from .base import COMPRESSED, EXACT, LOCAL, OnebitOptimizer
from .checkpoints import EXTRA_KEY, fp32_problem
from .updates import Denominators, check_count, decoupled_step_, mask_, master_weight, store_, update_moments


def _synced_now(p: torch.Tensor, state: dict[str, Any]) -> None:
    """Phase 2 keeps, per parameter, its weights at the last sync (w_s) and the learning rates
    summed since (L): its weights as they are now become w_s, and L starts over."""
    state["sync_weight"].copy_(master_weight(p, state))
    state["lr_sum"] = 0.0


def _since_sync(p: torch.Tensor, state: dict[str, Any]) -> None:
    """w_s and L are set at the freeze step for the parameters trained then; one first trained
    after it (frozen until then, so alike on every rank) starts them here, from its weights."""
    if "lr_sum" not in state:
        _synced_now(p, state)


def _moved_since_sync(state: dict[str, Any]) -> bool:
    """Whether local steps moved a parameter since the last sync (L > 0): its weights differ
    across ranks until a sync averages them, also where it is frozen now. One frozen since
    the last sync stays as it is (no step moves a frozen parameter)."""
    return state.get("lr_sum", 0.0) > 0


class ZeroOneAdam(OnebitOptimizer):
    """0/1 Adam: adaptive variance freezing, 1-bit gradients, then 1-bit synchronization of
    local steps at growing intervals (the math: `compcomm.optim.zeroone`'s module docstring).

    `var_freeze_step`: the last step that may refresh the variance; `var_update_scaler`: how many
    refreshes happen at one spacing before it doubles; `local_step_scaler`: how many steps of
    phase 2 pass before the sync interval doubles; `local_step_clipper`: the largest interval.
    The optimizer performs all gradient communication itself: do not wrap the model in DDP.
    """

    _SCALARS: ClassVar[dict[str, int]] = {
        "var_interval": 1,
        "var_counter": 0,
        "var_updates": 0,
        "local_interval": 1,
        "local_counter": 0,
    }
    _HELD_FROM_START = ("sync_weight",)  # w_s, filled at the freeze
    _SAME_MOMENTS = False  # local steps move each rank's momentum on its own gradients
    _FREEZE_SETTING = "var_freeze_step"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        backend: Backend | str | None = None,
    ) -> None:
        check_count("var_freeze_step", var_freeze_step, 1)
        check_count("var_update_scaler", var_update_scaler, 1)
        check_count("local_step_scaler", local_step_scaler, 1)
        check_count("local_step_clipper", local_step_clipper, 1)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, backend)
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
        self.var_interval, self.var_counter, self.var_updates = 1, 0, 0
        self.local_interval, self.local_counter = 1, 0
        # Whether a local step was taken since the last sync: the weights and momenta then differ
        # across ranks and a checkpoint must carry each rank's (whatever the learning rate was).
        self._between_syncs = False
        self._denominators = Denominators()  # d changes only when v is refreshed

    def _schedule(self) -> dict[str, Any]:
        return {
            "var_freeze_step": self.var_freeze_step,
            "var_update_scaler": self.var_update_scaler,
            "local_step_scaler": self.local_step_scaler,
            "local_step_clipper": self.local_step_clipper,
        }

    def _check_sharded(self) -> None:
        raise ValueError(
            "ZeroOneAdam does not run on FSDP2-sharded parameters: its local steps need whole parameters on "
            "every rank. Use OnebitAdam or OnebitLamb with compcomm.fsdp.compress, or ZeroOneAdam without FSDP"
        )

    def _kind(self, t: int) -> str:
        if t <= self.var_freeze_step:
            return EXACT if t % self.var_interval == 0 else COMPRESSED
        return COMPRESSED if t % self.local_interval == 0 else LOCAL

    def _fresh_errors(self, t: int) -> bool:
        return t == self.var_freeze_step + 1  # the errors of gradients do not carry over to updates

    def _denominator(
        self, p: torch.Tensor, group: dict[str, Any], refreshes: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """d after `refreshes` refreshes of v, and where it is negligible (see `mask_`)."""
        return self._denominators.get(p, self._moments(p)["exp_avg_sq"], refreshes, group)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        # Beside the per-rank part, so that drop_error_feedback's copy of a state saved between
        # syncs, loaded on the ranks that hold their own weights and momenta, still says so.
        sd[EXTRA_KEY]["between_syncs"] = self._between_syncs
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._denominators.clear()
        super().load_state_dict(state_dict)

    def _payload_shows_nonfinite(self, kind: str) -> bool:
        """Compressed payloads are masked, and a masked NaN would not show: true for them
        only when no element of any parameter is masked. Local steps send nothing."""
        if kind != COMPRESSED:
            return kind == EXACT
        if any(group.get("exp_avg_mask") is not None for group in self.param_groups):
            return False
        return all(
            self._denominator(p, group, self.var_updates)[1] is None
            for group in self.param_groups
            for p in group["params"]
            if p.requires_grad
        )

    def _local_step(
        self,
        t: int,
        w: torch.Tensor,
        m: torch.Tensor,
        g: torch.Tensor,
        group: dict[str, Any],
        p: torch.Tensor,
        m_out: torch.Tensor,
        w_out: torch.Tensor | None,
    ) -> None:
        """This rank's momentum and weights after a local step, written into m_out (which may
        be m itself) and w_out (None: w is updated in place)."""
        beta1 = group["betas"][0]
        denom, masked = self._denominator(p, group, self.var_updates)
        mask_(torch.lerp(m, g, 1 - beta1, out=m_out), p, group, masked)
        decoupled_step_(w, group, m_out, denom, group["lr"] / (1 - beta1**t), out=w_out)

    def _payload(
        self, t: int, kind: str, p: torch.Tensor, group: dict[str, Any], g: torch.Tensor, out: torch.Tensor
    ) -> None:
        frozen = not p.requires_grad
        if frozen and kind == COMPRESSED and t > self.var_freeze_step and _moved_since_sync(self.state.get(p, {})):
            # a sync of a parameter frozen since local steps moved it: w_r - w_s, no step now
            state = self.state[p]
            torch.sub(master_weight(p, state), state["sync_weight"], out=out)
            return
        if kind != COMPRESSED or frozen:
            out.copy_(g)
            return
        state = self._moments(p)
        if t <= self.var_freeze_step:  # a 1-bit gradient, in the update's units
            denom, masked = self._denominator(p, group, self.var_updates)
            mask_(torch.div(g, denom, out=out), p, group, masked)
            return
        # a sync: w_r - w_s, this step's local update included
        _since_sync(p, state)
        self._local_step(t, master_weight(p, state), state["exp_avg"], g, group, p, self._scratch_like(p), out)
        out.sub_(state["sync_weight"])

    def _apply(self, t: int, kind: str, values: Sequence[torch.Tensor]) -> None:
        if t <= self.var_freeze_step:
            self._phase1(t, kind, values)
        else:
            self._phase2(t, kind, values)

    def _phase1(self, t: int, kind: str, values: Sequence[torch.Tensor]) -> None:
        refreshes = self.var_updates + (kind == EXACT)
        for p, value, group, state in self._entries(values):
            state = self._moments(p)
            beta1 = group["betas"][0]
            if kind == EXACT:  # the mask is worked out later, if a 1-bit step needs it
                update_moments(state, value, group["betas"])
                denom = self._denominators.denominator(p, state["exp_avg_sq"], refreshes, group)
            else:
                denom, masked = self._denominator(p, group, refreshes)
                state["exp_avg"].lerp_(mask_(value.mul_(denom), p, group, masked), 1 - beta1)
            w = master_weight(p, state)
            decoupled_step_(w, group, state["exp_avg"], denom, group["lr"] / (1 - beta1**t))
            store_(p, w)
            if t == self.var_freeze_step:
                _synced_now(p, state)
        if kind == EXACT:
            self.var_updates = refreshes
            self.var_counter += 1
            if self.var_counter >= self.var_update_scaler:  # > after a resume with a smaller one
                self.var_counter, self.var_interval = 0, 2 * self.var_interval

    def _phase2(self, t: int, kind: str, values: Sequence[torch.Tensor]) -> None:
        for p, value, group, state in self._entries(values, also=_moved_since_sync if kind != LOCAL else None):
            state = self._moments(p)  # a parameter first trained now has none yet
            _since_sync(p, state)
            w = master_weight(p, state)
            if kind == LOCAL:
                self._local_step(t, w, state["exp_avg"], value, group, p, state["exp_avg"], None)
                state["lr_sum"] += group["lr"]
            else:
                denom, masked = self._denominator(p, group, self.var_updates)
                u = mask_(value, p, group, masked)
                lr_sum = state["lr_sum"] + (group["lr"] if p.requires_grad else 0.0)
                torch.add(state["sync_weight"], u, out=w)
                if lr_sum > 0:
                    torch.mul(u, denom, out=state["exp_avg"]).mul_(-(1 - group["betas"][0] ** t) / lr_sum)
                else:  # no step since the last sync moved w: u holds carried errors, no momentum
                    state["exp_avg"].zero_()
                _synced_now(p, state)
            store_(p, w)
        self._between_syncs = kind == LOCAL
        self.local_counter += 1
        if self.local_counter >= self.local_step_scaler:  # > after a resume with a smaller one
            self.local_counter = 0
            self.local_interval = min(2 * self.local_interval, self.local_step_clipper)

    def _rank_local(self) -> dict[str, Any]:
        """Mid local-step interval, this rank's weights and momenta (they differ across ranks)."""
        params = self._params()
        if not self._between_syncs:
            return {}
        return {
            "weights": [master_weight(p, self.state[p]).clone() for p in params],
            "exp_avg": [self.state[p].get("exp_avg") for p in params],
        }

    def _rank_local_problem(self, local: dict[str, Any], extra: dict[str, Any]) -> str | None:
        between = extra.get("between_syncs", False)  # absent: saved before it was recorded
        if not isinstance(between, bool):
            return f"the checkpoint's between_syncs must be True or False, got {between!r}"
        if not local:
            return None
        params = self._params()
        weights, moments = local.get("weights"), local.get("exp_avg")
        if not isinstance(weights, (list, tuple)) or not isinstance(moments, (list, tuple)):
            return "this rank's local-step state has no lists of weights and exp_avg"
        if len(weights) != len(params) or len(moments) != len(params):
            return (
                f"this rank's local-step state holds {len(weights)} weights and {len(moments)} exp_avg, "
                f"not one of each per parameter ({len(params)}): a checkpoint of another model"
            )
        for i, (p, w, m) in enumerate(zip(params, weights, moments)):
            # both as kept: fp32 (a low-precision parameter's weight is its fp32 master)
            for name, t in (("weight", w), ("exp_avg", m)):
                problem = (
                    None
                    if t is None and name == "exp_avg"
                    else fp32_problem(f"this rank's local-step {name} of parameter {i}", t, tuple(p.shape))
                )
                if problem is not None:
                    return problem
        return None

    def _load_rank_local(self, local: dict[str, Any], extra: dict[str, Any]) -> None:
        # saved between syncs: with each rank's part, or without (drop_error_feedback's copy)
        self._between_syncs = bool(local) or extra.get("between_syncs", False)
        if not local:
            return
        with torch.no_grad():
            for p, w, m in zip(self._params(), local["weights"], local["exp_avg"]):
                state = self.state[p]
                master = master_weight(p, state)
                master.copy_(w)
                store_(p, master)
                if m is not None:
                    state["exp_avg"] = m.detach().clone().to(p.device)
