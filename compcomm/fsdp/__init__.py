"""1-bit error-feedback compression for FSDP2 (`fully_shard`) and HSDP, through FSDP2's own seams.

    model = ...; fully_shard each layer and the model (a 1-D mesh)
    state = compcomm.fsdp.compress(model, start_iter=1000)            # FSDP: the reduce-scatter
    state = compcomm.fsdp.compress(model, replicate_group=G)          # HSDP: the all-reduce across replicas
    state = compcomm.fsdp.compress(model, replicate_group=G, intra="shm")  # and the replica's own collectives over shm

FSDP mode (`replicate_group=None`). Each FSDP module's gradient reduce-scatter becomes
compcomm's (`compcomm.schedules.reduce_scatter`): exact (fp32 sums in rank order) for the first
`start_iter` iterations, then with 1 bit per element. Rank r views its flat gradient x_r (N = n L
elements, as FSDP lays it out: row j is rank j's shard) as n rows; with e_r its worker error
(fp32, carried from step to step: n rows of L rounded up to a multiple of 8, N elements when L
is a multiple of 8),

    x'_r = x_r + e_r;   s_(r,j) = ||x'_r[row j]|| / sqrt(L);   e_r[row j] <- x'_r[row j] - s_(r,j) sign(x'_r[row j])
    rank j's shard = (sum_r s_(r,j) sign(x'_r[row j])) / d      (rank order, fp32; d = n for FSDP's mean)

one scale per row, one all-to-all: per rank (n-1)/n x (N/8 + 4n) bytes on the wire (and a 16-byte
header to each peer) against (n-1)/n x 4N for fp32. There is no server error: each row has one
owner. FSDP's parameter all-gathers stay fp32, which caps what the whole step can gain (see the
benchmarks).

HSDP mode (`replicate_group=G`). Each replica (e.g. a node) is sharded on a 1-D mesh of its own;
FSDP's reduce-scatter inside the replica stays exact, and each rank's gradient shard is then
averaged across the replicas in G (the ranks holding the same shard on other replicas) with
`compressed_allreduce` (exact for the first `start_iter` iterations), one ErrorFeedback per FSDP
module, the size of the shard. `compress` first makes the replicas' parameters equal (those of
G's first rank). With `intra="shm"` (CPU, a replica's ranks on one host) FSDP's own collectives
inside the replica, its parameter all-gathers and the exact reduce-scatter, go through
compcomm's shared-memory backend instead of FSDP's process group (gloo's loopback TCP, whose
cost on CPU nodes holds back what the 1-bit stage gains); the reduce-scatter sums in rank
order. A model sharded on a 2-D mesh (FSDP's own HSDP, whose all-reduce no seam reaches) is a
ValueError naming this fix.

Memory. The FSDP worker error is the full (unsharded) gradient of each module, fp32, per rank:
it gives back the 1/n that sharding saved on gradients, which is the price of error feedback on
the sending side of a reduce-scatter. Each module holds it twice: its state and a spare that a
backward's new errors go into, kept only when every module of the backward succeeded (see
Errors), so 2x the full gradient in fp32. The HSDP error is the shard's size, likewise twice
(the spare doubles as the x' form's second buffer, see `compcomm.ErrorFeedback`'s
`double_buffer`), plus the server error (1/R of the shard over R replicas).

Errors. Every rank raises the same error or none. NaN/Inf in any rank's gradients raises
`NonFiniteError` on every rank from `backward()` (after catching it, call `reset_iter_state()`
on the root FSDP module, as FSDP asks after any exception in backward, and zero the gradients;
the gradients of modules the backward had not reduced are dropped), or, with
`nonfinite="propagate"` (for a GradScaler), gives NaN gradients on every rank, every
parameter's, so that the scaler skips the step. Either way such a backward leaves no trace in
any error state, whichever module failed, and does not count as an iteration: each module's new
errors go into its spare, which replaces its state only when every module of the backward
succeeded.

Activation checkpointing, reentrant or not, inside the model's forward: the reductions of the
backward that reentrant checkpointing runs nested in the model's belong to the model's.

Gradient accumulation: `model.set_requires_gradient_sync(False)` on the micro-batches that only
accumulate (FSDP then reduces nothing; the iteration counts the backward that reduces).
`set_requires_all_reduce(False)` does not hold the HSDP hook back: use the former.

Optimizers: any torch optimizer works on the sharded parameters (SGD with momentum above all,
whose update is linear in the error-compensated gradients); `compcomm.optim.OnebitAdam` and
`OnebitLamb` run sharded on them (their `freeze_step` must equal `start_iter`), with the
variance frozen when the gradients turn 1-bit. Checkpoints: `CompressionState.state_dict()` /
`gathered_state_dict()` / `load_state_dict()`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..backends import Backend, check_backend_argument, get
from ..layout import is_integer
from ..loss_scale import check_grad_scaler
from ..optim.shards import compression_of as state_of

try:
    from torch.distributed.fsdp import FSDPModule

    from .comms import CompressedReduceScatter, IntraAllGather, IntraReduceScatter, all_reduce_hook
    from .modules import ShardedModule, group_ranks, sharded_modules
except ImportError as exc:  # an older torch, whose FSDP2 lacks the seams compcomm fills
    if not (exc.name or "").startswith("torch"):
        raise
    raise ImportError(
        f"compcomm.fsdp needs FSDP2 with custom collectives (torch.distributed.fsdp.FSDPModule."
        f"set_custom_reduce_scatter), which this torch {torch.__version__} lacks ({exc}); compcomm is "
        "tested with torch 2.13"
    ) from exc
from .state import NONFINITE, CompressionState

__all__ = ["CompressionState", "compress", "state_of"]


def compress(
    model: torch.nn.Module,
    start_iter: int = 1000,
    replicate_group: dist.ProcessGroup | None = None,
    backend: Backend | str | None = None,
    nonfinite: str = "raise",
    intra: str | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> CompressionState:
    """Compress the gradient communication of `model`, on which `fully_shard` was called (every
    FSDP module in it is handled): in FSDP mode its reduce-scatters, in HSDP mode
    (`replicate_group`) the average of each gradient shard across replicas. See the module
    docstring for the numerics. Call it on every rank, before the first backward.

    `backend`: the compcomm transport over the group that is compressed (a name or a Backend
    over that group; default gloo for CPU parameters, nccl for CUDA ones). The ranks first agree
    on the arguments over the default (every rank can build it, whatever it was given), so with
    CUDA parameters the model's groups need NCCL whatever `backend` is. `intra` (HSDP only):
    None leaves FSDP's collectives inside a replica on FSDP's process group; "shm" moves them to
    compcomm's shared-memory backend (CPU parameters, each replica's ranks on one host).
    `grad_scaler`: the GradScaler (e.g. FSDP's ShardedGradScaler) whose scaled loss the backward
    runs on, if any: the carried errors then follow its scale (`compcomm.loss_scale`). Returns
    the state to checkpoint.
    """
    modules = sharded_modules(model)
    if replicate_group is not None and not isinstance(replicate_group, dist.ProcessGroup):
        raise TypeError(
            f"replicate_group must be a torch.distributed ProcessGroup, got {type(replicate_group).__name__}"
        )
    if replicate_group is not None:
        _check_replicas(replicate_group, [group_ranks(m.shard_group) for m in modules])
    sizes = {dist.get_world_size(m.shard_group) for m in modules}
    if len(sizes) != 1:
        raise ValueError(f"the FSDP modules shard over groups of different sizes {sorted(sizes)}")
    refused: Exception | None = None
    try:
        _check_arguments(modules, start_iter, replicate_group, backend, nonfinite, intra)
        check_grad_scaler(grad_scaler)
        start_iter = int(start_iter)  # a numpy integer would make the state dict's file unloadable
    except Exception as exc:  # agreed by the state first thing, so no other rank waits on this one
        refused, backend, grad_scaler = exc, None, None
    watched = [model, *(m for m in model.modules() if isinstance(m, FSDPModule) and m is not model)]
    state = CompressionState(
        modules, start_iter, replicate_group, backend, nonfinite, refused, intra, grad_scaler, watched
    )
    intra_backends: dict[int, Any] = {}
    for m in modules:
        # A parameter without a gradient in a backward is left out of FSDP's reduce-scatter by
        # default, so the rows would lay out another parameter's gradient where its errors are:
        # with zeros in its place, each error state meets the gradient it came from.
        m.module.set_reduce_scatter_unused_params(True)
        if replicate_group is None:
            m.module.set_custom_reduce_scatter(CompressedReduceScatter(state, m.name))
            continue
        m.module.set_all_reduce_hook(all_reduce_hook(state, m.name))
        if intra is not None:
            if id(m.shard_group) not in intra_backends:
                intra_backends[id(m.shard_group)] = get(intra, group=m.shard_group)
            be = intra_backends[id(m.shard_group)]
            m.module.set_custom_all_gather(IntraAllGather(be))
            m.module.set_custom_reduce_scatter(IntraReduceScatter(be, state.intra_failed_for(m.name)))
    if replicate_group is not None:
        _equalize_replicas(state.params, replicate_group)
    for m in modules:
        # FSDP reduces a module that no forward ran (its unused parameters) only once it has
        # made its unsharded parameters, at its first forward in this process: made here, every
        # module takes part in every backward, alike in a run and in its resumption.
        m.module.unshard()
        m.module.reshard()
    return state


def _check_arguments(
    modules: list[ShardedModule],
    start_iter: object,
    replicate_group: dist.ProcessGroup | None,
    backend: object,
    nonfinite: object,
    intra: object,
) -> None:
    """This rank's arguments, checked alone: TypeError or ValueError naming the first bad one.
    (The groups the ranks agree over, the model's and `replicate_group`, are checked before.)"""
    if not is_integer(start_iter) or start_iter < 0:
        raise ValueError(f"start_iter must be an integer >= 0, got {start_iter!r}")
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {', '.join(map(repr, NONFINITE))}, got {nonfinite!r}")
    check_backend_argument(backend)
    if intra not in (None, "shm"):
        raise ValueError(f"intra must be None or 'shm', got {intra!r}")
    if intra is not None and replicate_group is None:
        raise ValueError(
            "intra= applies to HSDP (replicate_group=...): in FSDP mode the shard group spans the hosts, "
            "and compcomm's 1-bit reduce-scatter already replaces FSDP's"
        )
    if intra is not None and any(p.device.type != "cpu" for m in modules for p in m.params):
        raise ValueError("intra='shm' moves CPU tensors between a host's ranks; these parameters are not on the CPU")
    if any(not hasattr(m.module, "set_reduce_scatter_unused_params") for m in modules):
        raise RuntimeError(
            "compcomm.fsdp needs FSDP2's FSDPModule.set_reduce_scatter_unused_params (to keep each parameter's "
            f"error feedback with its own gradient), which torch {torch.__version__} lacks: upgrade torch"
        )
    if any(state_of(p) is not None for m in modules for p in m.params):
        raise ValueError("compcomm.fsdp.compress was already called on this model")


def _check_replicas(replicas: dist.ProcessGroup, shard_groups: list[list[int]]) -> None:
    """ValueError unless the replica group holds this rank and meets each shard group in this
    rank alone (it joins the ranks that hold the same shard on different replicas)."""
    me = dist.get_rank()
    members = set(group_ranks(replicas))
    if me not in members:
        raise ValueError(f"replicate_group does not hold this rank ({me}): pass the group of this rank's replicas")
    for shard in shard_groups:
        if members & set(shard) != {me}:
            raise ValueError(
                f"replicate_group {sorted(members)} shares ranks {sorted(members & set(shard))} with the FSDP shard "
                f"group {shard}: it must join the ranks that hold this rank's shard on the other replicas"
            )


def _equalize_replicas(params: list[torch.nn.Parameter], replicas: dist.ProcessGroup) -> None:
    """Every replica starts from the first replica's parameters (as DDP does at construction)."""
    source = dist.get_global_rank(replicas, 0)
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.to_local(), src=source, group=replicas)  # type: ignore[attr-defined]
