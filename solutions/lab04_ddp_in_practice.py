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
# `evaluate_f1(model, test_set, rank, world_size, device)`, called on every rank with the plain
# model (the script passes `model.module`) and the whole `test_set` (a dataset of `(image,
# class)` pairs). What must hold:
#
# - **the value:** it returns a Python float, the same on every rank, equal (to 1e-6) to what
#   one process gets with `macro_f1` of the whole test set's labels and predictions, with the
#   model in eval mode (as at test time);
# - **the work:** the ranks share it — together they run the model as many times as that one
#   process would;
# - **the wire:** what a rank passes into its collectives does not grow with the test set (a
#   real one has 10⁵ images on hundreds of ranks) and stays exact on such a set (whatever dtype
#   it travels in holds each of its numbers exactly, at 10⁵ images too; the check reads the
#   dtype you hand to each collective); it holds **no more numbers per class than the exact
#   value needs** (the check counts everything each rank passes, all classes together: a few
#   spare numbers in total are fine, not one more per class); and it lives on `device` (on
#   GPUs the group is NCCL's, which only moves GPU memory; here the ranks compute on the CPU,
#   and the check follows where each tensor would live on a GPU).
#
# The check calls your function on test sets that do not split evenly, and when one of these
# does not hold, its sentence says what it saw.
#
# **Your design decision:** what the ranks exchange — the fewest numbers per class from which
# the exact value follows.
#
# Re-run the cell after each edit: it rewrites `train_lab.py`.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# `macro_f1` is built from each class's precision and recall, each a fraction of some of the
# images. If rank 0 knows its precision for class 3 and rank 1 knows its own, can the whole
# set's precision for class 3 be computed from those two numbers alone? If not, what is missing,
# and how many numbers per class would that be?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Two ranks' fractions over different numbers of images do not combine; their numerators and
# denominators do: they are counts, and counts over disjoint sets of images add up. Write class
# c's precision and recall as counts over counts. They share their numerator; their harmonic
# mean, `2PR / (P + R)`, can be written as one fraction of counts: do it, and count how many
# different counts per class are left. How you split the images matters too: see lesson 04 §4.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Pieces, in order: this rank's indices of the test set (a `Subset`, from
# `torch.utils.data`); a zero tensor on `device`, one row per count that Hint 2 left you and
# one column per class; the model in its test-time mode and a loop, with autograd off, that
# adds each batch's counts per class into it (`torch.bincount(..., minlength=10)` counts per
# class); one collective that sums it over the ranks; each class's F1 from the sums (0 where
# it is undefined), and their mean as a float.
#
# </details>

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
    every rank; the ranks share the work; a rank sends no more numbers per class than the
    value needs, from tensors on ``device``."""
    ### BEGIN SOLUTION: evaluate_f1: the whole test set's macro-F1, the same on every rank
    from torch.utils.data import Subset

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
# whole test set is 1.0), the lab script's 101 test images (10 classes, 10 or 11 images each,
# in the data set's shuffled order), and deal them **round-robin to 8 ranks** — rank r takes
# images r, r + 8, r + 16, ..., so every image is on exactly one rank and no rank is sorted by
# class. What number does the shortcut report, with the lab's `macro_f1`? Write your number
# first (between 0 and 1), run the cell, then the measurement.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# On one rank, which classes get an F1 of 1? Is there a class that gets something else, and
# what does `macro_f1` give a class that has no image on that rank and is never predicted
# there? Then: how many images does each rank hold?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Each rank's macro-F1 is the fraction of the 10 classes that appear among its 12 or 13
# images. Estimate how many classes a random handful of 12 or 13 images leaves out: the chance
# that one given class is missing from 13 draws where each draw is of it with probability 1/10.
#
# </details>

# %%
from dpcourse.checks import predict

### BEGIN SOLUTION: your prediction (a number between 0 and 1)
my_guess = 0.73  # 13 draws miss a class with probability 0.9^13 = 0.25: about 7.5 of 10 held
### END SOLUTION
guess = predict("lab04", lab04.PREDICTION_QUESTION, my_guess)

# %%
import runpy

import torch

from dpcourse import data

macro_f1 = runpy.run_path(str(work / "train_lab.py"))["macro_f1"]  # the script's definition
labels = torch.as_tensor(data.load("shapes10", n_train=8, n_test=101, seed=0).y_test)
always_right = labels.clone()
N = lab04.PREDICTION_RANKS
per_rank = [macro_f1(labels[r::N], always_right[r::N]) for r in range(N)]  # rank r: r, r + N, ...
whole = macro_f1(labels, always_right)
# prints both measurements, once your prediction (the cell above: run it first) is recorded
lab04.check_prediction(guess, labels, per_rank, whole)

# %% [markdown]
# ## Stretch (optional): resume after a crash, exactly
#
# A workshop can stop here. Lesson 04 restarted a job with `torchrun --max-restarts`; a restart
# only helps if the script continues where it stopped. Write the two functions that the
# check's DDP training loop calls:
#
# * `save_training_state(path, model, optimizer, epoch, is_main)` — called on **every** rank at
#   the end of every epoch (`model` is the DDP wrapper, `epoch` the epoch just finished,
#   `is_main` true on rank 0). Afterwards there is one file at `path`, written by rank 0 alone;
#   the weights in it are the **unwrapped** model's (a plain model must be able to load them),
#   and a crash in the middle of a save leaves the previous checkpoint readable at `path` (the
#   check stops one save halfway through to see). Lesson 04's `save_checkpoint` and
#   `load_checkpoint`, imported below, may do the writing and reading: that part is given;
#   what the state must hold is yours to decide.
# * `resume_training_state(path, model, optimizer)` — called on every rank at the start, after
#   the model is wrapped; **returns the first epoch still to do**, or 0 when there is no file
#   (`load_checkpoint` returns None then).
#
# The contract: **a resumed run continues exactly as the uninterrupted run would have, on
# every rank** — on these CPU ranks and on GPUs. The check trains 3 epochs with this loop (2
# ranks, one thread each), stops the job after epoch 1 as a crash would, starts it again, and
# compares every rank's resumed state (weights, momentum, random state) with its state at the
# crash, bit for bit, and the final weights with a run that never stopped, to 1e-5 (a right
# resume matches them bit for bit too; the bound only absorbs a kernel that is not
# deterministic). Its ranks have no GPU: while your two functions run, torch.cuda's
# random-state functions (`get_rng_state`, `set_rng_state`, their `_all` forms, the seeding
# ones) act on stand-in GPUs, 2 per rank as on a 2-GPU node: rank r runs on GPU r alone (its
# current device, as after `torch.cuda.set_device(local_rank)`), whose generator each training
# step's dropout moves as it would on a GPU; the check compares them like the rest.
#
# ```python
# sampler = DistributedSampler(train_set, num_replicas=2, rank=rank, seed=0)
# loader = DataLoader(train_set, batch_size=32, sampler=sampler, drop_last=True)
# torch.manual_seed(0)
# model = DDP(models.SmallCNN(width=8, dropout=0.3))
# opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
# torch.manual_seed(0 + 1 + rank)
# start = resume_training_state(path, model, opt)     # the second run only
# for epoch in range(start, 3):
#     sampler.set_epoch(epoch)
#     for X, y in loader:
#         loss = F.cross_entropy(model(X), y)
#         opt.zero_grad(set_to_none=True)
#         loss.backward()
#         opt.step()
#     save_training_state(path, model, opt, epoch, rank == 0)
# ```
#
# **Your design decision, first:** what is the least the one file must hold so that epoch 2 of
# the resumed run computes exactly what it computes in the uninterrupted one? Choose one of
# `lab04.RESUME_PLANS` before you write the code; the check compares it with what its runs
# show once your code passes.

# %%
print("\n".join(lab04.RESUME_PLANS))

### BEGIN SOLUTION: your plan (one of lab04.RESUME_PLANS, as a string)
my_plan = "weights, optimizer state, epoch, each rank's random state"
### END SOLUTION
plan = predict("lab04", lab04.RESUME_PLAN_QUESTION, my_plan, choices=lab04.RESUME_PLANS)

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Go through the loop above line by line after epoch 1. Which of the things a line reads are
# the same on every rank, and which are rank 1's alone? Which of them does the loop rebuild by
# itself from numbers it already knows, and which depend on everything that happened before
# the crash? Which of them can rank 0 see when it writes?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Sort what epoch 2 reads into two piles: what is the same on every rank, so that rank 0's
# copy stands for all, and what each rank holds alone. For each item, ask what keeps the ranks
# in step: DDP's all-reduce of the gradients, a seed or number the loop sets again by itself
# (which lines set one, and from what?), or nothing at all. What the loop rebuilds needs no
# place in the file; what is one rank's own and moved with every step does, though only rank 0
# writes the file. Then ask where a training step on a GPU would keep that state. A save cut
# short is the given `save_checkpoint`'s concern: it leaves the old file whole until the new one
# is complete (lesson 04, §3).
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Save: every rank contributes its generator states (the CPU's, and `torch.cuda`'s for every
# device, an empty list without a GPU: dropout on a CUDA tensor draws from that GPU's own
# generator, which `torch.get_rng_state` does not hold) to an object collective, which pickles
# any Python object (`dist.all_gather_object` fills a list, one entry per rank, on every rank;
# `dist.gather_object` fills it on its `dst` rank only); then rank 0 alone writes one dict
# with `save_checkpoint`: the plain model's weights, the
# optimizer's state dict, the epoch, that list. Resume: no file, return 0; else on every rank
# load the weights into the model inside the wrapper, the optimizer's state, this rank's entry
# of the list into the generators; return the saved epoch plus one.
#
# </details>

# %%
import torch
import torch.distributed as dist

from dpcourse.ddp_practice import load_checkpoint, save_checkpoint


def save_training_state(path, model, optimizer, epoch, is_main):
    ### BEGIN SOLUTION: save_training_state: one file, by rank 0, to continue exactly
    # each rank's dropout stream: the CPU generator, and on GPUs each device's (here: [])
    mine = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all()}
    generators = [None] * dist.get_world_size()
    dist.all_gather_object(generators, mine)
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
    mine = state["rng"][dist.get_rank()]
    torch.set_rng_state(mine["cpu"])
    torch.cuda.set_rng_state_all(mine["cuda"])
    return state["epoch"] + 1
    ### END SOLUTION


# %%
lab04.check_resume(save_training_state, resume_training_state, plan)

# %% tags=["solution-only"]
import shutil

shutil.rmtree(work, ignore_errors=True)  # the build's scratch folder; learners keep theirs
