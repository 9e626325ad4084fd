# %% [markdown]
# # Lab 04 — turn a single-device script into a torchrun DDP script
#
# In lesson 04 you saw `train_single.py` become `train_ddp.py`. Now you do it yourself, on a
# shorter script. Below is the single-device script (it trains the course's `SmallCNN` on
# shapes10 with a fixed seed). Your job: fill in the TODOs of `train_lab.py`, the same script for
# **torchrun with 2 processes and DDP**, so that it ends with **the same weights** as one process
# trained on the global batch.
#
# The check runs your script with `torchrun --nproc-per-node=2`, then again with 3 processes,
# another `--seed` and another `--global-batch` (so nothing in it may be tied to 2 ranks or to
# the defaults), loads the weights it writes to `--out`, and compares them with the reference.
# If they differ, it tells you which classic mistake your weights correspond to.

# %% tags=["parameters"]
timeout = 120   # seconds the check gives torchrun

# %%
import tempfile
from pathlib import Path

# The scripts go to a scratch folder (print `work` to see where); %%writefile expands {work}.
work = Path(tempfile.mkdtemp(prefix="dpcourse-lab04-"))

# %% [markdown]
# ## What you start from: the single-device script
#
# Read it: the data order comes from a generator re-seeded with `seed + epoch` (so runs are
# repeatable), one batch is `--global-batch` images, and the final weights are saved atomically.

# %%
# %%writefile {work}/train_lab_single.py
"""Lab 04, single device: python train_lab_single.py --out final.pt"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler

from dpcourse import data, models
from dpcourse.ddp_practice import save_checkpoint

p = argparse.ArgumentParser()
for name, kind, default in [("--n-train", int, 256), ("--epochs", int, 2),
                            ("--global-batch", int, 64), ("--lr", float, 0.05),
                            ("--seed", int, 0), ("--width", int, 8)]:
    p.add_argument(name, type=kind, default=default)
p.add_argument("--out", default="final.pt")
args = p.parse_args()

device = torch.device("cpu")
ds = data.load("shapes10", n_train=args.n_train, n_test=10, seed=args.seed)
train_set = data.to_torch(ds.x_train, ds.y_train)
generator = torch.Generator()
sampler = RandomSampler(train_set, generator=generator)
loader = DataLoader(train_set, batch_size=args.global_batch, sampler=sampler, drop_last=True)

torch.manual_seed(args.seed)
model = models.SmallCNN(width=args.width).to(device)
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
for epoch in range(args.epochs):
    generator.manual_seed(args.seed + epoch)
    for X, y in loader:
        loss = F.cross_entropy(model(X.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
save_checkpoint(args.out, {"model": model.state_dict()})

# %% [markdown]
# ## Your task: the torchrun DDP version
#
# Fill in each TODO in the cell below (it writes `train_lab.py`; re-run it after each edit).
# Hints, in the order you meet them:
# 1. torchrun gives every process `RANK`, `LOCAL_RANK` and `WORLD_SIZE` in its environment; start
#    the process group (backend from `devices.backend_for`), pick the device with
#    `devices.device_for_rank`, and set `is_main`.
# 2. Each rank must read its own shard, and the **global** batch must stay `--global-batch`.
# 3. The model must average its gradients over the ranks.
# 4. The shard's order must change every epoch, the same way on every rank.
# 5. One rank saves the final weights (unwrapped), then every rank ends cleanly.

# %%
# %%writefile {work}/train_lab.py
"""Lab 04, DDP: torchrun --nproc-per-node=2 train_lab.py --out final.pt"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from dpcourse import data, devices, models
from dpcourse.ddp_practice import save_checkpoint

p = argparse.ArgumentParser()
for name, kind, default in [("--n-train", int, 256), ("--epochs", int, 2),
                            ("--global-batch", int, 64), ("--lr", float, 0.05),
                            ("--seed", int, 0), ("--width", int, 8)]:
    p.add_argument(name, type=kind, default=default)
p.add_argument("--out", default="final.pt")
args = p.parse_args()

### BEGIN SOLUTION: read rank, local_rank and world_size; init the process group; device; is_main
rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
world_size = int(os.environ["WORLD_SIZE"])
backend = devices.backend_for(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
dist.init_process_group(backend)
device = devices.device_for_rank(local_rank, backend)
is_main = rank == 0
### END SOLUTION
ds = data.load("shapes10", n_train=args.n_train, n_test=10, seed=args.seed)
train_set = data.to_torch(ds.x_train, ds.y_train)
### BEGIN SOLUTION: a sampler that gives each rank its shard, and a loader with the per-rank batch
sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                             seed=args.seed)
per_rank_batch = args.global_batch // world_size
loader = DataLoader(train_set, batch_size=per_rank_batch, sampler=sampler, drop_last=True)
### END SOLUTION

torch.manual_seed(args.seed)
model = models.SmallCNN(width=args.width).to(device)
### BEGIN SOLUTION: make the model average its gradients over the ranks
model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
### END SOLUTION
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
for epoch in range(args.epochs):
    ### BEGIN SOLUTION: what must happen at the start of every epoch?
    sampler.set_epoch(epoch)
    ### END SOLUTION
    for X, y in loader:
        loss = F.cross_entropy(model(X.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
### BEGIN SOLUTION: save once (unwrapped weights), then end every rank cleanly
if is_main:
    save_checkpoint(args.out, {"model": model.module.state_dict()})
dist.barrier()
sys.stdout.flush()
os._exit(0)  # skip interpreter shutdown, where gloo + DDP can abort a finished process
### END SOLUTION

# %% [markdown]
# ## Check
#
# This runs `torchrun --nproc-per-node=2 train_lab.py ...` and then the 3-process run (about
# 10 s each) and compares the weights. One line with ✔ means your script is right.

# %%
from dpcourse.checks import lab04

result = lab04.check(work / "train_lab.py", timeout=timeout)

# %% [markdown]
# ## Stretch (optional): resume after a crash
#
# A workshop can stop here. Lesson 04 restarted a job with `torchrun --max-restarts`; a restart
# only helps if the script can pick up where it stopped. Write the two functions a training
# script calls for that:
#
# * `save_training_state(path, model, optimizer, epoch, is_main)` — at the end of every epoch:
#   on the main rank only, save what the next run needs to continue *exactly* (the unwrapped
#   weights, the optimizer's state — SGD's momentum lives there — and the epoch just finished).
#   `save_checkpoint` from `dpcourse.ddp_practice` writes atomically.
# * `resume_training_state(path, model, optimizer)` — at the start, on every rank: if the file
#   exists, load it back into the (DDP-wrapped) model and the optimizer and **return the first
#   epoch still to do**; if not, return 0. `load_checkpoint` returns None for a missing file.
#
# The check trains the lab's model for 3 epochs on 2 ranks, stops the job after epoch 1 as a
# crash would, starts it again, and compares the final weights with an uninterrupted run.

# %%
from dpcourse.ddp_practice import load_checkpoint, save_checkpoint


def save_training_state(path, model, optimizer, epoch, is_main):
    ### BEGIN SOLUTION: on the main rank only: save the unwrapped weights, the optimizer state and the epoch
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch})
    ### END SOLUTION


def resume_training_state(path, model, optimizer):
    ### BEGIN SOLUTION: load weights and optimizer state if the file exists; return the first epoch still to do (0 if none)
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"] + 1
    ### END SOLUTION


# %%
lab04.check_resume(save_training_state, resume_training_state)

# %% tags=["solution-only"]
import shutil

shutil.rmtree(work, ignore_errors=True)  # the build's scratch folder; learners keep theirs
