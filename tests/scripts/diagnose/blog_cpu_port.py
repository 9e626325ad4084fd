"""A blog post's CIFAR-style DDP script, ported to the CPU as learners do: diagnose must find
the missing set_epoch, every rank saving to one file, the 'module.' keys, the barrier after
every batch, and the loss printed from rank 0 alone."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss = criterion(model(inputs), labels)
            loss.backward()
            optimizer.step()
            dist.barrier()  # keep the workers together
        if rank == 0:
            print(f"[epoch {epoch}] loss: {loss.item():.3f}")
    torch.save(model.state_dict(), "/tmp/dpcourse-diagnose-blog-checkpoint.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
