# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
# ---

# %% [markdown]
# # 01 · One device: the training loop, its speed, and its randomness
#
# **Prerequisites:** lesson 00; PyTorch tensors and modules; what a gradient is.
#
# **You will be able to:**
# - name the four moves of a training step and the one people forget (`zero_grad`);
# - train a small CNN on the course's offline data set and read its loss and accuracy curves;
# - measure throughput and say where a step's time goes (data, forward, backward + step);
# - use mixed precision (AMP) and check that it keeps the accuracy;
# - get bit-identical runs from a seed, and say when you cannot.
#
# **Time:** about 45 minutes to read and run (plus about 25 for the lab).
#
# **Lab:** [lab01_single_device](../labs/lab01_single_device.ipynb) — write `train_one_epoch`
# and `evaluate`.
#
# Data parallelism changes *one* thing about training: where the gradient of each step comes
# from. To see that change clearly later, we first take the single-device loop apart:
#
# 1. the four moves of a step — forward, loss, backward, step — and the one you must not forget;
# 2. training for real: the loss falls and accuracy ends far above chance;
# 3. throughput, and where a step's time goes;
# 4. mixed precision (AMP): 16-bit arithmetic, same accuracy; faster where the hardware has
#    fast 16-bit units, or where memory traffic dominates (16-bit activations halve the bytes);
# 5. seeds: when two runs are identical, and when they are not.
#
# The parameters cell below is what an instructor changes (with papermill, a tool that runs a
# notebook with new values for the cell tagged `parameters`) to run this lesson
# at a larger scale, e.g. `-p dataset cifar10 -p n_train 50000 -p epochs 10` (lessons 04–06
# call it `data_name`).

# %% tags=["parameters"]
dataset = "shapes10"  # "shapes10" (offline, made on the fly) or "cifar10" (if you have it)
n_train = 3000
n_test = 1000
epochs = 3
batch_size = 32
lr = 2e-3  # Adam's learning rate
seed = 0
device = None  # None: from the hardware profile (cuda if there is a GPU, else cpu)

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

from dpcourse import data, devices, models, train, viz
from dpcourse.checks import claim

device = torch.device(device or devices.choose_profile().device)
devices.seed_everything(seed)

# %% [markdown]
# ## The data
#
# The default data set, `shapes10`, is made from a seed when it is loaded: 32×32 colour
# images in 10 classes (discs, rings, squares, stripes in four directions, ...), at random places,
# sizes and colours, over noisy backgrounds. It has CIFAR-10's shape, so the lessons with a data
# parameter (01, 04, 05, 06) run on CIFAR-10 too; unlike CIFAR-10 it needs no download and a
# small CNN learns it within minutes on a CPU — which is what a course that re-runs every
# notebook on every change needs.

# %%
ds = data.load(dataset, n_train=n_train, n_test=n_test, seed=seed)
print(ds)
print("images", ds.x_train.shape, ds.x_train.dtype, "labels", ds.y_train.shape, ds.y_train.dtype)
print("images per class (train):", np.bincount(ds.y_train, minlength=ds.num_classes).tolist())

# %%
fig, axes = plt.subplots(2, 10, figsize=(12, 2.8))
for c in range(10):
    for row, i in enumerate(np.flatnonzero(ds.y_train == c)[:2]):
        axes[row, c].imshow(ds.x_train[i])
        axes[row, c].axis("off")
    axes[0, c].set_title(ds.classes[c], fontsize=8)
plt.tight_layout()
viz.show(fig, "two training images of each class: random place, size and colour on a noisy "
              "background, so the model must learn the pattern, not a pixel.")

# %% [markdown]
# **▶ How the images are made: `data.make_shapes10`** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(data.make_shapes10, folded="▶ code: data.make_shapes10")

# %% [markdown]
# The same seed gives the same images again, and a different seed different ones — which is
# what lets a test (and you) rely on them. The cell checks it in this process, on this machine;
# it does not test another machine.

# %%
x_again, _ = data.make_shapes10(8, seed=seed)
x_other, _ = data.make_shapes10(8, seed=seed + 1)
claim("the same seed gives the same images",
      np.array_equal(x_again, data.make_shapes10(8, seed=seed)[0]))
claim("another seed gives other images", not np.array_equal(x_again, x_other))

# %% [markdown]
# ## One step, taken apart
#
# A step of training is four moves. **Forward**: the model maps a batch `X` to scores (logits).
# **Loss**: one number saying how wrong the scores are for the labels `y` — here cross-entropy,
# *averaged* over the batch. **Backward**: autograd fills every parameter's `.grad` with the
# gradient of that loss. **Step**: the optimizer moves each parameter by a rule of its
# gradients (SGD: against the gradient; Adam, used below: against a scaled running average).

# %%
train_loader, test_loader = train.make_loaders(ds, batch_size, seed=seed)
model = models.SmallCNN().to(device)
loss_fn = nn.CrossEntropyLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=lr)
print("parameters:", models.count_parameters(model))

X, y = next(iter(train_loader))
X, y = X.to(device), y.to(device)
logits = model(X)                      # forward
loss = loss_fn(logits, y)              # loss: the mean over the batch
loss.backward()                        # backward: fills p.grad
print("X", tuple(X.shape), "-> logits", tuple(logits.shape))
claim("the loss is a scalar (one number for the whole batch)", loss.dim() == 0)
claim("after backward every parameter has a gradient",
      all(p.grad is not None for p in model.parameters()))

# %% [markdown]
# **▶ `models.SmallCNN`**, the model this lesson trains: three convolutions (padding 1, so each
# keeps its input's height and width until the pooling after it), then two linear layers, with
# a dropout layer between them, off here (p = 0): click the folded cell below.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(models.SmallCNN, folded="▶ code: models.SmallCNN")

# %% [markdown]
# The move people forget: **`.grad` accumulates**. `backward()` *adds* to whatever is already
# there (handy for gradient accumulation, lesson 04), so `optimizer.zero_grad()` must run
# somewhere before this step's `backward()` (where, exactly, is lab 01's question). Watch it: a
# second forward and backward on the same batch doubles the gradient —
# because the repeated forward (in train mode) computes the same function: `SmallCNN`'s dropout
# defaults to p = 0 (`lib/dpcourse/models.py`); with dropout on, each forward drops other units.

# %%
claim("the condition: SmallCNN's dropout is p = 0",
      [mod.p for mod in model.modules() if isinstance(mod, nn.Dropout)] == [0.0])
first = [p.grad.clone() for p in model.parameters()]
loss_fn(model(X), y).backward()  # no zero_grad in between
doubled = all(torch.allclose(p.grad, 2 * g, rtol=1e-4, atol=1e-6)
              for p, g in zip(model.parameters(), first))
claim("without zero_grad, a second forward and backward on the same batch doubled the gradient "
      "(to a relative 1e-4)", doubled)
optimizer.zero_grad(set_to_none=True)
claim("after zero_grad(set_to_none=True) every .grad is None",
      all(p.grad is None for p in model.parameters()))

# %% [markdown]
# ## Training for real
#
# Ten classes: guessing is right 10% of the time, and a model that outputs uniform
# probabilities (1/10 each) has a loss of ln 10 ≈ 2.30. A few epochs on the CPU take us far
# past both. We use Adam here, whose per-parameter step sizes need little tuning. (The later
# lessons' gradient comparisons hold for any optimizer.)

# %%
uniform = loss_fn(torch.zeros(len(y), 10, device=device), y).item()  # equal logits: 1/10 each
claim("equal logits (probabilities 1/10 each) give a loss of ln 10 ≈ 2.30",
      np.isclose(uniform, np.log(10)), loss=uniform)
devices.seed_everything(seed)
cfg = train.TrainConfig(epochs=epochs, batch_size=batch_size, optimizer="adam", lr=lr, seed=seed,
                        device=str(device))
trained = models.SmallCNN()
history = train.fit(trained, ds, cfg)
first_loss, last_loss = history[0]["train_loss"], history[-1]["train_loss"]
final_acc = history[-1]["test_acc"]
print(f"epochs: {len(history)}")
claim("the training loss fell every epoch",
      all(b["train_loss"] < a["train_loss"] for a, b in zip(history, history[1:])),
      losses=[h["train_loss"] for h in history])
claim("test accuracy ended above 50% (chance is 10%)", final_acc > 0.5, final_acc=final_acc)

fig = viz.new_figure(9, 3.2)
ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
epochs_axis = [h["epoch"] + 1 for h in history]
ax1.plot(epochs_axis, [h["train_loss"] for h in history], "o-", label="train loss")
ax1.axhline(np.log(10), color="grey", ls=":", label="ln 10 (uniform)")
ax2.plot(epochs_axis, [h["test_acc"] for h in history], "o-", color="#2ca02c", label="test accuracy")
ax2.axhline(0.1, color="grey", ls=":", label="chance")
ax2.set_ylim(0, 1)
for ax in (ax1, ax2):
    ax.set_xlabel("epoch")
    ax.set_xticks(epochs_axis)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
fig.subplots_adjust(left=0.07, right=0.98, bottom=0.16, top=0.95, wspace=0.25)
viz.show(fig, "the training loss leaves the ln 10 line of uniform probabilities, and test "
              "accuracy climbs far above chance (10%).")

# %%
# NBVAL_IGNORE_OUTPUT
# Why: the exact losses and speed depend on the CPU/GPU and its kernels.
for h in history:
    print(f"epoch {h['epoch']}: train loss {h['train_loss']:.3f}  test acc {h['test_acc']:.3f}  "
          f"{h['samples_per_s']:.0f} samples/s")
rates_per_epoch = [h["samples_per_s"] for h in history]
close = 1.25   # this lesson's one threshold: two rates of the same work within 1.25x are "close"
# On a GPU a slowest first epoch is one-time warm-up (kernel selection, memory allocation):
# there the later epochs alone are compared.
warm_up = device.type == "cuda" and int(np.argmin(rates_per_epoch)) == 0
compared = rates_per_epoch[1:] if warm_up else rates_per_epoch
spread = max(compared) / min(compared)
print(f"Throughput from epoch to epoch varied by {spread:.2f}x"
      + (" after the first (GPU warm-up)" if warm_up else "") + ", for the same work per epoch: "
      + (f"steady on this run (within {close}x)." if spread < close else
         f"more than the {close}x this lesson treats as steady: something changed between "
         "epochs (another program, warm-up or the CPU's clock; this run cannot tell which), so "
         "these epoch rates are no benchmark (the comparisons below are built to survive that)."))

# %% [markdown]
# ## Throughput, and where the time goes
#
# *Samples per second* is the number data parallelism is meant to multiply. It can depend on
# the batch size, two ways:
#
# 1. A bigger batch gives the hardware bigger matrices per step and fewer Python round trips
#    per sample, which pays off until the hardware is saturated; from there the rate stays
#    flat. Where that point lies depends on the hardware: a GPU usually needs large batches, a
#    CPU fewer; the run below shows whether these rounds can tell where it lay here.
# 2. A bigger batch can also be *slower*: its intermediate tensors grow with it, and once they
#    no longer fit in the processor's caches every layer reads and writes main memory.
#
# Which shape the rates take here is measured, not assumed; which cause is behind them, these
# runs do not measure. **The method:** batch sizes from 4 to 256, the same 256 samples each,
# seven rounds, each round in a newly shuffled order, on one *intra-op* thread (torch's
# threads that split one operation over the cores; why one: folded after the verdict); the
# median of each size. A size is called faster or slower than another only when it won every
# round (`train.compare_rates`; `train.rate_shape` applies the rule to each step from one
# size to the next and names the shape), "no clear difference" otherwise; `compare_rates` adds
# a *sign test*'s p: how often equally fast sizes would split the rounds that lopsidedly by
# chance. `ThroughputMeter` (folded below) synchronizes a GPU before reading the clock (CUDA
# runs asynchronously), and `train_one_epoch` times the training step alone: every rate in
# this lesson (the epochs of `fit` above too) leaves the loader's time out.
#
# So these rates do not say what fetching costs. The next section times it: batches sliced in
# advance (a floor: no loader runs inside the clock), `make_loaders`' `DataLoader` (it gathers
# and collates one sample at a time), and a slow per-sample transform; a loader that decodes
# images from disk would cost time outside these rates too. The lines of
# `train_one_epoch` that place the meter (the move to the device and the step stay folded until
# your lab passes):

# %%
import inspect
import textwrap

src_lines, first = inspect.getsourcelines(train.train_one_epoch)  # first: its line in train.py
loop_src = [line.rstrip("\n") for line in src_lines]
def line_of(text):                       # the line number in train.py of the first match
    return first + next(i for i, line in enumerate(loop_src) if text in line)
def lines(a, b):                         # train.py lines a to b - 1
    return loop_src[a - first:b - first]
start_at, stop_at = line_of("meter.start()"), line_of("meter.stop(")
to_at, step_at = line_of(".to(device"), line_of("optimizer.step()")
viz.show_code(textwrap.dedent("\n".join(
    lines(line_of("for X, y in batches"), to_at)
    + [f"        ...  # train.py line {to_at}: the batch moved to the device (lab 01 §1)"]
    + lines(to_at + 1, start_at + 1)
    + [f"        ...  # train.py lines {start_at + 1}-{stop_at - 2}: the step (lab 01 §1)"]
    + lines(stop_at - 1, stop_at + 1))))
claim(f"in train.py the meter starts (line {start_at}) after the batch reached the device "
      f"(line {to_at}) and stops (line {stop_at}) after optimizer.step() (line {step_at}, "
      "both elided above)", to_at < start_at < step_at < stop_at)

# %% [markdown]
# **▶ `ThroughputMeter`, `make_loaders`, `TrainConfig` and `fit`** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(train.ThroughputMeter, train.make_loaders, train.TrainConfig, train.fit,
              folded="▶ code: ThroughputMeter, make_loaders, TrainConfig, fit")

# %%
batch_sizes = tuple(sorted({4, 16, batch_size, 64, 256}))   # batch_size: the one `fit` used
m = models.SmallCNN().to(device)
opt = torch.optim.Adam(m.parameters(), lr=lr)
sample_batches = {bs: [b for _, b in zip(range(256 // bs), train.make_loaders(ds, bs, seed=seed)[0])]
                  for bs in batch_sizes}
rounds = 7
measured = {bs: [] for bs in batch_sizes}
order_rng = np.random.default_rng(seed)  # its own generator: the global seeds are untouched
orders, used_threads = [], set()
threads = torch.get_num_threads()
torch.set_num_threads(1)                 # one intra-op thread while we measure
try:
    train.train_one_epoch(m, sample_batches[64][:2], loss_fn, opt, device)  # warm-up
    for _ in range(rounds):              # rounds, interleaved so that a slow round hits all
        orders.append(tuple(batch_sizes[i] for i in order_rng.permutation(len(batch_sizes))))
        for bs in orders[-1]:            # this round's shuffled order
            meter = train.ThroughputMeter(device)
            train.train_one_epoch(m, sample_batches[bs], loss_fn, opt, device, meter=meter)
            measured[bs].append(meter.rate)
            used_threads.add(torch.get_num_threads())   # read right after each measured run
finally:
    torch.set_num_threads(threads)
rates = {bs: float(np.median(r)) for bs, r in measured.items()}
claim(f"every batch size was measured {rounds} times, each run on "
      f"{' or '.join(map(str, sorted(used_threads)))} intra-op thread (read after each run), "
      "and the thread count was restored afterwards",
      all(len(r) == rounds for r in measured.values()) and used_threads == {1}
      and torch.get_num_threads() == threads)
claim("each round ran the batch sizes in a shuffled order, not always the same one",
      all(sorted(o) == sorted(batch_sizes) for o in orders) and len(set(orders)) > 1)

# %% [markdown]
# **▶ The yardstick, before the verdict: how often noise alone names a shape, simulated**
# (click the folded cell below).

# %% jupyter={"source_hidden": true}
# How often does noise alone name a shape? Sizes equally fast: every run a random draw.
null_rng = np.random.default_rng(seed)
null_runs = [{bs: null_rng.random(rounds) for bs in batch_sizes} for _ in range(1000)]
noise_named = {o: 1 - [train.rate_shape(r, outliers=o)[0] for r in null_runs].count("flat")
               / len(null_runs) for o in (1, 0)}   # o: rounds a step may lose and still count
claim(f"with {len(batch_sizes)} equally fast batch sizes and {rounds} rounds, noise alone "
      f"named a shape other than flat in {noise_named[1]:.0%} of 1000 simulated runs when a "
      f"step may lose one round, in {noise_named[0]:.0%} when it must win every round: the "
      "verdicts below use the strict rule", 0.15 < noise_named[1] < 0.5 and noise_named[0] < 0.15,
      noise_named=noise_named)

# %%
# NBVAL_IGNORE_OUTPUT
# Why: timings depend on the machine and what else it is doing.
for bs in batch_sizes:
    print(f"batch {bs:4d}: median {rates[bs]:7.0f} samples/s  (runs: "
          + ", ".join(f"{r:.0f}" for r in measured[bs]) + ")")
smallest, largest = min(batch_sizes), max(batch_sizes)   # the pair chosen before the run
print(f"On this {device.type}, one intra-op thread, this run: " + train.compare_rates(
    f"batch {smallest}", measured[smallest], f"batch {largest}", measured[largest], outliers=0))
shape, steps = train.rate_shape(measured, outliers=0)   # each size against the next larger one
reading = {"rising": "case 1 above, not yet saturated: the bigger matrices still paid off",
           "plateau": f"case 1 above: batch {largest} beat batch {smallest}, and the gain "
                      "flattened (saturated, or too small for these rounds to show)",
           "rose, ends unclear": "no shape shown beyond the step that rose: case 1 and case 2 "
                                 "alike could give these rounds",
           "ends differ": "no shape shown between the ends: a rise, a plateau or a peak "
                          "could give these rounds",
           "flat": "no shape shown: case 1 saturated by the smallest batch already, or "
                   "differences lost in this machine's noise, these rounds cannot tell which"}
print(f"Step by step, a step counted only if one size won all {rounds} rounds (noise alone "
      f"names a shape {noise_named[0]:.0%} of the time, above), the rate {steps}. That is "
      + reading.get(
    shape, "case 2 above: saturation alone would give a plateau, not a drop. What made a "
    "larger batch slower, this run does not say: it times whole steps, not what happens "
    "inside them (memory traffic, the kernels chosen for each shape)") + ".")
ends = train.rate_verdict(measured[smallest], measured[largest], outliers=0)[0]
if shape in ("rising", "plateau"):   # a gain named: the pair chosen in advance must agree
    claim(f"the reading agrees with the pair chosen in advance: it names a gain ({shape}), and "
          f"batch {largest} won every round against batch {smallest}", ends == "faster",
          shape=shape, ends=ends)
else:
    print(f"shape {shape}: no gain from batch {smallest} to {largest} is named, so the pair "
          f"chosen in advance has nothing to confirm (that pair: {ends})")
fig = viz.new_figure(5.5, 3.2)
ax = fig.add_subplot(1, 1, 1)
ax.errorbar(list(batch_sizes), [rates[bs] for bs in batch_sizes],
            yerr=[[rates[bs] - np.percentile(measured[bs], 25) for bs in batch_sizes],
                  [np.percentile(measured[bs], 75) - rates[bs] for bs in batch_sizes]],
            fmt="o-", capsize=4)
ax.set_xscale("log", base=2)   # a doubling is one step: 64 -> 256 is two, with no run between
ax.set_xticks(list(batch_sizes), [str(bs) for bs in batch_sizes])
ax.minorticks_off()
ax.set_xlabel("batch size (log scale; only the marked sizes were run)")
ax.set_ylabel("samples / s (median, quartiles)")
ax.set_ylim(0, None)
ax.grid(True, alpha=0.3)
fig.subplots_adjust(left=0.18, right=0.97, bottom=0.17, top=0.95)
viz.show(fig, "training throughput per batch size on this machine (the lines only join the "
              "sizes that were run); the bars span the middle "
              f"half of {rounds} interleaved runs (one outlier run does not stretch them): each "
              "size's spread on its own. The verdicts above compare sizes round by round, in "
              "pairs, not these bars: a gap can be consistent where bars overlap, and "
              "unclear where they do not.")

# %% [markdown]
# <details><summary>▶ How sure are these verdicts, and why one thread? (open to read)</summary>
#
# **Rounds:** a slow moment that lasts a round hits every size; the shuffled order keeps a
# shorter one from always falling on the same sizes. **One thread:** an operation split over
# every core waits for its slowest thread, so a busy neighbour taking one core can slow it
# several-fold while a round's other runs escape (a reason, not a result: the neighbour is not
# timed). **The rule** (`train.rate_verdict` with `outliers=0`) needs one size to win every round.
# The sign test (two-sided): seven rounds of seven give p = 0.0156; all but one, the default
# rule lesson 02 keeps, p = 0.125, one noise call in eight. The pair, smallest and largest
# batch, is chosen before the run: testing the slowest and fastest after it would call noise
# a difference far more often. `rate_shape` makes one test per step, so more chances for
# noise: the simulation above the verdict counts how often noise alone names a shape under
# each rule.
#
# </details>

# %% [markdown]
# **▶ The rules behind these sentences: `round_wins`, `rate_verdict`, `sign_test_p`,
# `compare_rates`, `rate_shape`** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(train.round_wins, train.rate_verdict, train.sign_test_p, train.compare_rates,
              train.rate_shape,
              folded="▶ code: round_wins, rate_verdict, sign_test_p, compare_rates, rate_shape")

# %% [markdown]
# Where does one step's time go? `time_breakdown` charges each phase — waiting for the next
# batch, forward, backward + step — separately. Our data sits in memory as one tensor, so the
# loader's work, indexing one sample at a time (a `TensorDataset` has no `__getitems__`) and
# stacking them, is nearly free. Give the loader a per-sample transform written in
# Python — here a flip, noise, and small random shifts of every row of every channel, one tensor
# operation per row, the kind of augmentation image pipelines often do sample by sample — and the
# same model spends a large part of its step waiting for data (how large depends on how fast
# this machine computes; the cell prints it). More devices driven by one process
# (`nn.DataParallel`, lesson 02) would not help that: they all wait for the same loader. The
# usual remedies are loader workers (`DataLoader(num_workers=...)`: processes that prepare the
# next batches while the step runs) or a vectorised pipeline; we do not time them here, because
# on a two-core machine the workers would compete with the step for the same cores.
#
# We measure with one intra-op thread here too, as the batch sizes above.
#
# Every share below depends on where `time_breakdown` reads its clocks: before asking the
# loader for a batch, after the batch has reached the device, after the forward, and after the
# optimizer step — synchronizing a GPU at each, so a phase is charged what it cost, not how
# fast Python queued it. On a GPU that also stops the host from fetching the next batch while
# the device computes, so there the data share is an upper bound on what a loop without the
# synchronizations waits; on a CPU nothing overlaps. The clocks are in the cell below; the two phases it times between
# them, `step_phases`, hold a training step (part of lab 01's answer) and wait, folded, at the
# end of the lesson.

# %%
viz.show_code(train.time_breakdown)

# %%
class SlowAugment(torch.utils.data.Dataset):
    """A dataset that flips and jitters each image in Python, one sample at a time."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, label = self.base[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        x = x + 0.05 * torch.randn_like(x)
        # jitter every row of every channel by its own shift, four times over: 384 small
        # tensor operations per image, each cheap, together slow — Python's per-call overhead
        for _ in range(4):
            shifts = torch.randint(-1, 2, (x.shape[0], x.shape[1])).tolist()
            x = torch.stack([torch.stack([row.roll(k) for row, k in zip(c, ks)])
                             for c, ks in zip(x, shifts)])
        return x, label


base = data.to_torch(ds.x_train, ds.y_train)
X_all, y_all = base.tensors
# batches sliced here, before any clock starts: no loader and no per-sample Python, so their data
# share is near zero by construction (a floor); make_loaders' DataLoader is timed beside it
fast = [(X_all[i:i + batch_size], y_all[i:i + batch_size]) for i in range(0, 10 * batch_size, batch_size)]
slow = torch.utils.data.DataLoader(SlowAugment(base), batch_size=batch_size, shuffle=True)
m = models.SmallCNN().to(device)
opt = torch.optim.Adam(m.parameters(), lr=lr)
share, breakdown = {}, {}
# One intra-op thread while we measure. With torch's default, a thread per core, a busy
# neighbour (another notebook, a second test) slows the multi-threaded convolutions, whose
# threads wait for each other, far more than the one-threaded Python transform: the data's
# share would then measure the neighbour, not the pipeline. (A reason for the setting, not a
# result: this lesson does not time the neighbour.)
threads = torch.get_num_threads()
torch.set_num_threads(1)
try:
    for name, loader in (("pre-sliced (a floor)", fast),
                         ("make_loaders' DataLoader", train.make_loaders(ds, batch_size, seed=seed)[0]),
                         ("per-sample Python transform", slow)):
        parts = train.time_breakdown(m, loader, loss_fn, opt, device, max_batches=10)
        breakdown[name] = parts
        share[name] = parts["data"] / sum(parts.values())
finally:
    torch.set_num_threads(threads)

# %%
# NBVAL_IGNORE_OUTPUT
# Why: the shares depend on the machine's speed.
for name, s in share.items():
    print(f"{name:28s}: {100 * s:5.1f}% of the step waiting for data")
fig = viz.new_figure(7, 2.6)
ax = fig.add_subplot(1, 1, 1)
colours = {"data": "#d62728", "forward": "#1f77b4", "backward+step": "#2ca02c"}
for row, (name, parts) in enumerate(breakdown.items()):
    left, total = 0.0, sum(parts.values())
    for phase, seconds in parts.items():
        ax.barh(row, 100 * seconds / total, left=left, color=colours[phase],
                label=phase if row == 0 else None)
        left += 100 * seconds / total
ax.set_yticks(range(len(breakdown)))
ax.set_yticklabels(list(breakdown), fontsize=8)
ax.set_xlabel("% of the step's time")
ax.set_xlim(0, 100)
ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, 1.3))
fig.subplots_adjust(left=0.3, right=0.97, bottom=0.2, top=0.8)
loader_share = share["make_loaders' DataLoader"]
viz.show(fig, "batches sliced in advance wait for nothing, by construction (a floor); "
              f"make_loaders' DataLoader: {100 * loader_share:.0f}% of the step "
              f"waits for data; a per-sample Python transform: "
              f"{100 * share['per-sample Python transform']:.0f}%.")

# %%
claim("make_loaders' DataLoader (the one fit and lab 01 use): under 20% of the step waits "
      "for data", share["make_loaders' DataLoader"] < 0.2, share=share)
# Why not "over half": the share depends on how fast this machine computes (a fast GPU makes
# it larger, a slow CPU smaller), so the thresholds are loose; this run's shares are printed
# above.
claim("the per-sample Python transform: over 20% of the step waits for data, more than 3x "
      "the share with make_loaders' DataLoader",
      share["per-sample Python transform"] > 0.2
      and share["per-sample Python transform"] > 3 * share["make_loaders' DataLoader"],
      share=share)


# %% [markdown]
# ## Mixed precision (AMP)
#
# Most of a network's arithmetic does not need 32-bit floats. Under `torch.autocast`, matrix
# multiplications and convolutions run in a 16-bit type, while operations that autocast lists as
# safer in float32 (the loss among them, as the cell below checks) stay in float32. Which
# 16-bit type is a choice, not a property of the device. `torch.autocast` defaults to float16
# on CUDA and bfloat16 on a CPU, and this library keeps those defaults (`train.autocast_for`).
# float16's small range makes tiny gradients lose digits below its smallest normal number
# (6.1e-5) and become zero below about 3e-8 — hence a `GradScaler` that multiplies the loss
# up before backward and the gradients back down before the step.
# bfloat16 has float32's range: no scaler needed. GPUs from NVIDIA's Ampere generation on
# (A100, H100) compute in bfloat16 too, so there `autocast(dtype=torch.bfloat16)` without a
# scaler is the simpler choice; the library's float16 + `GradScaler` also runs on older GPUs.
# `train.fit(model, ds, train.TrainConfig(amp=True, device=...))` picks its pair for the
# config's device (default "cpu", whatever the machine has: `TrainConfig`, folded above):

# %%
viz.show_code(train.autocast_for)
fp16, bf16, fp32 = (torch.finfo(t) for t in (torch.float16, torch.bfloat16, torch.float32))
print(f"largest / smallest normal: float16 {fp16.max:.3g} / {fp16.tiny:.3g}, "
      f"bfloat16 {bf16.max:.3g} / {bf16.tiny:.3g}, float32 {fp32.max:.3g} / {fp32.tiny:.3g}")
claim("torch's autocast defaults: float16 on CUDA, bfloat16 on a CPU",
      torch.get_autocast_dtype("cuda") == torch.float16
      and torch.get_autocast_dtype("cpu") == torch.bfloat16)
claim("bfloat16 has float32's range (the same smallest normal number); float16's smallest "
      "normal number is 6.1e-05 and its largest 65504",
      bf16.tiny == fp32.tiny and fp16.tiny < 6.2e-5 and fp16.max == 65504)
tiny = torch.tensor([2.0**-24, 2.0**-26])        # 6.0e-08 and 1.5e-08, then kept in float16
claim("in float16, 2**-24 (6.0e-08) survives as a subnormal, with one significant bit; "
      "2**-26 (1.5e-08) becomes 0", tiny.half().tolist() == [2.0**-24, 0.0])

# %% [markdown]
#
# Autocast does not make *everything* 16-bit: it keeps, per device, a list of operations that
# are safer in float32. On the CPU `cross_entropy` itself is on it; CUDA's list lacks it but has
# its last step, `nll_loss`, so the loss ends in float32 there too. Either
# way, only *inside* the `autocast` block. Compute the loss after the block, from 16-bit
# logits, and it is 16-bit too. So put the loss inside (the cell checks the loss's dtype on
# this device):

# %%
with train.autocast_for(device, enabled=True):
    out = models.SmallCNN().to(device)(X)
    loss_inside = loss_fn(out, y)
loss_outside = loss_fn(out, y)
claim("under autocast the logits are 16-bit", out.dtype in (torch.float16, torch.bfloat16))
claim("the loss computed inside the autocast block is float32",
      loss_inside.dtype == torch.float32)
claim("computed after the block, from the same 16-bit logits, it is 16-bit",
      loss_outside.dtype == out.dtype)

# %% [markdown]
# Does the 16-bit arithmetic cost accuracy? Two tests on the model we just trained. First,
# its predictions on the test set with and without autocast. Second, one more (short) epoch of
# training from the *same* weights, once in float32 and once in AMP: both must end as accurate.
# (Continuing from trained weights, rather than training from scratch twice, keeps the run
# short.)
#
# Is it faster? AMP pays off when big matrix
# multiplications and convolutions dominate the step *and* the hardware has fast 16-bit units
# (a GPU's *tensor cores*, NVIDIA's units built for small matrix multiplies in reduced
# precision; some CPUs have bfloat16 units too), or when memory traffic dominates: 16-bit
# activations halve the bytes that layers such as ReLU and pooling read and write. This
# model's layers are tiny, and
# the casts autocast inserts cost time of their own, so it can go either way. The last cells
# time both on one intra-op thread, seven rounds, in an order drawn anew each round (each
# goes first in about half of them), and say which was faster on this run by the batch sizes'
# rule, or that there was no clear difference. Try a ResNet (`models.resnet18_cifar`) with a big batch on a
# GPU: there AMP can win.

# %% [markdown]
# **▶ `predictions(model, amp)`: the class the model predicts for every test image** (folded:
# it has the shape of lab 01's `evaluate`; open it after your lab passes).

# %% jupyter={"source_hidden": true}
viz.show_code(train.predictions, folded="▶ train.predictions — open after your lab passes")


def predictions(model, amp):  # on this lesson's test images and device
    return train.predictions(model, test_loader, device, amp)

# %%
import copy

agree = (predictions(trained, False) == predictions(trained, True)).float().mean().item()
claim("autocast changes at most 2% of the test predictions", agree >= 0.98, agree=agree)

subset = data.Dataset(ds.name, ds.x_train[:512], ds.y_train[:512], ds.x_test, ds.y_test,
                      ds.classes)
acc_after = {}
for amp in (False, True):
    devices.seed_everything(seed)
    m = copy.deepcopy(trained)
    opt = torch.optim.Adam(m.parameters(), lr=lr / 4)
    loader, _ = train.make_loaders(subset, batch_size, seed=seed)
    scaler = torch.amp.GradScaler("cuda") if amp and device.type == "cuda" else None
    train.train_one_epoch(m, loader, loss_fn, opt, device, amp=amp, scaler=scaler)
    acc_after[amp] = train.evaluate(m, test_loader, loss_fn, device, amp=amp)[1]
claim("after one more epoch, both runs are above 80% test accuracy",
      min(acc_after.values()) > 0.8, acc_after=acc_after)
claim("AMP ends within 3 points of float32", abs(acc_after[True] - acc_after[False]) < 0.03,
      acc_after=acc_after)

# %%
# Speed: the same 10 in-memory batches, float32 and AMP taking turns, on one intra-op thread.
# (Rates of the training step alone: the meter leaves the loader's time out, as above.)
m = copy.deepcopy(trained)
opt = torch.optim.Adam(m.parameters(), lr=lr / 4)
amp_runs = {False: [], True: []}
amp_rng = np.random.default_rng(seed)    # its own generator, as for the batch sizes' order
# which of the two runs first in each round: shuffled, and balanced so that each goes first
# in about half the rounds (in a fixed order, whatever slows a round's first run would always
# fall on the same side)
amp_first = [bool(f) for f in amp_rng.permutation([r % 2 == 1 for r in range(rounds)])]
torch.set_num_threads(1)
try:
    for amp in (False, True):  # warm-up, one batch each
        train.train_one_epoch(m, fast[:1], loss_fn, opt, device, amp=amp, scaler=None)
    for first in amp_first:
        for amp in (first, not first):   # this round's order
            scaler = torch.amp.GradScaler("cuda") if amp and device.type == "cuda" else None
            meter = train.ThroughputMeter(device)
            train.train_one_epoch(m, fast, loss_fn, opt, device, amp=amp, scaler=scaler,
                                  meter=meter)
            amp_runs[amp].append(meter.rate)
finally:
    torch.set_num_threads(threads)
claim(f"float32 and AMP were each timed {rounds} times",
      all(len(r) == rounds for r in amp_runs.values()))
claim(f"each went first in some rounds: AMP in {sum(amp_first)}, float32 in "
      f"{rounds - sum(amp_first)} of {rounds}", 0 < sum(amp_first) < rounds)

# %%
# NBVAL_IGNORE_OUTPUT
# Why: speed and exact accuracies depend on the hardware and its load; whether AMP is faster
# depends on them and on the size of the model's layers.
for amp, name in ((False, "float32"), (True, "AMP    ")):
    print(f"{name}: acc {acc_after[amp]:.3f}, median {np.median(amp_runs[amp]):6.0f} samples/s "
          "(runs: " + ", ".join(f"{r:.0f}" for r in amp_runs[amp]) + ")")
rule = {"outliers": 0}                   # the batch sizes' rule: every round must be won
print(f"On this {device.type}, one intra-op thread, this run: "
      + train.compare_rates("float32", amp_runs[False], "AMP", amp_runs[True], **rule))
amp_verdict = train.rate_verdict(amp_runs[False], amp_runs[True], **rule)[0]
claim(f"this verdict uses the batch sizes' rule: winning {rounds - 1} of {rounds} rounds is "
      "no clear difference under it", train.rate_verdict(
          [1] * rounds, [2] * (rounds - 1) + [0], **rule)[0] == "unclear")
print({"faster": "So on this machine AMP won even on this tiny model",
       "slower": "So on this machine AMP lost on this tiny model",
       "unclear": "So on this machine AMP made no clear difference on this tiny model"}[amp_verdict]
      + "; this lesson does not isolate why" + (" (fast bfloat16 matrix kernels on this CPU are "
      "a hypothesis only)." if amp_verdict == "faster" and device.type == "cpu" else "."))

# %% [markdown]
# **Beyond this CPU.** To measure the whole ladder on your device — naive float32, TF32,
# bf16/fp16 autocast, channels_last, `torch.compile` and all of them together, on ResNet-18 —
# run `python -m dpcourse.bench single` in a terminal; no GPU numbers are stored in this
# course. What TF32 and channels_last are, and how to switch TF32 on safely: folded below.

# %% [markdown]
# **▶ For GPU users: the details** (click the folded cells below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# *TF32* (TensorFloat-32): on NVIDIA GPUs since Ampere, float32 matrix multiplies and
# convolutions run on tensor cores with a 10-bit mantissa (float32's range, less precision).
# *channels_last* (`model.to(memory_format=torch.channels_last)`) stores each pixel's channels
# together (NHWC, not NCHW), the layout fast GPU convolution kernels prefer. The practical rule
# for TF32: of torch's two families of switches below, pick one and keep to it.
#
# On a GPU, torch hands convolutions to *cuDNN* and matrix multiplies to *cuBLAS*, NVIDIA's
# libraries of deep-learning kernels and of linear algebra, and each has its own TF32 switch.
# Torch's defaults differ by kind: cuDNN convolutions may use TF32 out of the box, float32
# matmuls may not. The switches this course uses (the benchmark sets them; lesson 03's
# `ddp.setup_rank` turns both off on a GPU) are `torch.backends.cudnn.allow_tf32` and
# `torch.backends.cuda.matmul.allow_tf32`. Torch 2.14 also has a newer family, the
# `fp32_precision` knobs ("tf32", "ieee" for full float32, or "none": read the level above,
# per backend and operation). Setting an old switch writes the new knob too (the cell shows it
# for matmuls), but the new knobs do not update the old switches, and once they disagree,
# reading an old one raises a `RuntimeError` ("mix of the legacy and new APIs"). That read is
# not only yours: Inductor, `torch.compile`'s default backend (the compiler that generates the
# compiled model's kernels), calls `torch.get_float32_matmul_precision()` when it caches its
# choice of matmul kernels. A cuDNN-named knob is enough to get there:
# `torch.backends.cudnn.fp32_precision` is the level the matmul knob reads through to. The
# CUDA knobs also refuse "bf16", which the generic level and the CPU's
# `torch.backends.mkldnn.matmul` take. **▶ The folded cell below** shows each step on this CPU (the
# switches are flags, readable without a GPU) and puts every flag back.
#
# </details>

# %% jupyter={"source_hidden": true}
on_off = {True: "on", False: "off"}
print("cudnn.allow_tf32:", on_off[torch.backends.cudnn.allow_tf32],
      "| cuda.matmul.allow_tf32:", on_off[torch.backends.cuda.matmul.allow_tf32])
print("cudnn.conv.fp32_precision:", torch.backends.cudnn.conv.fp32_precision,
      "| cuda.matmul.fp32_precision:", torch.backends.cuda.matmul.fp32_precision)
claim("by default cuDNN convolutions may use TF32 and float32 matmuls may not",
      torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
      and torch.backends.cudnn.conv.fp32_precision == "tf32")
# 1. The old switch writes the new knob.
torch.backends.cuda.matmul.allow_tf32 = True
knob_on = torch.backends.cuda.matmul.fp32_precision
torch.backends.cuda.matmul.allow_tf32 = False
knob_off = torch.backends.cuda.matmul.fp32_precision
torch.backends.cuda.matmul.fp32_precision = "none"   # back to the default
claim('setting matmul.allow_tf32 writes the new knob: True makes matmul.fp32_precision read '
      '"tf32", False "ieee"', (knob_on, knob_off) == ("tf32", "ieee"),
      knob_on=knob_on, knob_off=knob_off)
# 2. A new knob does not write the old switch: read the old one while they disagree.
legacy_reads = {"torch.backends.cuda.matmul.allow_tf32":
                lambda: torch.backends.cuda.matmul.allow_tf32,
                "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision}
errors = {}
torch.backends.cudnn.fp32_precision = "tf32"   # the level the matmul knob reads through to
from_cudnn = torch.backends.cuda.matmul.fp32_precision
for name, read in legacy_reads.items():
    try:
        read()
    except RuntimeError as e:
        errors[name] = str(e)
torch.backends.cudnn.fp32_precision = "none"   # back to the default
claim('with torch.backends.cudnn.fp32_precision = "tf32", the matmul knob reads "tf32" too',
      from_cudnn == "tf32", from_cudnn=from_cudnn)
claim("... and reading either old matmul switch raises RuntimeError (\"mix of the legacy and "
      "new APIs\"): " + ", ".join(legacy_reads),
      set(errors) == set(legacy_reads)
      and all("mix of the legacy and new APIs" in m for m in errors.values()), errors=errors)
claim('with the knob back at "none", the old switches read again: matmul TF32 off, precision '
      '"highest"', torch.backends.cuda.matmul.fp32_precision == "none"
      and not torch.backends.cuda.matmul.allow_tf32
      and torch.get_float32_matmul_precision() == "highest")
# 3. "bf16": which knobs take it (each set, read back, and put back).
bf16_knobs = {"torch.backends": torch.backends, "mkldnn.matmul": torch.backends.mkldnn.matmul,
              "cuda.matmul": torch.backends.cuda.matmul, "cudnn.conv": torch.backends.cudnn.conv}
bf16_takes = {}
for name, knob in bf16_knobs.items():
    before = knob.fp32_precision
    try:
        knob.fp32_precision = "bf16"
        bf16_takes[name] = knob.fp32_precision == "bf16"
    except RuntimeError as e:
        bf16_takes[name] = str(e)
    finally:
        knob.fp32_precision = before
claim('the CUDA knobs refuse "bf16" ("does not support precision"); the generic level and '
      'mkldnn.matmul take it', bf16_takes["torch.backends"] is True
      and bf16_takes["mkldnn.matmul"] is True
      and all("does not support precision 'bf16'" in str(bf16_takes[k])
              for k in ("cuda.matmul", "cudnn.conv")), bf16_takes=bf16_takes)

# %% [markdown]
# ## Seeds and reproducibility
#
# Randomness enters training in the initial weights, the shuffling order, dropout and data
# augmentation. `devices.seed_everything(seed)` seeds Python, NumPy and torch; our loaders draw
# their order from their own seeded generator.
#
# - **On the CPU, for this model.** With the same seed, code, hardware and number of threads,
#   two runs of `SmallCNN` in one process end with *bit-identical* weights: the cell below
#   proves it with *deterministic mode* (torch made to pick deterministic kernels,
#   `torch.use_deterministic_algorithms`: next bullet) **off**, the seed alone. Change the
#   seed and they differ. That is a fact about this model's ops, not a rule for every CPU
#   model: torch's own list of ops that deterministic mode makes deterministic names CPU ones
#   too, such as `index_put` with `accumulate=True` and `index_copy` (the cell prints every
#   entry of that list that is not CUDA-only, read from the installed docstring).
# - **On a GPU.** More kernels there (e.g. some convolution backwards, `index_add_`) are
#   nondeterministic. There the cell turns deterministic mode on:
#   `seed_everything(..., deterministic=True)` calls
#   `torch.use_deterministic_algorithms(True, warn_only=True)`: deterministic kernels where
#   torch has them, and only a *warning* for an op that has none, so read the warnings. The flag
#   is global, so the cell switches it off again.
# - **cuBLAS's workspace.** cuBLAS, NVIDIA's matrix-multiply library for the GPU, works in
#   scratch memory of its own, a workspace. Torch 2.14.1 no longer needs
#   `CUBLAS_WORKSPACE_CONFIG=:4096:8` for deterministic mode (the folded details below; the
#   cell checks the installed headers).
# - **Across machines.** On *different* hardware bit-identity is not promised at all:
#   floating-point sums are done in different orders.

# %% [markdown]
# **▶ For GPU users: cuBLAS's workspace, the details** (click the folded cell below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# Many scripts and answers say deterministic mode *needs*
# `CUBLAS_WORKSPACE_CONFIG=:4096:8` (or `:16:8`): torch used to raise an error without it on
# a GPU matrix multiply. Torch 2.14.1 no longer checks it. It gives cuBLAS (the GPU's
# matrix-multiply library) a workspace of its own for each handle (the context cuBLAS calls
# run in) and stream, which NVIDIA's cuBLAS
# documentation ("Results reproducibility") counts as enough, and the check was removed
# (pytorch/pytorch#161749). The cell checks the installed C++ headers: `Context` declares
# `alertNotDeterministic` and no cuBLAS alert; a per-handle-and-stream workspace map is
# declared. The variable now only *sizes* that scratch memory, read once, at the first cuBLAS
# workspace allocation: for another size, set it before the process's first GPU matrix
# multiply, in the shell or from Python with `os.environ` (as `seed_everything` does).
# `torch.backends.cuda.cublas_workspace_size(n)` sets the size from Python and beats the
# variable, but only for handles used after the call (its docstring; the cell checks it).
# `seed_everything(..., deterministic=True)` still sets `:4096:8` when it is unset: harmless
# here, and what an older torch needs.
#
# </details>

# %% [markdown]
# **▶ `devices.seed_everything`** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(devices.seed_everything, folded="▶ code: devices.seed_everything")

# %%
needs_deterministic = device.type != "cpu"  # CPU kernels of this model are deterministic


def one_epoch_weights(run_seed):
    devices.seed_everything(run_seed, deterministic=needs_deterministic)
    m = models.SmallCNN().to(device)
    small = data.Dataset(ds.name, ds.x_train[:512], ds.y_train[:512], ds.x_test[:10],
                         ds.y_test[:10], ds.classes)
    loader, _ = train.make_loaders(small, batch_size, seed=run_seed)
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    train.train_one_epoch(m, loader, loss_fn, opt, device)
    return torch.cat([p.detach().flatten().cpu() for p in m.parameters()])


try:
    a, b, c = one_epoch_weights(1), one_epoch_weights(1), one_epoch_weights(2)
finally:
    torch.use_deterministic_algorithms(False)  # a global flag: leave it as we found it
claim("same seed, same device: bit-identical weights after an epoch", torch.equal(a, b))
claim("deterministic mode is off again", not torch.are_deterministic_algorithms_enabled())
claim("another seed: different weights", not torch.equal(a, c))
import re

det_doc = " ".join(torch.use_deterministic_algorithms.__doc__.split())
det_list = det_doc[det_doc.index("will act deterministically"):   # the ops made deterministic
                   det_doc.index("The following normally-nondeterministic operations will "
                                 "throw")]                        # (the next list: ops that raise)
entries = det_list.split(" * ")[1:]
cpu_entries = [re.sub(r":\w+:`|`", "", e) for e in entries if "CPU" in e or "CUDA" not in e]
print("torch's list, entries that are not CUDA-only:", *cpu_entries, sep="\n  ")
claim(f"torch's docstring lists {len(cpu_entries)} ops (of {len(entries)}) that deterministic "
      "mode makes deterministic on a CPU too, index_put with accumulate=True and index_copy "
      "among them",
      any(e.startswith("torch.Tensor.index_put with accumulate=True") for e in cpu_entries)
      and any(e.startswith("torch.Tensor.index_copy") for e in cpu_entries),
      cpu_entries=cpu_entries)

# What deterministic=True sets besides the flag, checked on any machine (and put back after).
import os

saved_cublas = os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
try:
    devices.seed_everything(seed, deterministic=True)
    set_to = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"        # a value already there ...
    devices.seed_everything(seed, deterministic=True)
    kept = os.environ["CUBLAS_WORKSPACE_CONFIG"]           # ... is left alone
finally:
    torch.use_deterministic_algorithms(False)
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    if saved_cublas is not None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved_cublas
claim("seed_everything(deterministic=True) turns deterministic mode on with warn_only and sets "
      "CUBLAS_WORKSPACE_CONFIG=:4096:8 when it was unset, leaving a value already set alone",
      warn_only and set_to == ":4096:8" and kept == ":16:8", set_to=set_to, kept=kept)
ws_doc = " ".join(torch.backends.cuda.cublas_workspace_size.__doc__.split())
claim("torch.backends.cuda.cublas_workspace_size's docstring: it takes precedence over "
      "CUBLAS_WORKSPACE_CONFIG, and only handles used after the change get new workspaces",
      "take precedence over the CUBLAS_WORKSPACE_CONFIG" in ws_doc
      and "only handles used after the change get new workspaces" in ws_doc)
aten = os.path.join(os.path.dirname(torch.__file__), "include", "ATen")
with open(os.path.join(aten, "Context.h")) as f:
    context_h = f.read()
with open(os.path.join(aten, "cuda", "CUDAContextLight.h")) as f:
    cuda_context_h = f.read()
claim("torch 2.14.1's headers: Context declares alertNotDeterministic and no cuBLAS-config "
      "alert (the old CUBLAS_WORKSPACE_CONFIG requirement is gone), and a cuBLAS workspace per "
      "handle and stream (cublas_handle_stream_to_workspace)",
      "alertNotDeterministic(" in context_h and "CuBLASConfig" not in context_h
      and "cublas_handle_stream_to_workspace" in cuda_context_h
      and "CUBLAS" not in det_doc)

# %% [markdown]
# ## What carries over
#
# The step itself (forward, loss, backward, step after `zero_grad`) survives into data
# parallelism unchanged except one line of thought: *the gradient of a step*. With N devices,
# each computes the gradient on its own slice of the batch, and the slices' gradients are
# combined before the step — lesson 02 does it inside one process (`nn.DataParallel`), lesson 03
# across processes (DDP). Around the step, a few things do change once there is one process per
# device, each in the lesson that meets it:
#
# - **the data order:** each process must read its own part of the data, reshuffled every
#   epoch (lesson 03: `DistributedSampler` and `set_epoch`);
# - **evaluation:** each process measures its own part of the test set, and the numbers must
#   be combined across processes (lesson 04);
# - **the learning rate:** it goes with the global batch, which grows with the devices; how
#   to rescale it, and where that stops working, is lesson 09 §4's.
#
# ## Lab 01: write the loop yourself
#
# Open [lab01_single_device](../labs/lab01_single_device.ipynb) and write `train_one_epoch` and
# `evaluate`; its checks compare them with the library's and name your mistake. The library's
# loop, which every later lesson reuses, is folded below with the step phases `time_breakdown`
# times: open it once your lab passes. Its `train_one_epoch` meets lab 01's §1 contract; its
# `evaluate` takes one of lab 01 §2's two choices (the one whose callers set the mode they need
# next), so compare yours with the contract, not only with this code.

# %% [markdown]
# **▶ The library's loop — open after your lab passes** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(train.train_one_epoch, train.evaluate, train.step_phases,
              folded="▶ The library's loop — open after your lab passes")

# %% [markdown]
# ## Summary
#
# - A step is forward, loss (a mean over the batch), backward, step — after `zero_grad`, because
#   `.grad` accumulates.
# - Throughput is what data parallelism multiplies; measure it with repeats and medians, and
#   look at where the step's time goes before buying more devices: a data-bound step needs a
#   faster pipeline. More GPUs fed by the same loader would wait on it too; DDP (lesson 03)
#   gives each GPU a process and a loader of its own, which helps where the host has cores to
#   spare.
# - AMP runs matmuls and convolutions in 16 bits and keeps sensitive operations, like the loss
#   computed inside the autocast block, in float32; here it kept the accuracy.
# - The same seed, code, hardware and threads gave this model bit-identical weights on the CPU
#   (two runs in one process; a model with e.g. `index_put` would need deterministic mode). On a GPU
#   only with deterministic kernels (`warn_only=True` lets an op without one through: read the
#   warnings); torch 2.14.1 no longer asks for `CUBLAS_WORKSPACE_CONFIG` (older versions did).
#
# Next: open `02_data_parallel.ipynb`, where one process drives several devices.
#
# ## Check yourself
#
# **▶ The quiz** — run the folded cell below and answer in the widget (or read its output,
# where the answers are folded).

# %% jupyter={"source_hidden": true}
from dpcourse import quizzes

viz.quiz(quizzes.questions("01"))

# %% [markdown]
# ## Sources
#
# Statements about PyTorch in this lesson, checked in the installed torch 2.14.1 (paths
# relative to `site-packages`):
#
# - `torch/_tensor.py` — `Tensor.backward`: "This function accumulates gradients in the leaves"
#   (hence `zero_grad`).
# - `torch/nn/modules/dropout.py` — `Dropout`: "During training, randomly zeroes some of the
#   elements ... with probability p" (none when p = 0).
# - `torch/optim/optimizer.py` — `Optimizer.zero_grad(set_to_none=True)`: the gradients become
#   `None` (`set_to_none` defaults to `True`).
# - `torch/amp/autocast_mode.py` — `autocast`: "ops run in an op-specific dtype chosen by
#   autocast" (default `torch.float16` on CUDA, `torch.bfloat16` on CPU: `autocast.__init__`
#   takes `torch.get_autocast_dtype(device_type)` when no dtype is given); "The autocast state is
#   thread-local". Which ops run in which dtype is autocast's op list (the Autocast Op Reference
#   in PyTorch's documentation); this lesson checks the one it relies on, cross-entropy, on this
#   machine. `torch/nn/functional.py` — `cross_entropy` (l. 3478; the call, l. 3561) calls
#   `torch._C._nn.cross_entropy_loss`, which runs `log_softmax`, then `nll_loss`.
#   `torch/include/ATen/autocast_mode.h` — the float32 list CUDA registers, `AT_FORALL_FP32`
#   (~855), has `nll_loss` (~884) and no `cross_entropy_loss`; `log_softmax` is only in
#   `AT_FORALL_FP32_SET_OPT_DTYPE` (~920): float32 only when its caller passes no `dtype`
#   (`CastPolicy::fp32_set_opt_dtype`, ~423). The CPU list (`KERNEL_CPU(cross_entropy_loss,
#   fp32)`) is in `aten/src/ATen/autocast_mode.cpp`, not installed;
#   `torch._C._dispatch_dump("aten::cross_entropy_loss")` shows its AutocastCPU kernel.
# - `torch/amp/grad_scaler.py` — `GradScaler`: `scale(loss)` multiplies the loss before
#   backward, `step(optimizer)` unscales the gradients (and skips the step on inf/NaN),
#   `update()` adjusts the scale.
# - `torch/cuda/__init__.py` — `synchronize`: waits for the GPU's queued kernels, which is what
#   `ThroughputMeter` calls before reading the clock on CUDA.
# - `torch/backends/cuda/__init__.py` — `cuBLASModule.__getattr__`/`__setattr__`:
#   `torch.backends.cuda.matmul.allow_tf32` reads `torch._C._get_cublas_allow_tf32()` and sets
#   `_set_cublas_allow_tf32` (off by default); `matmul.fp32_precision` reads
#   `_get_fp32_precision_getter("cuda", "matmul")` ("none" by default: read through to the level
#   above); `torch/backends/cudnn/__init__.py` — `CudnnModule.allow_tf32` for convolutions (on
#   by default), `conv` and `fp32_precision`, which is the ("cuda", "all") level
#   (`_get_fp32_precision_getter("cuda", "all")`) that `matmul` reads through to;
#   `torch/backends/__init__.py` — `fp32_precision`, the generic level.
#   `torch/include/ATen/Context.h` — `Context` keeps both: `float32_matmul_precision` (the old
#   switch's state) and the `fp32_precision` map, with the getters `allowTF32CuBLAS` and
#   `float32MatmulPrecision`. The error when they disagree is raised in C++ (not installed as
#   source): the installed `libtorch_cpu.so` holds its text ("you have used mix of the legacy
#   and new APIs to set the TF32 status for cublas matmul", and the same "to set the matmul
#   precision"; read with `strings`); measured on torch 2.14.1 by the cell: after a new knob
#   says "tf32", both old reads raise; setting `allow_tf32` writes the new knob ("tf32" or
#   "ieee"). `torch/__init__.py` — `get_float32_matmul_precision` returns
#   `_C._get_float32_matmul_precision()`; `torch/__init__.py` — `compile`: "inductor" is the
#   default backend (`torch/_dynamo/backends/registry.py` — `_default_backend`);
#   `torch/_inductor/codecache.py` — `PersistentCache.lookup` (line 413; it reads the
#   precision at line 431) and `torch/_inductor/select_algorithm.py` — `create_precompile_key`
#   call it when Inductor caches and precompiles its choice of matmul
#   kernels. The values each knob takes are checked in C++ (`_set_fp32_precision_setter`);
#   on torch 2.14.1 the CUDA knobs refuse "bf16" ("backend 'cuda' does not support precision
#   'bf16'"), the generic level and `torch.backends.mkldnn.matmul` (CPUs) accept it (claimed
#   in the TF32 cell; `torch/backends/mkldnn/__init__.py` — `matmul`'s `fp32_precision`).
# - `torch/nn/modules/module.py` — `Module.to(memory_format=torch.channels_last)`.
# - `torch/utils/data/dataloader.py` — `DataLoader(num_workers=...)`: "how many subprocesses to
#   use for data loading". `torch/utils/data/dataset.py` — `TensorDataset` defines
#   `__getitem__`, no `__getitems__`; so `torch/utils/data/_utils/fetch.py` —
#   `_MapDatasetFetcher.fetch` indexes one sample at a time (`[self.dataset[idx] for idx in
#   ...]`) and collates the list (`torch/utils/data/_utils/collate.py` — `collate_tensor_fn`:
#   `torch.stack(batch, 0, ...)`).
# - `torch/utils/data/distributed.py` — `DistributedSampler`: each process loads "a subset of
#   the original dataset that is exclusive to it"; `set_epoch` changes the shuffle from epoch to
#   epoch (lesson 03 runs both).
# - `torch/__init__.py` — `use_deterministic_algorithms(mode, warn_only=...)`: with
#   `warn_only=True` (what `seed_everything(..., deterministic=True)` passes) an operation
#   without a deterministic implementation warns instead of raising; the flag is global
#   (`are_deterministic_algorithms_enabled`, `is_deterministic_algorithms_warn_only_enabled`);
#   its docstring does not mention `CUBLAS_WORKSPACE_CONFIG`.
# - `torch/include/ATen/Context.h` — `Context::alertNotDeterministic` is the one deterministic
#   alert declared (no `alertCuBLASConfigNotDeterministic`, which older torch had);
#   `torch/include/ATen/cuda/CUDAContextLight.h` — `cublas_handle_stream_to_workspace`: a
#   workspace per cuBLAS handle and stream. The installed `libtorch_cuda.so` and
#   `libtorch_cpu.so` no longer hold the old alert's text ("uses CuBLAS", ":4096:8"); the two
#   messages about the variable left in `libtorch_cuda.so` (read with `strings`) are "Could not
#   parse CUBLAS_WORKSPACE_CONFIG, using default workspace size" and one saying a requested
#   unified cuBLASLt workspace larger than cuBLAS's is "limited to the CUBLAS workspace size"
#   unless CUBLAS_WORKSPACE_CONFIG grows it: the variable sizes cuBLAS's workspace and so caps
#   a cuBLASLt workspace that shares it (`getCUDABlasLtWorkspaceSize`, declared in
#   `CUDAContextLight.h`). The removal: pytorch/pytorch#161749 ("remove
#   workspace requirement checks"), after #85447 gave each handle/stream its own workspace.
#   `torch/backends/cuda/__init__.py` — `cublas_workspace_size`: the workspace
#   size set there "will take precedence over the CUBLAS_WORKSPACE_CONFIG environment
#   variable" and "only handles used after the change get new workspaces". Not installed
#   (C++, read in PyTorch's repository): `aten/src/ATen/cuda/CublasHandlePool.cpp` —
#   `getChosenWorkspaceSize`, a `static` reading of `parseChosenWorkspaceSize()`: the size is
#   read once, from the process's environment (`c10::utils::get_env`), which Python's
#   `os.environ` writes too.
#   `torch/__init__.py` — `use_deterministic_algorithms`' docstring list of
#   "normally-nondeterministic operations" that "will act deterministically" includes CPU ones;
#   five entries are not CUDA-only in 2.14.1 (the cell prints them): `index_put`/`put_` with
#   `accumulate=True` on a CPU tensor; the backward of `__getitem__` with a list of tensors;
#   `index_put` with `accumulate=False`, no device named; `index_copy` "when called on a CPU
#   or CUDA tensor". This course's `lib/dpcourse/devices.py` — `seed_everything`: `os.environ.setdefault(...)`, after
#   `torch.use_deterministic_algorithms(True, warn_only=True)`.
# - PyTorch's documentation, "CPU threading and TorchScript inference": intra-op parallelism
#   (`torch.set_num_threads`) against the threads a program starts itself.
# - NVIDIA's documentation, "Automatic Mixed Precision" (docs.nvidia.com): besides tensor
#   cores, it speeds up "memory-limited operations by accessing half the bytes".
