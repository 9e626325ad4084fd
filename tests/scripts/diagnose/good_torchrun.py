"""A correct DDP script in torchrun's style: diagnose must find nothing."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--out", default=None)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ["LOCAL_RANK"])

g = torch.Generator().manual_seed(0)
X, y = torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g)
dataset = TensorDataset(X, y)
sampler = DistributedSampler(dataset, shuffle=True, seed=0)
loader = DataLoader(dataset, batch_size=8, sampler=sampler)

torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    total, count = torch.zeros(2), 0
    for xb, yb in loader:
        opt.zero_grad()
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        total += torch.tensor([loss.item() * len(xb), len(xb)])
    dist.all_reduce(total)
    if rank == 0:
        print(f"epoch {epoch}: loss {total[0] / total[1]:.4f}")
if args.out and rank == 0:
    torch.save(model.module.state_dict(), args.out)
dist.barrier()
dist.destroy_process_group()
