"""What `compcomm.fsdp.compress` keeps: one error state per FSDP module, the iteration count,
and the rule that a backward either changes them all or none.

Every reduction of a backward (one per FSDP module) goes through `CompressionState`. A backward
begins where the gradient of a compressed model's output first arrives (a hook on the outputs
of the model and of its FSDP modules), or at its first reduction if none came: there a callback
is queued that autograd runs once that backward is over (after FSDP's own), which counts the
iteration. The reductions of a backward that autograd runs nested in it (reentrant activation
checkpointing recomputes and differentiates its region in a backward of its own) belong to it.
Each module's new errors go into a spare ErrorFeedback that replaces its state only there, when
every module of the backward succeeded: a backward that raises NonFiniteError, or whose step a
GradScaler skips, leaves no trace in any error state, whichever module failed.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .. import schedules
from ..agreement import CallSpec, all_sum, raise_agreed
from ..backends import Backend, HierarchicalBackend
from ..backends.registry import falling_back, over_group
from ..error_feedback import REDUCE_SCATTER, ErrorFeedback
from ..errors import NonFiniteError
from ..gather_objects import agree_on_values, all_gather_object
from ..layout import is_integer
from ..loss_scale import ERRORS_SCALE, LossScale
from ..optim.checkpoints import agree_on_position
from ..optim.shards import register
from .modules import (
    ShardedModule,
    check_called_over,
    grad_tensors,
    holds_unreduced_gradients,
    unsharded_gradients_dropped,
    unsharded_parameters,
)

FORMAT = "compcomm.fsdp.CompressionState/1"
NONFINITE = ("raise", "propagate")


@dataclass
class _Module:
    """One FSDP module's compression: its error state and the groups it reduces over."""

    name: str
    params: list[torch.nn.Parameter]
    fsdp: FSDPModule
    errors: ErrorFeedback
    spare: ErrorFeedback  # where a backward's new errors go until it succeeds
    shard: Backend  # the group FSDP reduce-scatters over
    replicas: Backend | None  # HSDP: the replicas of this rank's shard (None: FSDP mode)
    layout: tuple[bool, ...] | None = None  # which parameters required gradients when `errors` was written

    def keep(self) -> None:
        """The backward succeeded: the spare's errors become the state."""
        self.errors, self.spare = self.spare, self.errors
        self.layout = self._requiring()

    def check_served(self, errors: ErrorFeedback) -> None:
        """ValueError unless `errors` (loaded from a checkpoint) hold the errors of what this
        module's calls reduce here: FSDP's reduce-scatter over its shard group, or (HSDP) the
        average of its shard across the replicas. Another mesh of as many ranks (2 replicas of 2
        shards saved, 4 shards loaded) holds the same parameters, split otherwise."""
        if not errors.initialized:
            return
        if self.replicas is None:
            world, layout, across = self.shard.world_size, REDUCE_SCATTER, "its shard group"
        else:  # over a hierarchical backend, the errors are of the part this rank reduces across nodes
            _, world, layout, _ = schedules.serves(self.replicas)(1)
            across = "the replicas of its shard"
        if errors.world_size != world or errors.layout != layout:
            raise ValueError(
                f"FSDP module {self.name!r}'s error feedback was saved by calls of kind {errors.layout} over "
                f"{errors.world_size} ranks; here its calls are of kind {layout} over {world} ({across}): "
                "the state belongs to another mesh (shards and replicas) of the same ranks, or another backend"
            )

    def _requiring(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.params)

    def layout_changed(self) -> ValueError | None:
        """FSDP lays a module's gradients out by the parameters that require them (those without
        a gradient take part as zeros): other ones than when its errors were written would meet
        other parameters' gradients."""
        if self.layout is None or not self.errors.initialized or self.layout == self._requiring():
            return None
        return ValueError(
            f"the parameters of FSDP module {self.name!r} that require gradients changed since its error "
            "feedback was written: FSDP lays their gradients out by them, so its errors would meet other "
            "parameters' gradients. Set requires_grad before compcomm.fsdp.compress and keep it, or after "
            f"changing it call state.error_feedback[{self.name!r}].reset() on every rank (its errors are dropped)"
        )


@dataclass
class _Transports:
    """The backends a compression reduces over: one per shard group and the replicas' (HSDP)."""

    shards: dict[int, Backend]  # by id() of the torch group
    first: Backend  # the first module's shard group's
    replicas: Backend | None

    @property
    def names(self) -> str:
        """Which transports these are, as the ranks compare them."""
        return self.first.name if self.replicas is None else f"{self.replicas.name} across replicas"

    def world(self) -> Backend:
        """Every rank of the model (a collective in HSDP mode: the hierarchical backend checks
        its groups)."""
        return self.first if self.replicas is None else HierarchicalBackend(self.first, self.replicas)


def _transports(
    modules: list[ShardedModule],
    replicate_group: dist.ProcessGroup | None,
    backend: Backend | str | None,
    device: torch.device,
) -> _Transports:
    """`backend` over the groups of `modules` (FSDP) or over `replicate_group` (HSDP, where the
    shard groups keep FSDP's own transport, gloo or nccl); None: gloo or nccl everywhere. Builds
    objects only: no rank waits on another here."""
    replicas = None if replicate_group is None else over_group(replicate_group, backend, device, "the replicate group")
    shards: dict[int, Backend] = {}
    for m in modules:
        if id(m.shard_group) not in shards:
            chosen = backend if replicate_group is None else None  # HSDP: FSDP's own group is the node's
            shards[id(m.shard_group)] = over_group(m.shard_group, chosen, device, "the shard group")
    return _Transports(shards, shards[id(modules[0].shard_group)], replicas)


def takes_gradients(output: torch.autograd.graph.Node, params: list[torch.nn.Parameter]) -> bool:
    """Whether the autograd pass running now, which has reached `output` (the grad_fn of a
    watched module's output), accumulates a gradient into any of `params` (as `backward()` does
    into every parameter it reaches; `torch.autograd.grad` into none). The graph behind `output`
    is searched for their AccumulateGrad nodes, until one that the pass runs; a graph in which
    none of them lies (the model under a reentrant checkpoint, whose parameters are reached in
    nested passes) is taken to take them, as `backward()` is the only pass such a checkpoint
    allows. Any leaf that is one of `torch.autograd.grad`'s inputs (the engine refuses to say
    whether it runs) marks that pass as one. The answer is the pass's, not the model's usage:
    the same on every rank that runs the same kind of pass, whatever parameters its data left
    unused, but for a rank whose graph holds no parameter and no such leaf (its output computed
    without the model's parameters, differentiated with respect to a non-leaf), which is taken
    for a training backward."""
    wanted = {id(p) for p in params if p.requires_grad}
    seen, todo, found = {id(output)}, collections.deque([output]), False
    while todo:  # breadth first: a training backward meets a parameter of the last layer at once
        node = todo.popleft()
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            try:
                runs = torch._C._will_engine_execute_node(node)
            except RuntimeError:  # one of torch.autograd.grad's inputs: its gradient is returned, not accumulated
                return False
            if id(variable) in wanted:
                if runs:
                    return True
                found = True
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                todo.append(child)
    return not found


class _BackwardEnd:
    """The end of one backward, queued with autograd when it begins. Its first call, among the
    backward's final callbacks, queues it once more, so that the commit runs after every final
    callback queued so far: FSDP's own, which reduces the modules whose gradients arrived by no
    hook, may have been queued after it. Autograd holds it alone: a backward that raises drops
    it unrun, which is how its state learns that that backward is over."""

    def __init__(self, commit: Callable[[_BackwardEnd], None]) -> None:
        self._commit, self._deferred = commit, False

    def __call__(self) -> None:
        if not self._deferred:
            self._deferred = True
            torch.autograd.Variable._execution_engine.queue_callback(self)
            return
        self._commit(self)


class CompressionState:
    """compcomm's part of a compressed FSDP2 / HSDP model (see `compcomm.fsdp.compress`).

    `iteration` counts the backward passes whose gradients were reduced, on every rank alike;
    those numbered below `start_iter` are reduced exactly. `error_feedback` maps each FSDP
    module's name to its ErrorFeedback. Checkpoints: `state_dict()` holds this rank's errors
    (save one file per rank); `gathered_state_dict()` (a collective) every rank's, for one file
    loaded by all ranks; `load_state_dict` raises the same ValueError on every rank when the
    state cannot resume this rank exactly.
    """

    def __init__(
        self,
        modules: list[ShardedModule],
        start_iter: int,
        replicate_group: dist.ProcessGroup | None,
        backend: Backend | str | None,
        nonfinite: str,
        refused: Exception | None = None,
        intra: str | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        watched: list[torch.nn.Module] | None = None,
    ) -> None:
        """`watched`: the modules (the model and its FSDP modules) whose outputs' gradients mark
        the beginning of a backward. `refused`: what was wrong with this rank's arguments
        (`compress` checks them), and `intra`, compress's choice inside a replica: agreed on
        every rank before anything else, over the default transport of the model's groups
        (which every rank can build, whatever it was given), so that no rank waits on one that
        gave up or chose another transport."""
        self.start_iter, self.nonfinite = start_iter, nonfinite
        self.mode = "fsdp" if replicate_group is None else "hsdp"
        self.iteration = 0
        self.params = [p for m in modules for p in m.params]
        device = self.params[0].device
        default = _transports(modules, replicate_group, None, device)
        chosen = default
        if backend is not None and refused is None:  # e.g. one that does not span the group, or nccl on CPU
            chosen, refused = falling_back(
                lambda: _transports(modules, replicate_group, backend, device), lambda: default
            )
        agreeing = default.world()
        raise_agreed(refused, agreeing, context="compcomm.fsdp.compress: ")
        agree_on_values(
            {
                "start_iter": start_iter,
                "nonfinite": nonfinite,
                "backend": chosen.names,
                "intra": intra,
                "grad_scaler": grad_scaler is not None,
            },
            agreeing,
            "compcomm.fsdp.compress must be given the same settings on every rank (else the ranks "
            "switch to 1 bit, or answer a non-finite gradient, at different backwards, or reduce over "
            "different transports, and wait on each other)",
        )
        self._modules: dict[str, _Module] = {
            m.name: _Module(
                m.name,
                m.params,
                m.module,
                ErrorFeedback(tag=f"compcomm.fsdp:{m.name}"),
                ErrorFeedback(tag=f"compcomm.fsdp:{m.name}"),
                chosen.shards[id(m.shard_group)],
                chosen.replicas,
            )
            for m in modules
        }
        self._loss_scale = LossScale(grad_scaler)
        self.world: Backend = agreeing if chosen is default else chosen.world()
        """Every rank of the model: where verdicts that concern the whole step are agreed."""
        self._backward: weakref.ref[_BackwardEnd] | None = None  # the end of the backward under way
        self._no_gradients = False  # the backward under way takes no parameter gradient (torch.autograd.grad)
        self._kept: bool | None = None  # and some rank holds gradients FSDP kept unreduced (None: not asked yet)
        self._pending: list[_Module] = []
        self._failed = False
        self._intra_failures: dict[str, Exception] = {}  # HSDP: the failed reduce-scatter inside the replica
        self._shard_of = {id(p): self._modules[m.name].shard for m in modules for p in m.params}
        self._shapes = {m.name: [list(p.shape) for p in m.params] for m in modules}
        self._layouts = {m.name: m.layout() for m in modules}
        for p in self.params:
            register(p, self)
        for module in watched or []:
            module.register_forward_hook(self._watch_outputs)

    @property
    def error_feedback(self) -> dict[str, ErrorFeedback]:
        """Each FSDP module's error feedback, by module name ("a+b" for modules sharded together
        by one `fully_shard([a, b])`; the object alternates between two, the state and its
        spare: look it up again after each backward)."""
        return {name: m.errors for name, m in self._modules.items()}

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank handed to the transport for compcomm's reductions (and their small
        agreements) so far; FSDP's own collectives (parameter all-gathers, HSDP's exact
        reduce-scatter inside the replica) are not counted."""
        used = {id(be): be for m in self._modules.values() for be in (m.shard, m.replicas) if be is not None}
        return sum(be.bytes_sent for be in used.values())

    def shard_backend(self, param: torch.Tensor) -> Backend:
        """The backend over the ranks that share `param` out among themselves (its shard group)."""
        return self._shard_of[id(param)]

    # ----------------------------------------------------------------- reductions

    @property
    def compressing(self) -> bool:
        """Whether the current (or next) backward reduces with 1 bit."""
        return self.iteration >= self.start_iter

    def reduce_scatter(
        self, name: str, output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup, op: str
    ) -> None:
        """FSDP mode: module `name`'s gradient reduce-scatter over its shard group."""
        module = self._modules[name]
        self._enter()
        be = module.shard
        check_called_over(group, be, f"module {name!r}'s reduce-scatter")
        if self._nothing_to_reduce(tensor):
            output.zero_()
            return
        spec = self._spec(module, tensor, op)
        spec.outputs = [output]
        self._run(module, output, lambda: be.ordered(lambda: schedules.reduce_scatter(spec, be)))

    def intra_failed_for(self, name: str) -> Callable[[Exception], None]:
        """HSDP mode: where module `name`'s reduce-scatter inside the replica reports that it
        failed (with `intra=`); the average across replicas that follows refuses it."""
        return lambda exc: self._intra_failures.__setitem__(name, exc)

    def all_reduce(self, name: str, shard: torch.Tensor) -> None:
        """HSDP mode: module `name`'s reduced gradient shard, averaged across the replicas; the
        verdict is then agreed among the shards, so that every rank raises alike."""
        module = self._modules[name]
        self._enter()
        replicas = module.replicas
        assert replicas is not None
        if self._nothing_to_reduce(shard, name in self._intra_failures):
            self._intra_failures.pop(name, None)
            return  # the shard is the exact sum of zeros inside the replica
        spec = self._spec(module, shard, "mean", self._intra_failures.pop(name, None))
        failure: Exception | None = None
        try:
            replicas.ordered(lambda: schedules.allreduce(spec, replicas))
        except Exception as exc:  # agreed across these replicas: now agreed among the shards too
            failure = exc
        self._run(module, shard, lambda: raise_agreed(failure, module.shard, context="across replicas: "))

    def _nothing_to_reduce(self, tensor: torch.Tensor, failed: bool = False) -> bool:
        """Whether this reduction belongs to an autograd pass that takes no gradient into the
        parameters (`torch.autograd.grad` through the model: a saliency map, an adversarial
        example) and has nothing to reduce on any rank. FSDP reduces there too, since `compress`
        has it reduce unused parameters as zeros, where on its own it would send nothing: such
        a reduction leaves its gradient shard zero, sends no gradient and touches no error, and
        the pass counts no iteration. The kind of pass is settled where it begins (`_enter`),
        alike on every rank; a training backward reduces every module as before, its unused
        ones' zeros too. At its first reduction (FSDP reduces only where gradient sync is on, so
        a rank that runs such a pass alone during micro-batches without sync asks nothing), a
        pass that takes no gradient agrees in one small all-reduce whether any rank holds
        gradients kept from micro-batches without sync, which FSDP reduces in it; only then do
        the ranks agree per module whether any has something to reduce, or a failure (`failed`)
        to refuse. Where none holds any, a failure inside the replica (HSDP) went with zeros: it
        is dropped with them."""
        if not self._no_gradients:
            return False
        something = failed or bool(tensor.any())  # FSDP has taken this module's kept gradients into `tensor`
        if self._kept is None:
            holds = any(holds_unreduced_gradients(m.fsdp) for m in self._modules.values())
            self._kept = all_sum([float(something or holds)], self.world)[0] > 0
        if not self._kept:
            return True
        return all_sum([float(something)], self.world)[0] == 0

    def _spec(self, module: _Module, tensor: torch.Tensor, op: str, failed: Exception | None = None) -> CallSpec:
        """Module `module`'s call on `tensor`: its new errors go into its spare; what `failed`
        before it on this rank, and a changed layout of its gradients, are refused in the call's
        agreement, on every rank. FSDP reduces a module once per forward that used it: a
        backward through a model called twice (two views of a batch) or a block applied twice
        reduces it twice, and the second call starts from the errors the first left, in the
        spare, which it updates in place."""
        exact = [not self.compressing]
        if self.compressing:
            self._loss_scale.follow(m.errors for m in self._modules.values())
        refused = failed or module.layout_changed()
        if self._reduced(module):
            return CallSpec([tensor], [module.spare], op, exact=exact, refused=refused)
        return CallSpec([tensor], [module.errors], op, [module.spare], exact=exact, refused=refused)

    def _reduced(self, module: _Module) -> bool:
        """Whether `module` was reduced already in the backward under way."""
        return any(m is module for m in self._pending)

    def _run(self, module: _Module, output: torch.Tensor, reduce: Any) -> None:
        """`reduce()`, then note the module for the end of the backward; a non-finite verdict
        becomes NaN gradients with nonfinite="propagate"."""
        try:
            with torch.no_grad():
                reduce()
        except NonFiniteError:
            self._failed = True
            if self.nonfinite != "propagate":
                self._abort_backward()
                raise
            output.fill_(float("nan"))
            return
        except Exception:
            self._failed = True
            self._abort_backward()
            raise
        if not self._reduced(module):
            self._pending.append(module)

    def _abort_backward(self) -> None:
        """The backward ends at this raise, before FSDP reduces the modules it has not reached:
        their gradients (this backward's, and earlier micro-batches' under
        `set_requires_gradient_sync(False)`) stay where FSDP keeps them unreduced, for the next
        backward to add to. Dropped here, as FSDP's `reset_iter_state` says a failed iteration's
        gradients are; the next backward starts afresh."""
        self._backward = None
        self._intra_failures.clear()
        for module in (m.fsdp for m in self._modules.values()):
            unsharded_gradients_dropped(module)

    def _watch_outputs(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A forward hook: the first gradient of these outputs to arrive begins a backward. The
        outputs are found as FSDP finds those it hooks its pre-backward to (in dataclasses too);
        a leaf (a parameter returned as it is) lives on past this forward, and would gather a
        hook at each one."""
        if torch.is_grad_enabled():
            for t in grad_tensors(output):
                if t.grad_fn is not None:
                    t.register_hook(self._gradient_arrived)

    def _gradient_arrived(self, grad: torch.Tensor) -> None:
        """The hook of a watched output: the node running now is that output's grad_fn (a hook
        holding it itself would tie the graph to itself, past the output's life)."""
        self._enter(torch._C._current_autograd_node())

    def _enter(self, output: torch.autograd.graph.Node | None = None) -> None:
        """Begin a backward unless one is under way: its end is queued with the autograd
        backward running now (none outside one: each reduction there stands alone). Where it
        begins at a watched output (`output`, its grad_fn), whether it takes parameter
        gradients is read from the graph behind it; a backward found begun by a reduction is
        taken to."""
        under_way = None if self._backward is None else self._backward()
        if under_way is not None:
            return
        self._pending, self._failed = [], False
        self._loss_scale.new_backward()
        if torch._C._current_graph_task_id() < 0:
            self._backward, self._no_gradients = None, False
            return
        self._no_gradients = output is not None and not takes_gradients(output, self._unsharded())
        self._kept = None
        end = _BackwardEnd(self._end_of_backward)
        torch.autograd.Variable._execution_engine.queue_callback(end)
        self._backward = weakref.ref(end)

    def _unsharded(self) -> list[torch.nn.Parameter]:
        """The model's unsharded parameters, as FSDP has made them (what autograd accumulates)."""
        return [p for m in self._modules.values() for p in unsharded_parameters(m.fsdp)]

    def _end_of_backward(self, end: _BackwardEnd) -> None:
        """Every reduction of the backward succeeded on every rank (or the step is skipped: with
        nonfinite="propagate" every gradient shard is then NaN, also those of the modules whose
        reductions passed, so that the whole backward reads as the failed one it is). A backward
        that reduced nothing (a micro-batch without sync) is not an iteration."""
        if self._backward is None or self._backward() is not end:
            return  # a backward that raised in a reduction, and went on: it was ended there
        if self._failed and self.nonfinite == "propagate":
            for p in self.params:
                if p.grad is not None:
                    p.grad.to_local().fill_(float("nan"))  # type: ignore[attr-defined]
        elif not self._failed and self._pending:
            for module in self._pending:
                module.keep()
            self.iteration += 1
        self._backward, self._pending, self._failed = None, [], False

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the iteration, and each module's error feedback (a copy)."""
        modules = {}
        for name, m in self._modules.items():
            saved = m.errors.state_dict()
            modules[name] = {k: v.clone() if torch.is_tensor(v) else v for k, v in saved.items()}
        return {
            "format": FORMAT,
            "mode": self.mode,
            "start_iter": self.start_iter,
            "iteration": self.iteration,
            ERRORS_SCALE: self._loss_scale.value,
            "rank": self.world.rank,
            "world_size": self.world.world_size,
            "modules": modules,
            "shapes": self._shapes,
            "parameters": self._layouts,
            "requires_grad": {name: None if m.layout is None else list(m.layout) for name, m in self._modules.items()},
        }

    def gathered_state_dict(self) -> dict[str, Any]:
        """Every rank's `state_dict()` in one dict, on every rank (a collective: call it on all
        ranks, save it from one); `load_state_dict` of it gives each rank its own part."""
        return {
            "format": FORMAT,
            "world_size": self.world.world_size,
            "ranks": all_gather_object(self.state_dict(), self.world),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()` or `gathered_state_dict()` (a collective). The same
        ValueError on every rank, with nothing changed, if any rank's state cannot resume it
        exactly: another world size, mode or set of modules, or another rank's errors."""
        loaded: dict[str, ErrorFeedback] = {}
        mine: dict[str, Any] = {}
        failure: Exception | None = None
        try:
            mine = self._own_part(state)
            for name, saved in mine["modules"].items():
                ef = ErrorFeedback(tag=f"compcomm.fsdp:{name}")
                ef.load_state_dict(saved)
                self._modules[name].check_served(ef)
                loaded[name] = ef
        except Exception as exc:  # reported to every rank, then raised everywhere
            failure = ValueError(f"{type(exc).__name__}: {exc}")
        raise_agreed(failure, self.world, context="cannot load the compcomm.fsdp state: ")
        position = {"iteration": int(mine["iteration"]), "start_iter": int(mine["start_iter"])}
        layouts = mine.get("requires_grad") or {}  # absent from states saved before it was kept
        agree_on_position(
            {**position, ERRORS_SCALE: mine.get(ERRORS_SCALE), "requires_grad": repr(layouts)}, self.world
        )
        self.iteration, self.start_iter = int(mine["iteration"]), int(mine["start_iter"])
        self._loss_scale.load(mine)  # the scale checked by _own_part
        for name, ef in loaded.items():
            module = self._modules[name]
            module.errors = ef
            layout = layouts.get(name)
            module.layout = None if layout is None else tuple(bool(flag) for flag in layout)
        self._backward, self._pending, self._failed = None, [], False

    def _own_part(self, state: Any) -> dict[str, Any]:
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError("not a compcomm.fsdp CompressionState state dict")
        if state.get("world_size") != self.world.world_size:
            raise ValueError(
                f"the state was saved on {state.get('world_size')} ranks, this model runs on {self.world.world_size}: "
                "its error feedback belongs to another sharding"
            )
        if "ranks" in state:
            state = state["ranks"][self.world.rank]
        if state.get("mode") != self.mode:
            raise ValueError(f"the state is of {state.get('mode')} mode, this model is compressed in {self.mode} mode")
        if set(state.get("modules", {})) != set(self._modules):
            raise ValueError(
                f"the state's FSDP modules {sorted(state.get('modules', {}))} are not this model's "
                f"{sorted(self._modules)}"
            )
        shapes = state.get("shapes", self._shapes)  # a state saved before shapes were kept: unchecked
        if shapes != self._shapes:
            raise ValueError(
                f"the state's FSDP modules hold parameters of the shapes {shapes}, this model's {self._shapes}: "
                "its error feedback belongs to another model"
            )
        layouts = state.get("parameters", self._layouts)  # saved before these were kept: unchecked
        for name, mine in self._layouts.items():
            if layouts.get(name) != mine:
                raise ValueError(
                    f"FSDP module {name!r} laid out its parameters (name, shape, placement) as {layouts.get(name)} "
                    f"when the state was saved, and lays them out as {mine} here: its error feedback would meet "
                    "other elements' gradients. Shard the model as it was (the same parameters in the same order, "
                    "the same shard placements)"
                )
        if state.get("rank") != self.world.rank and any(
            saved.get("worker_error") is not None for saved in state["modules"].values()
        ):
            raise ValueError(
                f"this is rank {state.get('rank')}'s state, loaded on rank {self.world.rank}: its error feedback is "
                "that rank's own. Save one file per rank, or one file with gathered_state_dict()"
            )
        for key in ("iteration", "start_iter"):
            if not is_integer(state.get(key)) or state[key] < 0:
                raise ValueError(f"the state's {key} must be an integer >= 0, got {state.get(key)!r}")
        LossScale.saved(state.get(ERRORS_SCALE))
        self._check_layouts(state.get("requires_grad"))
        return state

    def _check_layouts(self, layouts: Any) -> None:
        """ValueError unless a state's `requires_grad` entry (absent from states saved before it
        was kept) gives each module None or one bool per parameter: read after the agreement,
        anything else failed there on one rank, with the rest of its state loaded."""
        if layouts is None:
            return
        if not isinstance(layouts, dict) or set(layouts) != set(self._modules):
            raise ValueError(
                f"the state's requires_grad does not name this model's FSDP modules {sorted(self._modules)}"
            )
        for name, layout in layouts.items():
            count = len(self._modules[name].params)
            if layout is not None and not (
                isinstance(layout, list) and len(layout) == count and all(isinstance(flag, bool) for flag in layout)
            ):
                raise ValueError(
                    f"the state's requires_grad of FSDP module {name!r} is {layout!r}, not one bool per parameter "
                    f"({count})"
                )
