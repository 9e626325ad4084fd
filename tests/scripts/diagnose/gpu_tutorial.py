"""A DDP tutorial script written for GPUs: NCCL, .cuda(), device_ids. On a machine without
GPUs diagnose must say what to change; with --cpu the rest of it runs (and is correct)."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group(backend="nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Linear(6, 1).cuda()
ddp_model = DDP(model, device_ids=[torch.cuda.current_device()])
data = TensorDataset(torch.randn(32, 6), torch.randn(32, 1))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=8, sampler=sampler)
optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        x, y = x.cuda(), y.cuda()
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp_model(x), y).backward()
        optimizer.step()
dist.destroy_process_group()
