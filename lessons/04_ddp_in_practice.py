# %% [markdown]
# # 04 — DDP in practice
#
# **Prerequisites:** lesson 03 (ranks, collectives, DDP == one process on the global batch).
#
# **You will be able to:**
# - read every line that turns a single-device script into a torchrun DDP script, and say why it
#   is there (the whole diff is below);
# - run it on one or two "nodes", save checkpoints that survive a crash, and resume a killed run
#   to the very same weights;
# - evaluate and log under DDP so the numbers equal one process's (the three usual ways it goes
#   wrong, measured), and keep ranks with uneven inputs from hanging (`Join`);
# - set the learning rate for N ranks, and say what changes if gradients are summed;
# - accumulate gradients with `no_sync`, use AMP and SyncBatchNorm under DDP correctly;
# - recognise the first failures a GPU user meets by their messages, and turn a hang into a clear
#   error.
#
# **Time:** about 90 minutes to read and run (the lab aside).
#
# **Lab:** [lab04_ddp_in_practice](../labs/lab04_ddp_in_practice.ipynb) — inside a torchrun DDP
# script, evaluate a metric that is not a mean (macro-F1) so that it equals one process.
#
# Lesson 03 proved that DDP computes what one process computes on the global batch. This lesson
# is about the script you would really run: the **whole torchrun script**, **two nodes** joined by
# a rendezvous, **checkpoints** that survive a crash, **restarts** after a fault, **evaluation**
# and **uneven inputs**, the **learning rate** against the world size, **gradient accumulation**
# with `no_sync`, **mixed precision**, **SyncBatchNorm**, **debugging** — and the myths that the
# usual tutorials repeat, each tested by a cell.
#
# Every claim below is printed with ✔ by a check that ran, unless marked *not run here* (or
# *not replayed here*). The scripts live in `lib/dpcourse/scripts/`; the helpers in
# `dpcourse.ddp_practice`.

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

from IPython.display import Code, display

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
# LOGLEVEL=INFO: torchrun's agent logs each rendezvous's result, which §3 draws.
script_env = {"CUDA_VISIBLE_DEVICES": "", "LOGLEVEL": "INFO"}
print("ranks:", world_size, "| backend:", profile.backend)

# %% [markdown]
# ## 1. The whole script: `train_single.py` → `train_ddp.py`
#
# `torchrun --nproc-per-node=N script.py` starts N copies of the script on this machine. Its
# **agent** (the torchrun process itself, one per machine) starts those workers, watches them,
# and, with `--max-restarts`, kills and restarts all of them when one dies. It is **elastic**:
# the set of machines may change between restarts (`--nnodes=MIN:MAX`), so the agents agree on
# who takes part at each start — the **rendezvous** — and only then give each worker its
# identity, in environment variables: `RANK` (0..WORLD_SIZE-1 over all machines), `LOCAL_RANK`
# (0..N-1 on this machine: it picks the GPU), `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, and
# `MASTER_ADDR`/`MASTER_PORT`, where a **c10d store** listens: a small key-value server
# (torch.distributed's `TCPStore`) in which the ranks publish their addresses to find each other
# (section 3 shows it in the agents' logs).
# (The deprecated old launcher, `python -m torch.distributed.launch`, passed `--local-rank` as
# an argument.)
#
# Below is the diff of the course's single-device script and its DDP script (`-` lines only in
# `train_single.py`, `+` only in `train_ddp.py`), whole but for `evaluate`, which stands as one
# comment line: it is close to lab 04's question, so its diff is folded after the lab pointer at
# the end (the claims below check the whole diff). The lines that resume from and save the
# checkpoint, the same in both scripts, stand as comment lines too, for lab 04's stretch.
# Every changed line is one data parallelism or its restarts need, except a test hook:
# `--fail-at-step`, `--fail-rank` and the `os.kill(..., SIGKILL)` that uses them play a crash
# for section 3 and have no place in a real script (the cell after the diff counts them):
#
# - **the identity and the group:** `RANK`, `LOCAL_RANK`, `WORLD_SIZE` from torchrun; `is_main`
#   (rank 0, which prints and writes files); `dist.init_process_group` with the ranks
#   from the environment;
# - **one GPU per rank:** `torch.cuda.set_device(local_rank)` *before* anything touches CUDA, or
#   every process's `.cuda()` lands on GPU 0, and so do NCCL's collectives on those tensors (a
#   tensorless `barrier()`: section 10); `DDP(..., device_ids=[local_rank])`;
# - **the restart store:** a `PrefixStore` (the same store, every key prefixed) per attempt
#   (`store_for_this_attempt`), for the restarts of section 3, which says why;
# - **the data:** `DistributedSampler` gives each rank its shard, `set_epoch` reshuffles it each
#   epoch the same way on every rank; the evaluation takes each test image exactly once;
# - **the model:** `DDP(...)`, and `raw_model = model.module`, the plain model, which is what we
#   save, load and evaluate (after a broadcast of rank 0's buffers, tensors such as BatchNorm's
#   running statistics that no all-reduce keeps equal: section 4); `no_sync`, a context whose
#   forwards make the next backward skip the all-reduce, for accumulation (section 7);
# - **the numbers we print:** the logged training loss goes through `dist.all_reduce`, so it
#   is the whole job's, not rank 0's; so is the test accuracy (section 4 says what that takes);
# - **the end:** rank 0 saves; a barrier; `destroy_process_group`; and, once `main` has
#   returned, `os._exit`, which skips the interpreter's shutdown (the script's comment says
#   why).
#
# **How to read the diff now:** read the lines of the first, second, fourth, fifth and sixth
# bullets — they are DDP itself. Skim the rest: the restart store (`store_for_this_attempt`,
# `PrefixStore`, `TORCHELASTIC_USE_AGENT_STORE`) makes sense only after section 3's restarts,
# the crash hook only serves section 3, and the exit code after `main` is shutdown plumbing.

# %%
viz.show_code(dp.without_function, dp.without_resume_and_save,
              folded="▶ How the diff is cut (its anchors name lab 04's stretch) — open after "
                     "your lab passes")
single_shown, single_cut = dp.without_resume_and_save(dp.without_function(train_single, "evaluate"))
ddp_shown, ddp_cut = dp.without_resume_and_save(dp.without_function(train_ddp, "evaluate"))
shown = list(difflib.unified_diff(single_shown, ddp_shown,
                                  "train_single.py", "train_ddp.py", lineterm="", n=1))
display(Code("\n".join(shown), language="diff"))  # highlighted: + lines added for DDP
diff = list(difflib.unified_diff(train_single.read_text().splitlines(),   # the whole diff,
                                 train_ddp.read_text().splitlines(),      # for the claims
                                 "train_single.py", "train_ddp.py", lineterm="", n=1))

# %%
claim(f"the {len(ddp_cut)} resume and save lines cut from the diff above are the same in both "
      "scripts: no changed line is hidden", single_cut == ddp_cut)
removed = [line for line in diff[2:] if line.startswith("-")]
added = [line for line in diff[2:] if line.startswith("+")]
n_lines = len(train_ddp.read_text().splitlines())
print(f"{len(removed)} lines only in train_single.py, {len(added)} only in train_ddp.py "
      f"({n_lines} lines)")
pieces = ["dist.init_process_group(", "torch.cuda.set_device(", "device_ids=[local_rank]",
          "dist.PrefixStore(", "TORCHELASTIC_RESTART_COUNT", "DistributedSampler(",
          "sampler.set_epoch(epoch)", "DDP(model", "model.no_sync()", "dist.all_reduce(sums)",
          "dist.broadcast(buffer, src=0)",
          "dist.destroy_process_group()"]
claim("the diff holds every piece listed above, each on a '+' line",
      all(any(p in line for line in added) for p in pieces),
      missing=[p for p in pieces if not any(p in line for line in added)])
hook = [line for line in added
        if any(k in line for k in ("fail-at-step", "fail_at_step", "fail-rank", "fail_rank",
                                   "os.kill", "simulated fault", "import signal"))]
claim(f"{len(hook)} of the {len(added)} '+' lines are section 3's crash hook (--fail-at-step, "
      f"--fail-rank, the SIGKILL), not data parallelism", 0 < len(hook) < len(added),
      hook=hook)

# %% [markdown]
# Does the script keep its promise? Train the same small CNN with `train_single.py` (one
# process, batch 64) and with `train_ddp.py` on 2 ranks × 32, same seed and learning rate, and
# compare the weights they end with. Why are the batches the same? `train_single.py`'s
# `RandomSampler` and `train_ddp.py`'s `DistributedSampler` both draw `torch.randperm` from a
# generator seeded with `seed + epoch`, so they shuffle the images the same way; rank r takes
# positions r, r + 2, r + 4, ... of that order, so at step k the two ranks' batches of 32 are,
# together, exactly the 64 images of the single process's batch k, and DDP's average of the two
# ranks' mean gradients is the gradient of the mean over those 64. The model is `small_cnn`,
# which has no BatchNorm: BatchNorm normalises each rank's 32 images with their own statistics,
# which breaks this equality (section 9). Each script ends by printing `final weights
# <fingerprint>` (`dp.state_checksum`, folded below: 16 hex digits of a SHA-256 of every
# state_dict tensor's name, dtype and bytes). The two fingerprints below differ, because the two runs add the same numbers
# in another order; the cell after prints the largest weight difference. Here both scripts'
# `main` runs in ranks started by `launch.spawn` (faster: no agent), which sets only the
# variables the script needs (folded below); sections 2 and 3 use torchrun.


# %%
# NBVAL_IGNORE_OUTPUT
# (the losses and weight checksums depend on this CPU's float kernels; the ✔ lines below don't)
def run_main(rank, world_size, script, argv):
    """Run a course script's main(argv) in this rank, on the CPU (as on every machine)."""
    import os
    import runpy

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything touches CUDA
    seen = sorted(k for k in os.environ  # what launch.spawn set, before the script reads it
                  if k in SPAWN_SETS or k.startswith("TORCHELASTIC_") or k == "GROUP_RANK")
    runpy.run_path(script)["main"](argv)
    return seen


SPAWN_SETS = ["LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK",
              "WORLD_SIZE"]


small = ["--model", "small_cnn", "--n-train", "256", "--epochs", "2", "--lr", "0.05"]
print("train_single.py, 1 process:")
_ = launch.spawn(run_main, 1, str(train_single), small + [
    "--batch", str(per_rank_batch * world_size), "--out", str(work / "single.pt")], timeout=timeout)
print(f"train_ddp.py, {world_size} ranks:")
env_seen = launch.spawn(run_main, world_size, str(train_ddp), small + [
    "--per-rank-batch", str(per_rank_batch), "--out", str(work / "ddp.pt")], timeout=timeout)

# %% [markdown]
# <details><summary>▶ What launch.spawn sets in each rank's environment</summary>
#
# Six variables — `RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
# `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` — and not the others torchrun's agent sets
# (`TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_USE_AGENT_STORE`, `GROUP_RANK`, ...; torchrun
# also sets `OMP_NUM_THREADS=1` if unset and `--nproc-per-node` > 1). The script reads those
# two `TORCHELASTIC_` variables with a fallback (attempt 0, `init_process_group`'s own
# store): the path taken here, claimed below.
#
# </details>

# %%
claim("launch.spawn gave every rank exactly the six variables RANK, LOCAL_RANK, WORLD_SIZE, "
      "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and no TORCHELASTIC_* or GROUP_RANK: "
      "train_ddp.py ran on its fallbacks", all(seen == SPAWN_SETS for seen in env_seen),
      seen=env_seen[0])
one, many = dp.load_checkpoint(work / "single.pt"), dp.load_checkpoint(work / "ddp.pt")
gap = max(float((one["model"][k] - many["model"][k]).abs().max()) for k in one["model"])
claim(f"{world_size} DDP ranks end with the weights of one process on the global batch "
      f"(to 1e-5)", gap < 1e-5, gap=gap)
claim("and count the same test images right (the same integer)",
      one["test"][1:] == many["test"][1:], single=one["test"], ddp=many["test"])
claim("with the same test loss (to 1e-4 relative)",
      abs(one["test"][0] - many["test"][0]) <= 1e-4 * abs(one["test"][0]),
      single=one["test"][0], ddp=many["test"][0])
viz.show_code(dp.state_checksum, folded="▶ code: dp.state_checksum, the scripts' fingerprint")

# %%
# NBVAL_IGNORE_OUTPUT
# (the exact gap depends on the order of float additions on this CPU; the claim above bounds it)
print(f"largest difference between the two runs' weights: {gap:.1e}")

# %% [markdown]
# ## 2. Two nodes, for real
#
# On a cluster you run the same torchrun command on every machine, with the address of one of
# them as the **rendezvous endpoint**: the agent on that machine hosts the c10d store there, the
# others connect to it, and together they number the nodes and the workers. Here two torchrun
# agents on this machine play two nodes of one process each (`--nnodes=2 --nproc-per-node=1
# --rdzv-backend=c10d`). Two things the docs
# don't stress: with c10d, `--node_rank` is ignored and the nodes are numbered by *sorting* the
# participants — each described by (address, process id, a counter), in `_NodeDesc` order — so
# not in the order they arrive, and not in an order you choose (rank 0, whose node hosts the
# workers' store, is the smallest description); and a node whose partner never comes waits
# `join_timeout` (600 s by default) — so `dp.run_nodes` passes `--rdzv-conf=join_timeout=60`
# to each agent and kills both, with their workers, past `timeout`: the end of `run_nodes` and
# the `launch.kill_tree` it calls, below. The cell after prints the two command lines (folders
# cut), then rank 0's output.
#
# From here on the scripts train `small_bn`, the small CNN with BatchNorm (`--model small_bn`
# in the setup's `common` arguments): with SGD at lr 0.1 it learns within these few epochs,
# which the plain one does not; no run from here on is compared with one process, so
# BatchNorm's per-rank statistics (section 1) do no harm; and its running statistics are the
# buffers whose evaluation section 4 follows.

# %%
import inspect

src = inspect.getsource(dp.run_nodes).splitlines()
at = [next(i for i, line in enumerate(src) if key in line)
      for key in ("deadline = t0", "from None", "finally:", "kill_tree(p.pid)")]
kill = inspect.getsource(launch.kill_tree).splitlines()
viz.show_code("\n".join(["try:", "    ...  # the agents start, each in a session of its own"]
                        + [line[4:] for line in src[at[0]:at[1] + 1]]
                        + ["    ...  # read the logs, return the exit codes and outputs"]
                        + [line[4:] for line in src[at[2]:at[3] + 5]]),
              "\n".join(kill[:1] + kill[kill.index("    import psutil"):]),
              title="dp.run_nodes, from its deadline on, and launch.kill_tree (docstring cut)")

# %%
# NBVAL_IGNORE_OUTPUT
# (the loss values depend on this CPU's float kernels; the port is a free one picked per run)
nodes = dp.run_nodes(train_ddp, *common, "--out", str(work / "two_nodes.pt"), nnodes=2,
                     nproc_per_node=1, timeout=timeout, join_timeout=60, env=script_env)
for k, cmd in enumerate(nodes.commands):  # cmd[:3] is this Python's `-m torch.distributed.run`
    print(f"node {k}: torchrun", " ".join(Path(w).name if os.sep in w else w for w in cmd[3:]))
print("\n".join(line for line in nodes.text().splitlines() if "[rank" in line))

# %%
import math
import re


def epoch_losses(text):
    """The 'epoch k: mean loss x' lines that rank 0 of the script prints, as floats."""
    return [float(v) for v in re.findall(r"epoch \d+: mean loss ([0-9.]+)", text)]


claim("both nodes exited 0", nodes.ok, output=nodes.text()[-2000:])
first = nodes.commands[0]
claim("the 2 agents ran one command line (--nnodes=2 --nproc-per-node=1, one rendezvous "
      "endpoint, join_timeout 60 s) and formed one job of 2 ranks", nodes.commands == [first] * 2
      and {"--nnodes=2", "--nproc-per-node=1", "--rdzv-conf=join_timeout=60"} <= set(first)
      and "2 ranks over" in nodes.text(), commands=nodes.commands, output=nodes.text()[-2000:])
node_losses = epoch_losses(nodes.text())
claim(f"the model learns: the last epoch's mean loss is under 60% of ln 10 = {math.log(10):.2f}",
      bool(node_losses) and node_losses[-1] < 0.6 * math.log(10), losses=node_losses)

# %% [markdown]
# ### The SLURM recipe (not run here)
#
# ```bash
# ##!/bin/bash
# #SBATCH --job-name=ddp --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 --cpus-per-task=16
# #SBATCH --time=01:00:00
# head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # a fresh store per restart: nodes count restarts apart
# srun torchrun --nnodes="$SLURM_NNODES" --nproc-per-node=4 \
#     --rdzv-backend=c10d --rdzv-endpoint="$head:29500" --rdzv-id="$SLURM_JOB_ID" \
#     --max-restarts=3 lib/dpcourse/scripts/train_ddp.py --ckpt "$SCRATCH/ckpt.pt" --out final.pt
# ```
#
# One `srun` task per node runs one torchrun agent, which starts one process per GPU. Put
# checkpoints on a file system every node sees. **Keep the `export` line whenever you keep
# `--max-restarts`:** it gives every restart a fresh store, without which nodes that count
# their restarts apart look for each other under different attempt numbers and hang (the
# keys: section 3, "Where the restarted ranks meet"; read from torch's source, not run
# here). Without `--max-restarts`, a crash ends the job, and a
# resubmitted job resumes from the checkpoint.

# %% [markdown]
# ## 3. Checkpoints and fault tolerance
#
# The script saves a checkpoint every few steps — **on rank 0 only** (every rank holds the
# same weights), **atomically** (`dp.save_checkpoint`, below), and loads with `map_location` and `weights_only=True`. With
# `--max-restarts`, torchrun restarts *all* ranks when one dies; each finds the checkpoint and
# resumes. Here rank 1 kills itself (SIGKILL) after step 11; the last checkpoint is step 8. The
# run has the same arguments as the two-node run of section 2 (2 ranks, same seed), with the
# checkpoint and the fault added, so that uninterrupted run is what it must end equal to. It
# can only if the checkpoint leaves out nothing the rest of the run depends on; what that takes
# is lab 04's stretch question. The cell
# prints the torchrun command it ran (folders cut) and the variables the launcher sets
# (`launch.torchrun_env`: unbuffered output, a `[rank k]` prefix, one thread per worker).

# %%
# NBVAL_IGNORE_OUTPUT
# (torchrun's own log lines carry times, pids and ports)
fault = launch.torchrun(train_ddp, *common, "--ckpt", str(work / "ckpt.pt"), "--ckpt-every", "4",
                        "--fail-at-step", "11", "--out", str(work / "restarted.pt"),
                        nproc_per_node=2, max_restarts=1, timeout=timeout, echo=False,
                        env=script_env)
print("torchrun", " ".join(Path(w).name if os.sep in w else w for w in fault.command[3:]))
run_env = launch.torchrun_env(script_env)  # this process's environment, then these on top
print(" ".join(f"{k}={run_env[k]!r}" for k in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED",
                                                "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
                                                *script_env)))
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
viz.show(viz.restart_timeline_figure(total_steps=total_steps, ckpt_every=4, fail_at=11, resumed=8),
         "attempt 0 saves at steps 4 and 8 and dies after step 11; attempt 1 reloads step 8, "
         "redoes steps 9-11 (shaded; the axis stops 5 steps after the kill) and ends with the same weights as the uninterrupted two-node run of "
         "section 2.")

# %% [markdown]
# What torchrun did in both runs, read from its agents' own log (`LOGLEVEL=INFO`: each
# rendezvous logs what it gave the workers, `viz.torchrun_log` parses it):

# %%
agents = [viz.torchrun_log(out) for out in nodes.outputs]          # §2: one log per node
restart_log = viz.torchrun_log(fault.output)                        # §3: one node
rounds = [e for e in restart_log if e["event"] == "rendezvous"]
met = [next(e for e in log if e["event"] == "rendezvous") for log in agents]
claim("§2: each agent gave its one worker LOCAL_RANK 0, a RANK of its own and WORLD_SIZE 2, "
      "and both workers the same store (MASTER_ADDR:MASTER_PORT)",
      sorted(r for e in met for r in e["global_ranks"]) == [0, 1]
      and all(e["local_ranks"] == [0] and e["global_world_sizes"] == [2] for e in met)
      and len({(e["master_addr"], e["master_port"]) for e in met}) == 1, met=met)
claim("§3: the agent met the rendezvous twice; attempt 1 (restart_count 1) gave both workers "
      "the RANK and LOCAL_RANK of attempt 0, and the same store port",
      [e["restart_count"] for e in rounds] == [0, 1]
      and rounds[0]["global_ranks"] == rounds[1]["global_ranks"]
      and rounds[0]["local_ranks"] == rounds[1]["local_ranks"]
      and rounds[0]["master_port"] == rounds[1]["master_port"], rounds=rounds)
# Which worker died is read from the workers' own output: the agent logs one failure per
# attempt, the earliest by a clock in whole seconds (Sources), so the one it names is arbitrary.
killed = {int(r): int(step) for r, step in
          re.findall(r"^\[rank (\d+)\] rank \d+: simulated fault at step (\d+)",
                     fault.output, re.M)}
claim("the workers' own output names one worker that killed itself", len(killed) == 1,
      killed=killed)
(dead, dead_step), = killed.items()
viz.show(viz.torchrun_figure(agents, restart_log, killed=killed),
         "left, section 2: one torchrun agent per node; the agents meet at the rendezvous "
         "endpoint, number the nodes, and give each worker its RANK (in the job), LOCAL_RANK (on "
         "its node) and WORLD_SIZE; node 0's agent hosts the store the workers meet in. Right, "
         f"section 3: rank {dead} killed itself (SIGKILL) after step {dead_step}, by its own "
         "output; the agent ended the whole group and started both workers again with the same "
         "ranks, a restart count of 1 and the same store; the checkpoint does the rest.")

# %% [markdown]
# **▶ How the agents' log is read** (click the folded cell below): `viz.torchrun_log`.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(viz.torchrun_log, folded="▶ code: viz.torchrun_log")

# %% [markdown]
# What the checkpoint holds, and how each rank gets the rest back, is close to lab 04's
# stretch: those lines of `train_ddp.py` wait, folded, after the lab's pointer.
#
# **Where the restarted ranks meet.** The c10d rendezvous keeps one store for every round, and
# the restarted workers join it again, so, by torch's source (Sources; not replayed here), the
# dead attempt's keys, such as the peers' addresses, are still there. The script's
# `PrefixStore` named after `TORCHELASTIC_RESTART_COUNT` keeps the attempts apart **on one
# node**: the count is **per agent**, and a node restarted because another node is waiting
# does not count it ("membership changes do not count as retries"), so on several nodes (the
# SLURM recipe) ranks can look for `attempt_1` and `attempt_0` keys and never meet. There,
# export `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` before torchrun: each attempt's rank 0 hosts a
# fresh store, and `store_for_this_attempt` returns `None`.

# %% [markdown]
# **Myth: "every rank can save, it's the same file."** It races: a `torch.save` to the final
# path first truncates the file, then writes for a while, so a second writer, a reader, or a
# restart after a crash can meet half a file. `dp.save_checkpoint` (below) writes a temporary
# file in the same folder, flushes it to disk, and `os.replace`s it over the checkpoint in one
# step. Below, rank 1 reads the file while rank 0 is halfway through writing it (barriers make
# that timing certain); the "atomic" branch follows `save_checkpoint`'s protocol by hand, to
# stop halfway through the write.

# %%
viz.show_code(dp.save_checkpoint, dp.load_checkpoint,
              folded="▶ dp.save_checkpoint, dp.load_checkpoint — open after your lab passes")


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
# ## 4. Evaluation and logging under DDP
#
# Each rank sees only its shard, so every number a rank computes alone is a number about its
# shard. Three mistakes are common, and each gives a plausible number:
#
# 1. **rank 0's number:** the script prints the loss or accuracy that rank 0 computed on its
#    shard — half the data here;
# 2. **a mean of means:** each rank computes its accuracy and the ranks average them; when the
#    shards differ in size, a short shard weighs as much as a long one;
# 3. **padded duplicates:** `DistributedSampler` (shuffle or not) makes every shard equally long
#    by appending the first images of its order to the end of the list (the whole list again,
#    as often as needed, when the padding is longer than it) before it deals the list
#    out (rank r takes positions r, r + N, ...): with 201 test images on 2 ranks the list is 202
#    long, and its first image goes to rank 0 at position 0 and again to rank 1 at position 201.
#    Each rank evaluates it once; the job evaluates it twice, 202 images for 201.
#
# `train_ddp.py`'s `evaluate` avoids all three: every image is evaluated exactly once, and what
# the ranks combine makes the job's accuracy and loss equal one process's *exactly*. How it does
# that is lab 04's question for a harder metric, so its code is folded after the lab pointer at
# the end. We evaluate the weights the two-node run saved in section 2 four ways (the three
# mistakes and the script's `evaluate`), and compare with one process evaluating the whole test
# set with `train_single.py`'s `evaluate`. The code is folded (it shows how the ranks' numbers
# are combined: open it after lab 04 passes); its table is printed below it.

# %%
# NBVAL_IGNORE_OUTPUT
# (the accuracies are those of weights trained in section 2, which depend on this CPU's kernels)
viz.show_code(dp.evaluate_four_ways, folded="▶ The code of the four ways — open after lab 04 "
                                            "passes")
n_test = 201
ev = launch.spawn(dp.evaluate_four_ways, world_size, str(work / "two_nodes.pt"), n_test,
                  {"single": str(train_single), "ddp": str(train_ddp)},
                  backend="gloo", timeout=timeout)[0]
one_acc = ev["one"][1] / ev["one"][2]
fixed_acc = ev["fixed"][1] / ev["fixed"][2]
rows = [("one process, whole test set", one_acc, int(ev["one"][2])),
        ("rank 0's own accuracy", ev["rank0"], None),
        ("DistributedSampler, mean of the ranks' accuracies", ev["padded_mean_of_means"],
         ev["padded_count"]),
        ("DistributedSampler, one accuracy over its images", ev["padded_sum"], ev["padded_count"]),
        ("each image once, mean of the ranks' accuracies", ev["shard_mean_of_means"], n_test),
        ("train_ddp.py's evaluate", fixed_acc, int(ev["fixed"][2]))]
for name, acc, count in rows:
    print(f"{name:52s} accuracy {acc:.4%}" + (f"  over {count} images" if count else ""))

# %%
from torch.utils.data import DistributedSampler

claim("the script's evaluation equals one process exactly: the same accuracy, to the last bit, "
      "over the same number of images", ev["fixed"][1:] == ev["one"][1:], ev=ev)
claim("and the same summed test loss (to 1e-6 relative)",
      abs(ev["fixed"][0] - ev["one"][0]) <= 1e-6 * ev["one"][0], ev=ev)
claim(f"DistributedSampler's padding makes the job evaluate {ev['padded_count']} images for "
      f"{n_test}", ev["padded_count"] == -(-n_test // world_size) * world_size > n_test)
shards = [list(DistributedSampler(range(n_test), num_replicas=world_size, rank=r, shuffle=False))
          for r in range(world_size)]
twice = sorted(i for i in range(n_test) if sum(s.count(i) for s in shards) > 1)
print(f"images DistributedSampler(shuffle=False) deals out twice: {twice}, to ranks "
      f"{[r for r in range(world_size) if twice and twice[0] in shards[r]]}")
claim("each padded image is evaluated once by each of two ranks, not twice by one",
      all(s.count(i) <= 1 for s in shards for i in twice) and len(twice) > 0, twice=twice)
claim("every wrong way gives another accuracy than one process",
      all(abs(acc - one_acc) > 1e-9 for _, acc, _ in rows[1:5]), rows=rows)
claim("the padding and the mean of means move it by less than one point: easy to miss",
      all(abs(acc - one_acc) < 0.01 for _, acc, _ in rows[2:5]), rows=rows)

# %% [markdown]
# Which rank gets which image, where the padding lands, and what `set_epoch` changes, drawn from
# the sampler itself on a case small enough to read: 10 images, 4 ranks, shuffled (seed 0),
# epochs 0 and 1.

# %%
n_small, ranks_small = 10, 4
dealt = {}
for epoch in (0, 1):
    samplers = [DistributedSampler(range(n_small), num_replicas=ranks_small, rank=r, seed=0)
                for r in range(ranks_small)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    dealt[epoch] = [list(sampler) for sampler in samplers]
total = len(dealt[0][0]) * ranks_small   # the padded list's length
orders = {e: [dealt[e][p % ranks_small][p // ranks_small] for p in range(total)] for e in dealt}
pads = {e: order[n_small:] for e, order in orders.items()}
n_pad = total - n_small
claim(f"in each epoch the {n_pad} padded slots repeat the first {n_pad} images of that epoch's "
      "order", all(pads[e] == orders[e][:n_pad] for e in dealt), orders=orders)
claim(f"set_epoch(1) deals another order, so other images are repeated: {pads[0]} in epoch 0, "
      f"{pads[1]} in epoch 1", dealt[0] != dealt[1] and pads[0] != pads[1], pads=pads)
viz.show(viz.sampler_index_map_figure(dealt, n_small),
         f"rank r reads slots r, r + {ranks_small}, ... of the epoch's shuffled list padded to "
         f"{total}: the red slots repeat its first images, which are evaluated twice, on two "
         f"ranks; set_epoch(1) reshuffles, and the images padded change ({pads[0]}, then "
         f"{pads[1]}).")

# %% [markdown]
# **▶ Which slots are red** (click the folded cell below): `viz.sampler_slots`, the rule the
# figure colours by.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(viz.sampler_slots, folded="▶ code: viz.sampler_slots")

# %% [markdown]
# Rank 0's own number is simply an estimate from a different part of the test set (see the
# table). The padding and the mean of
# means are off by less than a point, which is exactly why they survive: nobody notices that a
# reported accuracy is 0.2 points off, or that two runs on 2 and on 8 GPUs "disagree". With 8
# ranks and a 10 001-image test set, the padding repeats 7 images; with small validation sets
# and many ranks the gap grows. For the training loss, `ReduceOp.AVG` of the ranks' mean
# losses would give the global mean here (up to rounding; *not run here*: gloo sums, then
# divides by the group's size): it averages the ranks' values, the global mean when every
# rank's batch has the same size, as `DistributedSampler(drop_last=True)` and a
# `drop_last=True` loader give (section 1's diff); with unequal shards it is a mean of means.
#
# Why does `evaluate` get `raw_model` and not the DDP wrapper? A module's **buffers** are the
# tensors it keeps that are not parameters: they get no gradient, so no all-reduce keeps them
# equal across ranks. BatchNorm's running mean and variance are the usual ones (section 9
# follows them through training). The wrapper keeps them equal another way, by this rule
# (the one place the lesson states it): with `forward_sync_buffers=True` (the default) a forward
# first **broadcasts rank 0's buffers** to the other ranks when it is the first forward, or the
# forward before it ran with gradients enabled and outside `no_sync`. So in a
# training loop every forward broadcasts; the forward after a `no_sync` forward does not; the
# first `torch.no_grad()` forward after training does, and the ones after it do not; a forward
# in `eval()` mode with gradients enabled does. So, under `torch.no_grad()`, only the
# *first* evaluation forward broadcasts: shards of different lengths do not hang, but a rank
# with **no** batch never makes that broadcast, and the others wait for it.
#
# **▶ Inside DDP: where the rule lives** (click the folded cell below; the rest of the lesson
# does not need it).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# `_pre_forward` calls `_sync_buffers`, the broadcast, when the wrapper's flag
# `require_forward_param_sync` is on (and `forward_sync_buffers`, and the module has buffers).
# The flag starts on; each forward's `_post_forward` sets it for the *next* forward: on when
# this forward ran with gradients enabled and outside `no_sync`, off otherwise. The source rank
# is rank 0, except under `Join` (section 5), where `_find_common_rank` picks the highest rank
# still training.
#
# </details>

# %% [markdown]
# Measured on 2 ranks, after one training step, counting each rank's calls of the wrapper's
# buffer broadcast (`_sync_buffers`):


# %%
def evaluate_through(rank, world_size, batches, wrapped):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(8, 4, generator=g)).sum().backward()  # one training step's forward
    trained = model.module[1].running_mean.clone()
    broadcasts = []
    real_sync = model._sync_buffers  # DDP's buffer broadcast, counted on this rank
    model._sync_buffers = lambda: (broadcasts.append(1), real_sync())[1]
    evaluated = (model if wrapped else model.module).eval()
    with torch.no_grad():
        for _ in range(batches[rank]):
            evaluated(torch.randn(8, 4, generator=g))
    return {"broadcasts": len(broadcasts), "trained": trained, "now": model.module[1].running_mean}


def same_on_both(ranks, key):
    return torch.equal(ranks[0][key], ranks[1][key])


uneven = launch.spawn(evaluate_through, 2, [3, 4], True, backend="gloo", timeout=timeout)
raw_empty = launch.spawn(evaluate_through, 2, [0, 1], False, backend="gloo", timeout=timeout)
try:
    launch.spawn(evaluate_through, 2, [0, 1], True, backend="gloo", timeout=8, show_output=False)
    wrapped_empty = None
except launch.LaunchTimeoutError as e:
    wrapped_empty = e
claim("under no_grad, through the wrapper, only the first forward broadcasts: ranks with 3 and "
      "4 batches broadcast once each and finish", [r["broadcasts"] for r in uneven] == [1, 1],
      uneven=uneven)
claim("through the wrapper, a rank with no batch leaves the other waiting in that broadcast",
      isinstance(wrapped_empty, launch.LaunchTimeoutError) and wrapped_empty.pending == [1],
      error=wrapped_empty)
claim("the plain module never communicates: 0 and 1 batches finish, with no broadcast",
      [r["broadcasts"] for r in raw_empty] == [0, 0])
claim("after training each rank's running statistics are its own; the wrapper's first "
      "evaluation forward made them rank 0's, the plain module left them",
      not same_on_both(uneven, "trained") and same_on_both(uneven, "now")
      and not same_on_both(raw_empty, "now"))

# %% [markdown]
# The plain module never communicates, even on a rank with nothing to evaluate (a small test
# set on many ranks). But the last claim shows what the wrapper's broadcast did: each rank's
# last training forward had updated its own statistics. So `train_ddp.py` broadcasts rank 0's
# buffers itself before evaluating `raw_model`: every rank evaluates the model rank 0 saves.
#
# ## 5. Uneven inputs: one rank with fewer batches
#
# Every backward under DDP all-reduces the gradients, and an all-reduce waits for *every* rank.
# If rank 0 has 3 batches and rank 1 has 4, rank 0 leaves the loop after 3 steps while rank 1
# waits in its 4th all-reduce for a partner that never comes. While rank 0 lives on without
# calling a collective (saving, say), rank 1 hangs until the group's timeout (30 minutes with
# gloo, 10 with NCCL); if rank 0 exits, gloo fails at once ("Connection reset by peer", as in
# section 3). If rank 0 calls one (`train_ddp.py` all-reduces its loss sums after the loop, and
# its `evaluate` too), that call pairs with rank 1's pending all-reduce: different sizes hang
# or crash, equal sizes silently sum two unrelated tensors (section 10).
# `DistributedSampler` avoids this by padding (or dropping, `drop_last=True`); data you shard
# yourself (files per rank, filtered records, packed sequences) often does not. The two
# timeouts are torch's defaults, read here from the installed torch:

# %%
from datetime import timedelta

from torch.distributed import constants

nccl_timeout = constants.default_pg_nccl_timeout     # None in a torch built without NCCL
claim("a process group's default timeout: 30 minutes with gloo, " + ("10 with NCCL" if nccl_timeout
      else "and this torch has no NCCL"), constants.default_pg_timeout == timedelta(minutes=30)
      and nccl_timeout in (None, timedelta(minutes=10)), nccl=nccl_timeout)

# %% [markdown]
# torch's fix is the `Join` context manager (`torch.distributed.algorithms.join`), and DDP is
# *joinable*: inside `with Join([model]):`, a rank that has run out of batches does not leave;
# it keeps answering the others' all-reduces with zero gradients until every rank is done, and
# at the end it broadcasts the module's parameters — and its buffers, when
# `forward_sync_buffers` is on (the default) — from the highest rank among the last to finish,
# so all ranks hold the same model. The module only: the **optimizer state is not
# synchronised**. A rank that joined early skipped the last `opt.step()`s, so with momentum (or
# Adam) its buffers differ from the others', and a second epoch after a `Join` makes the weights
# drift apart again; checkpoint from the broadcasting rank, or re-broadcast the optimizer
# state. Once a rank has joined, the gradients are still divided by the *initial* world size
# (`divide_by_initial_world_size=True`, *not run here*): the joined rank counts as a zero
# gradient. What
# `Join` costs: in every iteration inside it, each rank still training runs extra all-reduces
# from Python beside DDP's own — one that tells the `Join` context who is still training and
# one that agrees whether this backward syncs gradients (counted below) and, for a module with
# buffers, one that picks the rank that broadcasts them (not run here: this model has none;
# the Sources name the functions).
#
# The count comes from `collectives.record_collectives()`, the course's one recorder of
# `torch.distributed` calls: inside its block, each collective function of `torch.distributed`
# is replaced by a wrapper that notes the call and its bytes, then calls the real one, and is
# put back afterwards. So it sees what Python code calls — `Join`'s all-reduces — and not DDP's
# gradient all-reduce, which DDP's reducer starts in C++.

# %% [markdown]
# **▶ How the all-reduces are counted** (click the folded cell below):
# `collectives.record_collectives`, the wrapper it puts in place of each function, what that
# wrapper runs (`Recorder.run`), the functions it replaces (`RECORDED`) and `CollectiveLog.of`.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
import inspect

from dpcourse import collectives

module_lines = inspect.getsource(collectives).splitlines()
first = module_lines.index("RECORDED = {")
viz.show_code(collectives.record_collectives, collectives.Recorder.wrap, collectives.Recorder.run,
              collectives.CollectiveLog.of,
              "\n".join(module_lines[first:module_lines.index("}", first) + 1]),
              folded=("▶ code: record_collectives, Recorder.wrap, Recorder.run, "
                      "CollectiveLog.of, RECORDED"))

# %% [markdown]
# First the hang: `launch.spawn` keeps a returned rank alive, sockets open, and its `timeout`
# kills every rank after 8 s. So the hang below is this harness's, like a rank 0 busy with
# work that calls no collective: a torchrun rank 0 would exit, and rank 1 fail at once.
#
# **▶ Where a returned rank waits** (click the folded cell below): the end of
# `launch.spawn`'s worker.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
worker_src = inspect.getsource(launch.worker_entry).splitlines()
stay = next(i for i, line in enumerate(worker_src) if "result_conn.send_bytes" in line) - 1
viz.show_code("# launch.spawn's worker, after the function returned (launch.worker_entry)\n"
              + "\n".join(line[4:] for line in worker_src[stay:]),
              folded="▶ Where a returned rank waits: the end of launch.worker_entry")


# %%
def uneven_steps(rank, world_size, use_join, folder):
    import os
    from contextlib import nullcontext

    import torch
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse import collectives

    with open(os.path.join(folder, f"uneven_pid_{use_join}_{rank}"), "w") as f:
        f.write(str(os.getpid()))  # so the notebook can check that nothing is left running
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 8, generator=g) for _ in range(3 + rank)]  # rank r: 3 + r batches
    extra = []  # per iteration, the all-reduces called from Python (DDP's own run in C++)
    with Join([model]) if use_join else nullcontext():
        for X in batches:
            with collectives.record_collectives() as calls:
                loss = model(X).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            extra.append(len(calls.of("all_reduce")))
    return {"steps": len(batches), "weights": [p.detach().clone() for p in model.parameters()],
            "momentum": [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()],
            "extra": extra}


try:
    launch.spawn(uneven_steps, world_size, False, str(work), backend="gloo", timeout=8,
                 show_output=False)
    hang = None
except launch.LaunchTimeoutError as e:
    hang = e
print("without Join:", hang)

# %%
import psutil


def running(pid):
    """Whether process ``pid`` still runs (a zombie waiting to be reaped does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


pids = [int((work / f"uneven_pid_False_{r}").read_text()) for r in range(world_size)]
claim("without Join the launch timed out: the ranks with more batches waited for a partner",
      isinstance(hang, launch.LaunchTimeoutError) and hang.pending == list(range(1, world_size)),
      hang=hang)
claim("and every rank was stopped: none is left running",
      not any(running(p) for p in pids), pids=pids)

joined = launch.spawn(uneven_steps, world_size, True, str(work), backend="gloo", timeout=timeout)
print("with Join: steps per rank", [r["steps"] for r in joined])
claim("with Join every rank ran all its batches and the job ended",
      [r["steps"] for r in joined] == [3 + r for r in range(world_size)])
claim("and every rank ends with the same weights, bit for bit",
      all(torch.equal(a, b) for r in joined[1:] for a, b in zip(r["weights"], joined[0]["weights"])))
claim("but not with the same momentum buffers: Join synchronises the module, not the optimizer",
      all(not torch.equal(a, b) for r in joined[1:]
          for a, b in zip(r["momentum"], joined[0]["momentum"])))
claim("Join's cost: in every training iteration each rank made 2 all-reduces from Python, "
      "beside DDP's gradient all-reduce", all(r["extra"] == [2] * r["steps"] for r in joined),
      extra=[r["extra"] for r in joined])

# %% [markdown]
# `Join` keeps the extra batches. The other cure is to drop them: have every rank agree on the
# smallest number of batches (`dist.all_reduce(n, op=dist.ReduceOp.MIN)`) and stop there.
# `DistributedSampler(drop_last=True)` gets the same effect for a dataset every rank sees whole,
# without communicating: every rank computes the same shard length from `len(dataset)` and
# truncates the list to a multiple of the world size before dealing it out. And `Join(...,
# throw_on_early_termination=True)` makes every rank raise as soon as one runs out, for loops
# that must stop together (not run here; `Join.__exit__` and `notify_join_context` in
# `join.py`).
#
# ## 6. The learning rate against the world size
#
# DDP **averages** the ranks' gradients. With a per-rank batch B, N ranks compute the gradient
# of the mean loss over N·B images: one step of N ranks is one step of one process on the global
# batch N·B (section 1 showed it). So going from 1 to 8 GPUs *at a fixed per-rank batch* grows
# the global batch 8× and cuts the steps per epoch 8×. The **linear scaling
# rule** (Goyal et al., 2017) says: when the
# global batch is multiplied by k, multiply the learning rate by k — with a few epochs of
# warm-up, because a large rate at the start diverges. It is an empirical rule for SGD with
# momentum, and it breaks down past some batch size (Goyal et al. saw both; lesson 11 names that
# size, the critical batch size; neither run here). With Adam,
# square-root scaling is the usual starting point (Malladi et al., 2022; not run here).
#
# **What if the gradients are summed instead of averaged** (a hand-written all-reduce, or a
# comm hook — lesson 03 — that forgets to divide by N)? Then each step uses N × the mean
# gradient. For plain SGD and for SGD with momentum, that is the same step as averaging
# with `lr × N`: the momentum buffer just holds N × the averaged one. Bit for bit only when N is
# a power of two, as here (N = 2: halving and doubling are exact in floating point); for other
# N, up to rounding. And not under gradient clipping: `clip_grad_norm_` rescales gradients
# longer than `max_norm` by `max_norm / (total_norm + 1e-6)`, clamped at 1 (`clip_grad.py`), and
# summed gradients are N × as long. When the *averaged* gradient is longer than `max_norm` too
# (here, at 0.01, every step), both are clipped to the same length: summing equals averaging at
# the *same* lr, and `lr × N` takes N × the step; when only the sum is clipped, neither lr
# matches. With weight decay it is not:
# summing multiplies the gradient by N but not the decay term `wd·w`, so it equals averaging at
# `lr × N` *and* `wd / N`. With Adam (no weight decay), summing changes almost nothing: Adam
# divides by the gradient's running root-mean-square, so N cancels (except against `eps`), and
# multiplying Adam's lr by N is the mistake. Adam's `weight_decay`, when set, joins the gradient
# by default (`decoupled_weight_decay=False`) before that division (`adam.py`), so summing shrinks it N-fold; AdamW's
# (`decoupled_weight_decay=True`) is `w ← w·(1 − lr·wd)`, which summing leaves alone. Five steps
# on 2 ranks:


# %%
# NBVAL_IGNORE_OUTPUT
# (rounding-level differences depend on this CPU's float kernels; the claims below bound them)
def sum_or_average(rank, world_size, cases):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def summing_hook(state, bucket):  # DDP's all-reduce without the division by N
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
            lambda fut: fut.value()[0])

    def train(summed, make_opt, clip=None):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                        torch.nn.Linear(16, 1)))
        if summed:
            model.register_comm_hook(None, summing_hook)
        opt = make_opt(model.parameters())
        g = torch.Generator().manual_seed(rank)
        norms = []  # the gradients' length before each clipping
        for _ in range(5):
            X = torch.randn(8, 16, generator=g)
            loss = (model(X) - X[:, :1]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if clip is not None:  # rescale the gradients to norm `clip` when they are longer
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()]), norms

    N, lr = world_size, 0.01
    SGD, Adam = torch.optim.SGD, torch.optim.Adam
    recipes = {
        "SGD": (lambda p: SGD(p, lr=lr), lambda p: SGD(p, lr=lr * N)),
        "SGD + momentum": (lambda p: SGD(p, lr=lr, momentum=0.9),
                           lambda p: SGD(p, lr=lr * N, momentum=0.9)),
        "SGD + weight decay": (lambda p: SGD(p, lr=lr, weight_decay=0.1),
                               lambda p: SGD(p, lr=lr * N, weight_decay=0.1)),
        "SGD + weight decay / N": (lambda p: SGD(p, lr=lr, weight_decay=0.1),
                                   lambda p: SGD(p, lr=lr * N, weight_decay=0.1 / N)),
        "SGD, clipped at 0.01": (lambda p: SGD(p, lr=lr), lambda p: SGD(p, lr=lr * N)),
        "SGD, clipped, same lr": (lambda p: SGD(p, lr=lr), lambda p: SGD(p, lr=lr)),
        "Adam, same lr": (lambda p: Adam(p, lr=lr), lambda p: Adam(p, lr=lr)),
        "Adam": (lambda p: Adam(p, lr=lr), lambda p: Adam(p, lr=lr * N)),
        "Adam + weight decay": (lambda p: Adam(p, lr=lr, weight_decay=0.1),) * 2,
        "AdamW + weight decay": (lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.1),) * 2,
    }
    out = {}
    for name in cases:
        summed_opt, averaged_opt = recipes[name]
        clip = 0.01 if "clipped" in name else None
        (a, _), (b, norms) = train(True, summed_opt, clip), train(False, averaged_opt, clip)
        out[name] = float((a - b).abs().max() / b.abs().max())
        if clip is not None:
            out.setdefault("averaged gradients' lengths", []).extend(norms)
    return out


cases = ["SGD", "SGD + momentum", "SGD + weight decay", "SGD + weight decay / N",
         "SGD, clipped at 0.01", "SGD, clipped, same lr", "Adam, same lr", "Adam",
         "Adam + weight decay", "AdamW + weight decay"]
gaps_lr = launch.spawn(sum_or_average, world_size, cases, backend="gloo", timeout=timeout)[0]
print("summed gradients at lr  vs  averaged gradients at:")
for name, (versus) in zip(cases, ["lr × N", "lr × N", "lr × N", "lr × N, wd / N", "lr × N",
                                  "lr", "lr", "lr × N", "lr", "lr"]):
    print(f"  {name:24s} ({versus:14s}) largest weight difference {gaps_lr[name]:.1e} "
          f"of the largest weight")

# %%
claim("plain SGD: summing == averaging at lr × N (to 1e-6 of the weights)",
      gaps_lr["SGD"] < 1e-6, gaps=gaps_lr)
claim("SGD with momentum: the same (to 1e-6)", gaps_lr["SGD + momentum"] < 1e-6, gaps=gaps_lr)
if world_size & (world_size - 1) == 0:   # N a power of two: scaling by N is exact
    claim(f"N = {world_size}, a power of two: plain SGD and SGD with momentum bit for bit",
          gaps_lr["SGD"] == 0.0 and gaps_lr["SGD + momentum"] == 0.0, gaps=gaps_lr)
claim("clipped at 0.01, where even the averaged gradients are longer than 0.01 at every step: "
      "summing equals averaging at the same lr (to 1e-6), not at lr × N (more than 1e-4)",
      min(gaps_lr["averaged gradients' lengths"]) > 0.01
      and gaps_lr["SGD, clipped, same lr"] < 1e-6 and gaps_lr["SGD, clipped at 0.01"] > 1e-4,
      gaps=gaps_lr)
claim("with weight decay it differs (more than 1e-4) unless the decay is divided by N too "
      "(then to 1e-6)",
      gaps_lr["SGD + weight decay"] > 1e-4 and gaps_lr["SGD + weight decay / N"] < 1e-6,
      gaps=gaps_lr)
claim("Adam: summing is (almost) averaging at the same lr (to 1e-4), and lr × N is far off "
      "(more than 1e-3); so is Adam's default weight decay at the same lr, not AdamW's (to 1e-4)",
      max(gaps_lr["Adam, same lr"], gaps_lr["AdamW + weight decay"]) < 1e-4
      and min(gaps_lr["Adam"], gaps_lr["Adam + weight decay"]) > 1e-3, gaps=gaps_lr)

# %% [markdown]
# ## 7. Gradient accumulation with `no_sync`
#
# To reach a big global batch with little memory, run `accum` micro-batches per optimizer step.
# Under DDP every `backward()` all-reduces — unless its *forward* ran inside `model.no_sync()`,
# where the gradients add up locally and the last one all-reduces.
# We count the all_reduce calls with a comm hook, `dp.counting_allreduce_hook`: torch's
# `allreduce_hook` plus a counter. It divides each bucket by the world size, then all-reduces
# it: DDP's average without a hook, reached another way (without a hook the reducer, in C++,
# divides by its `div_factor_`, "equal to the process group size" in `reducer.hpp`; lesson 07
# shows where). Then we compare the gradients with
# one process on the whole global batch.

# %%
viz.show_code(dp.CommCounter, dp.counting_allreduce_hook)


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
# **Myth: "the loader's batch is the global batch, which DDP splits over the GPUs."** No: each
# rank loads `per_rank_batch` images, so one optimizer step sees
# `per_rank_batch × world_size × accum` images — above, 8 per micro-batch on each rank, and the
# single process that the gradients matched took all of them in one batch.

# %% [markdown]
# ## 8. Mixed precision under DDP
#
# Autocast changes the dtype of the forward's operations, not the parameters: they and their
# `.grad` stay float32, so with DDP's default hook the all_reduce still sends float32. (Two
# knobs do change what DDP sends: a comm hook such as `fp16_compress_hook` or
# `bf16_compress_hook` from `torch.distributed.algorithms.ddp_comm_hooks.default_hooks`, which
# casts each bucket to 16 bits for the all-reduce and back, halving the bytes; and DDP's
# experimental `mixed_precision=` argument (a private `_MixedPrecision` config), which runs
# forward and backward on low-precision copies of the parameters and reduces the gradients in
# its `reduce_dtype`: read in the source, *not run here*.)
# Which 16-bit type? bfloat16 has float32's range, so it needs no scaler: use it on a CPU and on
# GPUs that compute in it natively (compute capability 8.0 on, Ampere and later:
# `torch.cuda.is_bf16_supported(including_emulation=False)`). On older GPUs use float16 with a
# `GradScaler`: in the float16 backward, small gradients (of activations and, computed in
# float16 before their cast back, of weights) fall out of float16's range. Below about 6e-5 (its smallest normal number) a value
# becomes *subnormal* and keeps fewer significant bits the smaller it is; only below about 3e-8
# (half its smallest subnormal, 2⁻²⁴ ≈ 6e-8) is it nearer 0 than any float16, and rounding to
# nearest makes it zero (underflow; not flush-to-zero, a hardware mode that drops subnormals
# too; the first cell below shows both). The
# scaler multiplies the loss before `backward`, which lifts those gradients back into the normal
# range, and divides the float32 parameter gradients after. `train_ddp.py --amp` chooses by
# that test (its `fp16` line). Then: 10 steps with and without
# bf16 autocast on 2 ranks.

# %%
half = torch.finfo(torch.float16)
smallest = float(torch.nextafter(torch.tensor(0.0).half(), torch.tensor(1.0).half()))  # > 0
kept, lost = torch.tensor(1e-6).half(), torch.tensor(2e-8).half()
claim(f"float16 keeps 1e-6, below its smallest normal number ({half.tiny:.1e}), as a subnormal "
      f"(to 2%)", 0 < float(kept) < half.tiny and abs(float(kept) - 1e-6) < 2e-8,
      kept=float(kept))
claim(f"its smallest subnormal is 2⁻²⁴ ({smallest:.1e}); 2e-8, below half of it "
      f"({smallest / 2:.1e}), rounds to zero", smallest == 2.0 ** -24
      and 2e-8 < smallest / 2 and float(lost) == 0.0, smallest=smallest, lost=float(lost))
chosen = [line.strip() for line in train_ddp.read_text().splitlines()
          if line.lstrip().startswith(("fp16 =", "amp_dtype =", "scaler ="))]
print("train_ddp.py --amp chooses:", *chosen, sep="\n  ")


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
# ## 9. BatchNorm under DDP: buffers and SyncBatchNorm
#
# BatchNorm keeps two kinds of state. Its **running statistics** (`running_mean`,
# `running_var`) are *buffers*, which DDP makes rank 0's before a forward by section 4's rule.
# The running statistics that rank
# 0 checkpoints are therefore rank 0's: an average over *rank 0's* batches only; the other
# ranks' updates are overwritten at the next broadcast. (Lesson 03 shows it step by step.)
#
# `forward_sync_buffers` is not just a new name for the older `broadcast_buffers`, deprecated
# since torch 2.13. Both turn off the broadcast before each forward, but
# `broadcast_buffers=False` also leaves the buffers out of the broadcast from rank 0 when DDP
# wraps the model, and `forward_sync_buffers=False` does not: with `init_sync` on (the
# default; the constructor's argument that broadcasts rank 0's parameters and buffers as DDP
# wraps) the buffers are still made rank 0's there (read in the source, *not run here*:
# torch's deprecation warning says so; `DistributedDataParallel.__init__`
# hands `_sync_module_states` `broadcast_buffers=init_sync_buffers`, which only the old flag
# turns off). A model that keeps rank-local buffers on purpose still needs the old flag.
#
# And its **batch statistics**: in training, BatchNorm normalises with the mean and variance of
# *the batch it sees* — under DDP, the per-rank batch. So DDP with BatchNorm is **not** one
# process on the global batch; SyncBatchNorm combines the statistics of all ranks so that it is.
# What it sends, per BatchNorm layer with C channels, in training mode (read
# `torch/nn/modules/_functions.py`):
#
# - **forward:** each rank computes its per-channel mean and inverse standard deviation and its
#   sample count, and an **all_gather** gives every rank everyone's `[mean, invstd, count]`
#   (2C + 1 numbers per rank). All-gather rather than all-reduce, because what each rank sends
#   is a mean and an inverse standard deviation, not sums: means and invstds of shards of
#   different sizes cannot be added up, so every rank gets them all and combines them,
#   weighting by the counts (`batch_norm_gather_stats_with_counts`), which is also numerically
#   stabler than combining raw sums.
# - **backward:** each rank sums `dy` and `dy·(x − mean)` per channel, and one **all_reduce**
#   adds them up (2C numbers); every rank then finishes the input's gradient with the global
#   sums. Only when the layer's input needs a gradient (`needs_input_grad[0]`): a BatchNorm on
#   the raw input, or after frozen layers, sends only the forward's all_gather (read in the
#   source, not run here: `nn.SyncBatchNorm` refuses CPU tensors, below).
#
# In `eval()` mode it uses the running statistics and sends nothing. What does
# `nn.SyncBatchNorm` do on a CPU? Its `forward` (`torch/nn/modules/batchnorm.py`) wants to
# synchronise in training mode whenever a process group is initialised. Then it checks the
# **device first**: a CPU tensor raises, *even in a group of one rank*; only after that check
# does it look at the group's size and fall back to plain batch norm for one rank. Outside any
# process group it is plain batch norm. Below: no group; the 2-rank group; and, in the same two
# ranks, a group of one rank each (`dist.new_group`):


# %%
def sync_bn_on_cpu(rank, world_size):
    import torch
    import torch.distributed as dist

    alone = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank makes each group
    seen = {}
    for name, group in (("2-rank group", None), ("1-rank group", alone)):
        try:
            torch.nn.SyncBatchNorm(4, process_group=group)(torch.randn(2, 4, 3, 3))
            seen[name] = "ran"
        except ValueError as e:
            seen[name] = str(e)
    return seen


x = torch.randn(8, 4, 3, 3)
no_group = torch.nn.SyncBatchNorm(4)(x)  # in this notebook: no process group
plain = torch.nn.BatchNorm2d(4)(x)
in_group = launch.spawn(sync_bn_on_cpu, 2, backend="gloo", timeout=timeout)[0]
for name, what in in_group.items():
    print(f"nn.SyncBatchNorm in a {name}, on CPU tensors:", what)
claim("outside a process group nn.SyncBatchNorm is plain BatchNorm, bit for bit",
      torch.equal(no_group, plain))
claim("inside the 2-rank group it refuses CPU tensors",
      "expected input tensor to be on GPU" in in_group["2-rank group"])
claim("and inside a 1-rank group too: the device is checked before the group's size",
      "expected input tensor to be on GPU" in in_group["1-rank group"])

# %% [markdown]
# So on CPU we use `dp.CPUSyncBatchNorm`, a stand-in (`dp.convert_sync_batchnorm`, folded
# below with the model `dp.SmallBNNet`, picks the real one on CUDA). It aims at the same result by another route: one differentiable all_reduce of
# the per-channel sums of x and x² and the count (sums *can* be added across ranks of any size),
# the variance as E[x²] − mean² — simpler, but it loses precision when a channel's mean is
# large against its spread — and an all_reduce of the gradients of those sums in the backward.
# Everything measured below is this class, not `nn.SyncBatchNorm`, even on a GPU machine.

# %%
viz.show_code(dp.CPUSyncBatchNorm, dp.AllReduceSum)

# %% [markdown]
# **▶ Which BatchNorm it picks, and the model measured below** (click the folded cell below):
# `dp.convert_sync_batchnorm` (also `train_ddp.py --sync-bn`'s) and `dp.SmallBNNet`.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(dp.convert_sync_batchnorm, dp.SmallBNNet,
              folded="▶ code: dp.convert_sync_batchnorm, dp.SmallBNNet")

# %% [markdown]
# Compare plain BatchNorm and the stand-in against one process on the global batch, for small
# and large per-rank batches:


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
    print(f"per-rank batch {b:2d}, {'CPUSyncBatchNorm' if s else 'BatchNorm       '}: gradient error vs "
          f"one process on the global batch {'< 1e-5' if gap < 1e-5 else f'{gap:.0%}'}")
claim("with CPUSyncBatchNorm the gradients equal one process on the global batch (to 1e-5)",
      all(gap < 1e-5 for (b, s), gap in gaps.items() if s), gaps=gaps)
claim("with plain BatchNorm the error shrinks as the per-rank batch grows, but never vanishes",
      gaps[(2, False)] > gaps[(8, False)] > gaps[(64, False)] > 1e-3, gaps=gaps)
fig = viz.new_figure(5.5, 3.2)
ax = fig.add_subplot(1, 1, 1)
batches = sorted({b for b, _ in gaps})
ax.plot(batches, [100 * gaps[(b, False)] for b in batches], "o-", label="BatchNorm under DDP")
ax.plot(batches, [max(100 * gaps[(b, True)], 1e-5) for b in batches], "s-",
        label="CPUSyncBatchNorm (the stand-in) under DDP")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("per-rank batch")
ax.set_ylabel("gradient error vs one process (%)")
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8)
fig.subplots_adjust(left=0.17, right=0.97, bottom=0.16, top=0.95)
viz.show(fig, "plain BatchNorm's gradient error falls as the per-rank batch grows but stays above "
              "0.1%; the synchronised stand-in's stays below 1e-5 (relative) at every size.")

# %% [markdown]
# With the stand-in's synchronised batch statistics, DDP's gradients equal one process's on the
# global batch to 1e-5 (relative norm; the sums are taken in another order, so not bit for
# bit); `nn.SyncBatchNorm` was not measured here. Without it the error is large
# when per-rank batches are tiny (detection, segmentation, big 3-D inputs: 1-4 images per GPU)
# and shrinks as they grow. It costs up to two extra collectives per BatchNorm layer per
# training step — an all_gather in the forward, an all_reduce in the backward when the input
# needs a gradient, each blocking in the middle of the computation — so use it when per-rank
# batches are small.
#
# ## 10. Debugging: mismatches, hangs, timeouts, and the first GPU failures
#
# A collective that ranks call with different shapes is a bug that can hang, crash, or silently
# compute garbage. With `TORCH_DISTRIBUTED_DEBUG=DETAIL` each collective is first checked across
# ranks, and the mismatch becomes a clear error. (The variable is read when torch.distributed is
# imported, and the check is built into each process group as it is created, so a running worker
# calls `dist.set_debug_level` before `init_process_group` or `new_group`; a script exports the
# variable before launching.) For NCCL, `NCCL_DEBUG=INFO` prints its set-up and
# errors. For NCCL hangs (not run here), `TORCH_NCCL_TRACE_BUFFER_SIZE=2000` and
# `TORCH_NCCL_DUMP_ON_TIMEOUT=1` make each rank record its last 2000 collectives and dump them
# on a timeout (the **flight recorder**); `python -m torch.distributed.flight_recorder.fr_trace
# <folder>` merges the dumps and reports the first collective the ranks did not issue alike.
#
# For your own torchrun script, `python -m dpcourse diagnose your_script.py` runs it on two
# local ranks, bounded in time, and reports both kinds of bug: a hang (which rank, in which
# collective, at which line) and the silent mistakes of this lesson — a sampler without
# `set_epoch`, every rank saving the checkpoint, DDP's `module.` keys in it, an evaluation the
# sampler padded, rank 0's own loss printed as the global one — each with the line and the fix.
# Lesson 10 §5 runs it on a script written from a blog post.


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
# ### The first failures on a GPU machine, and their messages
#
# Three mistakes account for most first runs that fail on GPUs. The first runs here; the other
# two need GPUs, so their messages are quoted from the installed libraries (NCCL 2.30.7 as
# pip installs it with torch 2.14.1, and torch's own CUDA library) — **not run here**.
#
# **NCCL without a GPU per rank.** NCCL only moves GPU memory. Asked for on a machine (or in a
# container) without a visible GPU, it refuses at `init_process_group`:


# %%
def nccl_without_gpu(rank, world_size):
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # no GPU for this rank, even on a GPU machine
    import torch.distributed as dist

    try:
        dist.init_process_group("nccl")
        return "started"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


nccl_message = launch.spawn(nccl_without_gpu, 2, timeout=timeout)[0]
print(nccl_message)
claim("NCCL without GPUs fails at init_process_group with a clear message",
      "ProcessGroupNCCL is only supported with GPUs" in nccl_message)

# %% [markdown]
# The cure: `backend="nccl"` only when every local rank owns a GPU, `"gloo"` otherwise (the first
# lines of `train_ddp.py`'s `main` do exactly that test).
#
# **Two ranks on one GPU.** Start `torchrun --nproc-per-node=2` on a one-GPU machine with
# `torch.cuda.set_device(local_rank)` and rank 1 asks for a GPU that does not exist
# (`CUDA error: invalid device ordinal`); pin both ranks to GPU 0 instead and NCCL refuses at
# its first communicator (torch raises `torch.distributed.DistBackendError`, `NCCL error ...
# invalid usage`, with NCCL's last error):
#
# ```text
# Multiple Ranks are using the same GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this configuration.
# ```
#
# (a string in `nvidia/nccl/lib/libnccl.so.2`, NCCL 2.30.7; older NCCL versions said
# "Duplicate GPU detected"). One process per GPU is the rule; to practise with more ranks than
# GPUs, use gloo, as this course does on one GPU.
#
# **Forgetting `torch.cuda.set_device(local_rank)`.** Without it, the "current" GPU of every
# process is GPU 0. Every `.cuda()`, `torch.device("cuda")`, and every CUDA context lands there:
# GPU 0 fills up with N contexts (a few hundred MB each) while the others idle, and NCCL meets N
# ranks on one GPU — the message above. Even with the model placed right
# (`.to(f"cuda:{local_rank}")`), a collective that has no tensor to take its device from (a
# `dist.barrier()`) uses the current device; torch warns, from `barrier` in
# `torch/distributed/distributed_c10d.py`:
#
# ```text
# barrier(): using the device under current context. You can specify `device_id` in `init_process_group` to mute this warning.
# ```
#
# and ProcessGroupNCCL, when it must guess (`torch/lib/libtorch_cuda.so`): "Guessing device ID
# based on global rank. This can cause a hang if rank to GPU mapping is heterogeneous." The cure is the script's two lines:
# `torch.cuda.set_device(local_rank)` before anything touches CUDA, and
# `DDP(model, device_ids=[local_rank])` (or `init_process_group(..., device_id=...)`, which
# also binds the group to that GPU).

# %% [markdown]
# **What `find_unused_parameters` is really for.** DDP waits for a gradient of *every*
# parameter before it all-reduces the last bucket. If some take no part in a forward (a branch
# not taken), their gradients never come: the first backward (one bucket) all-reduces nothing
# and returns un-averaged gradients (lesson 10 §3 measures it), and DDP raises at the next
# iteration.
# `find_unused_parameters=True` makes DDP walk the graph after each forward to mark them ready.
# It fixes this and cures nothing else. It costs, in every step, that graph traversal and one
# more all-reduce, of the bitmap of parameters each rank used (`local_used_map_` in
# `reducer.hpp`; counted below with torch's profiler); and DDP then never rebuilds its buckets
# in the order the gradients arrive, keeping those made at construction
# (`should_rebuild_buckets`, read below in the source; what a rebuild changes is lesson 07's).
# All three costs hold only
# without `static_graph=True`, a promise that every step uses the same parameters in the same
# order: with it, DDP skips the walk, all-reduces the bitmap in the first step
# only (counted below), and rebuilds its buckets once (both conditions read below in the source).


# %%
def unused_branch(rank, world_size):
    runs = {flag: _unused_branch(flag) for flag in (False, True)}
    return runs | {"static": _unused_branch(True, static_graph=True)}


def _unused_branch(find_unused, static_graph=False):
    import torch
    import torch.profiler as tp
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head_a, self.head_b = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.head_a(self.body(x))  # head_b is never used

    model = DDP(TwoHeads(), find_unused_parameters=find_unused, static_graph=static_graph)
    try:
        for _ in range(2):
            with tp.profile(activities=[tp.ProfilerActivity.CPU]) as prof:
                model(torch.randn(3, 4)).sum().backward()
        return {"ran": "ok", "buckets": len(model.reducer._get_zeros_like_grad_buckets()),
                "all_reduces": sum(e.name == "gloo:all_reduce" for e in prof.events())}
    except RuntimeError as e:
        return {"ran": str(e).split(".")[0]}


# show_output=False: the profiler's lines on the ranks' stderr are not lesson output
unused = launch.spawn(unused_branch, 2, backend="gloo", timeout=timeout, show_output=False)[0]
print("default:                    ", unused[False]["ran"])
print("find_unused_parameters=True:", unused[True]["ran"])
claim("by default, an unused branch makes the next iteration fail",
      "Expected to have finished reduction" in unused[False]["ran"])
claim("with find_unused_parameters=True it runs", unused[True]["ran"] == "ok")
claim(f"and its second step made one all-reduce more than its {unused[True].get('buckets')} "
      f"bucket(s): the used-parameter bitmap's",
      unused[True]["all_reduces"] == unused[True]["buckets"] + 1, seen=unused[True])
claim("with static_graph=True as well, its second step made no bitmap all-reduce",
      unused["static"]["all_reduces"] == unused["static"]["buckets"], seen=unused["static"])
post_forward = inspect.getsource(torch.nn.parallel.DistributedDataParallel._post_forward)
claim("the walk runs only `if self.find_unused_parameters and not self.static_graph`",
      "if self.find_unused_parameters and not self.static_graph:" in post_forward)
reducer_hpp = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/reducer.hpp"
claim("the rebuild test is `(static_graph_ || !find_unused_parameters_) && !has_rebuilt_bucket_`",
      "return (static_graph_ || !find_unused_parameters_) && !has_rebuilt_bucket_;"
      in reducer_hpp.read_text())

# %% [markdown]
# ## 11. More myths, tested
#
# **"Call `dist.barrier()` after every step to keep ranks in sync"** and **"seed every rank the
# same or the models diverge."** Neither, for the *model*: DDP broadcasts rank 0's weights when
# it wraps the model, every rank then applies the same averaged gradient from the same
# optimizer state (which DDP never syncs: section 5), and every step's all_reduce already
# waits for all ranks. Below each rank
# starts from a *different* seed, trains 5 steps with no barrier, and the weights are identical
# bit for bit. But one seed *must* be the same on every rank: `DistributedSampler`'s `seed`
# ("should be identical across all processes", says its docstring). Each rank shuffles the
# whole dataset itself and keeps its slice; with different seeds the permutations differ and
# the shards overlap, some images trained on twice per epoch and others never.
#
# **"`gradient_as_bucket_view=True` compresses the gradients."** It only makes each `.grad` a
# view into DDP's communication buckets instead of a separate copy: it saves one copy of the
# gradients' memory, and the bytes all-reduced are the same. The cell zeroes the gradients with
# `zero_grad(set_to_none=False)`: with the default, `set_to_none=True`, the optimizer drops the
# `.grad` tensors every step, and DDP's own documentation notes that then
# "`gradient_as_bucket_view` alone cannot avoid copies because the bucket view alias is
# destroyed every iteration".


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
# * `train_ddp.py` is `train_single.py` plus the lines data parallelism needs: the identity
#   from torchrun's environment, `init_process_group`, `set_device(local_rank)` and
#   `device_ids`, a per-attempt `PrefixStore` (one node; on several,
#   `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`), `DistributedSampler` + `set_epoch`, `DDP` and
#   `raw_model`, reduced sums, rank-0 checkpoints, `destroy_process_group`; it ends with one
#   process's weights (to 1e-5).
# * The same command runs on one machine or many (c10d rendezvous; bound `join_timeout`).
#   Rank 0 saves, atomically; every rank loads with `map_location` and `weights_only=True`;
#   with `--max-restarts` a killed run resumes and ends with **the same weights** (here; what
#   else a checkpoint can need: lab 04's stretch).
# * Evaluate each image once, with the plain module (through the wrapper, a rank with no batch
#   hangs the others), and combine the ranks so that the result equals one process exactly
#   (how: lab 04, then the folded `evaluate`). Rank 0's number, a mean of means and
#   `DistributedSampler`'s padding each give another one.
# * A rank with fewer batches hangs the others in their next all-reduce (or, if it calls a
#   collective of its own, pairs with it: a crash, or two unrelated tensors summed);
#   `Join([model])` keeps it answering until all are done, then makes the modules equal (not
#   the optimizer states).
# * DDP averages: at a fixed per-rank batch the global batch grows with N (linear scaling rule:
#   lr × k for a k× batch, with warm-up). Summed gradients equal averaged ones at lr × N for SGD
#   (momentum too; bit for bit when N is a power of two), not with weight decay,
#   not under gradient clipping (the same lr when the average is clipped too), and not for Adam
#   (same lr; its weight decay, coupled by default, shrinks N-fold; AdamW's does not).
# * `no_sync` accumulation equals the big batch and all-reduces `accum` times less. AMP leaves
#   DDP's gradients in float32 (a 16-bit compress hook or `mixed_precision=` changes that).
#   Buffers get rank 0's before a forward by section 4's rule. With small per-rank batches, synchronised batch statistics
#   (measured with the CPU stand-in `dp.CPUSyncBatchNorm`) make BatchNorm's gradients one
#   process's (to 1e-5).
# * `TORCH_DISTRIBUTED_DEBUG=DETAIL` turns a mismatched collective into a clear error; a
#   process-group timeout ends a hang; NCCL needs one GPU per rank and `set_device`;
#   `find_unused_parameters` is for unused parameters only.

# %%
import shutil

shutil.rmtree(work, ignore_errors=True)

# %% [markdown]
# ## Lab 04: a metric that is not a mean, in your torchrun script
#
# Open [lab04_ddp_in_practice](../labs/lab04_ddp_in_practice.ipynb). It gives you a torchrun DDP
# script built the way section 1 built `train_ddp.py`, and asks for what this lesson did not
# show: the **macro-F1** of the trained model on a test set split over the ranks, equal to one
# process's, with as few numbers per class between the ranks as the exact value needs, whatever
# the size of the test set — which statistics the ranks exchange is your decision. The check runs your function
# on 2 and 3 ranks, compares it with one process, and names the mistake if it differs (it also
# follows whether what you exchange would live on the GPU); then it runs your script under
# torchrun. A prediction asks what the ranks' own macro-F1, averaged, reports on a fair split
# over many ranks. Its stretch asks for a resume after a crash that continues exactly as a run
# that never stopped, on every rank: what the checkpoint must hold for that you decide first.
#
# **▶ The reference answer — open after your lab passes** (click the folded cell below): the
# part of the diff that section 1 left out, `train_ddp.py`'s `evaluate`, and why it equals one
# process (below it).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
import ast


def function_lines(path, name):
    text = path.read_text()
    fn = next(node for node in ast.parse(text).body
              if isinstance(node, ast.FunctionDef) and node.name == name)
    return text.splitlines()[fn.lineno - 1:fn.end_lineno]


display(viz.folded_code_bundle(Code("\n".join(difflib.unified_diff(
    function_lines(train_single, "evaluate"), function_lines(train_ddp, "evaluate"),
    "train_single.py", "train_ddp.py", lineterm="", n=30)), language="diff")._repr_html_(),
    "▶ The evaluate diff — open after your lab passes"), raw=True)

# %% [markdown]
# <details><summary>▶ Why it equals one process — open after your lab passes</summary>
#
# Each image exactly once (rank r takes images r, r + N, ...), a SUM of the loss and a COUNT of
# right answers and of images on each rank, one all_reduce of those sums, division last: sums
# over disjoint images add up, fractions over shards of different sizes do not.
#
# </details>

# %% [markdown]
# **▶ Compare after your stretch passes** (click the folded cell below): what section 3's
# checkpoint holds and how the data order comes back.

# %% [markdown]
# <details><summary>▶ open</summary>
#
# It holds `{model, optimizer, scaler, step}`, no random state (section 3's run ended
# bit-identical without one). The data order is not saved: the loop restarts at the saved
# step's epoch, `set_epoch` deals the same permutation, `done_in_epoch` skips what was done.
#
# </details>

# %% [markdown]
# **▶ `train_ddp.py`'s resume and save — open after your stretch passes** (the folded cell
# below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
script_lines = train_ddp.read_text().splitlines()
first = next(i for i, line in enumerate(script_lines) if line.strip() == "step = 0")
last = next(i for i, line in enumerate(script_lines) if "os.kill(os.getpid()" in line)
viz.show_code("# train_ddp.py: resume and save\n" + "\n".join(script_lines[first:last + 1]),
              folded="▶ train_ddp.py's resume and save — open after your stretch passes")

# %% [markdown]
# ## Check yourself
#
# **▶ The quiz** — run the folded cell below and answer in the widget (or read its output,
# where the answers are folded).

# %% jupyter={"source_hidden": true}
from dpcourse import quizzes

viz.quiz(quizzes.questions("04"))

# %% [markdown]
# ## Sources
#
# Checked in the installed packages (torch 2.14.1; paths relative to `site-packages`):
#
# - `torch/distributed/run.py` — torchrun: `--nproc-per-node`, `--nnodes`, `--rdzv-backend`,
#   `--rdzv-endpoint`, `--max-restarts`; `run` sets `OMP_NUM_THREADS=1` when it is unset and
#   `--nproc-per-node` > 1; `torch/distributed/launch.py` — the deprecated launcher.
# - `torch/distributed/elastic/agent/server/local_elastic_agent.py` —
#   `LocalElasticAgent._start_workers`: the worker environment (`RANK`, `LOCAL_RANK`,
#   `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
#   `TORCHELASTIC_RESTART_COUNT` = `spec.max_restarts - self._remaining_restarts`, this
#   agent's own count, `TORCHELASTIC_USE_AGENT_STORE`, and more that the script does not read:
#   `GROUP_RANK`, `ROLE_RANK`, `TORCHELASTIC_RUN_ID`, `TORCHELASTIC_MAX_RESTARTS`, ...).
# - `torch/distributed/elastic/agent/server/api.py` — `SimpleElasticAgent._rendezvous`: logs
#   "Rendezvous complete for workers" with `restart_count`, `master_addr`, `master_port`,
#   `group_rank`, and each worker's `local_ranks`, `global_ranks`, `global_world_sizes` (what
#   section 3's picture reads, with `LOGLEVEL=INFO`: `torch/distributed/elastic/utils/logging.py`);
#   `torch/distributed/elastic/multiprocessing/api.py` — `SubprocessContext._poll`: the
#   "failed (exitcode: ...) local_rank:" line, logged once, for
#   `min(result.failures.values(), key=lambda f: f.timestamp)` (lines 1000-1008);
#   `torch/distributed/elastic/multiprocessing/errors/__init__.py` —
#   `ProcessFailure._set_no_reply_file`: a worker with no error file gets
#   `timestamp = int(time.time())`, whole seconds (why section 3's figure reads the dead worker
#   from the workers' own output). `SimpleElasticAgent._invoke_run`: an
#   `UNHEALTHY`/`FAILED` worker group decrements `_remaining_restarts` and restarts; a
#   `HEALTHY` one restarts without decrementing when `num_nodes_waiting() > 0` ("membership
#   changes do not count as retries").
# - `torch/distributed/elastic/rendezvous/dynamic_rendezvous.py` — `_NodeDesc` (a dataclass with
#   `order=True` on address, pid, local id) and
#   `_DistributedRendezvousOpExecutor._mark_rendezvous_complete` (`for rank, node in enumerate(sorted(state.participants))`): node ranks come from
#   sorting, not arrival; `DynamicRendezvousHandler.next_rendezvous`: the TCPStore server is
#   created once (`_shared_tcp_store_server`) and reused in later rounds, the workers joining it
#   as clients (`TORCHELASTIC_USE_AGENT_STORE=True`; what that leaves in it after a crash is
#   read from this source, not replayed in the lesson), unless
#   `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, when `RendezvousStoreInfo.build`
#   (`torch/distributed/elastic/rendezvous/api.py`) has rank 0 pick a free port each round and
#   `use_agent_store` is false — why the script needs a per-attempt `PrefixStore`, and what to
#   export on several nodes.
# - `torch/distributed/rendezvous.py` — `_create_c10d_store`, `_torchelastic_use_agent_store`:
#   under the agent every rank is a client of the agent's store (its comment "We create a new
#   TCPStore for every retry so no need to add prefix for each attempt" does not hold for the
#   shared store above).
# - `torch/distributed/distributed_c10d.py` — `init_process_group` (`store=`, `device_id=`),
#   `barrier` (the "using the device under current context" warning; lines 6340-6357: without
#   `device_ids` or a bound device, a GPU group gets the current device; its docstring's note lists
#   the fallbacks after those: the device a collective with tensor inputs first used, then the
#   global rank mod the local device count), `destroy_process_group`;
#   `_new_process_group_helper` wraps a new group in `_create_process_group_wrapper` (the
#   collective check) only if `get_debug_level()` is DETAIL then (lines 2887-2910). NCCL's
#   device per collective: `torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp` —
#   `usedDeviceIdxs_` ("Device Indexes used for all collectives in this group"), `guessDeviceId`.
# - `torch/utils/data/distributed.py` — `DistributedSampler.__iter__`: pads the indices to a
#   multiple of `num_replicas` by appending the first ones (`indices += indices[:padding_size]`;
#   the list repeated, lines 118-124, when the padding is longer than it), or truncates them locally with `drop_last=True`, then deals them out
#   (`indices[rank:total_size:num_replicas]`); `set_epoch` seeds the shuffle with
#   `seed + epoch`; the class docstring: `seed` "should be identical across all processes".
# - `torch/utils/data/sampler.py` — `RandomSampler.__iter__`: `torch.randperm(n,
#   generator=generator)`, the same permutation as `DistributedSampler` for the same seed.
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel.__init__`
#   (`forward_sync_buffers`, the deprecated `broadcast_buffers`; lines 960-990: the
#   deprecation's `FutureWarning`, and `init_sync_buffers` is `True` whenever
#   `forward_sync_buffers` is given, else the old flag's value; lines 1062-1073:
#   `_sync_module_states(..., broadcast_buffers=init_sync_buffers)` when `init_sync`;
#   `require_forward_param_sync`
#   starting on, `mixed_precision` / `_MixedPrecision.reduce_dtype`, and the
#   `batched_grad_copy` doc on `gradient_as_bucket_view` with `zero_grad(set_to_none=True)`),
#   `_pre_forward` (`_check_sync_bufs_pre_fwd` → `_sync_buffers`; with `Join`,
#   `_check_global_requires_backward_grad_sync`), `_post_forward` (sets
#   `require_forward_param_sync` from `torch.is_grad_enabled() and
#   require_backward_grad_sync`, and only then calls `reducer.prepare_for_backward`, so the
#   forward decides whether the next backward all-reduces; walks the graph only `if self.find_unused_parameters and not
#   self.static_graph`), `will_sync_module_buffers`, `_sync_buffers` (rank 0 is the
#   authoritative copy; under `Join`, `_find_common_rank` picks it), `no_sync`
#   (`require_backward_grad_sync`), `join` and `_DDPJoinHook` (zero all-reduces for joined
#   ranks, `divide_by_initial_world_size`), `_sync_final_model` (broadcasts `self.module` only:
#   its buffers only with `broadcast_buffers=self.forward_sync_buffers`; from
#   `_find_common_rank(rank, is_last_joiner)`, an all-reduce MAX of the rank, -1 for the
#   others: the highest of the last joiners, `is_last_joiner` from `Join.__exit__`),
#   `register_comm_hook`.
#   `join_hook` passes `divide_by_initial_world_size` (default `True`) to `_DDPJoinHook`
#   (section 5).
# - `torch/distributed/algorithms/join.py` — `Join`, `Join.notify_join_context` (the
#   notification all-reduce each iteration), `throw_on_early_termination` (`Join.__exit__`).
# - `torch/include/torch/csrc/distributed/c10d/gloo/ProcessGroupGlooDetail.hpp` — the gloo
#   all-reduce work: `ReduceOp::AVG` is run as a sum, then `tensors[0] /= context_->size`
#   ("Gloo doesn't support AVG so we use SUM + division"; section 4).
# - `torch/distributed/algorithms/ddp_comm_hooks/mixed_precision_hooks.py` —
#   `_reducer_allreduce_and_upcast_hook`: with DDP's `mixed_precision`, the bucket is cast to
#   `reduce_dtype` before the all-reduce, divided by the group's size, and the parameters and
#   gradients cast back (section 8).
# - `torch/include/torch/csrc/distributed/c10d/reducer.hpp` — `local_used_map_`,
#   `all_reduce_local_used_map` (the used-parameter bitmap, all-reduced every iteration with
#   `find_unused_parameters=True`), `should_rebuild_buckets` (`(static_graph_ ||
#   !find_unused_parameters_) && !has_rebuilt_bucket_`), `div_factor_` ("Division factor for
#   reduction of gradients. Equal to the process group size, with an exception of handling
#   uneven input."), `all_reduce_bucket` ("kick off all reduce for the ready bucket": the
#   reducer starts DDP's gradient all-reduce in C++, no Python `dist.all_reduce` call, so
#   section 5's recorder does not see it).
# - `torch/profiler/profiler.py` — `profile`: the process group's `gloo:all_reduce` records
#   counted in section 10.
# - `torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py` — `fp16_compress_hook`,
#   `bf16_compress_hook`: the bucket is cast to 16 bits for the all-reduce; `allreduce_hook`
#   (`_allreduce_fut`: `tensor.div_(group_to_use.size())`, then `dist.all_reduce`), what
#   `dp.counting_allreduce_hook` does. Without a hook the reducer divides by `div_factor_`
#   (`torch/include/torch/csrc/distributed/c10d/reducer.hpp`) as it copies each gradient into
#   its bucket (`Reducer::mark_variable_ready_dense`, in the reducer's C++ source
#   `reducer.cpp`, which is not installed: lesson 07's Sources).
# - `torch/distributed/constants.py` — `default_pg_timeout` (30 minutes) and
#   `default_pg_nccl_timeout` (from the C++ core's `_DEFAULT_PG_NCCL_TIMEOUT`, 10 minutes; the
#   claim in section 5 reads both).
# - `torch/nn/modules/batchnorm.py` — `SyncBatchNorm.forward`: in training, inside an
#   initialised process group, it first raises on a tensor that is not on a CUDA, HPU, XPU or
#   PrivateUse1 device ("expected input tensor to be on GPU or XPU or …"), and only then sets
#   `need_sync = world_size > 1`, falling back to `F.batch_norm` for one rank (and outside a group, or in eval mode). `torch/nn/modules/_functions.py` — `SyncBatchNorm.forward` /
#   `backward`: all_gather of `[mean, invstd, count]` combined by
#   `batch_norm_gather_stats_with_counts`, all_reduce of two per-channel sums only `if
#   self.needs_input_grad[0]`.
# - `torch/optim/sgd.py`, `torch/optim/adam.py` — where weight decay is added to the gradient
#   (Adam: unless `decoupled_weight_decay`, then `param.mul_(1 - lr * weight_decay)`) and Adam
#   divides by the root of its second moment; `torch/optim/adamw.py` — `AdamW` is `Adam` with
#   `decoupled_weight_decay=True`.
# - `torch/include/ATen/autocast_mode.h` — `WrapFunction_` for `CastPolicy::lower_precision_fp`
#   passes every argument through `cached_cast`: eligible tensors, float32 weights too, are cast
#   (section 8).
# - `torch/cuda/__init__.py` — `is_bf16_supported(including_emulation=False)`: true on ROCm
#   and on CUDA devices of compute capability 8.0 or more (`get_device_properties(...).major >= 8`).
# - `torch/nn/utils/clip_grad.py` — `clip_grad_norm_` → `_clip_grads_with_norm_`:
#   `clip_coef = max_norm / (total_norm + 1e-6)`, clamped to 1, multiplies every gradient.
# - `torch/distributed/flight_recorder/fr_trace.py` — the flight recorder's trace analyzer
#   (merges the ranks' dumps, finds the first mismatch); `torch/lib/libtorch_cuda.so` and
#   `torch/lib/libtorch_cpu.so` — the variables `TORCH_NCCL_TRACE_BUFFER_SIZE`,
#   `TORCH_NCCL_DUMP_ON_TIMEOUT`.
# - `torch/distributed/__init__.py` — `set_debug_level`, `DebugLevel` (from the C++ core);
#   `torch/lib/libtorch_cpu.so` — "Detected mismatch between collectives on ranks".
# - `nvidia/nccl/lib/libnccl.so.2` (NCCL 2.30.7) — "Multiple Ranks are using the same
#   GPU/Partition"; `torch/lib/libtorch_cuda.so` — "Guessing device ID based on global rank".
#
# Outside the installed packages: P. Goyal et al., *Accurate, Large Minibatch SGD: Training
# ImageNet in 1 Hour* (2017), the linear scaling rule and warm-up; S. Malladi et al., *On the
# SDEs and Scaling Rules for Adaptive Gradient Algorithms* (NeurIPS 2022), square-root scaling
# for Adam; PyTorch's documentation of
# torchrun and of `Join` (pytorch.org/docs).
