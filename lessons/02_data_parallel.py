# %% [markdown]
# # 02 · `nn.DataParallel`, taken apart
#
# **Prerequisites:** lesson 01 (the training step: forward, loss, backward, step); what a
# thread is.
#
# **You will be able to:**
# - explain the four moves of `nn.DataParallel` — scatter, replicate, parallel_apply, gather —
#   and how autograd brings the replicas' gradients back to the original parameters;
# - read a from-scratch implementation of each move and check it against the plain model;
# - predict what the real `nn.DataParallel` does on a machine with 0, 1 or several GPUs;
# - show that BatchNorm's running statistics after a DataParallel forward are not the whole
#   batch's, and say why (lab 02's part 5: what of a replica's state reaches the module);
# - count the traffic through device 0 when it hands the weights out and collects the
#   gradients copy by copy — 2(N−1)K weights and gradients per step — say what the real class
#   does instead (broadcast and reduce with NCCL, NVIDIA's GPU collectives library), and
#   name what DDP (`DistributedDataParallel`: lesson 03) removes: the
#   replication every step, the loss and the gathered outputs on device 0, one GIL for all
#   replicas.
#
# **Time:** about 40 minutes to read and run (plus about 30 for the lab).
#
# **Lab:** [lab02_data_parallel](../labs/lab02_data_parallel.ipynb) — write scatter, gather
# and a DataParallel forward/backward with plain copies of the model.
#
# `nn.DataParallel(model)` is the one-line way to use several GPUs in PyTorch, and the slowest.
# In this lesson we build it from scratch in `dpcourse.dp`, in four moves, and prove that it
# computes what the plain model computes on the whole batch — the same outputs and gradients
# to within 1e-5 (not bit for bit: the chunks' sums are added in another order) — as long as
# no layer couples the samples of a batch (training-mode BatchNorm does: section 2 shows it)
# or draws random numbers (dropout with p > 0: each replica draws its own mask):
#
# 1. **scatter** the batch along dim 0 into contiguous chunks, at most one per device;
# 2. **replicate** the model onto every device (every step!);
# 3. **parallel_apply**: run each replica on its chunk, one Python *thread* per replica when
#    there are two or more (a lone replica runs in the caller's thread; the threads of one
#    process share its GIL, Python's *global interpreter lock*: only one of them runs Python
#    code at a time — on the default CPython build, which this course runs ("Why it is
#    slow" checks it); the optional free-threaded build (3.13 on) has none unless an extension
#    without `Py_mod_gil`, or `PYTHON_GIL=1`, switches it back on);
# 4. **gather** the outputs on `output_device` (by default device 0, `device_ids[0]`, which
#    holds the parameters), compute the loss
#    there, and `backward()`: autograd carries the replicas' gradients back to the original
#    parameters on device 0.
#
# Then we see what the real `nn.DataParallel` does on *your* machine, count its costs and time
# them (each timing says whether it could tell).
#
# Without GPUs, our "devices" are all the CPU: the copies and the threads are real, and every
# number that would cross a PCIe link (the bus between a GPU and the rest of
# the machine; NVLink is NVIDIA's faster direct link between GPUs) can be counted.

# %% tags=["parameters"]
n_devices = 4        # simulated devices for the from-scratch version
batch = 32           # samples per step (the global batch)
width = 16           # SmallCNN width
seed = 0

# %%
import copy

import torch
import torch.nn.functional as F
from torch import nn

from dpcourse import devices, dp, dp_answers, dp_costs, models, viz
from dpcourse.checks import claim

# One intra-op thread (the threads torch uses *inside* one operation, e.g. to split a
# convolution over the cores): the model is tiny, and extra threads only add noise to the
# timings below (and would blur the GIL measurement, which is about *Python* threads).
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
# The batch is cut along dim 0 into contiguous chunks, at most one per device, never an empty
# one. Contiguous matters: gathering the outputs in device order must put the rows back in the
# order of `y`. Writing `scatter` is part of lab 02 (with a choice of the chunks' sizes that
# this lesson leaves to you), so its code is folded at the end; here we check what it returns:

# %%
chunks = dp.scatter(X, devs)
print("chunk sizes:", [c.shape[0] for c in chunks])
claim("the chunks, put back together in device order, are the batch",
      torch.equal(torch.cat(chunks), X))

# %% [markdown]
# The real class gives each device `ceil(B/N)` samples in turn, which can use up the batch
# before the last device: 6 samples on 4 devices are 3 chunks of 2, and 2 samples on 3 devices
# are 2 chunks of 1. The real `nn.DataParallel` then replicates onto only as many devices as
# there are chunks (`self.device_ids[:len(inputs)]`), leaving the others idle; so does
# `dp.data_parallel`, this lesson's whole DataParallel forward in one function (§4 shows it):

# %%
for b, n in ((6, 4), (2, 3), (batch, n_devices)):
    sizes = [c.shape[0] for c in dp.scatter(X[:b], dp.devices_for(n, kind="cpu"))]
    print(f"batch {b} on {n} devices -> chunks {sizes}")
    claim(f"batch {b} on {n} devices: {len(sizes)} non-empty chunk(s) of at most ceil({b}/{n}), "
          f"holding all {b} samples", min(sizes) > 0 and max(sizes) == -(-b // n)
          and sum(sizes) == b and len(sizes) <= n, sizes=sizes)

# %% [markdown]
# ## 2. Replicate
# A *broadcast* sends one device's tensor to every device, so that each holds a copy.
#
# Three autograd words first:
# - a *leaf* is a tensor no recorded operation made, like a model's parameter; `backward()`
#   leaves a leaf's gradient in its `.grad` if it requires one;
# - a tensor computed from others keeps in its `grad_fn` the operation that made it, which the
#   backward follows back to the leaves;
# - a `torch.autograd.Function` is an operation you write yourself: a `forward`, plus the
#   `backward` that turns the gradient of its output into the gradients of its inputs.
#
# With grad mode on (a training step), each replica's parameters are *outputs of a
# broadcast*, not leaves: autograd links them back to the original parameters, so the
# backward of the broadcast receives every copy's gradient and hands one gradient per original
# parameter back to device 0. That is how gradients reach `model`.
#
# The whole trick is one small `autograd.Function` — copies going out in its `forward`
# (folded below), the copies' gradients coming back in its `backward` — and `replicate`
# points each copy of the module at its own copies of the weights.
#
# Two pieces are lab 02's, so their code waits, folded, below the lab's pointer at the end of
# this lesson: how the `backward` combines what the copies received (for plain copies), and,
# in its part 5, what `replicate` gives each copy besides its weights — the module's
# *buffers*, tensors it keeps in its state that are not parameters (no gradient, no
# optimizer; printed below for a BatchNorm).

# %% [markdown]
# <details><summary>▶ Aside: replicating under <code>torch.no_grad()</code></summary>
#
# Under `torch.no_grad()`, torch's `DataParallel.replicate` asks for detached copies instead:
# leaves with no link back to the original parameters (`not torch.is_grad_enabled()`; *not run
# here*, Sources).
#
# </details>

# %%
viz.show_code(dp.Broadcast.forward,
              folded="▶ Broadcast.forward — what it does for device 0 is a hint for lab 02's "
                     "part 5: open it after the lab, or now if you skip it")

# %%
replicas = dp.replicate(model, devs)
w0 = next(model.parameters())
w_rep = next(replicas[1].parameters())
print("replicas:", len(replicas))
print("replica's copy comes from:", type(w_rep.grad_fn).__name__)
claim("the original weight is a leaf; the replica's copy is not (autograd links it back)",
      w0.is_leaf and not w_rep.is_leaf)
claim("the replica's copy holds the same numbers as the original", torch.equal(w0, w_rep))
bn_probe = nn.BatchNorm2d(8)
print("a BatchNorm2d's buffers:", [name for name, _ in bn_probe.named_buffers()])
claim("none of its buffers is among its parameters",
      not {id(b) for b in bn_probe.buffers()} & {id(q) for q in bn_probe.parameters()})

# %% [markdown]
# One consequence of what a replica's forward does to the module's *buffers* matters most for
# training: BatchNorm's *running* mean and variance (buffers, updated by every training-mode
# forward) are **not the whole batch's** after a DataParallel forward. A small BatchNorm model
# shows it:

# %%
bn_net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
whole = copy.deepcopy(bn_net)
before = bn_net[1].running_mean.clone()   # the module's running mean before the forward
dp.data_parallel(bn_net, X, devs)   # one DataParallel forward, in training mode
whole(X)                            # a plain copy that sees the whole batch
bn, bn_whole = bn_net[1], whole[1]
moved = (bn.running_mean - before).abs().max().item()
gap = (bn.running_mean - bn_whole.running_mean).abs().max().item()
print(f"largest change of the module's running mean: {moved:.4f}; largest difference from the "
      f"whole batch's: {gap:.4f}")
claim("after one DataParallel forward, the module's running mean moved, and it is not the "
      "whole batch's", moved > 1e-4 and gap > 1e-4,
      moved=moved, gap=gap)

# %% [markdown]
# The same layer breaks "DataParallel computes what the plain model computes". In training mode
# BatchNorm normalises each sample with the mean and variance of the batch it sees — here, of
# its replica's chunk, not of the whole batch — so the outputs themselves differ. The equality
# proven below holds only for models whose layers treat every sample on its own and draw no
# random numbers (SmallCNN has no BatchNorm, and its `nn.Dropout` has p = 0 here, SmallCNN's default;
# DDP in lesson 03 — one process per device, each called a *rank* — has the same caveat, and
# treats the buffers its own way, which lesson 03 measures):

# %%
twin_dp, twin_plain = copy.deepcopy(bn_net), copy.deepcopy(bn_net)
out_gap = (dp.data_parallel(twin_dp, X, devs) - twin_plain(X)).abs().max().item()
print(f"largest output difference, DataParallel vs plain, training-mode BatchNorm: {out_gap:.3f}")
claim("with training-mode BatchNorm the DataParallel output differs from the plain model's on "
      "the whole batch by more than 1e-3 (per-chunk statistics)", out_gap > 1e-3, out_gap=out_gap)
claim("SmallCNN's dropout has p = 0 here (its default): it draws no mask",
      all(m.p == 0 for m in model.modules() if isinstance(m, nn.Dropout)))

# %% [markdown]
# ## 3. Parallel apply — threads
# One thread per replica, as in the real one (`torch/nn/parallel/parallel_apply.py`: with two
# or more replicas; a single one runs in the caller's thread), each running its replica on its
# chunk, and the outputs handed back in device order. Writing this
# function is the lab's stretch, so it is folded at the end; here we check what it returns:

# %%
outputs = dp.parallel_apply(replicas, chunks)
print("output shapes:", [tuple(o.shape) for o in outputs])
claim("every replica's output is part of the autograd graph",
      all(o.requires_grad for o in outputs))

# %% [markdown]
# ## 4. Gather, loss, backward — and the proof
# `gather` concatenates the outputs along dim 0 on device 0 (folded at the end: the lab asks
# for it). Then: the mean loss over the whole batch, and backward.
# Compare with the plain model on the whole batch: the same outputs and gradients, to within
# 1e-5. Here is the whole step in one function, the four moves in order:

# %%
viz.show_code(dp.data_parallel)

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
claim("the gradients that reached `model` equal the plain model's (to 1e-5)", grad_diff < 1e-5,
      grad_diff=grad_diff)
claim("every parameter of the original model received a gradient",
      all(p.grad is not None for p in model.parameters()))

# %% [markdown]
# The whole step in one call, `dp.data_parallel(model, X, devs)` (shown above), is what
# `nn.DataParallel`'s `forward` does on two or more devices (on one, torch's class skips
# `replicate` and calls the module; ours still replicates). Below, that step as our `dp` does it,
# one copy at a time, drawn from this run's numbers. Two words in it name how
# tensors move between devices: a **broadcast** copies one device's tensor to every device, and
# a **reduce** brings a tensor from every device onto one device, combining them there with one
# operation into a single tensor.
# The real class moves the weights and the gradients with collectives — operations that all the
# devices join at once, such as one broadcast — when NCCL, NVIDIA's library of collectives for
# its GPUs, is there ("Why it is slow" below); it copies the input's chunks and the outputs
# device by device (`comm.scatter`, `comm.gather`):

# %%
claim("dp.data_parallel(model, X, devs) equals the plain model (to 1e-5)",
      torch.allclose(dp.data_parallel(model, X, devs), ref_out, atol=1e-5, rtol=0))
viz.show(viz.dp_step_figure([c.shape[0] for c in chunks], K),
         "in our copy-by-copy dp every arrow starts or ends at device 0: it sends the input's "
         "chunks and the weights out, collects the outputs, computes the loss alone and "
         "receives every gradient.")
viz.show_code(viz.dp_step_figure, folded="▶ code: viz.dp_step_figure (the arrows are drawn from "
                                         "dp.data_parallel's moves, the sizes from this run)")

# %% [markdown]
# That picture is who holds what; the next is **when**. `viz.record_dp_step` runs one training
# step of the same `dp` functions on a copy of `model` — scatter, replicate, the forwards in
# their threads, gather, the loss, `backward()`, an SGD step — and hooks record when each piece
# ran and for which device: a forward hook on each replica, a hook before and after every
# autograd node of each replica's backward, the broadcast's backward node for the reduce onto
# device 0, and a clock around each call device 0 makes alone. We run two steps and draw the
# second (the first pays one-off costs). One thing in it belongs to the CPU, not to
# DataParallel: autograd's engine starts a worker thread for each GPU (Sources), and runs CPU
# work in the thread that called `backward()`. On GPUs each replica's part of the backward runs on its own device's thread,
# so those parts can overlap; here every "device" is the CPU, so they take turns in one thread.
# This run can show only the CPU case:

# %%
clock_model = copy.deepcopy(model)
clock_opt = torch.optim.SGD(clock_model.parameters(), lr=0.05)
for _ in range(2):
    step = viz.record_dp_step(clock_model, X, y, devs, clock_opt)
spans = step["spans"]
solo = [s for s in spans if s[1] not in ("forward", "backward")]
backward = [s for s in spans if s[1] == "backward"]
claim(f"devices 1-{n_devices - 1} ran their forward and their part of the backward, nothing "
      f"else; device 0 also ran {len(solo)} pieces alone: "
      + ", ".join(dict.fromkeys(s[1] for s in solo)),
      {s[1] for s in spans if s[0] > 0} == {"forward", "backward"}
      and all(s[0] == 0 for s in solo), spans=spans)
claim("while device 0 worked alone, no other device had anything to do: none of their spans "
      "overlaps one of device 0's pieces",
      not any(a[2] < b[3] and b[2] < a[3] for a in spans if a[0] > 0 for b in solo))
claim(f"the {n_devices} forwards ran in {n_devices} threads, the backward, all on the CPU, in "
      "one: its replicas took turns, no two devices' backward spans overlap",
      step["threads"] == {"forward": n_devices, "backward": 1}
      and not any(a[0] != b[0] and a[2] < b[3] and b[2] < a[3]
                  for a in backward for b in backward), threads=step["threads"])
viz.show(viz.dp_timeline_figure(step),
         "one recorded step: the other devices wait (grey) while device 0 alone scatters and "
         "replicates, and again while it gathers, computes the loss, reduces the gradients and "
         "steps; each forward's bar is its thread's wall time from start to end, GIL waits "
         "included, so bars drawn side by side need not have computed at once (the line below "
         "compares them with the forwards run in turn), and on this one CPU the backward's nodes take turns in one thread (on GPUs each device's "
         "would have a thread of its own), so each lane is mostly grey there. Right: each of "
         "device 0's solo pieces, the time every other device waited.")

# %%
# NBVAL_IGNORE_OUTPUT
# (why: timings depend on the machine and its load.)
# A span is wall time from a piece's start to its end: a thread that waits for the GIL inside
# its forward is still inside its span, so these sums are not compute time.
import time

total = max(s[3] for s in spans)
for d in range(len(step["chunk_sizes"])):
    span = sum(s[3] - s[2] for s in spans if s[0] == d)
    print(f"device {d}: in its spans {span:6.1f} ms (wall time, GIL waits included), "
          f"outside them {total - span:6.1f} ms of {total:.1f} ms")
fwd = [s for s in spans if s[1] == "forward"]
fwd_wall = max(s[3] for s in fwd) - min(s[2] for s in fwd)   # first start to last end


def chunk_forward_ms():
    """One chunk's forward alone, with autograd, in this thread."""
    t0 = time.perf_counter()
    clock_model(chunks[0])
    return (time.perf_counter() - t0) * 1e3


one_chunk = min(chunk_forward_ms() for _ in range(5))   # best of 5
in_turn = len(fwd) * one_chunk          # the forwards one after the other, each alone
print(f"the {len(fwd)} forwards took {fwd_wall:.1f} ms, first start to last end; one chunk's "
      f"forward alone takes {one_chunk:.2f} ms, so {in_turn:.1f} ms in turn: on this run they "
      + ("overlapped (shorter than in turn)" if fwd_wall < 0.8 * in_turn else
         "took longer than in turn: no gain from the threads" if fwd_wall > 1.2 * in_turn else
         "took about as long as in turn: no measurable overlap") + ".")

# %% [markdown]
# **▶ How the step is recorded** (click the folded cell below): `viz.record_dp_step`, its hooks
# and what each one times.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(viz.record_dp_step, folded="▶ code: viz.record_dp_step")

# %% [markdown]
# ## The real `nn.DataParallel` on this machine
# With 2 or more GPUs it scatters over them for real, with the same four moves; what differs is
# how the tensors travel. Its `replicate` sends all the weights at once through
# `comm.broadcast_coalesced` (small tensors packed into 10 MiB buffers, handed to the C++
# `torch._C._broadcast_coalesced`, which in PyTorch's C++ source, `torch/csrc/cuda/comm.cpp`,
# broadcasts with NCCL when it can), and the backward of that broadcast brings the gradients
# to device 0 with **an NCCL collective** when NCCL is available (NCCL pipelines the bytes
# over the links between GPUs), and only otherwise copies every GPU's
# gradient to device 0 (the folded Sources at the end name the functions). With **one** GPU it moves the input to `cuda:0` and calls the module. With **no**
# accelerator it can use it has no `device_ids` and *silently calls the module*: no error, no
# warning, no parallelism. "No accelerator" is torch's test, not "no CUDA": it looks for CUDA,
# then Apple's MPS, then Intel's XPU and other backends, and treats an Apple-silicon Mac's MPS
# GPU as none (passthrough there too), while on a machine with XPUs and no CUDA `__init__` takes
# the multi-device path (Sources; not run here). `dp.real_data_parallel` wraps a copy of our model, counts how often the wrapper
# calls its `scatter`, its `replicate` and its `parallel_apply` (where its threads start), reads
# the mode from those counts (not from the number of GPUs), compares with the module's own
# output, and `explain` writes its sentence from the counts:

# %%
viz.show_code(dp.real_data_parallel, dp.RealDataParallelReport.explain)

# %%
# NBVAL_IGNORE_OUTPUT
# (why: what the wrapper does depends on how many GPUs this machine has.)
report = dp.real_data_parallel(model, X)
print(report.explain())
print(f"GPUs: {report.gpu_count}, observed mode: {report.mode}, device_ids: "
      f"{report.device_ids}, scatter calls: {report.scatter_calls}, replicate calls: "
      f"{report.replicate_calls}, parallel_apply calls: {report.parallel_apply_calls}, largest difference from the module: {report.max_abs_diff:.1e}")

# %%
if report.gpu_count >= 2:
    as_described = (report.mode == "parallel" and report.replicate_calls == 1
                    and report.matches_module)
else:
    as_described = (report.mode == "passthrough" and report.replicate_calls == 0
                    and report.scatter_calls == report.gpu_count
                    and report.device_ids in ([], [0])
                    and report.matches_module and report.max_abs_diff == 0.0)
claim("the real nn.DataParallel behaves as described above for this machine's number of GPUs "
      "(printed above): the observed mode matches", as_described, report=report)

# %% [markdown]
# ## Why it is slow
#
# **Whose costs.** By its source (Sources), the real class pays, every step, in one process:
# a **replication** in every `forward` (the weights out of device 0 by
# `broadcast_coalesced`, in 10 MiB buffers); the **gradients brought back** onto device 0 by that
# broadcast's backward; the outputs **gathered** on device 0, where the loss is computed
# alone; and **Python threads** for the replicas' forwards (`parallel_apply`), which take
# turns on the GIL between kernels. Our `dp` makes the same moves. One cost is our
# strawman's alone: **how the bytes travel**.
#
# **A naive parameter server on device 0 (the strawman's traffic).** Our `dp` copies one device at a time: every step,
# device 0 sends the K weights to each of the other N−1 devices (replicate) and receives N−1
# gradients of K numbers back (in the backward). A *parameter server* is one
# place that holds the weights, hands them out and collects the gradients (lesson 09 builds a
# real one); done copy by copy, device 0 **sends (N−1)K and receives (N−1)K** numbers per step,
# T = 2(N−1)K weights and gradients through its link — linear in N. The real class's
# broadcast and reduce are NCCL collectives when it can use them, which pipeline the bytes over
# the links between GPUs, so device 0 no longer carries every copy (*not measured here*: no
# GPUs). Our `Broadcast` adds to a counter the size of each copy it
# actually makes (in `forward`) and of each gradient it actually receives on device 0 (in
# `backward`); the claim checks that those counts are what the formula says. T counts
# weights and gradients only: the input's chunks sent out and the outputs gathered (their
# gradients sent back out) grow with the batch, not with K; the cell prints them beside it.
#
# **▶ The counter and the formula it is checked against** (click below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(dp.TrafficCounter, dp.parameter_server_traffic,
              folded="▶ code: dp.TrafficCounter, dp.parameter_server_traffic")

# %%
counted = {}
for n in (2, 4, 8):
    m = copy.deepcopy(model)
    with dp.TrafficCounter() as tc:
        out = dp.data_parallel(m, X, dp.devices_for(n, kind="cpu"))
        F.cross_entropy(out, y).backward()
    counted[n] = tc.total
    # not counted: the other devices' input chunks out, their outputs in and those gradients out
    batch_traffic = (sum(c.numel() for c in torch.chunk(X, n)[1:])
                     + 2 * sum(c.numel() for c in torch.chunk(out, n)[1:]))
    print(f"N={n}: weights out {tc.params_out:>8,}  gradients in {tc.grads_in:>8,}  "
          f"total {tc.total:>9,}  (not counted: input chunks, outputs and their gradients "
          f"{batch_traffic:>7,}, {batch_traffic / tc.total:.0%} more)")
    claim(f"N={n}: (N-1)K weights out, (N-1)K gradients in, 2(N-1)K in all",
          tc.params_out == (n - 1) * K and tc.grads_in == (n - 1) * K
          and tc.total == dp.parameter_server_traffic(n, K), counted=tc.total)

# %% [markdown]
# An all-reduce is the collective after which every rank holds the sum of all ranks' tensors
# (lesson 03). A ring all-reduce (derived in lesson 06) has every rank send 2(N−1)K/N and receive
# as much: counted the
# same way, sends plus receives, **4(N−1)K/N** — less than 4K however large N grows — and no
# device is a bottleneck. (Per direction the comparison is (N−1)K against 2(N−1)K/N.)

# %%
viz.show(viz.traffic_both_ways_figure(K, counted),
         "sends plus receives per step: device 0 of the copy-by-copy model (our dp, not the "
         "real class, whose NCCL collectives pipeline the bytes) grows linearly with N (the "
         "points are this run's counted copies); a ring rank stays under 4K.")

# %% [markdown]
# Try it yourself: the explorer starts at N up to 8, the GPUs of one typical server (the most
# single-node DataParallel sees; the slider stops at 16); its red line is still the copy-by-copy
# model, not the real class. Change N, and change the model size to see that it only rescales
# both lines.

# %%
def traffic_up_to(n_max, millions_of_params):
    """The two formulas above, for N = 2..n_max and K = millions_of_params × 10⁶."""
    return viz.traffic_both_ways_figure(int(millions_of_params * 1e6), {}, range(2, n_max + 1))


traffic_explorer = viz.explorer(
    traffic_up_to, {"n_max": (8, 3, 16), "millions_of_params": (25.0, 1.0, 1000.0, 1.0)},
    caption="numbers sent plus received per step: device 0 of the copy-by-copy model (our "
            "dp, not the real class), 2(N−1)K, grows with N; a ring's rank, 4(N−1)K/N, "
            "stays under 4K.",
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
# cross PCIe or NVLink; here they are memory copies plus building N module objects in Python.
# That second part is *our* `replicate`'s: it deep-copies the module tree (`copy.deepcopy`).
# Torch's builds each replica module with `Module._replicate_for_data_parallel`, which copies
# no tensor, so its Python part is cheaper than ours. So torch's own
# `replicate` is timed too, called as a training step calls it (`detach=False`: its
# differentiable `Broadcast`, Sources); on the CPU that GPU-only broadcast is replaced, for
# the timing, by ours, one clone of the weights per extra device. All three run with grad mode
# on, as in a training step; each time printed below is the best of five calls, and the
# forward is replica 0's on chunk 0, recording its graph.
#
# **▶ How the two are timed** (click below): `dp_costs.time_replicate_vs_forward`.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(dp_costs.time_replicate_vs_forward,
              folded="▶ code: dp_costs.time_replicate_vs_forward")

# %%
# NBVAL_IGNORE_OUTPUT
# (why: timings depend on the machine and its load.)
t = dp_costs.time_replicate_vs_forward(model, X, devs)
print(f"replicate onto {n_devices} devices: {t['replicate_s'] * 1e3:.2f} ms; "
      f"forward of one chunk: {t['forward_chunk_s'] * 1e3:.2f} ms; ratio {t['ratio']:.2f}")
print(f"torch's own replicate onto {n_devices} devices: {t['torch_replicate_s'] * 1e3:.2f} ms, "
      f"{t['torch_replicate_s'] / t['forward_chunk_s']:.2f} times one chunk's forward, "
      f"every step")
assert t["replicate_s"] > 0 and t["forward_chunk_s"] > 0 and t["torch_replicate_s"] > 0

# %% [markdown]
# And the whole step? Below, one forward + backward of the plain model on the batch against
# our `dp.data_parallel` on 1, 2 and 4 simulated devices (on 1 it still replicates), interleaved
# over nine rounds. Every "device" here is the same CPU, and each op runs on one intra-op thread. Their forwards run
# in threads, and torch kernels release the GIL (measured below), so on two or more cores they
# *can* use a second core while the plain model's step uses one (§4 printed whether its step
# did). The backward on a CPU runs in one thread either way. Against
# that possible gain, DataParallel adds overhead per step — replication, threads, scatter and
# gather — and the measurement decides which wins. Whether our step stands out of this run's
# noise, the last line printed says, computed by lesson 01's `compare_rates`. At nine rounds
# its rule — one side wins all, or all but one — is a two-sided sign test at 5%: 8 or more wins of 9,
# either way, is what a coin gives 3.9% of the time; anything less is no clear difference. On GPUs the forwards really
# run side by side, and this overhead eats into the gain.
#
# **▶ `compare_rates` and its rule** (click below); the next cell tests it.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
from dpcourse import train

viz.show_code(train.round_wins, train.rate_verdict, train.compare_rates,
              folded="▶ code: train.round_wins, rate_verdict, compare_rates")

# %%
from dpcourse.train import compare_rates

level, ahead_8, ahead_7 = [100.0] * 9, [101.0] * 8 + [99.0], [101.0] * 7 + [99.0] * 2  # made up
claim("at 9 rounds compare_rates gives a verdict for 8 wins of 9 (all but one) and none for 7",
      " was faster than " in compare_rates("a", level, "b", ahead_8)
      and compare_rates("a", level, "b", ahead_7).startswith("no clear difference"))

# %%
# NBVAL_IGNORE_OUTPUT
# Why: timings depend on the machine and its load.
import statistics
import time

import math

step_model = copy.deepcopy(model)


def samples_per_s(n):
    """One forward + backward: the plain model (n = 0) or DataParallel on n devices."""
    step_model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = step_model(X) if n == 0 else dp.data_parallel(step_model, X,
                                                        dp.devices_for(n, kind="cpu"))
    F.cross_entropy(out, y).backward()
    return batch / (time.perf_counter() - t0)


samples_per_s(0), samples_per_s(2)  # warm-up
ROUNDS = 9
step_rates = {n: [] for n in (0, 1, 2, 4)}
for _ in range(ROUNDS):               # rounds, interleaved so that a slow moment hits all
    for n in step_rates:
        step_rates[n].append(samples_per_s(n))
for n, runs in step_rates.items():
    print(("plain model              " if n == 0 else f"our data_parallel, N = {n} ")
          + f"median {statistics.median(runs):6.0f} samples/s")
# The weakest split compare_rates calls a difference, all but one of 9 rounds won, by chance
# alone (each round a coin toss), either way: a two-sided sign test.
worst = 2 * (math.comb(ROUNDS, ROUNDS - 1) + 1) / 2**ROUNDS
claim(f"at {ROUNDS} rounds compare_rates' weakest verdict (all but one round won) has sign "
      f"test p = {worst:.3f} <= 0.05", worst <= 0.05)
verdicts = {}
for n in (1, 2, 4):
    verdicts[n] = compare_rates("the plain step", step_rates[0], f"our data_parallel on {n}",
                                step_rates[n])
    print(f"N = {n}: {verdicts[n]}")
slower = [n for n, v in verdicts.items() if " was slower than " in v]
faster = [n for n, v in verdicts.items() if " was faster than " in v]
unclear = [n for n in verdicts if n not in slower + faster]
overlapped = fwd_wall < 0.8 * in_turn            # §4's recorded forwards, measured above
print("On this run: " + "; ".join(
    part for part in (
        f"our data_parallel's step was the slower one (sign test at 5%) with N = "
        f"{', '.join(map(str, slower))}"
        if slower else "our data_parallel's step was never clearly the slower one",
        f"with N = {', '.join(map(str, unclear))} no clear difference from the plain step"
        if unclear else "",
        f"with N = {', '.join(map(str, faster))} our data_parallel was faster (sign test at 5%)"
        + (": §4's recorded forwards overlapped, so they may have used a second core"
           if overlapped else ", though §4's recorded forwards showed no overlap: the "
           "machine's load, not a second core, is the likelier cause")
        if faster else "") if part) + ".")

# %% [markdown]
# **One process, one GIL.** The replicas run in threads of one Python process. Torch kernels
# release the GIL: while one thread runs a long matrix product, another thread's Python never
# pauses for half the product's time (`dp_costs.kernel_gil_probe`, folded below, measures its
# longest pause):

# %%
# NBVAL_IGNORE_OUTPUT
# (why: timings depend on the machine and its load.)
viz.show_code(dp_costs.kernel_gil_probe, folded="▶ dp_costs.kernel_gil_probe: how the pause is measured")
probe = dp_costs.kernel_gil_probe()
print(f"one matrix product: {probe['kernel_s'] * 1e3:.0f} ms; the Python thread's longest pause "
      f"meanwhile: {probe['longest_gap_s'] * 1e3:.0f} ms")
claim("a torch kernel releases the GIL: the Python thread never paused for half the "
      "kernel's time", probe["longest_gap_s"] < 0.5 * probe["kernel_s"], probe=probe)

# %% [markdown]
# But all the Python around the kernels (module calls, hooks, the autograd glue) takes
# turns. Pure Python work is where it shows: under the GIL, two units of it run in two threads
# cannot finish faster than one after the other, beyond the noise of the machine's load,
# however many cores there are (handing the lock over can make them slower).
# The demo below times both ways, but the wall clock is not the judge: it also measures the CPU
# time the process burns per second of each way. Two truly parallel threads would burn up to
# two, threads that take turns at most about one. A busy machine lowers these numbers whatever
# the GIL does, so the run's own verdict says what this run could tell:

# %%
viz.show_code(dp_costs.python_work, dp_costs.gil_threads_demo)

# %% [markdown]
# Both numbers depend on the machine's load, so the verdict is computed from them, not
# asserted. If it says the machine was busy, this run could not tell the GIL's turns from the
# load's (`python_work` above holds the GIL: pure Python, no torch kernel to release it);
# rerunning the cell on a quiet machine is the test.
#
# **▶ The measurement and the rule that words its verdict** (click the folded cell below; its
# numbers and verdict are printed under it).

# %% jupyter={"source_hidden": true}
# NBVAL_IGNORE_OUTPUT
# (why: timings depend on the machine and its load.)
import sysconfig

claim("this Python is a build with a GIL (not the free-threaded one: Py_GIL_DISABLED unset)",
      not sysconfig.get_config_var("Py_GIL_DISABLED"))
g = dp_costs.gil_threads_demo()
print(f"2 units of Python work: one after another {g['sequential_s'] * 1e3:.0f} ms, "
      f"in 2 threads {g['threaded_s'] * 1e3:.0f} ms, speed-up {g['speedup']:.2f}x")
print(f"CPU seconds the process used per wall second: one after another "
      f"{g['seq_cpu_per_wall']:.2f}, in 2 threads {g['cpu_per_wall']:.2f}")
if g["cpu_per_wall"] > 1.2:
    verdict = ("the threads used more than one core at once, which GIL-bound threads cannot "
               f"(wall-clock speed-up {g['speedup']:.2f}x)")
elif g["cpu_per_wall"] < 0.7:
    verdict = (f"inconclusive: the threads got only {g['cpu_per_wall']:.2f} of a core, so the "
               "machine was busy and the load, not the GIL, may have set both timings (the "
               f"{g['speedup']:.2f}x wall-clock ratio proves nothing either way)")
else:
    verdict = ("the threads used about one core's worth at most, as threads that take turns "
               "with the GIL do")
    if abs(g["cpu_per_wall"] - g["seq_cpu_per_wall"]) > 0.1:
        verdict += (f"; the two ways got different shares of a core, so the {g['speedup']:.2f}x "
                    "wall-clock ratio shows the load, not parallelism")
    elif g["speedup"] > 1.1:
        verdict += (f"; yet the best threaded run beat the best sequential one by "
                    f"{g['speedup']:.2f}x, more than equal shares of one core allow: the "
                    "best-of timings are noise here (inconclusive as a time comparison)")
    elif g["speedup"] < 0.9:
        verdict += (f"; the threads were slower than one after the other: "
                    f"{1 / g['speedup']:.2f} times the time")
    else:
        verdict += (f"; no real speed-up ({g['speedup']:.2f}x, where truly parallel threads "
                    "would approach 2.00x)")
print(f"On this run: {verdict}.")

# %% [markdown]
# **Device 0 does extra work.** It holds the gathered outputs, computes the loss alone, and
# receives every gradient, so the other devices wait for it (the recorded timeline in §4 shows
# the waits). On GPUs it also holds those outputs and gradients in its own memory, on top of
# what every device holds (not measured here: our devices all share the CPU's one memory).
#
# So `nn.DataParallel` has four costs, and DDP (lesson 03) answers each one (which setup a
# traffic number is for is said in its row):
#
# | DataParallel's cost (this lesson) | DDP's answer |
# |---|---|
# | replicate every step: the whole model goes out again, and torch's `replicate` rebuilds the replicas in Python (timed above against one chunk's forward) | the weights are broadcast **once** (again in one case lesson 04 shows), then stay equal as long as every rank applies the same averaged gradient deterministically from the same optimizer state (which DDP never syncs) (a model's *buffers* still travel: next row) |
# | how the weights and gradients travel — *our copy-by-copy `dp`*: 2(N−1)K through device 0 per step, linear in N (counted above); *the real class*: NCCL's broadcast and reduce, which pipeline the bytes between GPUs, so device 0 does not carry every copy (not measured here) | the gradients move each step, in an all-reduce among equals: under 4K sent plus received per rank (lesson 06); plus, for a model with buffers (the BatchNorm of §2), rank 0's buffers, broadcast before the first forward and before most later ones (which: lesson 04 §4). Against the real class, what goes is the weights' trip out every step (the row above), not a bottleneck link |
# | device 0 gathers all outputs, computes the loss alone and receives the gradients | every rank computes the loss on its own chunk |
# | one process, one GIL, shared by every replica's Python — read from CPython's design; the demo above measures it only on a quiet machine (its verdict says if this run did) | one **process** per device |
#
# DDP adds one more thing DataParallel never had: it starts all-reducing gradients **during**
# the backward, as they become ready (lessons 03 and 07).
#
# ## Lab 02: DataParallel's step by hand
#
# Open [lab02_data_parallel](../labs/lab02_data_parallel.ipynb): you write `scatter`, `gather`,
# and a forward/backward with plain copies of the model (`copy.deepcopy`, not the broadcast
# above), whose gradients no autograd link brings back: getting them onto the original is up to
# you, under the contract of `loss.backward()`. You also choose how `scatter` sizes its chunks,
# decide what of the copies' state must come back to the model, and make predictions (what your
# choice does, one copy's share of the gradient, what `p.grad` holds after a step, what a
# replica's forward leaves on the module) before they are measured. Its stretch asks for the threads of `parallel_apply`.

# %% [markdown]
# **▶ The library's versions — open after your lab passes** (click below): the
# `scatter`, `gather` and `parallel_apply` that sections 1, 3 and 4 ran. Not the lab's answer:
# the lab asks for more than they do — its `gather` also joins models that return several
# tensors (this one takes tensors only), and its `threaded_apply` hands the caller a failing
# replica's own error (this one raises a `RuntimeError` that carries it).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(dp.scatter, dp.gather, dp.parallel_apply,
              folded="▶ The library's versions — open after your lab passes")

# %% [markdown]
# **▶ The reference answer — open after your lab passes** (click below): what
# each thread of `parallel_apply` takes care of besides the call, measured (why:
# `dp.parallel_apply`'s docstring above and the sources below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(dp_answers.measure_thread_grad_mode,
              folded="▶ The measurement — open after your lab passes")
with viz.folded_output("▶ What it measured — open after your lab passes"):
    dp_answers.measure_thread_grad_mode(replicas, chunks)

# %% [markdown]
# **▶ The reference answer — open after your lab passes** (click the folded cell below): the
# whole `Broadcast`, whose `backward` section 2 left out: what it does with the gradients the
# copies received; and `replicate`, which section 2 ran: what each copy gets of the module's
# buffers, and what replica 0 is, measured.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(dp.Broadcast, dp.replicate, dp_answers.measure_replica0_storage,
              folded="▶ The reference answer — open after your lab passes")
with viz.folded_output("▶ What replica 0 is, measured — open after your lab passes"):
    dp_answers.measure_replica0_storage(model, replicas)   # section 2's replicas

# %% [markdown]
# **▶ The reference answer — open after your lab passes** (click below): where
# section 2's BatchNorm running statistics came from, measured (why: the first source below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(dp_answers.measure_bn_stats_source,
              folded="▶ The measurement — open after your lab passes")
with viz.folded_output("▶ What it measured — open after your lab passes"):
    dp_answers.measure_bn_stats_source(bn_net, chunks[0])   # bn_net: section 2's, after its forward

# %% [markdown]
# **▶ The reference answer — open after your lab passes** (click below): how
# the replicas' gradients combine into the whole batch's, measured.
#
# <details><summary>▶ open</summary>
#
# Sum, not average: the loss is the whole gathered batch's *mean*, so each replica's gradient
# is already its chunk's share (scaled by 1/B, not 1/chunk); averaging makes it N times too
# small. DDP (next lesson) averages: each rank's loss is its *own* chunk's mean.
#
# </details>

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(dp_answers.measure_averaged_shares,
              folded="▶ The measurement — open after your lab passes")
with viz.folded_output("▶ What it measured — open after your lab passes"):
    dp_answers.measure_averaged_shares(plain, X, y, devs)   # plain: section 4's, its .grad the batch's


# %% [markdown]
# ## Summary
#
# - `nn.DataParallel` = scatter the batch, replicate the model, run the replicas in threads,
#   gather the outputs on device 0, and let the backward bring the replicas' gradients there.
# - The replicas' gradients meet on the original parameters through the backward of the
#   broadcast.
# - Without an accelerator it can use (CUDA, XPU…; MPS counts as none) the real
#   `nn.DataParallel` silently calls the module.
# - After a training-mode forward the module's BatchNorm running statistics are not the whole
#   batch's (section 2's claim). How the gradients combine, and why the statistics differ, are
#   lab 02's questions (answers folded after its pointer).
# - Its costs: a replication every step, threads sharing one GIL (default CPython build; a
#   cost read from its design, measured only on a quiet machine), device 0 doing the loss alone,
#   and, when the copies go one by one (a naive parameter server, as in our `dp`), 2(N−1)K
#   weights and gradients through device 0 every step, the batch's chunks and outputs on top;
#   the real class broadcasts and reduces with NCCL when it can.
# - DataParallel computes what the plain model computes only when no layer couples the samples
#   of a batch (training-mode BatchNorm sees each replica's chunk alone) or draws random numbers.
#
# Next: open `03_ddp_first_principles.ipynb`, where each device gets a process of its own.
#
# ## Check yourself
#
# **▶ The quiz** — run the folded cell below and answer in the widget (or read its output,
# where the answers are folded).

# %% jupyter={"source_hidden": true}
from dpcourse import quizzes

viz.quiz(quizzes.questions("02"))

# %% [markdown]
# ## Sources
#
# Every statement this lesson makes about PyTorch's own `nn.DataParallel` was checked in the
# installed torch 2.14.1 (paths relative to `site-packages`), or, where a bullet says so, in its
# upstream C++ source:
#
# - `torch/nn/parallel/data_parallel.py` — `DataParallel.__init__` (lines 145-149): when
#   `_get_available_device_type()` returns `None` or `"mps"`, `device_ids = []`; otherwise the
#   device type's indices; with one device, the module is moved to it. `DataParallel.forward`: no
#   `device_ids` → `self.module(*inputs)`; otherwise `self.scatter` first, then with one device
#   the module on it (no `replicate`: what `real_data_parallel` observes); otherwise
#   `replicate(self.module, self.device_ids[:len(inputs)])` (fewer devices when the batch gives
#   fewer chunks), `self.parallel_apply` (the method `real_data_parallel` counts), `gather` on
#   `output_device` (`device_ids[0]` by default, lines 157-158; the parameters must be on
#   `src_device_obj`, `device_ids[0]`: lines 164, 178-183). (What
#   the class docstring says of replica 0's buffers: folded at the end.)
# - `torch/_utils.py` — `_get_available_device_type` (lines 819-833): `"cuda"` if
#   `torch.cuda.is_available()`, else `"mps"`, else `"xpu"`, `"mtia"` or the PrivateUse1
#   backend's name when available, else `None`.
# - `torch/nn/parallel/distributed.py` — DDP's buffers (the table's DDP column):
#   `DistributedDataParallel.__init__` (lines 982-990: `forward_sync_buffers` defaults to the
#   old `broadcast_buffers`, True); `_pre_forward` calls `_sync_buffers()` when
#   `_check_sync_bufs_pre_fwd()` (lines 1782-1783), that is when `will_sync_module_buffers()`
#   (lines 2383-2388: `require_forward_param_sync`, True from `__init__`, line 993, then set
#   by a grad-enabled forward outside `no_sync` in `_post_forward`, lines 1829-1842, and `forward_sync_buffers`, and the module has buffers);
#   `_sync_buffers` broadcasts from rank 0 (line 2419) when no `Join` is active. The weights:
#   `__init__` broadcasts the module's states from rank 0 (`_sync_module_states`, line 1066),
#   `_sync_final_model` (the end of a `Join`) broadcasts `self.module`'s again (lines
#   1947-1961); DDP holds no optimizer, so nothing of it synchronises optimizer state.
# - `torch/nn/parallel/data_parallel.py` — `DataParallel.replicate` passes
#   `detach=not torch.is_grad_enabled()` (lines 199-200).
# - `torch/nn/parallel/replicate.py` — `replicate`: parameters go through `Broadcast.apply`
#   (differentiable) when `detach` is false; under `torch.no_grad()`
#   `_broadcast_coalesced_reshape` copies them with `comm.broadcast_coalesced`, detached
#   (lines 93-106), buffers that need no gradient through `comm.broadcast_coalesced`
#   (detached); each replica module is made by `Module._replicate_for_data_parallel`
#   (`torch/nn/modules/module.py`), and its parameters are set as plain attributes, not leaves.
# - `torch/nn/parallel/_functions.py` — `Broadcast.forward` refuses CPU tensors (lines 13-14:
#   "Broadcast function not implemented for CPU tensors": why the course runs its own
#   `dp.Broadcast` on CPU devices) and calls `comm.broadcast_coalesced`;
#   `Scatter.forward` calls `comm.scatter`. (What `Broadcast.backward` calls: folded at the
#   end.)
# - `torch/nn/parallel/comm.py` — `broadcast_coalesced` (`buffer_size=10485760`, done in C++ by
#   `torch._C._broadcast_coalesced`; its `_get_device_index` refuses a CPU device, "Expected a
#   non cpu device": why `dp_costs.time_replicate_vs_forward` stands clones in for it, and our
#   `dp.Broadcast` for `Broadcast` on `replicate`'s `detach=False` path). `scatter` and
#   `gather` call `torch._C._scatter` and `torch._C._gather` (declared in
#   `torch/include/torch/csrc/cuda/comm.h`; their C++ source, `comm.cpp`, not installed, copies each chunk
#   to its device with `.to(...)` / `copy_`, no NCCL call).
# - `torch/nn/parallel/scatter_gather.py` — `scatter`, `scatter_kwargs` (tensors split along
#   `dim` by `Scatter.apply`), `gather`.
# - `torch/nn/parallel/parallel_apply.py` — `parallel_apply`: when `len(modules) > 1`, one
#   `threading.Thread` per replica (target `_worker`), all started, then all joined; with a
#   single replica `_worker` runs in the caller's thread. What each `_worker` sets up besides
#   the call: folded at the end.
# - `torch/cuda/nccl.py` — `is_available`: whether NCCL can take the tensors (the folded
#   sources name the collective the backward then runs).
# - `torch/nn/modules/dropout.py` — `Dropout.forward` calls `F.dropout(input, self.p,
#   self.training, ...)` (`torch/nn/functional.py`, `dropout`: `_VF.dropout`), which draws a
#   fresh random mask on every training-mode call: each replica draws its own.
# - `torch/nn/modules/batchnorm.py` — `_BatchNorm.forward`: in training mode the running mean
#   and variance (buffers) are updated in place and `num_batches_tracked` is incremented.
# - `torch/include/torch/csrc/autograd/engine.h` — `Engine::start_device_threads` ("start
#   device threads (CUDA, XLA, etc.) in Engine, note that it does NOT start CPU thread") and
#   `device_ready_queues_`: a worker thread and a ready queue per device, CPU work in the
#   calling thread (why the recorded backward takes turns on the CPU).
# - `torch/autograd/graph.py` — `Node.register_prehook` and `Node.register_hook`: called before
#   and after an autograd node runs in the backward (how `viz.record_dp_step` times each
#   replica's backward, node by node); `torch/nn/modules/module.py` —
#   `register_forward_pre_hook`, `register_forward_hook` (its forwards).
#
# Outside the installed packages: CPython's free-threading HOWTOs (docs.python.org/3/howto/,
# `free-threading-extensions.html`, "Module Initialization", and `free-threading-python.html`):
# importing an extension without `Py_mod_gil`, or `PYTHON_GIL=1`, enables the GIL at run time.

# %% [markdown]
# **▶ The sources of `parallel_apply`'s threads, of the broadcast's backward and of what
# survives a replica — open after your lab passes** (click below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# - `torch/nn/parallel/data_parallel.py` — the `DataParallel` class docstring's warning: the
#   replica on `device[0]` shares parameters and buffers with the module, so in-place updates
#   made there during the forward (BatchNorm's) are recorded in the module, and those on the
#   other replicas are lost.
# - `torch/nn/modules/module.py` — `_replicate_for_data_parallel`: the replica's `__dict__` is a
#   shallow copy of the module's, then gets an empty `_parameters` and its own copies of the
#   `_buffers` and `_modules` dicts (the same tensors and submodules in new dicts): a buffer
#   written in place on replica 0 is the module's own tensor changed; a buffer rebound on it
#   changes only the replica's dict.
# - `torch/nn/parallel/_functions.py` — `Broadcast.backward` is `ReduceAddCoalesced.apply`,
#   which calls `comm.reduce_add_coalesced` (the gradients are summed onto the source device).
# - `torch/nn/parallel/comm.py` — `reduce_add`: `nccl.reduce(...)` when
#   `nccl.is_available(inputs)`, otherwise each non-root tensor copied to the destination and
#   added; `reduce_add_coalesced` flattens small tensors and calls `reduce_add`.
# - `torch/cuda/nccl.py` — `reduce`: the NCCL call `comm.reduce_add` uses.
# - `torch/nn/parallel/parallel_apply.py` — `parallel_apply._worker`: each thread sets the
#   caller's grad mode (`torch.set_grad_enabled`) and autocast state and the replica's device;
#   an exception is wrapped (`ExceptionWrapper`) and re-raised in the caller, the first failing
#   replica's in device order (the loop over `results`).
#
# </details>
