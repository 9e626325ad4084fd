# %% [markdown]
# # 04 — DDP in practice
#
# **Prerequisites:** lesson 03 (ranks, collectives, DDP == one process on the global batch).
#
# **You will be able to:**
# - turn a single-device script into a torchrun DDP script, and run it on one or two "nodes";
# - save checkpoints that survive a crash, and resume a killed run to the very same weights;
# - accumulate gradients with `no_sync`, and use AMP and SyncBatchNorm under DDP correctly;
# - turn a hang into a clear error (`TORCH_DISTRIBUTED_DEBUG=DETAIL`, timeouts) and test the
#   common myths yourself.
#
# **Time:** about 40 minutes to read and run.
#
# **Lab:** [lab04_ddp_in_practice](../labs/lab04_ddp_in_practice.ipynb) — turn a single-device
# script into a torchrun DDP script.
#
# Lesson 03 proved that DDP computes what one process computes on the global batch. This lesson
# is about running it for real: a **torchrun script**, **two nodes** joined by a rendezvous,
# **checkpoints** that survive a crash, **restarts** after a fault, **gradient accumulation**
# with `no_sync`, **mixed precision**, **SyncBatchNorm**, **debugging** hangs — and the myths
# that the usual tutorials repeat, each tested by a cell.
#
# Every claim below is printed with ✔ by a check that ran. The scripts live in `lib/dpcourse/scripts/`; the
# helpers in `dpcourse.ddp_practice`.

# %% tags=["parameters"]
data_name = "shapes10"   # or "cifar10" if you have it
n_train = 1024           # images the scripts train on
epochs = 6               # enough for the model to leave the ln 10 plateau of guessing
per_rank_batch = 32
world_size = None        # None: from the hardware profile (2 on a CPU)
timeout = 120            # seconds any launch may take

# %%
# NBVAL_IGNORE_OUTPUT
# (the number of ranks and the backend depend on the hardware profile)
import difflib
import os
import tempfile
import warnings
from pathlib import Path

import torch

from dpcourse import ddp_practice as dp
from dpcourse import devices, launch, viz
from dpcourse.checks import claim

profile = devices.choose_profile(world_size=world_size)
world_size = profile.world_size
work = Path(tempfile.mkdtemp(prefix="dpcourse-l04-"))
train_single, train_ddp = dp.script_path("train_single"), dp.script_path("train_ddp")
# A small CNN with BatchNorm and SGD at lr 0.1: within a few epochs it learns, which the plain
# small CNN with SGD does not (it sits near ln 10 for many epochs on this budget).
common = ["--data", data_name, "--n-train", str(n_train), "--epochs", str(epochs),
          "--per-rank-batch", str(per_rank_batch), "--model", "small_bn", "--lr", "0.1"]
# The scripts below run their ranks on the CPU even on a GPU machine: two "nodes" on one machine
# would both put their rank on GPU 0, which NCCL refuses, and the fault-tolerance check compares
# two runs bit for bit, so both must run on the same kind of device, with the same 2 ranks.
script_env = {"CUDA_VISIBLE_DEVICES": ""}
print("ranks:", world_size, "| backend:", profile.backend)

# %% [markdown]
# ## 1. A torchrun script
#
# `torchrun --nproc-per-node=N script.py` starts N copies of the script and gives each one its
# identity in environment variables: `RANK` (0..WORLD_SIZE-1 over all machines), `LOCAL_RANK`
# (0..N-1 on this machine: it picks the GPU), `WORLD_SIZE`, and `MASTER_ADDR`/`MASTER_PORT`
# where the ranks meet. `dist.init_process_group(backend)` reads them. (`python -m
# torch.distributed.launch` is the old launcher: it passed `--local-rank` as an argument and is
# deprecated; torchrun sets `LOCAL_RANK` instead and adds restarts and elastic rendezvous.)
#
# `train_ddp.py` is `train_single.py` plus the distributed parts (run `diff` on them to see
# every line; the docstrings and the clean exit account for much of it). The lines that carry
# the ideas:

# %%
diff = list(difflib.unified_diff(train_single.read_text().splitlines(),
                                 train_ddp.read_text().splitlines(), lineterm="", n=0))
changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
print(f"{len(changed)} changed lines out of {len(train_ddp.read_text().splitlines())}")
print("\n".join(line for line in diff if line.startswith("+") and not line.startswith("+++")
                and ("RANK" in line or "DistributedSampler(" in line or "DDP(" in line
                     or "set_epoch" in line or "no_sync" in line or "is_main =" in line)))

# %% [markdown]
# ## 2. Two nodes, for real
#
# On a cluster you run the same torchrun command on every machine, with the address of one of
# them as the **rendezvous endpoint**. Here two torchrun agents on this machine play two nodes of
# one process each (`--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d`). Two things the docs
# don't stress: with c10d, nodes get their rank in the order they arrive (`--node_rank` is
# ignored), and a node whose partner never comes waits `join_timeout` (600 s by default) — so
# `dp.run_nodes` sets it and kills everything past `timeout`.

# %%
# NBVAL_IGNORE_OUTPUT
# (the loss values depend on this CPU's float kernels)
nodes = dp.run_nodes(train_ddp, *common, "--out", str(work / "two_nodes.pt"), nnodes=2,
                     nproc_per_node=1, timeout=timeout, join_timeout=60, env=script_env)
print("\n".join(line for line in nodes.text().splitlines() if "[rank" in line))

# %%
import math
import re


def epoch_losses(text):
    """The 'epoch k: mean loss x' lines that rank 0 of the script prints, as floats."""
    return [float(v) for v in re.findall(r"epoch \d+: mean loss ([0-9.]+)", text)]


claim("both nodes exited 0", nodes.ok, output=nodes.text()[-2000:])
claim("they formed one job of 2 ranks across the 2 torchrun agents", "2 ranks over" in nodes.text())
node_losses = epoch_losses(nodes.text())
claim(f"the model learns: the last epoch's mean loss is under 60% of ln 10 = {math.log(10):.2f}",
      bool(node_losses) and node_losses[-1] < 0.6 * math.log(10), losses=node_losses)

# %% [markdown]
# ### The SLURM recipe (not run here)
#
# ```bash
# #!/bin/bash
# #SBATCH --job-name=ddp --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 --cpus-per-task=16
# #SBATCH --time=01:00:00
# head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# srun torchrun --nnodes="$SLURM_NNODES" --nproc-per-node=4 \
#     --rdzv-backend=c10d --rdzv-endpoint="$head:29500" --rdzv-id="$SLURM_JOB_ID" \
#     --max-restarts=3 lib/dpcourse/scripts/train_ddp.py --ckpt "$SCRATCH/ckpt.pt" --out final.pt
# ```
#
# One `srun` task per node runs one torchrun agent, which starts one process per GPU. Put
# checkpoints on a file system every node sees.

# %% [markdown]
# ## 3. Checkpoints and fault tolerance
#
# The script saves `{model, optimizer, scaler, step}` every few steps — **on rank 0 only**
# (every rank holds the same weights), **atomically** (`dp.save_checkpoint`: a temporary file,
# then `os.replace`), and loads with `map_location` and `weights_only=True`. With
# `--max-restarts`, torchrun restarts *all* ranks when one dies; each finds the checkpoint and
# resumes. Here rank 1 kills itself (SIGKILL) after step 11; the last checkpoint is step 8.

# %%
# NBVAL_IGNORE_OUTPUT
# (torchrun's own log lines carry times, pids and ports)
fault = launch.torchrun(train_ddp, *common, "--ckpt", str(work / "ckpt.pt"), "--ckpt-every", "4",
                        "--fail-at-step", "11", "--out", str(work / "restarted.pt"),
                        nproc_per_node=2, max_restarts=1, timeout=timeout, echo=False,
                        env=script_env)
print("\n".join(line for line in fault.output.splitlines()
                if line.startswith("[rank") and "Traceback" not in line and "  " not in line))

# %% [markdown]
# (The restarted run's "epoch 0" loss differs from the uninterrupted one: the resumed attempt
# averages only the steps of that epoch it ran itself, 9 to 16. From epoch 1 on they print the
# same numbers, because they compute the same steps.)

# %%
restarted = dp.load_checkpoint(work / "restarted.pt")["model"]
uninterrupted = dp.load_checkpoint(work / "two_nodes.pt")["model"]
claim("rank 1 was killed after step 11", "simulated fault at step 11" in fault.output)
claim("torchrun restarted both ranks, which resumed from the step-8 checkpoint",
      "resumed from step 8" in fault.output)
claim("the restarted run ends with weights bit-identical to the uninterrupted run",
      all(torch.equal(restarted[k], uninterrupted[k]) for k in uninterrupted))
total_steps = int(re.findall(r"after (\d+) steps", fault.output)[-1])
viz.show(dp.restart_timeline_figure(total_steps=total_steps, ckpt_every=4, fail_at=11, resumed=8),
         "attempt 0 saves at steps 4 and 8 and dies after step 11; attempt 1 reloads step 8, "
         "redoes steps 9-11 and ends with the same weights as the run that never failed.")

# %% [markdown]
# **Myth: "every rank can save, it's the same file."** It races. Below, rank 0 is halfway
# through writing a checkpoint when rank 1 reads it (the barriers make the timing certain):
# with a plain `torch.save` to the final path, the reader finds a broken file; with
# `save_checkpoint`, it finds the previous complete one, then the new one.


# %%
def read_while_writing(rank, world_size, folder):
    return {atomic: _read_while_writing(rank, folder, atomic) for atomic in (False, True)}


def _read_while_writing(rank, folder, atomic):
    import io
    import os

    import torch
    import torch.distributed as dist

    from dpcourse import ddp_practice as dp

    path = os.path.join(folder, f"race_{atomic}.pt")
    dp.save_checkpoint(path, {"step": torch.tensor(1)})  # an old, complete checkpoint
    dist.barrier()
    seen = []
    if rank == 0:
        buf = io.BytesIO()
        torch.save({"step": torch.tensor(2), "w": torch.zeros(1000)}, buf)
        data = buf.getvalue()
        target = path + ".tmp" if atomic else path
        with open(target, "wb") as f:
            f.write(data[: len(data) // 2])      # half written ...
            f.flush()
            dist.barrier()                        # ... when rank 1 reads
            dist.barrier()
            f.write(data[len(data) // 2:])
        if atomic:
            os.replace(target, path)
    else:
        dist.barrier()
        try:
            seen.append(int(dp.load_checkpoint(path)["step"]))
        except RuntimeError as e:
            seen.append(str(e).split(" (")[0])
        dist.barrier()
    dist.barrier()
    if rank == 1:
        seen.append(int(dp.load_checkpoint(path)["step"]))
    return seen


seen = launch.spawn(read_while_writing, 2, str(work), backend="gloo", timeout=timeout)[1]
plain, atomic = seen[False], seen[True]
print("plain torch.save, rank 1 read:", plain)
print("atomic save,      rank 1 read:", atomic)
claim("with a plain torch.save the reader found a broken file", "cannot be read" in str(plain[0]))
claim("with the atomic save it found the previous complete checkpoint, then the new one",
      atomic == [1, 2])

# %% [markdown]
# ## 4. Gradient accumulation with `no_sync`
#
# To reach a big global batch with little memory, run `accum` micro-batches per optimizer step.
# Under DDP every `backward()` all-reduces — unless it runs inside `model.no_sync()`, where the
# gradients just add up locally and the last backward all-reduces the sum. We count the
# all_reduce calls with a comm hook (`dp.counting_allreduce_hook`, equal to DDP's default), and
# compare the gradients with one process on the whole global batch.


# %%
def accumulate(rank, world_size, accum, per_rank_batch):
    return {use: _accumulate(rank, world_size, accum, per_rank_batch, use) for use in (True, False)}


def _accumulate(rank, world_size, accum, per_rank_batch, use_no_sync):
    from contextlib import nullcontext

    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse import ddp_practice as dp
    from dpcourse import models

    torch.manual_seed(0)
    model = DDP(models.SmallCNN(width=8))
    counter = dp.CommCounter()
    model.register_comm_hook(counter, dp.counting_allreduce_hook)
    g = torch.Generator().manual_seed(1)
    global_batch = per_rank_batch * world_size * accum
    X, y = torch.randn(global_batch, 3, 32, 32, generator=g), torch.randint(0, 10, (global_batch,), generator=g)
    # micro-batch m of rank r: a contiguous slice, so the union is the whole global batch
    for m in range(accum):
        start = (m * world_size + rank) * per_rank_batch
        last = m == accum - 1
        with model.no_sync() if (use_no_sync and not last) else nullcontext():
            loss = F.cross_entropy(model(X[start:start + per_rank_batch]),
                                   y[start:start + per_rank_batch]) / accum
            loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    # the same model, one process, the whole global batch
    torch.manual_seed(0)
    single = models.SmallCNN(width=8)
    F.cross_entropy(single(X), y).backward()
    diff = max(float((a - p.grad).abs().max()) for a, p in zip(grads, single.parameters()))
    return {"calls": counter.calls, "max_grad_diff": diff, "global_batch": global_batch}


accum = 4
result = launch.spawn(accumulate, world_size, accum, 8, backend="gloo", timeout=timeout)[0]
with_no_sync, without = result[True], result[False]
print("all_reduce calls per optimizer step: without no_sync", without["calls"],
      "| with no_sync", with_no_sync["calls"])
claim(f"no_sync all-reduces {accum} times less", without["calls"] == accum * with_no_sync["calls"])
claim("with or without no_sync, the gradients equal one process on the global batch (to 1e-6)",
      with_no_sync["max_grad_diff"] < 1e-6 and without["max_grad_diff"] < 1e-6)

# %% [markdown]
# **Myth: "the global batch is the per-rank batch divided by the number of GPUs."** No: each
# rank loads `per_rank_batch` images, so one optimizer step sees
# `per_rank_batch × world_size × accum` images — the gradient above equals one process on
# exactly that many.

# %%
print("per_rank_batch 8 ×", world_size, "ranks ×", accum, "micro-batches = global batch",
      with_no_sync["global_batch"])
claim("the global batch is per_rank_batch × world_size × accum",
      with_no_sync["global_batch"] == 8 * world_size * accum)

# %% [markdown]
# ## 5. Mixed precision under DDP
#
# Autocast changes the forward's dtype, not DDP: parameters and their gradients stay float32,
# so the all_reduce is unchanged. On CUDA use float16 with a `GradScaler` (float16 gradients
# underflow); on CPU use bfloat16 (float32's range, no scaler needed). `train_ddp.py --amp` does
# both. Here: 10 steps with and without bf16 autocast on 2 ranks.


# %%
def amp_run(rank, world_size):
    return {use: _amp_run(rank, use) for use in (False, True)}


def _amp_run(rank, use_amp):
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse import models

    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(256, 3, 32, 32, generator=g), torch.randint(0, 10, (256,), generator=g)
    torch.manual_seed(0)
    model = DDP(models.SmallCNN(width=8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(10):
        idx = slice((step % 8) * 32 + rank * 16, (step % 8) * 32 + rank * 16 + 16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_amp):
            out = model(X[idx])
            loss = F.cross_entropy(out.float(), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"out_dtype": str(out.dtype), "grad_dtype": str(next(model.parameters()).grad.dtype),
            "first": losses[0], "last": losses[-1]}


runs = launch.spawn(amp_run, 2, backend="gloo", timeout=timeout)[0]
fp32, bf16 = runs[False], runs[True]
claim("under bf16 autocast the forward's output is bfloat16", bf16["out_dtype"] == "torch.bfloat16")
claim("the gradients DDP all-reduces are float32 (they belong to float32 parameters)",
      bf16["grad_dtype"] == "torch.float32")
claim("after 10 steps the bf16 loss is within 0.05 of the fp32 loss",
      abs(bf16["last"] - fp32["last"]) < 0.05, bf16=bf16["last"], fp32=fp32["last"])

# %% [markdown]
# ## 6. SyncBatchNorm, and when it matters
#
# BatchNorm normalises with the statistics of *the batch it sees* — under DDP, the per-rank
# batch. So DDP with BatchNorm is **not** one process on the global batch; SyncBatchNorm
# combines the statistics of all ranks so it is. What it sends, per BatchNorm layer with C
# channels, in training mode (read `torch/nn/modules/_functions.py`):
#
# - **forward:** each rank computes its per-channel mean and inverse standard deviation and its
#   sample count, and an **all_gather** gives every rank everyone's `[mean, invstd, count]`
#   (2C + 1 numbers per rank). All-gather rather than all-reduce, because the per-rank counts
#   may differ; each rank then combines them, weighting by the counts.
# - **backward:** each rank sums `dy` and `dy·(x − mean)` per channel, and one **all_reduce**
#   adds them up (2C numbers); every rank then finishes the gradient with the global sums.
#
# In `eval()` mode it uses the running statistics and sends nothing. `nn.SyncBatchNorm` runs on
# GPUs only:

# %%
try:
    torch.nn.SyncBatchNorm(4)(torch.randn(2, 4, 3, 3))
except ValueError as e:
    print("nn.SyncBatchNorm on CPU:", e)

# %% [markdown]
# so on CPU we use `dp.CPUSyncBatchNorm` (the same maths with one differentiable all_reduce of
# per-channel sums of x and x² and the count in the forward, whose backward is an all_reduce too;
# `dp.convert_sync_batchnorm` picks the real one on CUDA). Compare each against one process on
# the global batch, for a small and a large per-rank batch:


# %%
def bn_gap(rank, world_size, cases):
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse import ddp_practice as dp

    gaps = {}
    for per_rank_batch, sync in cases:
        g = torch.Generator().manual_seed(0)
        n = per_rank_batch * world_size
        X, y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        torch.manual_seed(0)
        single = dp.SmallBNNet(width=8)
        F.cross_entropy(single(X), y).backward()  # one process, the global batch
        torch.manual_seed(0)
        net = dp.SmallBNNet(width=8)
        model = DDP(dp.convert_sync_batchnorm(net, "cpu") if sync else net)
        mine = slice(rank * per_rank_batch, (rank + 1) * per_rank_batch)
        F.cross_entropy(model(X[mine]), y[mine]).backward()
        a = torch.cat([p.grad.flatten() for p in model.parameters()])
        b = torch.cat([q.grad.flatten() for q in single.parameters()])
        gaps[(per_rank_batch, sync)] = float((a - b).norm() / b.norm())
    return gaps


gaps = launch.spawn(bn_gap, 2, [(b, s) for b in (2, 8, 64) for s in (False, True)],
                    backend="gloo", timeout=timeout)[0]
for (b, s), gap in gaps.items():
    print(f"per-rank batch {b:2d}, {'SyncBatchNorm' if s else 'BatchNorm    '}: gradient error vs "
          f"one process on the global batch {'< 1e-5' if gap < 1e-5 else f'{gap:.0%}'}")
claim("with SyncBatchNorm the gradients equal one process on the global batch (to 1e-5)",
      all(gap < 1e-5 for (b, s), gap in gaps.items() if s), gaps=gaps)
claim("with plain BatchNorm the error shrinks as the per-rank batch grows, but never vanishes",
      gaps[(2, False)] > gaps[(8, False)] > gaps[(64, False)] > 1e-3, gaps=gaps)
fig = viz.new_figure(5.5, 3.2)
ax = fig.add_subplot(1, 1, 1)
batches = sorted({b for b, _ in gaps})
ax.plot(batches, [100 * gaps[(b, False)] for b in batches], "o-", label="BatchNorm under DDP")
ax.plot(batches, [max(100 * gaps[(b, True)], 1e-5) for b in batches], "s-",
        label="SyncBatchNorm under DDP")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("per-rank batch")
ax.set_ylabel("gradient error vs one process (%)")
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8)
fig.subplots_adjust(left=0.17, right=0.97, bottom=0.16, top=0.95)
viz.show(fig, "plain BatchNorm's gradient error falls as the per-rank batch grows; SyncBatchNorm's "
              "sits at rounding level at every size.")

# %% [markdown]
# SyncBatchNorm makes DDP exact. Without it the error is large when per-rank batches are tiny
# (detection, segmentation, big 3-D inputs: 1-4 images per GPU) and shrinks as they grow. It
# costs two extra collectives per BatchNorm layer per training step — an all_gather in the
# forward, an all_reduce in the backward, each blocking in the middle of the computation — so use
# it when per-rank batches are small.
#
# ## 7. Debugging: mismatches, hangs, timeouts
#
# A collective that ranks call with different shapes is a bug that can hang, crash, or silently
# compute garbage. With `TORCH_DISTRIBUTED_DEBUG=DETAIL` each collective is first checked across
# ranks, and the mismatch becomes a clear error. (The variable is read when torch.distributed is
# imported, so in a worker that is already running we call `dist.set_debug_level` — in a script,
# export the variable before launching.) For NCCL, `NCCL_DEBUG=INFO` prints its set-up and
# errors.


# %%
def mismatched(rank, world_size, detail, seconds):
    import datetime

    import torch
    import torch.distributed as dist

    if detail:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
    t = torch.ones(3 if rank == 0 else 4)  # the bug: shapes differ between ranks
    dist.all_reduce(t)
    return t.tolist()


try:
    launch.spawn(mismatched, 2, True, 30, timeout=timeout, show_output=False)
except launch.RankFailedError as e:
    detail_error = e.summary
# (which rank reports it first varies from run to run, so we print the stable parts)
print(detail_error.split(". Rank")[0] + ".")
claim("DETAIL mode reports a mismatch between collectives",
      "Detected mismatch between collectives" in detail_error)
claim("and names the difference: the tensor shapes", "Tensor shapes" in detail_error)

# %% [markdown]
# Without DETAIL the same bug here makes rank 1 wait for data that never comes. The process
# group's `timeout` (default 30 min for gloo, 10 min for NCCL) is what ends it; we set 2 s.

# %%
try:
    launch.spawn(mismatched, 2, False, 2, timeout=timeout, show_output=False)
except launch.RankFailedError as e:
    plain_error = e
print(f"rank {plain_error.rank} failed:", plain_error.summary.split("] ")[-1])
claim("without DETAIL, the process group's timeout ends the hang", "Timed out" in plain_error.summary)

# %% [markdown]
# **What `find_unused_parameters` is really for.** DDP waits for a gradient of *every*
# parameter before it all-reduces the last bucket. If some parameters take no part in a forward
# (a branch not taken), their gradients never come, and DDP raises at the next iteration.
# `find_unused_parameters=True` makes DDP walk the graph after each forward to mark them ready.
# It fixes exactly this, costs a graph traversal every step, and is not a cure for other errors.


# %%
def unused_branch(rank, world_size):
    return {flag: _unused_branch(flag) for flag in (False, True)}


def _unused_branch(find_unused):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head_a, self.head_b = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.head_a(self.body(x))  # head_b is never used

    model = DDP(TwoHeads(), find_unused_parameters=find_unused)
    try:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        return "ok"
    except RuntimeError as e:
        return str(e).split(".")[0]


unused = launch.spawn(unused_branch, 2, backend="gloo", timeout=timeout)[0]
print("default:                    ", unused[False])
print("find_unused_parameters=True:", unused[True])
claim("by default, an unused branch makes the next iteration fail",
      "Expected to have finished reduction" in unused[False])
claim("with find_unused_parameters=True it runs", unused[True] == "ok")

# %% [markdown]
# ## 8. More myths, tested
#
# **"Call `dist.barrier()` after every step to keep ranks in sync"** and **"seed every rank the
# same or the models diverge."** Neither: DDP broadcasts rank 0's weights when it wraps the
# model, and every step's all_reduce already waits for all ranks. Below each rank starts from a
# *different* seed, trains 5 steps with no barrier, and the weights are identical bit for bit.
#
# **"`gradient_as_bucket_view=True` compresses the gradients."** It only makes each `.grad` a
# view into DDP's communication buckets instead of a separate copy: it saves one copy of the
# gradients' memory, and the bytes all-reduced are the same.


# %%
def no_barrier(rank, world_size):
    return {view: _no_barrier(rank, view) for view in (False, True)}


def _no_barrier(rank, bucket_view):
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse import ddp_practice as dp
    from dpcourse import models

    torch.manual_seed(100 + rank)  # a different seed on every rank
    model = DDP(models.SmallCNN(width=8), gradient_as_bucket_view=bucket_view)
    counter = dp.CommCounter()
    model.register_comm_hook(counter, dp.counting_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):  # each rank its own random data; no barrier anywhere
        loss = F.cross_entropy(model(torch.randn(8, 3, 32, 32)), torch.randint(0, 10, (8,)))
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
    grad_storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    return {"checksum": dp.state_checksum(model.module),
            "grad_storages": len(grad_storages), "bytes": counter.bytes}


ranks = launch.spawn(no_barrier, 2, backend="gloo", timeout=timeout)
plain_view = [r[False] for r in ranks]
bucket_view = [r[True] for r in ranks]
print("separate gradient tensors:", plain_view[0]["grad_storages"],
      "| with gradient_as_bucket_view:", bucket_view[0]["grad_storages"], "(views into the buckets)")
claim("different seeds, no barrier: the weights are identical on both ranks",
      plain_view[0]["checksum"] == plain_view[1]["checksum"]
      and bucket_view[0]["checksum"] == bucket_view[1]["checksum"])
claim("gradient_as_bucket_view leaves fewer separate gradient tensors",
      bucket_view[0]["grad_storages"] < plain_view[0]["grad_storages"])
claim("and all-reduces the same number of bytes in 5 steps",
      plain_view[0]["bytes"] == bucket_view[0]["bytes"])

# %% [markdown]
# **"`resnet50(pretrained=True)`"** and **"`nn.ResNet50`"**, from many DDP tutorials:
# `pretrained=` is deprecated since torchvision 0.13 in favour of `weights=` (an enum that also
# carries the matching preprocessing), and torch.nn has no ResNet at all — the models live in
# `torchvision.models`. (We pass `weights=None`: nothing is downloaded.)

# %%
import torchvision

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torchvision.models.resnet18(pretrained=False)
print("the weights= way:", torchvision.models.ResNet50_Weights.DEFAULT)
claim("pretrained= warns that it is deprecated",
      any("'pretrained' is deprecated" in str(w.message) for w in caught))
claim("torch.nn has no ResNet50", not hasattr(torch.nn, "ResNet50"))
claim("torchvision.models.resnet50 is where it lives", callable(torchvision.models.resnet50))

# %% [markdown]
# ## Summary
#
# * A torchrun script reads `RANK`, `LOCAL_RANK`, `WORLD_SIZE`; the same command runs on one
#   machine or many (c10d rendezvous; bound `join_timeout`).
# * Rank 0 saves, atomically; every rank loads with `map_location` and `weights_only=True`;
#   with `--max-restarts` a killed run resumes and ends with **the same weights**.
# * `no_sync` accumulation equals the big batch and all-reduces `accum` times less.
# * AMP leaves DDP's gradients in float32; SyncBatchNorm makes BatchNorm exact under DDP and
#   matters when per-rank batches are small.
# * `TORCH_DISTRIBUTED_DEBUG=DETAIL` turns a mismatched collective into a clear error; a
#   process-group timeout ends a hang; `find_unused_parameters` is for unused parameters only.

# %%
import shutil

shutil.rmtree(work, ignore_errors=True)

# %% [markdown]
# ## Lab 04: your own torchrun script
#
# Open [lab04_ddp_in_practice](../labs/lab04_ddp_in_practice.ipynb): you turn a single-device
# training script into a torchrun DDP script; the check runs it under torchrun and compares the
# final weights with the reference.
#
# ## Check yourself

# %%
viz.quiz([
    {"q": "torchrun restarts your job after rank 1 dies at step 11; the last checkpoint is from "
          "step 8. What must the restarted ranks do to end with the uninterrupted run's weights?",
     "options": ["Continue from step 11 with fresh weights",
                 "Load the step-8 checkpoint (model, optimizer, step) and redo steps 9-11",
                 "Only rank 1 reloads; rank 0 keeps its weights in memory"],
     "answer": 1,
     "why": ["Fresh weights throw away all the training so far.",
             "Right: with the optimizer state and the data order restored, steps 9-11 are "
             "recomputed exactly.",
             "torchrun restarts ALL ranks: every rank's memory is gone."]},
    {"q": "Why does rank 0 alone save the checkpoint, to a temporary file and then os.replace?",
     "options": ["Other ranks hold different weights",
                 "All ranks hold the same weights; one writer avoids a race, and the rename means "
                 "a reader never sees half a file",
                 "torch.save only works on rank 0"],
     "answer": 1,
     "why": ["Under DDP every rank holds the same weights.",
             "Right: this lesson showed a plain save being read half-written.",
             "torch.save works anywhere; the problem is several writers and partial files."]},
    {"q": "With per_rank_batch 32, 4 ranks and accum 2, how many samples does one optimizer step "
          "see?",
     "options": ["32", "128", "256"],
     "answer": 2,
     "why": ["That is one rank's micro-batch.",
             "That is one micro-batch over all ranks; accumulation doubles it.",
             "Right: 32 × 4 × 2."]},
    {"q": "What does SyncBatchNorm send per BatchNorm layer in a training step?",
     "options": ["Nothing: it only changes the maths",
                 "An all_gather of each rank's mean, invstd and count in the forward, and an "
                 "all_reduce of two per-channel sums in the backward",
                 "The whole activation tensor to rank 0"],
     "answer": 1,
     "why": ["It must combine statistics across ranks, so it communicates.",
             "Right: 2C + 1 numbers per rank gathered forward, 2C summed backward.",
             "Only per-channel statistics travel, never activations."]},
])
