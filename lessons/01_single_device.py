# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
# ---

# %% [markdown]
# # 01 · One device: the training loop, its speed, and its randomness
#
# Data parallelism changes *one* thing about training: where the gradient of each step comes
# from. To see that change clearly later, we first take the single-device loop apart:
#
# 1. the four moves of a step — forward, loss, backward, step — and the one you must not forget;
# 2. training for real: the loss falls and accuracy ends far above chance;
# 3. throughput, and where a step's time goes;
# 4. mixed precision (AMP): cheaper arithmetic, same accuracy;
# 5. seeds: when two runs are identical, and when they are not.
#
# The parameters cell below is what an instructor changes (with papermill) to run this lesson
# at a larger scale, e.g. `-p dataset cifar10 -p n_train 50000 -p epochs 10`.

# %% tags=["parameters"]
dataset = "shapes10"  # "shapes10" (offline, made on the fly) or "cifar10" (if you have it)
n_train = 4000
n_test = 1000
epochs = 3
batch_size = 32
lr = 2e-3  # Adam's learning rate
seed = 0
device = None  # None: from the hardware profile (cuda if there is a GPU, else cpu)

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

from dpcourse import data, devices, models, train

device = torch.device(device or devices.choose_profile().device)
devices.seed_everything(seed)

# %% [markdown]
# ## The data
#
# The default data set, `shapes10`, is made from a seed in well under a second: 32×32 colour
# images in 10 classes (discs, rings, squares, stripes in four directions, ...), at random places,
# sizes and colours, over noisy backgrounds. It has CIFAR-10's shape, so every line of this
# course runs on CIFAR-10 too; unlike CIFAR-10 it needs no download and a small CNN learns it in
# seconds on a CPU — which is what a course that re-runs every notebook on every change needs.

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
plt.show()

# %% [markdown]
# The same seed gives the same images on every machine, and a different seed different ones —
# which is what lets a test (and you) rely on them.

# %%
x_again, _ = data.make_shapes10(8, seed=seed)
x_other, _ = data.make_shapes10(8, seed=seed + 1)
print("same seed, same images:", np.array_equal(x_again, data.make_shapes10(8, seed=seed)[0]))
print("other seed, other images:", not np.array_equal(x_again, x_other))

# %% [markdown]
# ## One step, taken apart
#
# A step of training is four moves. **Forward**: the model maps a batch `X` to scores (logits).
# **Loss**: one number saying how wrong the scores are for the labels `y` — here cross-entropy,
# *averaged* over the batch. **Backward**: autograd fills every parameter's `.grad` with the
# gradient of that loss. **Step**: the optimizer moves each parameter against its gradient.

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
print("loss is a scalar:", loss.dim() == 0)
print("every parameter has a gradient:", all(p.grad is not None for p in model.parameters()))

# %% [markdown]
# The move people forget: **`.grad` accumulates**. `backward()` *adds* to whatever is already
# there (handy for gradient accumulation, lesson 04), so each step must start with
# `optimizer.zero_grad()`. Watch it: a second backward on the same batch doubles the gradient.

# %%
first = [p.grad.clone() for p in model.parameters()]
loss_fn(model(X), y).backward()  # no zero_grad in between
doubled = all(torch.allclose(p.grad, 2 * g, rtol=1e-4, atol=1e-6)
              for p, g in zip(model.parameters(), first))
print("without zero_grad the gradient doubled:", doubled)
assert doubled
optimizer.zero_grad(set_to_none=True)
print("after zero_grad:", all(p.grad is None for p in model.parameters()))

# %% [markdown]
# The library's loop, which every later lesson reuses. Note the two details that lab01 checks:
# the epoch's loss is weighted by batch size (the last batch is shorter), and `evaluate` runs in
# `eval()` mode under `torch.no_grad()`.

# %%
print(inspect.getsource(train.train_one_epoch))
print(inspect.getsource(train.evaluate))

# %% [markdown]
# ## Training for real
#
# Ten classes means a model that guesses is right 10% of the time, with a loss of
# ln 10 ≈ 2.30. A few epochs on the CPU take us far past that. We use Adam here: on a budget
# of a few hundred steps it leaves the initial plateau sooner than plain SGD (the later
# lessons' equivalence proofs hold for any optimizer, because they compare gradients).

# %%
devices.seed_everything(seed)
cfg = train.TrainConfig(epochs=epochs, batch_size=batch_size, optimizer="adam", lr=lr, seed=seed,
                        device=str(device))
trained = models.SmallCNN()
history = train.fit(trained, ds, cfg)
first_loss, last_loss = history[0]["train_loss"], history[-1]["train_loss"]
final_acc = history[-1]["test_acc"]
print(f"epochs: {len(history)}")
print("training loss fell every epoch:",
      all(b["train_loss"] < a["train_loss"] for a, b in zip(history, history[1:])))
print("test accuracy above 50% (chance is 10%):", final_acc > 0.5)
assert last_loss < first_loss and final_acc > 0.5

# %%
# NBVAL_IGNORE_OUTPUT
# Why: the exact losses and speed depend on the CPU/GPU and its kernels.
for h in history:
    print(f"epoch {h['epoch']}: train loss {h['train_loss']:.3f}  test loss {h['test_loss']:.3f}  "
          f"test acc {h['test_acc']:.3f}  {h['samples_per_s']:.0f} samples/s")

# %% [markdown]
# ## Throughput, and where the time goes
#
# *Samples per second* is the number data parallelism is meant to multiply. It depends on the
# batch size: a bigger batch gives the hardware bigger matrices to chew on per step (and fewer
# Python round trips per sample), until it is saturated. `ThroughputMeter` synchronizes a GPU
# before reading the clock: CUDA runs asynchronously, and without the sync you would time how
# fast Python *queues* work.

# %%
# NBVAL_IGNORE_OUTPUT
# Why: timings depend on the machine and what else it is doing.
rates = {}
for bs in (16, 64, 256):
    loader, _ = train.make_loaders(ds, bs, seed=seed)
    m = models.SmallCNN().to(device)
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    meter = train.ThroughputMeter(device)
    batches = [b for _, b in zip(range(max(2, 1024 // bs)), loader)]
    train.train_one_epoch(m, batches, loss_fn, opt, device, meter=meter)
    rates[bs] = meter.rate
    print(f"batch {bs:4d}: {meter.rate:8.0f} samples/s")

# %% [markdown]
# Where does one step's time go? `time_breakdown` charges each phase — waiting for the next
# batch, forward, backward + step — separately. Our data sits in memory as one tensor, so
# slicing batches out of it is nearly free; give the loader a per-sample transform (an augmentation done in
# Python, as image pipelines often are) and the same model suddenly spends much of its time
# waiting for data. More devices would not help that; more loader workers (`num_workers`)
# or a faster pipeline would.

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
        x = torch.stack([c.roll(int(torch.randint(-2, 3, ())), dims=0) for c in x])
        return x, label


base = data.to_torch(ds.x_train, ds.y_train)
X_all, y_all = base.tensors
# batches sliced straight out of one tensor: no per-sample Python at all
fast = [(X_all[i:i + batch_size], y_all[i:i + batch_size]) for i in range(0, 10 * batch_size, batch_size)]
slow = torch.utils.data.DataLoader(SlowAugment(base), batch_size=batch_size, shuffle=True)
m = models.SmallCNN().to(device)
opt = torch.optim.Adam(m.parameters(), lr=lr)
share = {}
for name, loader in (("in-memory tensors", fast), ("per-sample Python transform", slow)):
    parts = train.time_breakdown(m, loader, loss_fn, opt, device, max_batches=10)
    share[name] = parts["data"] / sum(parts.values())

# %%
# NBVAL_IGNORE_OUTPUT
# Why: the shares depend on the machine's speed.
for name, s in share.items():
    print(f"{name:28s}: {100 * s:5.1f}% of the step waiting for data")

# %%
print("the Python transform makes data loading a bigger share of the step:",
      share["per-sample Python transform"] > share["in-memory tensors"])
assert share["per-sample Python transform"] > share["in-memory tensors"]

# %% [markdown]
# ## Mixed precision (AMP)
#
# Most of a network's arithmetic does not need 32-bit floats. Under `torch.autocast`, matrix
# multiplications and convolutions run in a 16-bit type while reductions and the loss stay in
# float32. On a GPU the type is float16, whose small range makes tiny gradients underflow to
# zero — hence a `GradScaler` that multiplies the loss up before backward and the gradients back
# down before the step. On a CPU the type is bfloat16, which has float32's range: no scaler
# needed. `train.fit(..., amp=True)` picks the right pair for the device.

# %%
with train.autocast_for(device, enabled=True):
    out = models.SmallCNN().to(device)(X)
print("under autocast the logits are 16-bit:", out.dtype in (torch.float16, torch.bfloat16))
print("the loss computed from them is float32:", loss_fn(out, y).dtype == torch.float32)

# %% [markdown]
# Does the cheaper arithmetic cost accuracy? Two tests on the model we just trained. First,
# its predictions on the test set with and without autocast. Second, one more (short) epoch of
# training from the *same* weights, once in float32 and once in AMP: both must end as accurate.
#
# Why not train from scratch in AMP? On a GPU, do (`train.fit(..., amp=True)`): tensor cores
# make float16 much faster. On a CPU, bfloat16 saves memory but for convolutions this small it
# is usually *slower* than float32 (the last cell measures it on your machine) — a full AMP run
# would double this lesson's time for no insight.

# %%
import copy


def predictions(model, amp):
    model.eval()
    with torch.no_grad(), train.autocast_for(device, amp):
        return torch.cat([model(Xb.to(device)).argmax(1).cpu() for Xb, _ in test_loader])


agree = (predictions(trained, False) == predictions(trained, True)).float().mean().item()
print("autocast changes at most 2% of test predictions:", agree >= 0.98)

subset = data.Dataset(ds.name, ds.x_train[:1024], ds.y_train[:1024], ds.x_test, ds.y_test,
                      ds.classes)
acc_after, rate = {}, {}
for amp in (False, True):
    devices.seed_everything(seed)
    m = copy.deepcopy(trained)
    opt = torch.optim.Adam(m.parameters(), lr=lr / 4)
    loader, _ = train.make_loaders(subset, batch_size, seed=seed)
    scaler = torch.amp.GradScaler("cuda") if amp and device.type == "cuda" else None
    meter = train.ThroughputMeter(device)
    train.train_one_epoch(m, loader, loss_fn, opt, device, amp=amp, scaler=scaler, meter=meter)
    acc_after[amp] = train.evaluate(m, test_loader, loss_fn, device, amp=amp)[1]
    rate[amp] = meter.rate
print("after one more epoch, both above 80%:", min(acc_after.values()) > 0.8)
print("AMP within 3 points of float32:", abs(acc_after[True] - acc_after[False]) < 0.03)
assert agree >= 0.98 and min(acc_after.values()) > 0.8
assert abs(acc_after[True] - acc_after[False]) < 0.03

# %%
# NBVAL_IGNORE_OUTPUT
# Why: speed and exact accuracies depend on the hardware (a GPU's tensor cores gain far
# more from float16 than a CPU gains from bfloat16, which may even be slower).
print(f"float32: acc {acc_after[False]:.3f}, {rate[False]:7.0f} samples/s")
print(f"AMP    : acc {acc_after[True]:.3f}, {rate[True]:7.0f} samples/s")

# %% [markdown]
# ## Seeds and reproducibility
#
# Randomness enters training in the initial weights, the shuffling order, dropout and data
# augmentation. `devices.seed_everything(seed)` seeds Python, NumPy and torch; our loaders draw
# their order from their own seeded generator. With the same seed, the same code, the same
# hardware and the same number of threads, two runs end with *bit-identical* weights. Change
# the seed and they differ. (On a GPU some kernels are nondeterministic unless you also ask for
# `deterministic=True`, at some cost in speed; across *different* hardware, bit-identity is not
# promised at all — floating-point sums are done in different orders.)

# %%
def one_epoch_weights(run_seed):
    devices.seed_everything(run_seed, deterministic=True)
    m = models.SmallCNN().to(device)
    small = data.Dataset(ds.name, ds.x_train[:1024], ds.y_train[:1024], ds.x_test[:10],
                         ds.y_test[:10], ds.classes)
    loader, _ = train.make_loaders(small, batch_size, seed=run_seed)
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    train.train_one_epoch(m, loader, loss_fn, opt, device)
    return torch.cat([p.detach().flatten().cpu() for p in m.parameters()])


a, b, c = one_epoch_weights(1), one_epoch_weights(1), one_epoch_weights(2)
print("same seed -> identical weights:", torch.equal(a, b))
print("other seed -> different weights:", not torch.equal(a, c))
assert torch.equal(a, b) and not torch.equal(a, c)

# %% [markdown]
# ## What carries over
#
# Everything in this loop survives into data parallelism unchanged except one line of thought:
# *the gradient of a step*. With N devices, each computes the gradient on its own slice of the
# batch, and the slices' gradients are averaged before the step — lesson 02 does it inside one
# process (`nn.DataParallel`), lesson 03 across processes (DDP). Now do **lab01**: write
# `train_one_epoch` and `evaluate` yourself.
