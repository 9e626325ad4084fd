"""A new DistributedSampler (and loader) built at the top of every epoch, never told its
epoch, and the loss logged from rank 0 through the logging module: every epoch repeats the
same order, and the logged loss is rank 0's own."""
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

logging.basicConfig(level=logging.INFO, format="%(message)s")
log = logging.getLogger("train")

dist.init_process_group("gloo")
data = TensorDataset(torch.randn(32, 6), torch.randn(32, 1))
torch.manual_seed(0)
model = DDP(torch.nn.Linear(6, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(2):
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=True))
    for x, y in loader:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    if dist.get_rank() == 0:
        log.info("epoch %d train loss %.4f", epoch, loss.item())
dist.destroy_process_group()
