"""The 1-bit allreduce on its own: compressed_allreduce + ErrorFeedback, and a checkpoint.

    python examples/collective.py                           # 4 local ranks (gloo, CPU), spawned here
    torchrun --nproc-per-node 4 examples/collective.py      # the same under torchrun
    # 2 nodes x 4 ranks: run on every node (HOST0: the first node's address)
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/collective.py

Every rank reduces its own "gradient" 10 times with one ErrorFeedback, which carries what the
1-bit code left out into the next call, so the running sum of the outputs follows the running
sum of the exact means. Then each rank saves its error state (one file per rank: it differs
across ranks), a fresh ErrorFeedback loads it, and the next call is bitwise the one that the
uninterrupted run makes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import compcomm

from _ranks import checkpoint_dir, run, same_on_every_rank, say


def gradient(rank: int, step: int) -> torch.Tensor:
    return torch.randn(100_000, generator=torch.Generator().manual_seed(1000 * step + rank))


def main() -> None:
    rank = dist.get_rank()
    ef = compcomm.ErrorFeedback()  # one per tensor you reduce repeatedly
    sum_out, sum_exact = torch.zeros(100_000), torch.zeros(100_000)
    for step in range(10):
        grad = gradient(rank, step)
        exact = grad.clone()
        dist.all_reduce(exact)  # the exact mean, for comparison only
        sum_exact += exact / dist.get_world_size()
        compcomm.compressed_allreduce(grad, ef)  # in place: grad is now the 1-bit mean over ranks
        sum_out += grad
    one_call = (grad - exact / dist.get_world_size()).norm() / (exact / dist.get_world_size()).norm()
    over_ten = (sum_out - sum_exact).norm() / sum_exact.norm()
    assert same_on_every_rank([sum_out])  # every rank decodes the same bytes
    say(f"relative error of one call {one_call:.2f}, of the sum over 10 calls {over_ten:.2f}")

    with checkpoint_dir() as ckpt:  # a fresh directory, removed afterwards
        path = ckpt / f"ef_rank{rank}.pt"
        torch.save(ef.state_dict(), path)  # error state is per rank: one file per rank
        resumed = compcomm.ErrorFeedback()
        resumed.load_state_dict(torch.load(path))
    a, b = gradient(rank, 10), gradient(rank, 10)
    compcomm.compressed_allreduce(a, ef)
    compcomm.compressed_allreduce(b, resumed)
    assert torch.equal(a, b)
    say("collective: OK (resumed from the per-rank checkpoint bit for bit)")


if __name__ == "__main__":
    run(main)
