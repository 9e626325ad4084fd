# %% [markdown]
# # Lab 10 · Bug hunt: five broken torchrun scripts
#
# Lesson 10 ran broken distributed programs safely and showed how each bug betrays itself.
# Now you hunt five bugs the lesson did not show. Each script below trains the same tiny model
# (6 → 8 → 1) on the same 48 examples, 3 epochs on every rank, and saves rank 0's weights to
# `--out`; each has **one** classic data-parallel bug. A correct script ends with the weights
# of one process training on the global batch, whatever the number of ranks.
#
# Here "bug N" is script N's bug (`lab10.show(N)`), numbered from 1 as the zoo's are in lesson
# 10, but not the same bugs: lab bug 5, for one, is not the zoo's bug 5.
#
# For each script, in this order:
#
# 1. **Find it yourself.** `lab10.show(n)` prints the script with line numbers. Set `lineN` to
#    the number of the line where the bug is, and `effectN` to the number that answers the
#    bug's question about what the script does (each bug's section asks it; work it out from
#    the script's own lines), then run `lab10.check_line(n, lineN, effectN)`. Where a bug lies
#    in two lines, either one counts as its line. The check judges
#    your number before the line (a line given with a wrong number is neither confirmed nor
#    refused), and only a right line shows the options.
# 2. **Name it.** Set `answerN` to the letter of the option that says what is wrong.
# 3. **Fix it.** Build `fixedN`, the fixed script's text, from `brokenN`. Change as little as
#    the bug needs; any fix that trains right passes. `brokenN.replace("old piece", "new
#    piece")` edits within a line; three line tools edit whole lines, each found by a piece
#    that must match exactly one line, with no indentation or line ending to type:
#    `lab10.delete_line(text, "piece")`, `lab10.insert_line(text, "new line", before="piece")`
#    and `lab10.move_line(text, "piece", before="piece of another line")`. An inserted or
#    moved line takes the indentation of its `before` line: before a line inside a loop, it
#    lands inside that loop.
#
# At the end one check runs your five fixes under `torchrun` (all at once: a launch costs
# seconds) with `--seed 3`, bug 5's on **3** ranks, and compares the weights each saves with a
# correct data-parallel run. If a fix is still wrong, it names the mistake your weights (or
# your text) reproduce.
#
# Stretch: a detector for replicas that differ, `replicas_in_sync(model)`.

# %% tags=["parameters"]
timeout = 90  # seconds the check gives each torchrun run

# %%
import torch
import torch.distributed as dist

from dpcourse.checks import lab10, predict

# %% [markdown]
# ## Bug 1
#
# The gradients are averaged by hand after `backward` (no DDP wrapper here).
#
# `effect1`: this script seeds three random streams (the data's generator, the sampler's
# shuffle, `torch.manual_seed`). With the check's `--seed 3` on 2 ranks: the sum of the three
# seeds that rank 1's lines pass, each as its line writes it (a number).

# %%
broken1 = lab10.script(1)
lab10.show(1)

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# In one epoch, which examples does rank 0 read, and which does rank 1 read? Do the two ranks
# together read the data set exactly once?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# A `DistributedSampler` does not pick examples for its rank alone: every rank builds the same
# shuffled order of all 48 indices and keeps its own slice of it. What has to be the same on
# every rank for the slices to fit together?
#
# </details>

# %%
### BEGIN SOLUTION: line1 (a line number) and effect1 (a number)
line1 = 21
effect1 = 1241
### END SOLUTION
lab10.check_line(1, line1, effect1)

# %%
### BEGIN SOLUTION: answer1, the letter of the option that says what is wrong
answer1 = "B"
### END SOLUTION
lab10.check_answer(1, answer1)

# %% [markdown]
# **Predict, then count.** With this script on 2 ranks, how many *different* examples of the
# 48 does one epoch train on (both ranks together)? Reason it out before you run the count:
# within 6 of it counts as close.

# %%
### BEGIN SOLUTION: your prediction (a number of examples, 0 to 48)
my_guess = 36
### END SOLUTION
guess = predict("lab10", "distinct examples script 1 reads in one epoch", my_guess,
                unit="examples")

# %%
lab10.check_prediction(guess)

# %%
### BEGIN SOLUTION: fixed1, the fixed script's text
fixed1 = broken1.replace("seed=args.seed + rank", "seed=args.seed")
### END SOLUTION

# %% [markdown]
# ## Bug 2
#
# This one runs to the end, and its loss falls.
#
# `effect2`: on 2 ranks, how many examples rank 1 reads in one epoch (a number of examples).

# %%
broken2 = lab10.script(2)
lab10.show(2)

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Which object decides which examples a rank reads, and in which order? Follow it from where
# it is built to where the batches come from.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# An object that is built, and even told which epoch starts, does nothing unless the loop reads
# through it. Two ranks that read the same examples in the same order compute the same
# gradient: averaging them is averaging one rank with itself.
#
# </details>

# %%
### BEGIN SOLUTION: line2 (a line number) and effect2 (a number)
line2 = 22
effect2 = 48
### END SOLUTION
lab10.check_line(2, line2, effect2)

# %%
### BEGIN SOLUTION: answer2, the letter of the option that says what is wrong
answer2 = "C"
### END SOLUTION
lab10.check_answer(2, answer2)

# %%
### BEGIN SOLUTION: fixed2, the fixed script's text
fixed2 = broken2.replace("batch_size=4, shuffle=True)", "batch_size=4, sampler=sampler)")
### END SOLUTION

# %% [markdown]
# ## Bug 3
#
# Gradient clipping, as on one device. `clip_grad_norm_(params, max_norm)` computes one 2-norm
# over all the gradients it is given and multiplies every one of them by
# `max_norm / (norm + 1e-6)`, clamped to at most 1 (torch's formula, as in lesson 10).
#
# `effect3`: take rank 0's gradient `g₀ = (3, 0)`, rank 1's `g₁ = (0, 1)` and `max_norm = 1`
# (instead of the script's 0.2). The first component of the gradient this script's
# `opt.step()` uses, to 2 decimals (the check accepts ±0.01).

# %%
broken3 = lab10.script(3)
lab10.show(3)

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# On one device, which gradient is clipped: the gradient of which batch? Here, which gradient
# does each rank clip?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# With `effect3`'s gradients `g₀ = (3, 0)` and `g₁ = (0, 1)` and `max_norm = 1`, work out by
# hand the gradient one device would step with on their global batch (the mean, then one
# clip), and set it beside the one this script steps with. When would the two agree?
#
# </details>

# %%
### BEGIN SOLUTION: line3 (a line number) and effect3 (a number)
line3 = 33
effect3 = 0.5
### END SOLUTION
lab10.check_line(3, line3, effect3)

# %%
### BEGIN SOLUTION: answer3, the letter of the option that says what is wrong
answer3 = "D"
### END SOLUTION
lab10.check_answer(3, answer3)

# %%
### BEGIN SOLUTION: fixed3, the fixed script's text
fixed3 = lab10.move_line(broken3, "clip_grad_norm_", before="opt.step()")
### END SOLUTION

# %% [markdown]
# ## Bug 4
#
# Under torchrun this one never gets to its first step. Run it yourself if you like, in a
# terminal: `timeout 30 torchrun --nproc-per-node=2 bug4_start.py --out /tmp/final.pt` in the
# folder `lab10.SCRIPT_DIR` (print it to see where), or `python -m dpcourse diagnose` on it.
#
# `effect4`: on 2 ranks, in the first `dist.broadcast`, how many ranks get their tensor from
# another rank (a number of ranks; a sender, which keeps its own tensor, does not count).

# %%
broken4 = lab10.script(4)
lab10.show(4)

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# The run stops before the first step: which collective is the first one every rank calls, and
# what does each rank expect the others to do in it?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# A rooted collective (a broadcast, a reduce) needs every rank to name the same root: one
# sender, everyone else a receiver. Which rank does each rank name here?
#
# </details>

# %%
### BEGIN SOLUTION: line4 (a line number) and effect4 (a number)
line4 = 28
effect4 = 0
### END SOLUTION
lab10.check_line(4, line4, effect4)

# %%
### BEGIN SOLUTION: answer4, the letter of the option that says what is wrong
answer4 = "B"
### END SOLUTION
lab10.check_answer(4, answer4)

# %% [markdown]
# What must hold after your fix: every replica starts from one rank's initial weights (any one
# rank's is right: the check compares with a correct run started from each rank's in turn), and
# each rank keeps its own random stream, as the script's comment asks.

# %%
### BEGIN SOLUTION: fixed4, the fixed script's text
fixed4 = broken4.replace("src=rank", "src=0")
### END SOLUTION

# %% [markdown]
# ## Bug 5
#
# This one runs on 3 ranks in the check.
#
# `effect5`: on 3 ranks, how many times smaller the gradient `opt.step()` uses is than the
# gradient of one device's mean loss over the global batch (a factor; the same counts as 1).
#
# **Your design decision:** once you know what is wrong, decide where to repair it: more than
# one repair trains right, and they do not leave the same script behind. Then answer three
# questions about *your* repair; the check judges each answer against the code of your
# `fixed5`, so each has one right value per repair:
#
# - `bug5_kept`: the number of the line (as `lab10.show(5)` numbers the broken script) whose
#   division by the world size your fix kept;
# - `bug5_loss_holds`: the number `loss` holds on one rank after your fix: `"this rank's mean"`,
#   `"this rank's mean / world_size"` or `"the global mean"`;
# - `bug5_under_ddp`: someone later moves your fixed loop to DDP, which averages the gradients
#   over the ranks itself, deletes the hand-written `all_reduce` loop and changes nothing else.
#   On 3 ranks, how many times smaller than one device's gradient (of its mean loss over the
#   global batch) is the gradient `opt.step()` then uses? (1 if the same.)

# %%
broken5 = lab10.script(5)
lab10.show(5)

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Follow one gradient from the loss to `opt.step()`. What is it multiplied or divided by on
# the way, and what should it be divided by in the end?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# A constant factor in the loss is a constant factor in every gradient (the backward is
# linear in the loss). The average over ranks needs exactly one division by the world size.
#
# </details>

# %%
### BEGIN SOLUTION: line5 (a line number) and effect5 (a number)
line5 = 30
effect5 = 3
### END SOLUTION
lab10.check_line(5, line5, effect5)

# %%
### BEGIN SOLUTION: answer5, the letter of the option that says what is wrong
answer5 = "C"
### END SOLUTION
lab10.check_answer(5, answer5)

# %%
### BEGIN SOLUTION: fixed5, the fixed script's text
fixed5 = broken5.replace("F.mse_loss(model(xb), yb) / world_size", "F.mse_loss(model(xb), yb)")
### END SOLUTION

# %%
### BEGIN SOLUTION: bug5_kept (a line), bug5_loss_holds (from the list), bug5_under_ddp
bug5_kept = 35
bug5_loss_holds = "this rank's mean"
bug5_under_ddp = 1
### END SOLUTION
lab10.check_decision(fixed5, bug5_kept, bug5_loss_holds, bug5_under_ddp)

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
# A workshop can stop here. The zoo's bugs 4 and 5 in lesson 10 were silent: the runs ended,
# the loss even fell, but the replicas did not agree. Write the detector you would call after building
# the model, or every few steps. The contract:
#
# - `replicas_in_sync(model)` is called on every rank of a process group, each with its own
#   replica of one architecture (the same parameters in the same order, of the same shapes and
#   dtypes on every rank; only their values may differ);
# - it returns one verdict, a Python `bool`, the same on every rank: **True exactly when every
#   rank's parameters are identical, bit for bit**;
# - `model` is whatever model the job trains: parameters of any floating dtype, any shape,
#   any size;
# - it must not change the parameters;
# - it runs under the job's backend: under NCCL every tensor a collective takes lives on the
#   parameters' GPU. The check runs gloo on the CPU, where it cannot see this: it is yours.
#
# The check runs it on 3 ranks over many pairs of replicas, alike and not, and names the way
# your verdict went wrong from what it saw across them.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# A rank can only compare what it holds. What does a rank need from the others to decide, and
# once each rank has its own verdict, how do the ranks end up with one verdict?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Any single number that summarizes the weights (a sum, a norm, a weighted checksum) maps
# different weights to the same number somewhere, so no summary will do. Lesson 03 compared
# two local tensors bit for bit (`same_bits`): what changes when the two tensors live on
# different ranks, and when the parameters may be of any dtype? Then combine the ranks'
# verdicts so that one rank's "no" wins.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Three pieces: all parameters as one flat tensor of their bits, in one form that fits every
# dtype; a copy of one rank's flat tensor on every rank (a rooted collective into a clone,
# never into the parameters); a 0/1 number per rank, reduced with the operation under which
# any 0 wins.
#
# </details>

# %%
def replicas_in_sync(model):
    ### BEGIN SOLUTION: True on every rank when all replicas are equal, else False on every rank
    # the bits of every parameter, as bytes: NaN equals itself, -0.0 differs from +0.0
    flat = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    # the verdict travels on the parameters' device: NCCL takes CUDA tensors only
    same = torch.tensor([1.0 if torch.equal(flat, reference) else 0.0], device=flat.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item() == 1.0)
    ### END SOLUTION


# %%
lab10.check_replicas_in_sync(replicas_in_sync)
