# %% [markdown]
# # Lab 10 · Bug hunt: five broken torchrun scripts
#
# Lesson 10 ran broken distributed programs safely and showed how each bug betrays itself.
# Now you hunt. Below are five short torchrun scripts. Each trains the same tiny model
# (6 → 8 → 1) on the same 48 examples, 3 epochs on every rank, and saves rank 0's weights to
# `--out`. Each has **one** classic data-parallel bug. For each script:
#
# 1. read it and **name the bug**: set `answerN` to the letter of the right option (the check
#    says why a wrong option is not it);
# 2. **fix it**: build `fixedN`, the fixed script's text, from `brokenN` with `str.replace`
#    (change as little as the bug needs).
#
# At the end, one check runs your five fixed scripts under `torchrun` (all at once: a launch
# costs seconds) with `--seed 3` — bug 5's on **3** ranks — and compares the weights each one
# saves with a correct data-parallel run. If a fix is still wrong, it names the bug your
# weights reproduce.
#
# Stretch: write the detector for bug 1, `replicas_in_sync(model)`.

# %% tags=["parameters"]
timeout = 90  # seconds the check gives each torchrun run

# %%
import torch
import torch.distributed as dist

from dpcourse.checks import lab10

# %% [markdown]
# ## Bug 1
#
# The gradients are averaged by hand after `backward` (no DDP wrapper here).

# %%
broken1 = lab10.script(1)
lab10.show(1)

# %%
### BEGIN SOLUTION: answer1 = the letter of the right option, e.g. "A"
answer1 = "B"
### END SOLUTION
lab10.check_answer(1, answer1)

# %%
### BEGIN SOLUTION: fixed1 = broken1.replace(..., ...)
fixed1 = broken1.replace("torch.manual_seed(args.seed + rank)", "torch.manual_seed(args.seed)")
### END SOLUTION

# %% [markdown]
# ## Bug 2
#
# This one logs an averaged loss at every epoch: rank 0 prints the mean over all ranks.

# %%
broken2 = lab10.script(2)
lab10.show(2)

# %%
### BEGIN SOLUTION: answer2 = the letter of the right option, e.g. "A"
answer2 = "C"
### END SOLUTION
lab10.check_answer(2, answer2)

# %%
### BEGIN SOLUTION: fixed2 = broken2.replace(..., ...)
fixed2 = broken2.replace(
    "        loss.backward()\n",
    "        loss.backward()\n"
    "        for p in model.parameters():  # average the gradients over the ranks\n"
    "            dist.all_reduce(p.grad)\n"
    "            p.grad /= world_size\n")
### END SOLUTION

# %% [markdown]
# ## Bug 3
#
# This one uses the DDP wrapper.

# %%
broken3 = lab10.script(3)
lab10.show(3)

# %%
### BEGIN SOLUTION: answer3 = the letter of the right option, e.g. "A"
answer3 = "A"
### END SOLUTION
lab10.check_answer(3, answer3)

# %%
### BEGIN SOLUTION: fixed3 = broken3.replace(..., ...)
fixed3 = broken3.replace("    for xb, yb in loader:",
                         "    sampler.set_epoch(epoch)\n    for xb, yb in loader:")
### END SOLUTION

# %% [markdown]
# ## Bug 4
#
# Under torchrun this one does not end well. Run it yourself if you like, in a terminal:
# `torchrun --nproc-per-node=2 bug4_log.py --out /tmp/final.pt` in the folder
# `lab10.SCRIPT_DIR` (print it to see where).

# %%
broken4 = lab10.script(4)
lab10.show(4)

# %%
### BEGIN SOLUTION: answer4 = the letter of the right option, e.g. "A"
answer4 = "D"
### END SOLUTION
lab10.check_answer(4, answer4)

# %%
### BEGIN SOLUTION: fixed4 = broken4.replace(..., ...)
inside = "        logged = loss.detach().clone()\n        dist.all_reduce(logged)\n"
outside = ("    logged = loss.detach().clone()  # every rank joins the collective\n"
           "    dist.all_reduce(logged)\n")
fixed4 = broken4.replace(inside, "").replace("    if rank == 0:", outside + "    if rank == 0:")
### END SOLUTION

# %% [markdown]
# ## Bug 5

# %%
broken5 = lab10.script(5)
lab10.show(5)

# %%
### BEGIN SOLUTION: answer5 = the letter of the right option, e.g. "A"
answer5 = "C"
### END SOLUTION
lab10.check_answer(5, answer5)

# %%
### BEGIN SOLUTION: fixed5 = broken5.replace(..., ...)
fixed5 = broken5.replace("dist.all_reduce(p.grad)\n",
                         "dist.all_reduce(p.grad)\n            p.grad /= world_size\n")
### END SOLUTION

# %% [markdown]
# ## Check the five fixes
#
# Each fixed script runs under `torchrun` (2 ranks; bug 5's on 3) and must end with the weights
# of a correct data-parallel run, computed in this process with every rank's replica side by
# side (`lab10.simulate`). About 30 s on two cores. To check one fix alone:
# `lab10.check_fix(1, fixed1)`.

# %%
lab10.check_fixes({1: fixed1, 2: fixed2, 3: fixed3, 4: fixed4, 5: fixed5}, timeout=timeout)

# %% [markdown]
# ## Stretch (optional): a detector for bug 1
#
# A workshop can stop here. Bug 1 is silent: the run ends, the loss even falls, but the
# replicas never agreed. Write the detector you would call after building the model (or every
# few steps): `replicas_in_sync(model)` returns **True on every rank** when every rank's
# parameters are exactly equal, and **False on every rank** when any replica differs anywhere.
# It must not change the parameters. Hints: flatten the parameters into one tensor; compare
# with rank 0's copy (`dist.broadcast` a clone); then the ranks must agree on one verdict
# (`dist.all_reduce` with `dist.ReduceOp.MIN` on a 0/1 tensor).
#
# The check runs it on 3 ranks: equal replicas; rank 2's replica off by +1e-3 in one weight and
# −1e-3 in another (a checksum cannot see that); rank 1's last parameter off.

# %%
def replicas_in_sync(model):
    ### BEGIN SOLUTION: compare every rank's parameters with rank 0's; one verdict on every rank
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    same = torch.tensor([1.0 if torch.equal(flat, reference) else 0.0])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item() == 1.0)
    ### END SOLUTION


# %%
lab10.check_replicas_in_sync(replicas_in_sync)
