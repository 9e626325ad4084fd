# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
# ---

# %% [markdown]
# # 00 · Start here
#
# This course takes you from a single-device PyTorch training loop to data-parallel training
# on many devices — `nn.DataParallel`, DistributedDataParallel (DDP), TensorFlow's
# `MirroredStrategy` — and down to the ring AllReduce that moves the gradients. Every lesson
# runs on a laptop without a GPU, and runs unchanged on a multi-GPU workstation.
#
# **Every claim is checked.** When a lesson says "the two gradients are equal", a cell below
# it asserts exactly that, and the continuous integration re-runs every notebook and compares
# every output. If a claim stopped being true, the course would fail to build.
#
# ## The course map
#
# | lesson | what you learn | what it proves by running | lab |
# |---|---|---|---|
# | 00 start here | the map, labs, your hardware profile | which profile this machine uses | – |
# | 01 single device | the loop: forward, loss, backward, step; throughput; AMP; seeds | loss falls, accuracy ≫ chance, AMP keeps accuracy | `train_one_epoch`, `evaluate` |
# | 02 data parallel | `nn.DataParallel`: scatter, replicate, parallel_apply, gather — and why it is slow | DP from scratch == the plain module | DP step by hand |
# | 03 DDP from first principles | processes, ranks, collectives, averaging gradients, DDP, `DistributedSampler` | hand-averaged == DDP == one process on the global batch | `average_gradients` |
# | 04 DDP in practice | torchrun, multi-node, checkpoints, faults, accumulation, AMP, debugging | a killed-and-restarted run ends with the same weights | script → torchrun DDP |
# | 05 MirroredStrategy | TensorFlow's data parallelism, Keras `fit`, a custom loop, multi-worker | mirrored step == one replica on the global batch | loss scaling in a custom loop |
# | 06 ring AllReduce | the algorithm, its cost model fitted to your machine, a real ring | ring == sum; bytes per rank == 2(N−1)K/N | the ring, simulated then real |
#
# ## How the labs work
#
# Each lab (in `labs/`) is a notebook with a few `# TODO` holes, each followed by a **check
# cell**. Fill a hole, run its check: it prints one line starting with ✔ when your code is
# right, or stops with a `LabCheckError` whose one sentence names the mistake — "gradients from
# earlier batches leaked into each step", not just "wrong". The labs are generated from the
# published solutions in `solutions/`, so the two never drift apart.
#
# Here is the mechanism on a toy: a check that wants the mean of a list.

# %%
from dpcourse.checks import LabCheckError, fail, passed


def check_mean(mean_fn):
    """A miniature lab check: compare with the right answer, name the usual mistake."""
    data = [1.0, 2.0, 3.0, 6.0]
    got = mean_fn(data)
    if got == sum(data):
        fail("you returned the sum: divide by the number of items.")
    if got != sum(data) / len(data):
        fail(f"mean_fn gave {got}, the mean is {sum(data) / len(data)}.")
    return passed("mean_fn is right.")


check_mean(lambda xs: sum(xs) / len(xs))
try:
    check_mean(lambda xs: sum(xs))
except LabCheckError as err:
    print("LabCheckError:", err)

# %% [markdown]
# ## Your machine: the three hardware profiles
#
# The lessons never ask you to edit a cell to match your hardware. `dpcourse.devices` looks at
# the machine and picks one of three profiles:
#
# | profile | when | single-device lessons | multi-rank lessons (03, 04, 06) | TensorFlow (05) |
# |---|---|---|---|---|
# | `cpu` | no GPU (laptop, Binder, CI) | CPU | 2 processes over **gloo** on the CPU | CPU split into 2 logical devices |
# | `one-gpu` | one GPU | CUDA | ranks over gloo (NCCL refuses two ranks on one GPU) | GPU split into 2 logical GPUs |
# | `multi-gpu` | 2+ GPUs | CUDA | **NCCL**, one GPU per rank | the real GPUs |
#
# Instructors can force a profile with the environment variable `DPCOURSE_PROFILE` (for
# example to rehearse the CPU path on a GPU server). `python -m dpcourse doctor` prints the
# report below from a terminal. Its output depends on your machine, so this cell is not
# compared by the course's tests.

# %%
# NBVAL_IGNORE_OUTPUT
# Why: versions, CPU count and GPUs differ from machine to machine.
from dpcourse.__main__ import doctor

_ = doctor()  # (keep its return code out of the output)

# %% [markdown]
# What the lessons rely on is not the exact report but a few rules, checked here on this
# machine: the profile follows the number of GPUs, NCCL is chosen only when every rank can own
# a GPU, and everything needed for the CPU path (gloo) is present.

# %%
import os

from dpcourse import devices

report = devices.hardware_report()
profile = devices.choose_profile(report)
expected = {0: "cpu", 1: "one-gpu"}.get(report.gpu_count, "multi-gpu")
print("profile follows the GPU count:", profile.name == expected or "DPCOURSE_PROFILE" in os.environ)
print("gloo available:", report.gloo)
print("nccl only with a GPU per rank:",
      devices.backend_for(2, gpu_count=0, nccl=True) == "gloo"
      and devices.backend_for(2, gpu_count=1, nccl=True) == "gloo"
      and devices.backend_for(2, gpu_count=2, nccl=True) == "nccl"
      and devices.backend_for(2, gpu_count=4, nccl=False) == "gloo")
assert report.gloo

# %% [markdown]
# ## Running many processes from a notebook
#
# From lesson 03 on, cells start several processes ("ranks") that work together. Doing that
# from a notebook has traps — a function defined in a cell cannot normally be sent to another
# process, ranks print on top of each other, and a rank that crashes can leave the others
# waiting forever. `dpcourse.launch.spawn` deals with all of them: it returns each rank's
# result, prints each rank's output after the run with a `[rank k]` prefix, turns a crash in
# any rank into one error naming it, and stops a hang at a timeout. A first taste — two
# processes each contribute a number and both receive the sum:

# %%
from dpcourse import launch


def hello(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([10.0 * (rank + 1)])
    dist.all_reduce(t)  # every rank ends with the sum over all ranks
    print(f"I am rank {rank} of {world_size}; the sum is {t.item():.0f}")
    return t.item()


results = launch.spawn(hello, 2, backend="gloo", timeout=60)
print(results)
assert results == [30.0, 30.0]

# %% [markdown]
# ## Next
#
# Open `01_single_device.ipynb`. If you want to run a lesson at a bigger scale (CIFAR-10,
# more epochs), every lesson starts with a *parameters* cell that
# [papermill](https://papermill.readthedocs.io) can override, e.g.
# `papermill lessons/01_single_device.ipynb out.ipynb -p dataset cifar10 -p epochs 10`.
