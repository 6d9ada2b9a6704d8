"""1-bit Adam owning the gradient communication (no DDP), with checkpoints saved and resumed.

    python examples/onebit_adam.py                          # 4 local ranks (gloo, CPU), spawned here
    torchrun --nproc-per-node 4 examples/onebit_adam.py     # the same under torchrun
    # 2 nodes x 4 ranks: run on every node (HOST0: the first node's address)
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/onebit_adam.py

For `freeze_step` steps OnebitAdam averages the gradients exactly (plain AdamW); then it freezes
the second moment and averages the momentum in 1 bit with error feedback, one collective per
bucket, overlapped with backward. The model is not wrapped in DDP, every rank starts from the
same parameters and calls `step()` together.

Its state differs across ranks (each rank's error feedback), so a checkpoint is either one file
per rank (`opt.state_dict()`) or one file for all ranks (`opt.gathered_state_dict()`, a
collective, saved by rank 0 and loaded by every rank, which picks its own part). Both resume
bit for bit; loading another rank's file raises the same ValueError on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compcomm.optim import OnebitAdam

from _ranks import checkpoint_dir, run, same_on_every_rank, say


def build() -> tuple[torch.nn.Module, OnebitAdam]:
    torch.manual_seed(0)  # every rank starts from the same parameters
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    return model, OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)


def train(model: torch.nn.Module, opt: OnebitAdam, steps: range) -> float:
    rank = dist.get_rank()
    for step in steps:
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = torch.nn.functional.mse_loss(model(x), x[:, :8].sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()  # each bucket's collective starts as soon as its gradients are ready
        opt.step()
    return loss.item()


def main() -> None:
    rank = dist.get_rank()
    model, opt = build()
    say(f"loss after 6 steps (3 exact, 3 in 1 bit): {train(model, opt, range(6)):.4f}")
    with checkpoint_dir() as ckpt:  # a fresh directory, removed afterwards
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt / f"ckpt_rank{rank}.pt")  # per rank
        gathered = opt.gathered_state_dict()  # collective: every rank's part, on every rank
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": gathered}, ckpt / "ckpt.pt")  # one file for all ranks
        dist.barrier()
        train(model, opt, range(6, 9))
        reference = [p.detach().clone() for p in model.parameters()]

        for name in (f"ckpt_rank{rank}.pt", "ckpt.pt"):
            model, opt = build()
            saved = torch.load(ckpt / name)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])  # collective: raises the same ValueError everywhere on a wrong file
            train(model, opt, range(6, 9))
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference)), name
    assert same_on_every_rank(reference)
    say("onebit_adam: OK (resumed bit for bit from the per-rank files and from the gathered file)")


if __name__ == "__main__":
    run(main)
