# %% [markdown]
# # Lab 10 · Bug hunt: five broken torchrun scripts
#
# Lesson 10 ran broken distributed programs safely and showed how each bug betrays itself.
# Now you hunt — five bugs the lesson did not show. Below are five short torchrun scripts. Each trains the same tiny model
# (6 → 8 → 1) on the same 48 examples, 3 epochs on every rank, and saves rank 0's weights to
# `--out`. Each has **one** classic data-parallel bug. For each script:
#
# 1. read it and **name the bug**: set `answerN` to the letter of the right option (the check
#    says why a wrong option is not it);
# 2. **fix it**: build `fixedN`, the fixed script's text, from `brokenN`. Change as little as
#    the bug needs; any fix that trains right passes. Two tools, neither needing exact
#    indentation or line endings: `brokenN.replace("old piece", "new piece")` changes a
#    piece of a line, and `lab10.move_line(brokenN, "piece of the line", before="piece of
#    another line")` moves one whole line (re-indented to fit) — for a bug where a line is
#    right but in the wrong place.
#
# At the end, one check runs your five fixed scripts under `torchrun` (all at once: a launch
# costs seconds) with `--seed 3` — bug 5's on **3** ranks — and compares the weights each one
# saves with a correct data-parallel run. If a fix is still wrong, it names the bug your
# weights reproduce.
#
# Stretch: write a detector for replicas that differ, `replicas_in_sync(model)`.

# %% tags=["parameters"]
timeout = 90  # seconds the check gives each torchrun run

# %%
import torch
import torch.distributed as dist

from dpcourse.checks import lab10

# %% [markdown]
# ## Bug 1
#
# The gradients are averaged by hand after `backward` (no DDP wrapper here). Read the sampler
# line slowly.

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
fixed1 = broken1.replace("seed=args.seed + rank", "seed=args.seed")
### END SOLUTION

# %% [markdown]
# ## Bug 2
#
# This one runs, the loss falls, and every rank logs nothing suspicious.

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
fixed2 = broken2.replace("batch_size=4, shuffle=True)", "batch_size=4, sampler=sampler)")
### END SOLUTION

# %% [markdown]
# ## Bug 3
#
# Gradient clipping, as on one device. The replicas agree at every step here — check that
# claim against the options before you answer.

# %%
broken3 = lab10.script(3)
lab10.show(3)

# %%
### BEGIN SOLUTION: answer3 = the letter of the right option, e.g. "A"
answer3 = "D"
### END SOLUTION
lab10.check_answer(3, answer3)

# %%
### BEGIN SOLUTION: fixed3 = broken3.replace(..., ...) or lab10.move_line(broken3, ..., before=...)
fixed3 = lab10.move_line(broken3, "clip_grad_norm_", before="opt.step()")
### END SOLUTION

# %% [markdown]
# ## Bug 4
#
# Under torchrun this one never gets to its first step. Run it yourself if you like, in a
# terminal: `timeout 30 torchrun --nproc-per-node=2 bug4_start.py --out /tmp/final.pt` in
# the folder `lab10.SCRIPT_DIR` (print it to see where).

# %%
broken4 = lab10.script(4)
lab10.show(4)

# %%
### BEGIN SOLUTION: answer4 = the letter of the right option, e.g. "A"
answer4 = "B"
### END SOLUTION
lab10.check_answer(4, answer4)

# %%
### BEGIN SOLUTION: fixed4 = broken4.replace(..., ...)
fixed4 = broken4.replace("src=rank", "src=0")
### END SOLUTION

# %% [markdown]
# ## Bug 5
#
# This one runs on 3 ranks in the check.

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
fixed5 = broken5.replace("F.mse_loss(model(xb), yb) / world_size", "F.mse_loss(model(xb), yb)")
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
# ## Stretch (optional): a detector for replicas that differ
#
# A workshop can stop here. Lesson 10's bugs 4 and 5 were silent: the runs ended, the loss
# even fell, but the replicas did not agree. Write the detector you would call after building the model (or every
# few steps): `replicas_in_sync(model)` returns **True on every rank** when every rank's
# parameters are exactly equal, and **False on every rank** when any replica differs anywhere.
# It must not change the parameters. Hints: flatten the parameters into one tensor; compare
# with rank 0's copy (`dist.broadcast` a clone); then the ranks must agree on one verdict
# (`dist.all_reduce` with `dist.ReduceOp.MIN` on a 0/1 tensor).
#
# The check runs it on 3 ranks: equal replicas, then replicas that differ in ways a summary
# misses — rank 2's off by +1e-3 in one weight and −1e-3 in the next (a plain sum cannot see
# that; lesson 10's position-weighted checksum can), two of rank 2's weights swapped, one of
# its weights' sign flipped (a norm sees neither), rank 1's last parameter off — and it names
# the ways to get the verdict wrong.

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
