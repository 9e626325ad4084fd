"""A DDP script that all-reduces its loss "for the log" every step and then prints rank 0's own
loss: the reduced copy is never read. diagnose must name that all_reduce (a collective per step
for nothing) and the printed loss of rank 0's shard."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
data = TensorDataset(torch.randn(48, 6), torch.randn(48, 1))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=8, sampler=sampler)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(6, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        global_loss = torch.tensor([loss.item()]) / world_size
        dist.all_reduce(global_loss)  # the mean over the ranks, for the log
    if rank == 0:
        print(f"epoch {epoch}: loss {loss.item():.4f}")
dist.destroy_process_group()
