# %% [markdown]
# # Lab 04 — a metric that is not a mean, in your torchrun DDP script
#
# Lesson 04 turned `train_single.py` into `train_ddp.py` line by line, and made its evaluation
# equal one process: each test image on exactly one rank, a **sum** of right answers and a
# **count** of images on every rank, one `all_reduce`, the division last. That works because
# accuracy is a mean over images. Many metrics are not: precision, recall, F1, AUC, a BLEU
# score. Here you evaluate the **macro-F1** of the model the script trained — the mean over the
# 10 classes of each class's F1 = 2·precision·recall / (precision + recall) — on a test set
# split over the ranks, and the number must be **the one process's**, on every rank.
#
# Below is a torchrun DDP script built the way the lesson built `train_ddp.py` (read it: nothing
# in it is new). One function in it is yours: `evaluate_f1`. The check first calls your
# function on 2 and on 3 ranks, with test sets that do not split evenly, and compares it with
# one process; if it differs it names the mistake (duplicates, a rank's own number, a mean of
# the ranks' F1 scores ...). Then it runs the whole script with
# `torchrun --nproc-per-node=2` and compares the weights and the F1 it saved.

# %% tags=["parameters"]
timeout = 120   # seconds the check gives torchrun

# %%
import tempfile
from pathlib import Path

# The script goes to a scratch folder (print `work` to see where); %%writefile expands {work}.
work = Path(tempfile.mkdtemp(prefix="dpcourse-lab04-"))

# %% [markdown]
# ## Your task: `evaluate_f1`
#
# `macro_f1(confusion)` is given: from a 10 × 10 matrix whose entry `[t, p]` counts the test
# images of true class `t` that the model predicted as `p`, it returns the macro-F1. Write
# `evaluate_f1(model, test_set, rank, world_size, device)` so that **every rank returns the
# macro-F1 of the whole test set**, exactly what one process gets — and each rank does only its
# share of the work. Hints:
# 1. Which images does this rank evaluate? Every image must be counted exactly once over all
#    ranks (what does `DistributedSampler` do when 101 images meet 2 ranks?).
# 2. F1 is not a sum over images, so neither summing nor averaging the ranks' F1 scores gives
#    the F1 of the whole set. What *is* a sum over images, from which F1 follows?
# 3. Evaluate with the model in evaluation mode and without gradients. `model` is the plain
#    model (the script passes `model.module`, not the DDP wrapper), so its forward sends nothing.
#
# <details><summary>▶ More on hint 2 — open only if you are stuck</summary>
#
# The confusion matrix is a sum over images: each image adds 1 to one entry `[true, predicted]`.
# Count this rank's images into a matrix, add the ranks' matrices, and compute F1 from the sum.
# </details>
#
# Re-run the cell after each edit: it rewrites `train_lab.py`.

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
from torch.utils.data import DataLoader, DistributedSampler, Subset

from dpcourse import data, devices, models
from dpcourse.ddp_practice import save_checkpoint

NUM_CLASSES = 10


def macro_f1(confusion):
    """Mean over classes of F1 = 2 TP / (2 TP + FP + FN); confusion[t, p] counts true t, predicted p."""
    confusion = confusion.double()
    tp = confusion.diagonal()
    fp = confusion.sum(0) - tp  # predicted p, but another true class
    fn = confusion.sum(1) - tp  # true t, predicted as another class
    denominator = 2 * tp + fp + fn
    f1 = torch.where(denominator > 0, 2 * tp / denominator.clamp(min=1), torch.zeros_like(tp))
    return float(f1.mean())


def evaluate_f1(model, test_set, rank, world_size, device):
    """The macro-F1 of ``model`` (the plain model, ``model.module`` of the DDP wrapper) over the
    WHOLE ``test_set``: the same number on every rank."""
    ### BEGIN SOLUTION: evaluate this rank's share of the images (each exactly once over all ranks), combine across the ranks what macro_f1 is computed from, then call macro_f1
    mine = Subset(test_set, range(rank, len(test_set), world_size))
    confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64, device=device)
    model.eval()
    with torch.no_grad():
        for X, y in DataLoader(mine, batch_size=64):
            predicted = model(X.to(device)).argmax(1)
            pairs = y.to(device) * NUM_CLASSES + predicted  # (true, predicted) as one index
            confusion += torch.bincount(pairs, minlength=NUM_CLASSES ** 2).view_as(confusion)
    dist.all_reduce(confusion)  # the whole test set's matrix, on every rank
    return macro_f1(confusion)
    ### END SOLUTION


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for name, kind, default in [("--n-train", int, 256), ("--n-test", int, 101),
                                ("--epochs", int, 2), ("--global-batch", int, 64),
                                ("--lr", float, 0.05), ("--seed", int, 0), ("--width", int, 8)]:
        p.add_argument(name, type=kind, default=default)
    p.add_argument("--out", default="final.pt")
    args = p.parse_args()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    backend = devices.backend_for(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    dist.init_process_group(backend)
    device = devices.device_for_rank(local_rank, backend)  # set_device(local_rank) on a GPU
    is_main = rank == 0

    ds = data.load("shapes10", n_train=args.n_train, n_test=args.n_test, seed=args.seed)
    train_set = data.to_torch(ds.x_train, ds.y_train)
    test_set = data.to_torch(ds.x_test, ds.y_test)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed)
    per_rank_batch = args.global_batch // world_size
    loader = DataLoader(train_set, batch_size=per_rank_batch, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)
    model = models.SmallCNN(width=args.width).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for X, y in loader:
            loss = F.cross_entropy(model(X.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    f1 = evaluate_f1(model.module, test_set, rank, world_size, device)
    if is_main:
        print(f"macro-F1 on {len(test_set)} test images: {f1:.4f}")
        save_checkpoint(args.out, {"model": model.module.state_dict(), "f1": f1})
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter shutdown, where gloo + DDP can abort a finished process

# %% [markdown]
# ## Check
#
# This calls your `evaluate_f1` on 2 and 3 ranks (a few seconds), then runs
# `torchrun --nproc-per-node=2 train_lab.py ...` (about 10 s). One line with ✔ means your
# script is right.

# %%
from dpcourse.checks import lab04

lab04.check(work / "train_lab.py", timeout=timeout)

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
