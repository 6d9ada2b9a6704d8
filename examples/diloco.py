"""DiLoCo: each rank trains alone with AdamW and the ranks sync every H steps, in 1 bit.

    python examples/diloco.py                               # 4 local ranks (gloo, CPU), spawned here
    torchrun --nproc-per-node 4 examples/diloco.py          # the same under torchrun
    # 2 nodes x 4 ranks: run on every node (HOST0: the first node's address)
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/diloco.py

Every `sync_every` steps the ranks average how far they moved since the last sync (the
pseudo-gradient) with the 1-bit error-feedback allreduce, and an outer Nesterov SGD step moves
the synced parameters, which every rank then holds bitwise alike. Over H steps that sends about
H x 32 fewer bytes than data-parallel fp32. `fragments=K` spreads the syncs (Streaming DiLoCo).
`opt.sync()` at the end of training syncs what moved since; `opt.global_parameters()` are the
synced parameters. Checkpoints: `gathered_state_dict()` (one file) or `state_dict()` per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compcomm.optim import DiLoCo

from _ranks import checkpoint_dir, run, same_on_every_rank, say


def main() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)  # ranks that start apart are given rank 0's parameters, with a warning
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = DiLoCo(model.parameters(), inner, sync_every=4, outer_lr=0.7, outer_momentum=0.9)  # no DDP wrapper
    for step in range(12):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = torch.nn.functional.mse_loss(model(x), x[:, :8].sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()  # an inner step; every 4th step also syncs
        if step in (0, 11):
            say(f"step {step:2d}: loss {loss.item():.4f} on rank 0")
    opt.sync()
    sent = opt.backend.bytes_sent
    assert same_on_every_rank(list(model.parameters()))
    gathered = opt.gathered_state_dict()  # collective
    with checkpoint_dir() as ckpt:  # a fresh directory, removed afterwards
        if rank == 0:  # one file; every rank's opt.load_state_dict(torch.load(...)) resumes
            torch.save(gathered, ckpt / "diloco.pt")
    say(f"diloco: OK (parameters equal on every rank after opt.sync(); rank 0 sent {sent} bytes in all)")


if __name__ == "__main__":
    run(main)
