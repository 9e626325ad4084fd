"""A DDP script that logs to Weights & Biases as on one GPU: wandb.init and wandb.log on every
rank. diagnose must say that every rank starts its own run (a dashboard of N runs, each of one
shard), and nothing else."""
import os
import sys

# wandb is not a course dependency: a stand-in with the same names (tests/scripts/diagnose/stubs)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import wandb  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

dist.init_process_group("gloo")
data = TensorDataset(torch.randn(48, 6), torch.randn(48, 1))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=8, sampler=sampler)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(6, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
wandb.init(project="ddp-demo", config={"lr": 0.05, "batch_size": 8})
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        wandb.log({"train/loss": loss.item()})
wandb.finish()
dist.destroy_process_group()
