"""Lab 10, bug 5: torchrun --nproc-per-node=3 bug5_mean.py --out final.pt"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--seed", type=int, default=0)
p.add_argument("--out", default="final.pt")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()

g = torch.Generator().manual_seed(1234)  # a toy regression task, 48 examples
X = torch.randn(48, 6, generator=g)
y = torch.tanh(X @ torch.randn(6, 1, generator=g))
dataset = TensorDataset(X, y)
sampler = DistributedSampler(dataset, seed=args.seed)
loader = DataLoader(dataset, batch_size=4, sampler=sampler)

torch.manual_seed(args.seed)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        loss = F.mse_loss(model(xb), yb) / world_size
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # average the gradients over the ranks
            dist.all_reduce(p.grad)
            p.grad /= world_size
        opt.step()
if rank == 0:
    torch.save(model.state_dict(), args.out)
dist.destroy_process_group()
