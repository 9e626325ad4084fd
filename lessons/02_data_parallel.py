# %% [markdown]
# # 02 · `nn.DataParallel`, taken apart
#
# `nn.DataParallel(model)` is the one-line way to use several GPUs in PyTorch, and the slowest.
# In this lesson we build it from scratch in `dpcourse.dp`, in four moves, and prove that it
# computes exactly what the plain model computes on the whole batch:
#
# 1. **scatter** the batch along dim 0, one contiguous chunk per device;
# 2. **replicate** the model onto every device (every step!);
# 3. **parallel_apply**: run each replica on its chunk, one Python *thread* per device;
# 4. **gather** the outputs on device 0, compute the loss there, and `backward()`: the replicas'
#    gradients are **summed** onto the original parameters on device 0.
#
# Then we see what the real `nn.DataParallel` does on *your* machine, and measure why it is slow.
#
# Without GPUs, our "devices" are all the CPU: the copies are real copies, the threads are real
# threads, and every number that would cross a PCIe link can be counted.

# %% tags=["parameters"]
n_devices = 4        # simulated devices for the from-scratch version
batch = 32           # samples per step (the global batch)
width = 16           # SmallCNN width
seed = 0

# %%
import copy

import torch
import torch.nn.functional as F

from dpcourse import devices, dp, models

# One intra-op thread: the model is tiny, and extra threads only add noise to the timings below
# (and would blur the GIL measurement, which is about *Python* threads).
torch.set_num_threads(1)
devices.seed_everything(seed)
model = models.SmallCNN(width=width)
X = torch.randn(batch, 3, 32, 32)
y = torch.randint(0, 10, (batch,))
devs = dp.devices_for(n_devices, kind="cpu")
K = models.count_parameters(model)
print(f"{n_devices} devices, batch {batch}, model with K = {K} parameters")

# %% [markdown]
# ## 1. Scatter
# The batch is cut along dim 0 into contiguous chunks (`torch.chunk`'s sizes: `ceil(B/N)` each,
# the last one smaller). Contiguous matters: gathering the outputs in device order must put the
# rows back in the order of `y`.

# %%
chunks = dp.scatter(X, devs)
print("chunk sizes:", [c.shape[0] for c in chunks])
assert torch.equal(torch.cat(chunks), X)

# %% [markdown]
# A batch that cannot give every device a sample is refused in one sentence. (The real
# `nn.DataParallel` silently uses fewer devices instead: 5 samples on 4 GPUs run on 3.)

# %%
try:
    dp.scatter(X[:3], devs)
except ValueError as e:
    print("ValueError:", e)

# %% [markdown]
# ## 2. Replicate
# Each replica's parameters are *outputs of a broadcast*, not leaf tensors: autograd links them
# back to the original parameters, and the backward of a broadcast is a **sum** (a reduce-add
# onto device 0). That is how gradients reach `model`.

# %%
replicas = dp.replicate(model, devs)
w0 = next(model.parameters())
w_rep = next(replicas[1].parameters())
print("replicas:", len(replicas))
print("original is a leaf:", w0.is_leaf, "| replica's copy is a leaf:", w_rep.is_leaf)
print("replica's copy comes from:", type(w_rep.grad_fn).__name__)
assert w0.is_leaf and not w_rep.is_leaf and torch.equal(w0, w_rep)

# %% [markdown]
# ## 3. Parallel apply — threads
# One thread per replica, as in the real one. Grad mode is thread-local in PyTorch, so each thread
# switches it to the caller's setting (forget it and the replicas run without autograd).

# %%
outputs = dp.parallel_apply(replicas, chunks)
print("output shapes:", [tuple(o.shape) for o in outputs])
assert all(o.requires_grad for o in outputs)

# %% [markdown]
# ## 4. Gather, loss, backward — and the proof
# Concatenate along dim 0 on device 0, compute the mean loss over the whole batch, and backward.
# Compare with the plain model on the whole batch: same outputs, same gradients.

# %%
out = dp.gather(outputs, devs[0])
loss = F.cross_entropy(out, y)
model.zero_grad(set_to_none=True)
loss.backward()

plain = copy.deepcopy(model)
plain.zero_grad(set_to_none=True)
ref_out = plain(X)
ref_loss = F.cross_entropy(ref_out, y)
ref_loss.backward()

out_diff = (out - ref_out).abs().max().item()
grad_diff = max((p.grad - q.grad).abs().max().item()
                for p, q in zip(model.parameters(), plain.parameters()))
print(f"outputs equal: {out_diff < 1e-5}   gradients equal: {grad_diff < 1e-5}")
assert out_diff < 1e-5 and grad_diff < 1e-5
assert all(p.grad is not None for p in model.parameters())  # the sums landed on `model`

# %% [markdown]
# **Sum, not average.** The loss is a *mean over the whole gathered batch*, so each replica's
# gradient is already its chunk's share (scaled by 1/B, not by 1/chunk). Summing them gives the
# full-batch gradient; averaging would make it N times too small. (DDP, next lesson, is the other
# way round: each rank's loss is a mean over its *own* chunk, so there the gradients are averaged.)

# %%
avg_grad = [torch.zeros_like(p) for p in model.parameters()]
# Recompute each replica's share by hand and average them, to see the difference:
for Xc, yc in zip(dp.scatter(X, devs), dp.scatter(y, devs)):
    share = copy.deepcopy(plain)
    share.zero_grad(set_to_none=True)
    (F.cross_entropy(share(Xc), yc, reduction="sum") / batch).backward()
    for a, p in zip(avg_grad, share.parameters()):
        a += p.grad / n_devices
ratio = (next(plain.parameters()).grad / avg_grad[0]).mean().item()
print(f"full-batch gradient / averaged shares = {ratio:.2f}  (= number of devices)")
assert abs(ratio - n_devices) < 1e-3

# %% [markdown]
# The whole step in one call, `dp.data_parallel(model, X, devs)`, is what `nn.DataParallel`'s
# `forward` does.

# %%
same = torch.allclose(dp.data_parallel(model, X, devs), ref_out, atol=1e-5)
print("dp.data_parallel == plain model:", same)
assert same

# %% [markdown]
# ## The real `nn.DataParallel` on this machine
# With 2 or more GPUs it scatters over them for real. With **one** GPU it moves the input to
# `cuda:0` and calls the module. With **no** GPU it has no `device_ids` and *silently calls the
# module*: no error, no warning, no parallelism. `dp.real_data_parallel` wraps a copy of our model,
# counts how often the wrapper replicates it, and compares with the module's own output.

# %%
# NBVAL_IGNORE_OUTPUT
# (why: what the wrapper does depends on how many GPUs this machine has.)
report = dp.real_data_parallel(model, X)
print(report.explain())
print(report)

# %%
if report.gpu_count >= 2:
    as_described = (report.mode == "parallel" and report.replicate_calls == 1
                    and report.matches_module)
else:
    as_described = (report.mode == "passthrough" and report.replicate_calls == 0
                    and report.device_ids in ([], [0])
                    and report.matches_module and report.max_abs_diff == 0.0)
print("the real nn.DataParallel behaves as described for this machine:", as_described)
assert as_described, report

# %% [markdown]
# ## Why it is slow
#
# **A parameter server on device 0.** Every step, device 0 sends the K weights to each of the other
# N−1 devices (replicate) and receives N−1 gradients of K numbers back (the reduce-add of the
# backward). That is **T = 2(N−1)K** numbers through device 0's link per step — linear in N. Our
# implementation counts what it copies:

# %%
for n in (2, 4, 8):
    m = copy.deepcopy(model)
    with dp.TrafficCounter() as tc:
        F.cross_entropy(dp.data_parallel(m, X, dp.devices_for(n, kind="cpu")), y).backward()
    T = dp.parameter_server_traffic(n, K)
    print(f"N={n}: weights out {tc.params_out:>8,}  gradients in {tc.grads_in:>8,}  "
          f"total {tc.total:>9,}  = 2(N-1)K: {tc.total == T}")
    assert tc.params_out == (n - 1) * K and tc.grads_in == (n - 1) * K and tc.total == T

# %% [markdown]
# A ring all-reduce (lesson 06) moves 2(N−1)K/N per device instead, and no device is a bottleneck.
#
# **Replicate every step.** The weights change at every optimizer step, so the replicas are built
# again every step — three steps, three replications:

# %%
m = copy.deepcopy(model)
opt = torch.optim.SGD(m.parameters(), lr=0.05)
with dp.TrafficCounter() as tc:
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(dp.data_parallel(m, X, devs), y).backward()
        opt.step()
print("replicate calls in 3 steps:", tc.replicate_calls)
assert tc.replicate_calls == 3

# %% [markdown]
# How long does a replication take compared with the forward it serves? On a GPU box the copies
# cross PCIe/NVLink; here they are memory copies plus building N module objects in Python.

# %%
# NBVAL_IGNORE_OUTPUT
# (why: timings depend on the machine and its load.)
t = dp.time_replicate_vs_forward(model, X, devs)
print(f"replicate onto {n_devices} devices: {t['replicate_s'] * 1e3:.2f} ms; "
      f"forward of one chunk: {t['forward_chunk_s'] * 1e3:.2f} ms; ratio {t['ratio']:.2f}")
assert t["replicate_s"] > 0 and t["forward_chunk_s"] > 0

# %% [markdown]
# **One process, one GIL.** The replicas run in threads of one Python process. Torch kernels
# release the GIL, but all the Python around them (module calls, hooks, the autograd glue) takes
# turns. Pure Python work shows it plainly: two threads are no faster than doing the work twice
# in a row, however many cores you have.

# %%
# NBVAL_IGNORE_OUTPUT
# (why: timings depend on the machine and its load.)
g = dp.gil_threads_demo()
print(f"2 units of Python work: one after another {g['sequential_s'] * 1e3:.0f} ms, "
      f"in 2 threads {g['threaded_s'] * 1e3:.0f} ms, speed-up {g['speedup']:.2f}x")
print(f"CPU seconds used per second while the 2 threads ran: {g['cpu_per_wall']:.2f}")

# %% [markdown]
# The speed-up above is at the mercy of whatever else the machine is doing. The CPU time is not:
# two truly parallel threads would burn about 2 CPU-seconds per second; under the GIL the process
# never burns more than one core's worth, however many cores are idle.

# %%
one_core = g["cpu_per_wall"] < 1.3
print("the threads used one core at a time:", one_core)
assert one_core, g

# %% [markdown]
# **Device 0 does extra work.** It holds the gathered outputs, computes the loss alone, and
# receives every gradient — so it runs out of memory first and the other GPUs wait for it.
#
# DDP (lesson 03) fixes all four: one *process* per device (no GIL), weights replicated once at
# the start (then kept equal because every rank applies the same averaged gradients), no device 0
# bottleneck (all-reduce), and communication overlapped with the backward.
#
# **Lab 02** asks you to write the step by hand: `scatter`, `gather`, and a forward/backward with
# plain copies of the model whose gradients you sum onto the original.
