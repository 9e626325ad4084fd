# %% [markdown]
# # Lab 02 · DataParallel's step by hand
#
# Lesson 02 took `nn.DataParallel` apart, with replicas that autograd ties back to the module.
# Now you write its step yourself, on simulated devices, with **plain copies** of the model
# (`copy.deepcopy`): nothing links their parameters to the original's, so what the backward of
# a broadcast did for the lesson is yours to do. The pieces and their contracts:
#
# 1. `scatter(X, n_devices) -> list (or tuple) of tensors`: contiguous chunks of `X` along dim
#    0, in order (concatenated, they are `X`), at most one per device and none empty, sized as
#    **your choice** of §1 says; an empty batch and zero devices are refused with a
#    `ValueError` that says so. The prediction after it shows what your choice does.
# 2. `gather(outputs)`: the devices' outputs as `nn.DataParallel` hands them to its caller —
#    the one tensor the loss compares with `y` when each device's output is a tensor, and, when
#    the model returns a tuple of tensors (say `(logits, features)`), what the caller of
#    `nn.DataParallel(model)` unpacks from it, a tuple (or a list).
# 3. Two predictions about gradients, each then measured: what one copy's holds, and what
#    `model`'s holds after a DataParallel step.
# 4. `dp_forward_backward(model, X, y, n_devices) -> float`: one DataParallel step's forward
#    and backward. Every chunk, chunk 0 included, runs on a copy of `model` of its own, made by
#    `copy.deepcopy` (no parameter of it shared with `model`); `model` itself runs no forward.
#    The copies run at the same time, one thread each, through `dp.parallel_apply`, as the
#    real class runs them; the chunks come from your `scatter` and
#    the outputs go through your `gather`. It returns the mean cross-entropy over the whole
#    batch, as a float. Afterwards `model` — its weights, its gradients, its buffers — is what it
#    would be after the forward and `backward()` of `nn.DataParallel(model)` on `n_devices`
#    devices, whatever state it arrived in.
# 5. Three predictions, then the same step on a module with state of its own,
#    `lab02.SampleCounter`: afterwards every buffer of `model` (persistent or not) and every
#    plain attribute holds what `nn.DataParallel(model)` would leave there, as torch's own
#    `replicate` builds the replicas. Part 5 holds **the lab's design decision**: what of the
#    copies' state comes back to `model`, and from which copy. You change your part-4 step for
#    it (part 5's check reruns part 4's first).
#
# Each part has a check cell that names your mistake, if there is one, and hints behind clicks.
# The checks compare with the library's `dpcourse.dp`, whose `scatter`, `gather`, `replicate`
# and `parallel_apply` your answers may not hand their work to: the checks refuse them, with
# one exception, `dp.parallel_apply` in part 4 (the stretch writes your own; putting it in your
# step afterwards is optional).

# %%
import copy

import torch
import torch.nn.functional as F

from dpcourse import dp
from dpcourse.checks import lab02, predict

torch.set_num_threads(1)

# %% [markdown]
# ## 1. `scatter`
#
# **Your choice (both are accepted):** when N does not divide B, how big is each chunk?
# `"like DataParallel"`: the chunks `nn.DataParallel` itself cuts (lesson 02 §1). `"balanced"`:
# sizes that differ by at most one, over every device the batch can feed, the larger ones
# first. Neither is wrong, and the check does not grade the choice; what this part asks you to
# work out is the prediction after it: what your choice does to the devices over many batch
# sizes. Write your choice in `chunk_sizes`; the check holds your `scatter` to it.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# For 10 samples on 4 devices, which sizes does each choice give? Which sample goes to which
# device, if the outputs are to line up with `y` after `gather`?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Work out the list of sizes first (its length is the number of chunks, never zero-sized
# entries), then cut `X` along its first dimension at the running totals of that list. Torch
# has functions that cut a tensor into pieces of given sizes, or into a given number of pieces.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Three steps, in this order: turn away the inputs the contract refuses; decide the list of
# chunk sizes from B and N alone (how many entries, what they add up to, which ones are
# larger); cut `X` once, along dim 0, at those sizes.
#
# </details>

# %%
### BEGIN SOLUTION: your choice: "like DataParallel" or "balanced"
chunk_sizes = "like DataParallel"  # the step's time is set by the largest chunk either way;
# filling in turn leaves a device free instead of giving it one sample's worth of work.
### END SOLUTION


def scatter(X, n_devices):
    """At most n_devices contiguous, non-empty chunks of X along dim 0, in order."""
    ### BEGIN SOLUTION: contiguous chunks of X along dim 0, sized as you decided
    if X.shape[0] == 0 or n_devices < 1:
        raise ValueError(f"scatter: nothing to split ({X.shape[0]} samples, {n_devices} devices)")
    return list(torch.chunk(X, n_devices, dim=0))
    ### END SOLUTION


lab02.check_scatter(scatter, sizes=chunk_sizes)

# %% [markdown]
# **Predict what your choice does.** Lesson 02 showed single batches; take them all. On 8
# devices, for how many of the batch sizes 1, 2, ..., 32 does *your* `scatter` leave at least
# one device without a sample? Write a number; the next cell counts it with your function and
# says what your choice costs or saves in a step.

# %%
### BEGIN SOLUTION: set my_idle_guess to your prediction (a number of batch sizes)
my_idle_guess = 22
### END SOLUTION
idle_guess = predict("lab02", "batch sizes 1-32 on 8 devices that leave a device idle",
                     my_idle_guess, unit="batch sizes")
lab02.check_idle_prediction(idle_guess, scatter, sizes=chunk_sizes)

# %% [markdown]
# ## 2. `gather`
#
# The devices' outputs, joined as `nn.DataParallel` hands them to its caller (the contract at
# the top). Lesson 02's models return one tensor; a model may also return several — a
# classifier that hands back its features beside its logits, `return logits, features` — and
# the caller of `nn.DataParallel(model)` writes `logits, features = dp_model(X)` for the whole
# batch as it would for the plain model. The check tries both kinds of output.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Each output has shape (chunk size, classes). Along which dimension do the devices' outputs
# differ, and along which do they agree? When each device returns `(logits, features)`, which
# of the tensors in `outputs` belong together in the caller's `logits`?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Join them end to end along the samples' dimension, keeping the list's order; no new dimension.
# For tuples, do that once per position: every device's logits into one batch, every device's
# features into another, and hand the results back in the tuple's order.
#
# </details>

# %%
def gather(outputs):
    """The devices' outputs, in device order, as nn.DataParallel hands them to its caller."""
    ### BEGIN SOLUTION: the devices' outputs joined as nn.DataParallel hands them over
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs, dim=0)
    return tuple(gather(list(same_position)) for same_position in zip(*outputs))
    ### END SOLUTION


lab02.check_gather(gather)

# %% [markdown]
# ## 3. Predict, then measure: one copy's gradient
#
# Before you write the step, reason about what a copy's backward leaves in its `p.grad`. Take a
# batch of 10 samples that are all the *same* sample (and label), on 4 devices, cut as
# DataParallel cuts it: chunks of 3, 3, 3 and 1. The loss is one mean cross-entropy over all 10
# gathered outputs, and `backward()` runs through the four plain copies. **What fraction of the
# whole batch's gradient (the plain model's, on the 10 samples) does the last copy's gradient,
# the one that ran on 1 sample, hold?** Write a number; the check then runs exactly that with
# plain copies and measures it.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# The mean over 10 samples is a sum of 10 terms, each divided by 10. Which of those terms does
# the last copy's backward differentiate?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# A copy's gradient is the gradient of its own chunk's terms of the one mean, divided by the
# whole batch's size. With identical samples, every term has the same gradient: how many terms
# does the last copy hold?
#
# </details>

# %%
### BEGIN SOLUTION: set my_guess to your prediction (a number)
my_guess = 0.1
### END SOLUTION
guess = predict("lab02", "the 1-sample copy's fraction of the whole batch's gradient", my_guess)

# %%
lab02.check_prediction(guess)

# %% [markdown]
# **One more prediction before you write the step.** A model arrives holding gradients: every
# `p.grad` holds some G, left by an earlier backward (a loop that accumulates gradients over
# several batches before one optimizer step leaves exactly that). Call g the gradient the plain
# model would get on this step's batch alone. After one forward and `backward()` of
# `nn.DataParallel(model)` on 4 devices, what does `p.grad` hold? Choose one of
# `lab02.HELD_CHOICES`: `"g"`, `"G + g"`, `"G + g/4"`, `"4G + g"`. The next cell runs the
# lesson's `dp.data_parallel` on 4 CPU devices and compares: the course's own `dp.Broadcast`,
# not torch's (torch's `Broadcast.forward` refuses CPU tensors).

# %%
### BEGIN SOLUTION: set my_held_guess to your answer (one of lab02.HELD_CHOICES)
my_held_guess = "G + g"
### END SOLUTION
held_guess = predict("lab02", "p.grad after a DataParallel step on a model that held G",
                     my_held_guess, choices=lab02.HELD_CHOICES)
lab02.check_held_prediction(held_guess)

# %% [markdown]
# ## 4. `dp_forward_backward`
#
# The step, with the contract at the top of the lab: every chunk through a plain copy of its
# own (chunk 0's too: `model` itself runs no forward), the copies in threads, and afterwards
# `model` as `nn.DataParallel`'s forward and backward would leave it, whatever state it arrived
# in. Nothing ties a plain copy's parameters to `model`'s: what the real class gets from the
# broadcast and its backward, your code does.
#
# The rule that turns the copies' gradients into `model`'s is yours to work out; your two §3
# measurements are your evidence (and a fresh copy's `p.grad` is one print away), and the check
# refuses a wrong rule with the numbers it saw. Once it passes, it says why the rule is right.
#
# The check hands your function models in more than one state, batches
# that do and do not divide by the number of devices, and a training-mode model with BatchNorm
# (whose outputs then differ from the plain model's: for that one it looks at the buffers
# only). Every parameter of the check's models takes part in the loss; a parameter that gets no
# gradient (a layer the forward skips) is outside this contract. Part 5 then holds the same
# function to a module with state of its own.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# After the backward, where are the gradients — on `model`, or on the copies? What did your
# prediction in §3 say about how the copies' gradients relate to the whole batch's? What may
# `model` hold in `p.grad` when your function is called, and what does a copy start with? And
# the buffers the forwards wrote: on which modules are they, and which of those writes does
# `nn.DataParallel` leave on the module?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# One copy per chunk your `scatter` returns (print a fresh copy's `p.grad` if unsure what it
# starts with); one loss on the gathered outputs and one backward; then, parameter by
# parameter, combine what the copies received and add it to what `model` held, starting from
# nothing where `p.grad` is `None`. For the buffers: in `nn.DataParallel` one replica is not a
# copy at all — it shares the module's storage; plain copies share nothing, so what that
# replica's forward wrote is yours to bring back.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Four stages, in this order. Cut and copy: as many copies as chunks. Run and join: the copies
# on their chunks at once, the outputs as one batch. One loss and one backward. Then bring back:
# for each of `model`'s parameters, the matching parameter of every copy goes through your rule
# into `p.grad`, together with what was there; for each of its buffers, the matching buffer of
# the one copy whose writes `nn.DataParallel` keeps. The value returned is a plain number.
#
# </details>

# %%
def dp_forward_backward(model, X, y, n_devices):
    """One DataParallel forward/backward with plain copies; returns the loss as a float.

    Afterwards `model` is as nn.DataParallel(model)'s forward and backward would leave it.
    """
    ### BEGIN SOLUTION: the step on plain copies; model left as nn.DataParallel leaves it
    chunks = scatter(X, n_devices)
    # Copy 0 is handed model's own buffer tensors (the memo), as replica 0 is: what its forward
    # writes into them is model's; a tensor it binds to a buffer's name stays on the copy.
    own = {id(b): b for b in model.buffers()}
    replicas = [copy.deepcopy(model, own if i == 0 else None)
                for i in range(len(chunks))]  # as many copies as chunks
    loss = F.cross_entropy(gather(dp.parallel_apply(replicas, chunks)), y)
    loss.backward()
    for p, *copies in zip(model.parameters(), *(r.parameters() for r in replicas)):
        summed = sum(c.grad for c in copies)  # one mean over the batch: the shares add up
        p.grad = summed if p.grad is None else p.grad + summed
    return loss.item()
    ### END SOLUTION


lab02.check_dp_forward_backward(dp_forward_backward)

# %% [markdown]
# ## 5. What survives a replica
#
# `lab02.SampleCounter` is a linear classifier that keeps three records of what its
# training-mode forwards saw:
#
# ```python
# self.seen += x.shape[0]                                       # a buffer (persistent=False)
# self.peak = torch.maximum(self.peak, x.detach().abs().max())  # a buffer
# self.calls += 1                                               # a plain Python int
# ```
#
# Its `seen` holds 7, `peak` 0.5 and `calls` 5; then one training-mode forward of the real
# `nn.DataParallel(model)` runs 10 samples on 4 GPUs (chunks of 3, 3, 3 and 1; every chunk's
# largest `|x|` is above 0.5, and the batch's largest lies in chunk 2, not chunk 0). The
# replicas come from torch's `replicate`, not from `copy.deepcopy`.
#
# **Predict, before the contract:**
# 1. what the module's `seen` holds afterwards (a number);
# 2. what its `peak` holds afterwards: one of `lab02.PEAK_CHOICES`, `"0.5, as before"`,
#    `"chunk 0's largest |x|"` or `"the batch's largest |x|"`;
# 3. the same forward on a counter whose forward writes `seen` twice, `self.seen +=
#    x.shape[0]` and then `self.seen = torch.clamp(self.seen, max=10**6)` (a new tensor with
#    the same value): what its module's `seen` holds afterwards (a number; it too starts at 7).
#
# The next cell runs torch's own replica-building code on the CPU and says what it measured;
# why waits for part 5's check to pass.

# %%
### BEGIN SOLUTION: set my_seen_guess, my_peak_guess, my_rebound_seen_guess (your predictions)
my_seen_guess = 10
my_peak_guess = "0.5, as before"
my_rebound_seen_guess = 10
### END SOLUTION
state_guesses = (
    predict("lab02", "SampleCounter's seen (7 before) after one DataParallel forward",
            my_seen_guess, unit="samples"),
    predict("lab02", "SampleCounter's peak (0.5 before) after that forward", my_peak_guess,
            choices=lab02.PEAK_CHOICES),
    predict("lab02", "seen (7 before) of the counter that adds in place, then rebinds",
            my_rebound_seen_guess, unit="samples"))
lab02.check_state_predictions(*state_guesses)

# %% [markdown]
# **The contract.** Your `dp_forward_backward` of part 4, run on a `SampleCounter` (10 samples
# on 4 devices), must leave every buffer of `model` — `seen` and `peak` — and its `calls` as
# `nn.DataParallel(model)` would leave them, the buffers still the tensor objects `model` held
# before the step (as under `nn.DataParallel`, which never binds new ones to the module). The check builds the replicas with torch's own
# `torch.nn.parallel.replicate` (only its device copy is stood in for on the CPU, by one that
# does for every device what torch's C++ `broadcast_coalesced` does),
# runs them in threads and compares; then it tries two more modules with the same buffers,
# whose forwards treat them otherwise. It checks the state, and first reruns part 4's check on
# your step (what part 4 asks must still hold).
#
# **Your design decision:** what of the copies' state comes back to `model`, and from which
# copy. The lesson showed one kind of buffer coming back (BatchNorm's); your three predictions
# were about the others, and what was measured above is what your step must reproduce with
# plain copies, for these modules and for ones whose forwards write the same buffers
# otherwise. Change your step in part 4's cell, run that cell again (its check must
# still pass), then this one.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Which objects does a replica share with the module, and which does it get of its own? Read
# `Module._replicate_for_data_parallel` in `torch/nn/modules/module.py`: which dicts are new
# for the replica? Then, for each of the three lines of the forward above, ask where the result
# of the line is stored when replica 0 runs it.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Replica 0 is handed the module's own buffer tensors (torch's C++ `broadcast_coalesced`
# returns the first device's tensors themselves; the check's CPU stand-in does the same), but
# in dicts of its own: a write *into*
# one of those tensors lands in the module; a new tensor (or int) bound to a name lands in the
# replica's dict and goes when the replica goes. Your copy 0 can be built to hold `model`'s
# buffer tensors the same way, or your code can keep, before the forward, the tensors copy 0
# starts with, and afterwards bring back what was written into them.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Either at the copying stage (`copy.deepcopy` takes a memo: a dict from `id(obj)` to the object
# to use instead of a copy), or in two extra stages: before the forwards, note which tensor
# copy 0 holds under each buffer name; after the backward, for each name, bring back the values
# of that noted tensor, whatever copy 0 holds under the name by then. Plain attributes: torch's
# replicas get a shallow copy of the module's `__dict__`, so one the forward rebinds (`calls`)
# changes only a replica's dict and needs nothing from you; a mutable one changed in place (a
# list appended to) would be the module's own object, shared by every replica, which a
# `copy.deepcopy` loses (the modules this check tries only rebind theirs).
#
# </details>

# %%
lab02.check_dp_state(dp_forward_backward)

# %% [markdown]
# ## Use it
# Your step trains a model just like the plain loop: a few SGD steps on a fixed batch bring the
# loss down. (`copy.deepcopy` copies the model every step — the "replicate every step" cost of
# lesson 02.)

# %%
from dpcourse import models

torch.manual_seed(0)
model = models.SmallCNN(width=8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(16, 3, 32, 32)
y = torch.randint(0, 10, (16,))
losses = []
for _ in range(5):
    opt.zero_grad(set_to_none=True)
    losses.append(dp_forward_backward(model, X, y, 4))
    opt.step()
from dpcourse.checks import claim

claim("your DataParallel step trains: the loss fell", losses[-1] < losses[0], losses=losses)

# %% [markdown]
# ## Stretch (optional): the copies in real threads
#
# A workshop can stop here. `dp.parallel_apply` ran your copies for you; now write your own.
# `threaded_apply(replicas, inputs) -> list` has this contract:
#
# * it returns the list `[replicas[i](inputs[i]) for i in ...]` would give, in replica order;
# * the replicas run **at the same time**, each in a thread of its own;
# * the outputs carry an autograd graph exactly when the same loop run by the caller would
#   (mixed precision, `torch.autocast`, is outside this contract);
# * when a replica raises — whatever it raises, `SystemExit` included — the caller gets that
#   error itself (its type and message, not another exception wrapping it), after no thread
#   is left running; when several raise, the caller gets the
#   lowest-numbered failing replica's error, however fast or slow each thread was.
#
# The check uses stand-in replicas that sleep (as a torch kernel does, they release the GIL),
# the slowest first, and calls your function both with autograd on and inside
# `torch.no_grad()`.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Threads finish in any order: how does a result find its place in the list? What state does a
# new thread start with — does it share what the caller set for itself, such as
# `torch.no_grad()`? (torch's own `parallel_apply`, in `torch/nn/parallel/parallel_apply.py`,
# reads some settings in the caller and sets them again in each worker: which, and why would it
# need to?) Where does an exception raised inside a thread go?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Give each thread its index, and a slot per index for its output and for its error. Read the
# caller's autograd setting before starting the threads, and apply it inside each one. Start all
# threads before waiting for any; after waiting for all, raise the first error kept.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Two lists of `None` (outputs, errors); a worker function of `i` that, under the caller's grad
# mode, stores `replicas[i](inputs[i])` at `i` or catches the exception into its slot; a list
# of `threading.Thread`s, each started, then each joined; any error raised; the outputs
# returned.
#
# </details>

# %%
import threading


def threaded_apply(replicas, inputs):
    ### BEGIN SOLUTION: the replicas run at once, one thread each, with the contract above
    grad_enabled = torch.is_grad_enabled()
    results = [None] * len(replicas)
    errors = [None] * len(replicas)

    def work(i):
        try:
            with torch.set_grad_enabled(grad_enabled):
                results[i] = replicas[i](inputs[i])
        except BaseException as exc:  # SystemExit too: a thread it ends dies silently
            errors[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return results
    ### END SOLUTION


# %%
try:
    lab02.check_threaded_apply(threaded_apply)
except NotImplementedError:
    print("Stretch skipped: threaded_apply is not written yet (the cell below will say so too).")

# %% [markdown]
# How much do real threads buy for the lesson's CNN? Only the time spent inside torch kernels
# can overlap (they release the GIL); the Python between them takes turns. The cell below times
# four copies run one after another against your threads, with one torch thread per operation
# so that the threads, not torch's own pool, share the cores. One timing says little on a
# shared machine (two runs of the same cell can disagree by a factor of two): the cell runs the two ways in
# nine interleaved rounds, so that a slow moment hits both, and its last line is the verdict
# of lesson 01's `compare_rates` — a difference only when one way won at least 8 of the 9
# rounds (a two-sided sign test at 5%, lesson 02's bar), otherwise "no clear difference" — with
# the sign test's p.

# %%
# NBVAL_IGNORE_OUTPUT
# Why: timings, and so the verdict computed from them, depend on the machine and its load.
import os
import time

from dpcourse.train import compare_rates, sign_test_p

torch.manual_seed(0)
net = models.SmallCNN(width=16)
copies = [copy.deepcopy(net) for _ in range(4)]
batch = torch.randn(256, 3, 32, 32)
chunks = scatter(batch, 4)


def samples_per_s(fn):
    t0 = time.perf_counter()
    fn()
    return len(batch) / (time.perf_counter() - t0)


try:
    with torch.no_grad():
        ways = {"one after another": lambda: [c(x) for c, x in zip(copies, chunks)],
                "in threads": lambda: threaded_apply(copies, chunks)}
        for fn in ways.values():
            fn()  # warm-up
        rates = {name: [] for name in ways}
        for _ in range(9):  # rounds, interleaved so that a slow moment hits both ways
            for name, fn in ways.items():
                rates[name].append(samples_per_s(fn))
    for name, runs in rates.items():
        print(f"4 copies {name:17}: {', '.join(f'{r:5.0f}' for r in runs)} samples/s")
    verdict = compare_rates("one after another", rates["one after another"],
                            "in threads", rates["in threads"])
    p = sign_test_p(rates["one after another"], rates["in threads"])
    print(f"On this run ({os.cpu_count()} cores): {verdict}"
          + ("" if "sign test p" in verdict else f" (sign test p = {p:.3g})"))
except NotImplementedError:
    print("Stretch skipped: write threaded_apply above to time it.")
