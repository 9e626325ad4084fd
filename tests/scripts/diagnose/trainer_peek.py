"""A correct Trainer in the style of the DDP tutorial series: it peeks at one batch to log the
batch size before calling set_epoch, then trains. diagnose must find nothing (a peek is not a
training read)."""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Trainer:
    def __init__(self, model, loader, optimizer):
        self.rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.loader = loader
        self.optimizer = optimizer

    def _run_epoch(self, epoch):
        batch = len(next(iter(self.loader))[0])
        if self.rank == 0:
            print(f"epoch {epoch}: batches of {batch}, {len(self.loader)} steps")
        self.loader.sampler.set_epoch(epoch)
        for x, y in self.loader:
            self.optimizer.zero_grad()
            F.mse_loss(self.model(x), y).backward()
            self.optimizer.step()

    def train(self, epochs):
        for epoch in range(epochs):
            self._run_epoch(epoch)


def main():
    dist.init_process_group("gloo")
    data = TensorDataset(torch.randn(40, 6), torch.randn(40, 1))
    loader = DataLoader(data, batch_size=5, sampler=DistributedSampler(data))
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=0.05)).train(2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
