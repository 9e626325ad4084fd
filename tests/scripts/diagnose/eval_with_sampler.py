"""Correct training, then an evaluation that shards 49 examples with a DistributedSampler and
sums the ranks' counts: the sampler's padding counts one example twice."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
train = TensorDataset(torch.randn(48, 6), torch.randn(48, 1))
sampler = DistributedSampler(train)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(6, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for xb, yb in DataLoader(train, batch_size=8, sampler=sampler):
        opt.zero_grad()
        F.mse_loss(model(xb), yb).backward()
        opt.step()
test = TensorDataset(torch.randn(49, 6), torch.randn(49, 1))
totals = torch.zeros(2)
with torch.no_grad():
    for xb, yb in DataLoader(test, batch_size=8, sampler=DistributedSampler(test, shuffle=False)):
        totals += torch.tensor([F.mse_loss(model(xb), yb, reduction="sum").item(), len(xb)])
dist.all_reduce(totals)
if dist.get_rank() == 0:
    print(f"test loss {totals[0] / totals[1]:.4f} over {int(totals[1])} examples")
dist.destroy_process_group()
