# %% [markdown]
# # Lab 04 — a metric that is not a mean, in your torchrun DDP script
#
# Lesson 04 turned `train_single.py` into `train_ddp.py` line by line and made its evaluation
# of the accuracy, a mean over images, equal one process's. Many metrics are not means over
# images: precision, recall, F1, AUC, a BLEU
# score. Here you evaluate the **macro-F1** of the model the script trained — the mean over the
# 10 classes of each class's F1 — on a test set split over the ranks.
#
# Below is a torchrun DDP script built the way the lesson built `train_ddp.py` (read it: nothing
# in it is new). One function in it is yours: `evaluate_f1`. The check calls it on 2 and on 3
# ranks, with test sets that do not split evenly, and compares what it returns with one
# process; then it runs the whole script with `torchrun --nproc-per-node=2` and compares the
# weights and the F1 it saved. When something is wrong, its sentence says what.

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
# `macro_f1(y_true, y_pred)` is given: it **defines** the number you must produce — from the
# true classes and the predicted classes of a set of images, the macro-F1 of that set (what
# `sklearn.metrics.f1_score(y_true, y_pred, average="macro", labels=range(10),
# zero_division=0)` returns). Read its code: it is the definition. Write
# `evaluate_f1(model, test_set, rank, world_size, device)`. The contract:
#
# - it is called on every rank, with the plain model (the script passes `model.module`) and the
#   whole `test_set` (a dataset of `(image, class)` pairs);
# - it returns a float, **the same on every rank: `macro_f1` of the whole test set's labels and
#   predictions**, what one process evaluating every image gets (to 1e-6);
# - each rank runs the model on its own share of the images, and every image is evaluated on
#   exactly one rank;
# - the model is evaluated as at test time, without building an autograd graph; the mode it
#   is left in afterwards does not matter here (the script evaluates once, after the last
#   epoch, and the check does not look at it);
# - what a rank sends to the others **does not grow with the test set** (a real test set has
#   10⁵ images on hundreds of ranks), and is small: **at most 2 numbers per class** (20 here),
#   plus 2 more if you want them (a count, or a result one rank broadcasts). The check adds up
#   the numbers each rank passes into its collectives (an object collective's numbers too).
#   That is less than the usual ways of writing precision and recall seem to need — a 10 × 10
#   table of (true, predicted) pairs is 100 numbers, and a million for 1000 classes — and it
#   is enough;
# - every tensor a rank passes to a collective lives on `device`: on GPUs the script's group is
#   NCCL's, which only moves GPU memory. Here every rank computes on the CPU, where gloo would
#   take a tensor from anywhere, so the check follows where each of your tensors would live on
#   a GPU.
#
# **Your design decision:** what the ranks exchange. It must determine the whole test set's
# macro-F1 exactly, in at most 2 numbers per class, whatever the number of images.
#
# Re-run the cell after each edit: it rewrites `train_lab.py`.

# %% [markdown]
# **▶ Hint 1 — a question** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# `macro_f1` is built from each class's precision and recall, each a fraction of some of the
# images. If rank 0 knows its precision for class 3 and rank 1 knows its own, can the whole
# set's precision for class 3 be computed from those two numbers alone? If not, what is missing,
# and how many numbers per class would that be?

# %% [markdown]
# **▶ Hint 2 — the idea**

# %% [markdown] jupyter={"source_hidden": true}
# Two ranks' fractions over different numbers of images do not combine; their numerators and
# denominators do: they are counts, and counts over disjoint sets of images add up. Write class
# c's precision and recall as counts over counts. They share their numerator; their harmonic
# mean, `2PR / (P + R)`, can be written as one fraction of counts: do it, and count how many
# different counts per class are left. How you split the images matters too: see lesson 04 §4.

# %% [markdown]
# **▶ Hint 3 — the shape of the code**

# %% [markdown] jupyter={"source_hidden": true}
# Pieces, in order: this rank's indices of the test set (a `Subset`); a zero tensor of shape
# (2, 10) on `device`; the model in its test-time mode and a loop, with autograd off, that adds
# each batch's two counts per class into it (`torch.bincount(..., minlength=10)` counts per
# class); one collective that sums it over the ranks; each class's F1 from the sums (0 where it
# is undefined), and their mean as a float.

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


def macro_f1(y_true, y_pred):
    """The macro-F1 of one set of images: ``y_true`` and ``y_pred`` are 1-D integer tensors of
    classes 0..9 (each image's true class and the model's prediction); returns a float."""
    y_true, y_pred = y_true.long().cpu(), y_pred.long().cpu()
    scores = []
    for c in range(NUM_CLASSES):
        predicted_c, truly_c = y_pred == c, y_true == c
        # precision: of the images predicted c, the fraction truly c (0 if none predicted c)
        precision = (y_true[predicted_c] == c).double().mean().item() if predicted_c.any() else 0.0
        # recall: of the images truly c, the fraction predicted c (0 if none is truly c)
        recall = (y_pred[truly_c] == c).double().mean().item() if truly_c.any() else 0.0
        both = precision + recall
        scores.append(2 * precision * recall / both if both else 0.0)  # their harmonic mean
    return sum(scores) / NUM_CLASSES


def evaluate_f1(model, test_set, rank, world_size, device):
    """macro_f1 of the WHOLE ``test_set`` under ``model`` (the plain model), the same float on
    every rank; each image evaluated on one rank; a rank sends at most 2 numbers per class (+2),
    from tensors on ``device``."""
    ### BEGIN SOLUTION: evaluate_f1: the whole test set's macro-F1, the same on every rank
    mine = Subset(test_set, range(rank, len(test_set), world_size))
    # Per class c: its true positives, and (images predicted c) + (images truly c). Class c's
    # F1, 2PR/(P+R) with P = TP/predicted and R = TP/truly, is 2 TP / (predicted + truly).
    counts = torch.zeros(2, NUM_CLASSES, dtype=torch.int64, device=device)
    model.eval()
    with torch.no_grad():
        for X, y in DataLoader(mine, batch_size=64):
            predicted, y = model(X.to(device)).argmax(1), y.to(device)
            counts[0] += torch.bincount(y[predicted == y], minlength=NUM_CLASSES)
            counts[1] += torch.bincount(torch.cat([predicted, y]), minlength=NUM_CLASSES)
    dist.all_reduce(counts)  # 20 numbers, whatever the test set: now the whole set's
    tp, predicted_or_true = counts.double()
    return float((2 * tp / predicted_or_true.clamp(min=1)).mean())  # 0 where neither
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
# script is right. On a crowded machine, raise `timeout` in the parameters cell at the top.

# %%
from dpcourse.checks import lab04

lab04.check(work / "train_lab.py", timeout=timeout)

# %% [markdown]
# ## Predict, then measure: the ranks' macro-F1, averaged
#
# A shortcut often seen in DDP scripts: each rank computes the metric on its own images and
# the ranks average the numbers. Take a model that is **always right** (its macro-F1 on the
# whole test set is 1.0) and a test set split **by class**, as happens when the files are
# sorted by label and cut into contiguous pieces: rank 0 holds the images of classes 0–4,
# rank 1 those of classes 5–9. What number does the shortcut report, with the lab's
# `macro_f1`? Write your number first (between 0 and 1), run the cell, then the measurement.

# %% [markdown]
# **▶ Hint 1 — a question** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# On rank 0, no image is of class 7 and none is predicted 7. What does `macro_f1` give class 7
# there, and how many classes does it average over?

# %%
from dpcourse.checks import predict

### BEGIN SOLUTION: your prediction (a number between 0 and 1)
my_guess = 0.5
### END SOLUTION
guess = predict("lab04", "mean of 2 ranks' macro-F1, always right, split by class", my_guess)

# %%
import runpy

import torch

from dpcourse import data

macro_f1 = runpy.run_path(str(work / "train_lab.py"))["macro_f1"]  # the script's definition
labels = torch.as_tensor(data.load("shapes10", n_train=8, n_test=101, seed=0).y_test)
always_right = labels.clone()
shards = [labels < 5, labels >= 5]  # rank 0: classes 0-4, rank 1: classes 5-9
per_rank = [macro_f1(labels[s], always_right[s]) for s in shards]
print(f"whole test set: {macro_f1(labels, always_right):.2f}; rank 0: {per_rank[0]:.2f}; "
      f"rank 1: {per_rank[1]:.2f}")
lab04.check_prediction(guess, sum(per_rank) / len(per_rank))

# %% [markdown]
# ## Stretch (optional): resume after a crash, exactly
#
# A workshop can stop here. Lesson 04 restarted a job with `torchrun --max-restarts`; a restart
# only helps if the script continues where it stopped. Write the two functions that the
# check's DDP training loop (2 ranks, SGD with momentum) calls:
#
# * `save_training_state(path, model, optimizer, epoch, is_main)` — called on **every** rank at
#   the end of every epoch (`model` is the DDP wrapper, `epoch` the epoch just finished,
#   `is_main` true on rank 0). Afterwards there is one file at `path`, written by rank 0 alone;
#   the weights in it are the **unwrapped** model's (a plain model must be able to load them).
#   `save_checkpoint` from `dpcourse.ddp_practice` writes atomically.
# * `resume_training_state(path, model, optimizer)` — called on every rank at the start, after
#   the model is wrapped; **returns the first epoch still to do**, or 0 when there is no file
#   (`load_checkpoint` returns None then).
#
# The contract: **a resumed run continues exactly as the uninterrupted run would have, on
# every rank.** The check trains 3 epochs, stops the job after epoch 1 as a crash would, starts
# it again, and compares every rank's state and the final weights with a run that never
# stopped: they must agree bit for bit (to 1e-5).
#
# **Your design decision:** what the one file must hold for that, and how each piece of it gets
# there and back.

# %% [markdown]
# **▶ Hint 1 — a question** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# After epoch 1, list everything that decides what epoch 2 computes on rank 1, not only the
# tensors of the model. Which of it is the same on every rank, and which is rank 1's alone?
# Which of it can rank 0 see when it writes? (For your list: whatever is random in the check's
# model and loop draws from torch's global default generator, the one `torch.manual_seed`
# seeds — no `torch.Generator` object of its own, no GPU. A real GPU job has more: CUDA's
# generators, the DataLoader workers' seeds, Python's and NumPy's `random`.)

# %% [markdown]
# **▶ Hint 2 — the idea**

# %% [markdown] jupyter={"source_hidden": true}
# The weights and SGD's momentum are the same on every rank (DDP keeps them so), so rank 0's
# copy stands for all. The check's model has dropout, and after building it the check seeds
# each rank's global default generator differently (`seed + 1 + rank`): each rank draws its
# own masks, and its generator's state is its own. Rank 0 can only write what reaches it; on
# resume, each rank needs its own back. And DDP copies nothing to the other ranks after it has
# wrapped the model: every rank loads what it needs.

# %% [markdown]
# **▶ Hint 3 — the shape of the code**

# %% [markdown] jupyter={"source_hidden": true}
# Save: every rank contributes its generator state to an object collective, which pickles any
# Python object (`dist.all_gather_object` fills a list, one entry per rank; no lesson used it
# yet); then rank 0 alone writes one dict: the plain model's weights, the optimizer's
# state dict, the epoch, that list. Resume: no file, return 0; else on every rank load the
# weights into the model inside the wrapper, the optimizer's state, this rank's entry of the
# list into the generator; return the saved epoch plus one.

# %%
import torch
import torch.distributed as dist

from dpcourse.ddp_practice import load_checkpoint, save_checkpoint


def save_training_state(path, model, optimizer, epoch, is_main):
    ### BEGIN SOLUTION: save_training_state: one file, by rank 0, to continue exactly
    generators = [None] * dist.get_world_size()
    dist.all_gather_object(generators, torch.get_rng_state())  # each rank's dropout stream
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch,
                               "rng": generators})
    ### END SOLUTION


def resume_training_state(path, model, optimizer):
    ### BEGIN SOLUTION: resume_training_state: every rank continues where it stopped
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"][dist.get_rank()])
    return state["epoch"] + 1
    ### END SOLUTION


# %%
lab04.check_resume(save_training_state, resume_training_state)

# %% tags=["solution-only"]
import shutil

shutil.rmtree(work, ignore_errors=True)  # the build's scratch folder; learners keep theirs
