"""A single-device training loop started under torchrun: it never sets up a process group, so
every rank trains its own copy."""
import torch
import torch.nn.functional as F

X, y = torch.randn(32, 6), torch.randn(32, 1)
model = torch.nn.Linear(6, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(4):
    opt.zero_grad()
    F.mse_loss(model(X), y).backward()
    opt.step()
