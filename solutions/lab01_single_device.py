# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
# ---

# %% [markdown]
# # Lab 01 · Write the training loop
#
# In lesson 01 you took a training step apart. Now write the two functions every later lesson
# builds on:
#
# * `train_one_epoch(model, loader, loss_fn, optimizer, device)` — one pass over the loader,
#   one optimizer step per batch; returns the **mean loss per sample** as a Python float.
# * `evaluate(model, loader, loss_fn, device)` — returns `(mean_loss, accuracy)` over the
#   loader, with accuracy a fraction in [0, 1], without changing the model.
#
# After each, run its check cell. The check runs your function on a tiny model with dropout
# and a loader whose last batch is short, and compares with the reference; if something is off
# it tells you which mistake it looks like.

# %% tags=["parameters"]
dataset = "shapes10"
n_train = 3000
n_test = 500
epochs = 2
batch_size = 32
lr = 2e-3
seed = 0
device = None

# %%
import torch
from torch import nn

from dpcourse import data, devices, models, train
from dpcourse.checks import lab01

device = torch.device(device or devices.choose_profile().device)


# %% [markdown]
# ## 1. `train_one_epoch`
#
# For each batch: move `X` and `y` to `device`, clear the old gradients, forward, loss,
# backward, step. Keep a running total so you can return the mean loss *per sample* — careful,
# the last batch can be smaller than the others. And the model may arrive in eval mode.

# %%
def train_one_epoch(model, loader, loss_fn, optimizer, device):
    ### BEGIN SOLUTION: loop over the batches: zero_grad, forward, loss, backward, step; return the mean loss per sample
    model.train()
    total_loss, total = 0.0, 0
    for X, y in loader:
        X, y = X.to(device), y.to(device)
        optimizer.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        optimizer.step()
        total_loss += loss.item() * len(y)
        total += len(y)
    return total_loss / total
    ### END SOLUTION


# %%
lab01.check_train_one_epoch(train_one_epoch)


# %% [markdown]
# ## 2. `evaluate`
#
# Switch the model to evaluation mode (dropout off, batch norm frozen), and don't let autograd
# record anything. Return the mean loss per sample and the fraction of correct predictions
# (the predicted class is the argmax of the logits).

# %%
def evaluate(model, loader, loss_fn, device):
    ### BEGIN SOLUTION: eval mode, no autograd; return (mean loss per sample, accuracy in [0, 1])
    model.eval()
    total_loss, correct, total = 0.0, 0, 0
    with torch.no_grad():
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            logits = model(X)
            total_loss += loss_fn(logits, y).item() * len(y)
            correct += (logits.argmax(dim=1) == y).sum().item()
            total += len(y)
    return total_loss / total, correct / total
    ### END SOLUTION


# %%
lab01.check_evaluate(evaluate)

# %% [markdown]
# ## 3. Use them
#
# Your two functions now train the lesson's CNN. The loss should fall and the accuracy end far
# above the 10% of guessing.

# %%
devices.seed_everything(seed)
ds = data.load(dataset, n_train=n_train, n_test=n_test, seed=seed)
train_loader, test_loader = train.make_loaders(ds, batch_size, seed=seed)
model = models.SmallCNN().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=lr)
loss_fn = nn.CrossEntropyLoss()
losses, accs = [], []
for epoch in range(epochs):
    losses.append(train_one_epoch(model, train_loader, loss_fn, optimizer, device))
    accs.append(evaluate(model, test_loader, loss_fn, device)[1])
from dpcourse.checks import claim

claim("your loop trains: the loss fell", losses[-1] < losses[0], losses=losses)
claim("test accuracy is above 30% (chance is 10%)", accs[-1] > 0.3, accs=accs)

# %% [markdown]
# ## Stretch (optional): gradient accumulation
#
# A workshop can stop here. For self-study: what if the batch you want does not fit in memory?
# Run it as **k micro-batches** and add up their gradients before one step. Gradients add in
# `p.grad` by themselves (that is why you zero them); the only care is the scale — the loss of
# each micro-batch is a mean over *its* samples, so divide it by `k` and the k gradients sum to
# the gradient of the mean over all `k × micro-batch` samples.
#
# Write `train_accumulated(model, loader, loss_fn, optimizer, k, device)`: one forward and
# backward per micro-batch, one `optimizer.step()` (and zeroing) per k micro-batches. The check
# trains a small model both ways — your accumulation with micro-batches of `b`, and plain
# training with batches of `k × b` — and asks for the same weights. The model may arrive with
# gradients already in `p.grad`: start from zero. (Its loaders always hold a
# whole number of groups of k; the model has no dropout, whose masks would differ.) This is the
# same sum that DDP computes across ranks in lesson 03, done across time instead of devices.

# %%
def train_accumulated(model, loader, loss_fn, optimizer, k, device):
    ### BEGIN SOLUTION: forward/backward each micro-batch on loss / k; step and zero every k micro-batches
    model.train()
    optimizer.zero_grad()
    for i, (X, y) in enumerate(loader):
        X, y = X.to(device), y.to(device)
        loss = loss_fn(model(X), y) / k
        loss.backward()
        if (i + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
    ### END SOLUTION


# %%
lab01.check_train_accumulated(train_accumulated)
