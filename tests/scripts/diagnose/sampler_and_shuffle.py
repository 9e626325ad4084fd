"""A DistributedSampler handed to a loader that is told to shuffle as well."""
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
dataset = TensorDataset(torch.randn(48, 6), torch.randn(48, 1))
sampler = DistributedSampler(dataset, shuffle=True)
loader = DataLoader(dataset, batch_size=8, sampler=sampler, shuffle=True)
for xb, yb in loader:
    pass
dist.destroy_process_group()
