# %% [markdown]
# # 02 · `nn.DataParallel`, taken apart
#
# **Prerequisites:** lesson 01 (the training step: forward, loss, backward, step); what a
# thread is.
#
# **You will be able to:**
# - explain the four moves of `nn.DataParallel` — scatter, replicate, parallel_apply, gather —
#   and why the replicas' gradients are *summed* onto the original parameters;
# - read a from-scratch implementation of each move and check it against the plain model;
# - predict what the real `nn.DataParallel` does on a machine with 0, 1 or several GPUs;
# - count the traffic through device 0 (2(N−1)K per step) and name the costs DDP removes.
#
# **Time:** about 20 minutes to read and run.
#
# **Lab:** [lab02_data_parallel](../labs/lab02_data_parallel.ipynb) — write scatter, gather
# and a DataParallel forward/backward with plain copies of the model.
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

from dpcourse import devices, dp, models, viz
from dpcourse.checks import claim

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
# rows back in the order of `y`. Here is the library's `scatter`; it checks its input more than
# you will need to in the lab, but the heart of it is one `torch.chunk`:

# %%
viz.show_code(dp.scatter)

# %%
chunks = dp.scatter(X, devs)
print("chunk sizes:", [c.shape[0] for c in chunks])
claim("the chunks, put back together in device order, are the batch",
      torch.equal(torch.cat(chunks), X))

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
# onto device 0). That is how gradients reach `model`. The whole trick is one small
# `autograd.Function` — copies going out in `forward`, a sum coming back in `backward` — and
# `replicate` points each copy of the module at its own copies of the weights:

# %%
viz.show_code(dp._Broadcast, dp.replicate)

# %%
replicas = dp.replicate(model, devs)
w0 = next(model.parameters())
w_rep = next(replicas[1].parameters())
print("replicas:", len(replicas))
print("replica's copy comes from:", type(w_rep.grad_fn).__name__)
claim("the original weight is a leaf; the replica's copy is not (autograd links it back)",
      w0.is_leaf and not w_rep.is_leaf)
claim("the replica's copy holds the same numbers as the original", torch.equal(w0, w_rep))

# %% [markdown]
# ## 3. Parallel apply — threads
# One thread per replica, as in the real one. Grad mode is thread-local in PyTorch, so each thread
# switches it to the caller's setting (forget it and the replicas run without autograd).

# %%
viz.show_code(dp.parallel_apply)

# %%
outputs = dp.parallel_apply(replicas, chunks)
print("output shapes:", [tuple(o.shape) for o in outputs])
claim("every replica's output is part of the autograd graph",
      all(o.requires_grad for o in outputs))

# %% [markdown]
# ## 4. Gather, loss, backward — and the proof
# Concatenate along dim 0 on device 0, compute the mean loss over the whole batch, and backward.
# Compare with the plain model on the whole batch: same outputs, same gradients.

# %%
viz.show_code(dp.gather, dp.data_parallel)

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
claim("DataParallel's outputs equal the plain model's (to 1e-5)", out_diff < 1e-5,
      out_diff=out_diff)
claim("the gradients summed onto `model` equal the plain model's (to 1e-5)", grad_diff < 1e-5,
      grad_diff=grad_diff)
claim("every parameter of the original model received a gradient",
      all(p.grad is not None for p in model.parameters()))

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
print(f"full-batch gradient / averaged shares = {ratio:.2f}")
claim(f"averaging the shares makes the gradient {n_devices}x (the number of devices) too small",
      abs(ratio - n_devices) < 1e-3, ratio=ratio)

# %% [markdown]
# The whole step in one call, `dp.data_parallel(model, X, devs)` (shown above), is what
# `nn.DataParallel`'s `forward` does. The picture of that step, drawn from this run's chunk sizes
# and parameter count:

# %%
claim("dp.data_parallel(model, X, devs) equals the plain model (to 1e-5)",
      torch.allclose(dp.data_parallel(model, X, devs), ref_out, atol=1e-5))
viz.show(viz.dp_step_figure([c.shape[0] for c in chunks], K),
         "every arrow starts or ends at device 0: it sends the weights out, collects the "
         "outputs, computes the loss alone and receives every gradient.")

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
print(f"GPUs: {report.gpu_count}, mode: {report.mode}, device_ids: {report.device_ids}, "
      f"replicate calls: {report.replicate_calls}, largest difference from the module: "
      f"{report.max_abs_diff:.1e}")

# %%
if report.gpu_count >= 2:
    as_described = (report.mode == "parallel" and report.replicate_calls == 1
                    and report.matches_module)
else:
    as_described = (report.mode == "passthrough" and report.replicate_calls == 0
                    and report.device_ids in ([], [0])
                    and report.matches_module and report.max_abs_diff == 0.0)
claim("the real nn.DataParallel behaves as described for this machine", as_described,
      report=report)

# %% [markdown]
# ## Why it is slow
#
# **A parameter server on device 0.** Every step, device 0 sends the K weights to each of the other
# N−1 devices (replicate) and receives N−1 gradients of K numbers back (the reduce-add of the
# backward). That is **T = 2(N−1)K** numbers through device 0's link per step — linear in N. Our
# implementation counts what it copies:

# %%
counted = {}
for n in (2, 4, 8):
    m = copy.deepcopy(model)
    with dp.TrafficCounter() as tc:
        F.cross_entropy(dp.data_parallel(m, X, dp.devices_for(n, kind="cpu")), y).backward()
    counted[n] = tc.total
    print(f"N={n}: weights out {tc.params_out:>8,}  gradients in {tc.grads_in:>8,}  "
          f"total {tc.total:>9,}")
    claim(f"N={n}: (N-1)K weights out, (N-1)K gradients in, 2(N-1)K in all",
          tc.params_out == (n - 1) * K and tc.grads_in == (n - 1) * K
          and tc.total == dp.parameter_server_traffic(n, K), counted=tc.total)

# %% [markdown]
# A ring all-reduce (lesson 06) moves 2(N−1)K/N per device instead — less than 2K however
# large N grows — and no device is a bottleneck:

# %%
viz.show(viz.traffic_figure(K, counted),
         "device 0's traffic grows linearly with N (the points are this run's counts); a ring "
         "keeps every rank's traffic under 2K.")

# %% [markdown]
# Try it yourself: raise N and watch device 0's line climb while the ring's stays under 2K;
# change the model size and see that it only rescales both lines.

# %%
def traffic_up_to(n_max, millions_of_params):
    """The two formulas above, for N = 2..n_max and K = millions_of_params × 10⁶."""
    return viz.traffic_figure(int(millions_of_params * 1e6), {}, range(2, n_max + 1))


traffic_explorer = viz.explorer(
    traffic_up_to, {"n_max": (16, 3, 64), "millions_of_params": (25.0, 1.0, 1000.0, 1.0)},
    caption="numbers moved per step: device 0 in DataParallel, 2(N−1)K, grows with N; "
            "a ring’s rank, 2(N−1)K/N, stays under 2K.",
    description="traffic explorer (N, model size)")

# %% [markdown]
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
claim("three steps replicated the model three times", tc.replicate_calls == 3)

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
# turns. Pure Python work shows it plainly: two units of it, run in two threads, take about as
# long as running them one after the other, however many cores you have.

# %%
# NBVAL_IGNORE_OUTPUT
# (why: timings depend on the machine and its load.)
g = dp.gil_threads_demo()
print(f"2 units of Python work: one after another {g['sequential_s'] * 1e3:.0f} ms, "
      f"in 2 threads {g['threaded_s'] * 1e3:.0f} ms, speed-up {g['speedup']:.2f}x")
print(f"CPU seconds used per second while the 2 threads ran: {g['cpu_per_wall']:.2f}")
verdict = ("no real speed-up" if g["speedup"] < 1.5 else "a speed-up the GIL alone cannot explain")
print(f"On this run: {verdict} (truly parallel threads would approach 2.00x; what is left "
      "around 1.00x is timing noise from the rest of the machine).")

# %% [markdown]
# The wall-clock ratio above is at the mercy of whatever else the machine is doing (on a busy
# machine it can land a little above or below 1). The CPU time is not: two truly parallel
# threads would burn about 2 CPU-seconds per second; under the GIL the process burns at most one
# core's worth, however many cores are idle. That is what we assert:

# %%
claim("the two Python threads used at most about one core at a time (GIL)",
      g["cpu_per_wall"] < 1.3, cpu_per_wall=g["cpu_per_wall"])

# %% [markdown]
# **Device 0 does extra work.** It holds the gathered outputs, computes the loss alone, and
# receives every gradient — so it runs out of memory first and the other GPUs wait for it.
#
# So `nn.DataParallel` has four costs, and DDP (lesson 03) answers each one:
#
# | DataParallel's cost (this lesson) | DDP's answer |
# |---|---|
# | traffic through device 0: 2(N−1)K per step | an all-reduce among equals: about 2K per rank (lesson 06) |
# | replicate every step | the weights are broadcast **once**, then stay equal because every rank applies the same averaged gradient |
# | one process, one GIL | one **process** per device |
# | device 0 computes the loss and holds all outputs | every rank computes the loss on its own chunk |
#
# DDP adds one more thing DataParallel never had: it starts all-reducing gradients **during**
# the backward, as they become ready (lessons 03 and 07).
#
# ## Lab 02: DataParallel's step by hand
#
# Open [lab02_data_parallel](../labs/lab02_data_parallel.ipynb): you write `scatter`, `gather`,
# and a forward/backward with plain copies of the model (`copy.deepcopy`, not the broadcast
# above) whose gradients you then sum onto the original yourself.
#
# ## Summary
#
# - `nn.DataParallel` = scatter the batch, replicate the model, run the replicas in threads,
#   gather the outputs on device 0, and let the backward sum the replicas' gradients there.
# - Summing is right because the loss is one mean over the whole gathered batch; averaging would
#   make the gradient N times too small.
# - Without GPUs the real `nn.DataParallel` silently just calls the module.
# - Its costs: 2(N−1)K numbers through device 0 every step, a replication every step, threads
#   sharing one GIL, and device 0 doing the loss alone.
#
# ## Check yourself

# %%
viz.quiz([
    {"q": "In nn.DataParallel, the replicas' gradients reach the original parameters how?",
     "options": ["They are averaged by an all-reduce between the GPUs",
                 "The backward of the broadcast that made the copies sums them onto device 0",
                 "Each replica steps its own optimizer and the weights are averaged after"],
     "answer": 1,
     "why": ["There is no all-reduce in DataParallel: everything flows through device 0.",
             "Right: broadcast forward, reduce-add backward — autograd does the summing.",
             "There is one optimizer, on the original parameters; replicas are rebuilt each step."]},
    {"q": "Why are the replicas' gradients summed and not averaged?",
     "options": ["Because the loss is a mean over the whole gathered batch, so each replica's "
                 "gradient is already its share", "Because summing is faster than averaging",
                 "They should be averaged; summing is a known DataParallel bug"],
     "answer": 0,
     "why": ["Right: each chunk's term is already divided by the whole batch size B.",
             "Speed has nothing to do with it: the result would differ by a factor N.",
             "Averaging would make the gradient N times too small — this lesson measured it."]},
    {"q": "With 8 devices and a model of K parameters, how many numbers cross device 0's link "
          "per step?",
     "options": ["2K", "14K", "8K"],
     "answer": 1,
     "why": ["That is (about) what one rank moves in a ring all-reduce, not DataParallel.",
             "Right: 2(N−1)K = 14K — K out to each of 7 copies, K gradients back from each.",
             "Close, but the weights go out to 7 copies AND 7 gradients come back."]},
    {"q": "On a laptop with no GPU, what does nn.DataParallel(model)(X) do?",
     "options": ["Raises an error", "Splits the batch over CPU threads",
                 "Calls the module on the whole batch, silently"],
     "answer": 2,
     "why": ["It does not complain — which is why this course builds its own.",
             "It has no CPU devices to scatter to.",
             "Right: with no device_ids it just calls model(X)."]},
])
