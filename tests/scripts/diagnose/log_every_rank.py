"""A DDP script that logs its loss through the logging module on every rank, as it did on one
GPU: diagnose must say that the log holds one line per rank, each of one rank's shard."""
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
logger = logging.getLogger(__name__)

dist.init_process_group("gloo")
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
    logger.info("epoch %d loss %.4f", epoch, loss.item())
dist.destroy_process_group()
