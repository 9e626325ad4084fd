"""DDP with a plain shuffling DataLoader: every rank reads the whole data set."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("gloo")
dataset = TensorDataset(torch.randn(48, 6), torch.randn(48, 1))
loader = DataLoader(dataset, batch_size=8, shuffle=True)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(6, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(2):
    for xb, yb in loader:
        opt.zero_grad()
        F.mse_loss(model(xb), yb).backward()
        opt.step()
dist.destroy_process_group()
