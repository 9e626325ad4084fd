"""A DDP script written for GPUs that moves its model in a helper (gloo, so the group starts):
on a machine without GPUs diagnose must say what to change and point at the learner's own
line, the .to(device) inside the helper; with --cpu the rest of it runs (and is correct)."""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def build_model(local_rank):
    device = torch.device("cuda", local_rank)
    return torch.nn.Linear(6, 1).to(device), device


dist.init_process_group("gloo")
local_rank = int(os.environ["LOCAL_RANK"])
model, device = build_model(local_rank)
model = DDP(model)
data = TensorDataset(torch.randn(32, 6), torch.randn(32, 1))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=8, sampler=sampler)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
dist.destroy_process_group()
