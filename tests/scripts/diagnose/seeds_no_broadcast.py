"""Gradients averaged by hand, but every rank seeds its model with its own rank and nothing
broadcasts rank 0's weights: the replicas never agree; and the group is never destroyed."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
dataset = TensorDataset(torch.randn(32, 6), torch.randn(32, 1))
sampler = DistributedSampler(dataset)
torch.manual_seed(rank)
model = torch.nn.Linear(6, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for xb, yb in DataLoader(dataset, batch_size=8, sampler=sampler):
        opt.zero_grad()
        F.mse_loss(model(xb), yb).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        opt.step()
