"""nccl: torch.distributed on CUDA tensors; the bit packing already runs on the GPU (codec.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .torch_dist import TorchDistBackend


class NcclBackend(TorchDistBackend):
    """Collectives on a NCCL process group (`group=None`: the default group), on the CUDA device
    current when it is built (`torch.cuda.set_device(local_rank)` first). Fixed then: the
    current device is a thread's own, and async calls run on a worker thread, whose is device 0."""

    name = "nccl"
    device_type = "cuda"
    pg_backend = "nccl"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the nccl backend needs a CUDA GPU, and torch.cuda.is_available() is False here: "
                "use backend='gloo' (CPU tensors under torchrun) or backend='mpi' (under mpirun), "
                "or install a CUDA build of torch on a GPU machine"
            )
        if not (dist.is_available() and dist.is_nccl_available()):
            raise RuntimeError(
                "this torch build has no NCCL: install a CUDA build of torch, or use backend='gloo' or backend='mpi'"
            )
        super().__init__(group)
        self._device = torch.device("cuda", torch.cuda.current_device())

    @property
    def device(self) -> torch.device:
        return self._device
