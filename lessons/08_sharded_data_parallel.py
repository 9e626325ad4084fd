# %% [markdown]
# # 08 · Sharded data parallelism: ZeRO stages 1–3, then FSDP2
#
# **Prerequisites:** lesson 03 (averaging gradients with all-reduce), lesson 06 (an all-reduce
# is a reduce-scatter followed by an all-gather) and lesson 07 (hooks during the backward).
# New here, each explained where it is taught: mixed precision with an fp32 master copy,
# Adam's two states per parameter, `Tensor.register_hook`, `saved_tensors_hooks` (what
# autograd keeps for the backward), freeing a tensor's storage, and FSDP2's DTensors (device
# mesh, placements).
#
# **You will be able to:**
# - say where a data-parallel rank's memory goes with mixed-precision Adam — 16 bytes per
#   parameter, split 2 + 2 + 12 in the ZeRO paper, 4 + 4 + 8 with fp32 weights (FSDP2 here)
#   — and count it on a real (small, CPU) run;
# - build ZeRO stages 1, 2 and 3 from collectives you know, and prove each one trains like
#   DDP (to float rounding), frozen and tied parameters included;
# - count what each stage sends per step, and explain why, with gradients and weights in one
#   dtype, ZeRO-1 and ZeRO-2 cost what DDP costs while ZeRO-3 costs 1.5× — and what changes
#   when the gradients travel in fp32 and the weights in bf16;
# - read ZeRO-3's step layer by layer from its recorded calls;
# - use PyTorch's FSDP2 (`fully_shard`): DTensor shards, mixed precision, a full checkpoint,
#   and reconcile what it holds and sends with the formula;
# - pick the stage a model needs from its size, the GPU's memory and the number of GPUs.
#
# **Time:** about 70 minutes to read and run.
#
# **Lab:** [lab08_zero_two](../labs/lab08_zero_two.ipynb) — ZeRO stage 2 that lowers the
# peak, checked next to DDP on 2 and 3 ranks (its pointer is in section 3).
#
# Data parallelism copies *everything* to every rank: weights, gradients, optimizer state. When
# the model stops fitting, the answer that keeps it *data* parallel is to stop copying: each
# rank keeps 1/N of the state and fetches the rest when it needs it. That is ZeRO (Rajbhandari
# et al., SC 2020), in three stages; PyTorch's FSDP is stage 3 by default (section 6 says what
# else it can be). The code lives in `dpcourse.zero` and `dpcourse.zero_experiments`; cells
# show what the claims run, folded where it holds a lab's answer.

# %% tags=["parameters"]
world_size = None     # None: from the hardware profile (2 on the cpu profile)
steps = 4             # training steps of every comparison
sweep = (2, 3, 4)     # rank counts where memory and traffic are counted

# %%
import torch

from dpcourse import devices, launch, viz, zero, zero_answers
from dpcourse import zero_experiments as experiments
from dpcourse.checks import claim

torch.set_num_threads(1)
profile = devices.choose_profile(world_size=world_size)
world_size = profile.world_size
backend = devices.backend_for(world_size)

# %%
# NBVAL_IGNORE_OUTPUT
# Why: the profile depends on this machine's GPUs.
print(profile.describe())
print(f"this lesson: {world_size} ranks over {backend}")

# %% [markdown]
# ## 1. Where the memory goes
# *Mixed precision*: the model computes in a 2-byte float format (fp16 or bf16) while the
# optimizer updates a 4-byte fp32 *master copy* of the weights, so that small updates are not
# lost to rounding. Adam keeps two numbers per parameter, a running mean of its gradients
# (momentum) and of their squares ("variance", uncentered). Train in mixed precision with Adam and every
# parameter costs, on every rank:
#
# | what | bytes |
# |---|---|
# | the weights the model computes with (fp16 in the paper, or bf16) | 2 |
# | their gradients (fp16; bf16 ones are often reduced in fp32: below) | 2 |
# | fp32 master copy of the weights, which the optimizer steps | 4 |
# | Adam's momentum (fp32) | 4 |
# | Adam's variance (fp32) | 4 |
#
# 16 bytes, of which K = 12 are optimizer state. Activations come on top but they belong to
# the batch, not the model. In bf16, Megatron-LM's `--bf16` accumulates and all-reduces the
# gradients in fp32 by default: 2 + 4 + 12 = 18 bytes (lesson 11 plans with both). ZeRO
# removes the copies one kind at a time: stage 1 shards the optimizer state, stage 2 the
# gradients too, stage 3 the weights too.
#
# That split is the ZeRO paper's: fp16 weights beside an fp32 master copy. `torch.autocast`
# (fp32 weights, bf16 operations) and FSDP2 as section 6 runs it (fp32 shards, computed in
# bf16) keep no master copy: a parameter costs 4 (weights) + 4 (gradients) + 8 (momentum and
# variance), still 16 but split differently, so each stage saves a different amount — ZeRO-2
# keeps 4 + 12/N, not 2 + 14/N. (16 persists between steps if `zero_grad()` runs at the top of
# a step, not right after `step()`: section 3. Autocast also keeps bf16 casts of the
# weights, up to 2 more: its cache holds every cast until the autocast region exits, and
# autograd keeps those the backward needs; FSDP2 casts one unit at a time.) Below, `saved_tensors_hooks` lists what autograd saves.

# %%
viz.show_code(zero.bytes_per_param)

# %%
n_table = 8
print(f"bytes per parameter at N = {n_table}:  paper (2+2+12)  fp32 weights (4+4+8)  bf16 (2+4+12)")
for stage in zero.STAGES:
    row = [zero.bytes_per_param(stage, n_table, *pgk) for pgk in [(), (4, 4, 8), (2, 4)]]
    print(f"{stage:>6}:" + "".join(f"{b:16.2f}" for b in row))
claim("with fp32 weights ZeRO-2 keeps 4 + 12/N bytes per parameter (5.5 at N = 8), not "
      "2 + 14/N; bf16 weights with fp32 gradients cost DDP 2 + 4 + 12 = 18",
      zero.bytes_per_param("zero2", 8, 4, 4, 8) == 5.5
      and zero.bytes_per_param("ddp", 8, 2, 4) == 18)

# %%
mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
kept = []   # every tensor autograd saves for the backward
with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(
        lambda t: kept.append(t) or t, lambda t: t):
    mlp(torch.randn(4, 64))
casts = [t for t in kept if t.shape == (64, 64)]
claim("under autocast autograd keeps a bf16 copy (2 bytes per weight) of one of the two "
      "Linears' weights until the backward (which, and why: folded below)",
      len(casts) == 1 and casts[0].dtype == torch.bfloat16
      and any(torch.equal(c, lin.weight.to(torch.bfloat16)) for c in (casts[0], casts[0].T)
              for lin in (mlp[0], mlp[2])))

# %% [markdown]
# <details><summary>▶ Which, and why — open after lab 11's part 6 (skip it until then)</summary>
#
# `mlp[2]`'s: a Linear saves its weight for its input's gradient only, and `mlp[0]`'s input,
# the data, needs none (lesson 11, §1, checks it).
#
# </details>

# %% [markdown]
# The ZeRO paper's Figure 1 is this formula for a 7.5-billion-parameter model on 64 GPUs:

# %%
psi, n_gpus = 7.5e9, 64
paper = {"ddp": 120, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}   # GB, as printed there
for stage, gb in paper.items():
    ours = psi * zero.bytes_per_param(stage, n_gpus) / 1e9
    print(f"{stage:>6}: {ours:6.1f} GB per GPU")
claim("the formula gives the paper's 120 / 31.4 / 16.6 / 1.9 GB",
      all(round(psi * zero.bytes_per_param(s, n_gpus) / 1e9, 1) == gb for s, gb in paper.items()))

# %%
viz.show(viz.zero_holdings_figure(4),
         "Four ranks. DDP fills every band on every rank; each stage keeps only the rank's own "
         "slice of one more band.")

# %% [markdown]
# Try it yourself: set your own GPU's memory and a model size, and find the smallest number
# of GPUs at which each stage fits (activations come on top of these bars). A GB here is 10⁹
# bytes, the paper's unit; an "80-GB" A100 holds 80 GiB = 80 × 2³⁰ bytes ≈ 85.9 GB, the
# calculator's default.

# %%
zero_calculator = viz.explorer(
    viz.zero_calculator_figure,
    {"billions": (7.5, 0.5, 200.0, 0.5), "gpu_gb": (85.9, 8.0, 192.0, 0.1), "n_gpus": (64, 1, 1024)},
    caption="model state per GPU for each stage (zero.bytes_per_param) against the GPU's memory; "
            "green bars fit.",
    description="ZeRO memory calculator (model size, GPU memory, N)")

# %% [markdown]
# ## 2. ZeRO-1: shard the optimizer state
# See all the parameters as one flat vector of Ψ numbers cut into N slices, one per rank (padded
# to a multiple of N: `flatten_padded`, folded before `Zero1` below). Rank r keeps the fp32 master copy and Adam's state for slice
# r only, so the optimizer state costs 12Ψ/N instead of 12Ψ. A step:
#
# 1. the backward, as always: every rank has the full gradient of its own micro-batch;
# 2. **reduce-scatter** the gradients: rank r receives the sum over the ranks of slice r only
#    (divide by N for the mean). That is the first half of lesson 06's ring all-reduce — and a
#    rank needs nothing else, because it steps nothing else;
# 3. step the optimizer on slice r;
# 4. **all-gather** the updated slices: every rank has every new weight again — the second
#    half of the all-reduce.
#
# Reduce-scatter + all-gather = one all-reduce: ZeRO-1 sends as many *elements* as DDP, and
# as many bytes when the gradients travel in the weights' dtype (section 5 counts the case
# where they do not).
#
# ### The library's stages
# Every stage has the same interface — `zero_grad()`, then your backward, then `step()` — and
# shares a small base class, `Stage`: it broadcasts rank 0's weights to every rank, keeps the
# trainable parameters only (a frozen one, `requires_grad=False`, gets no gradient), and lists
# the tensors it holds by category for the byte count of section 5. `Replicated` is lesson 03's
# DDP with an fp32 master copy: the baseline, stage 0.

# %%
viz.show_code(zero.Stage, zero.Replicated, zero.grads_of, zero.optimizer_tensors)

# %% [markdown]
# **▶ The flat-shard helpers, ZeRO-1's substrate (not lab 08's answer: open them any
# time)** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(zero.shard_numel, zero.flatten_padded, zero.reduce_scatter_mean,
              zero.all_gather_flat, zero.copy_flat_into,
              folded="▶ The flat-shard helpers (ZeRO-1's substrate; not lab 08's answer)")

# %% [markdown]
# `Zero1`, section 2's stage 1: its master and Adam state are this rank's slice of the flat,
# padded parameters; `step()` reduce-scatters the gradients into that slice, steps it, and
# all-gathers everyone's new slices (section 3 checks it against DDP).

# %%
viz.show_code(zero.Zero1.__init__, zero.Zero1.gradient_slice, zero.Zero1.step)

# %% [markdown]
# ## 3. ZeRO-2: shard the gradients too
# After the reduce-scatter a rank needs only the averaged gradient of its own slice. Stage 2
# keeps that and drops the full gradients. The short way to write it does the reduce-scatter
# in `step()`: between the end of the backward and that reduce-scatter
# every full gradient still exists at once, as in ZeRO-1, so it saves memory *at rest* (from
# `step()` to the next `zero_grad()`, called here at the top of a step; a `zero_grad()` right
# after `step()`, ours, or torch's by default, drops ZeRO-1's gradients too: nothing saved),
# not at the rank's fullest moment, its **peak**.
#
# ### Lab 08: ZeRO-2 that earns its memory
# Open [lab08_zero_two](../labs/lab08_zero_two.ipynb) and write stage 2 the way that lowers
# the peak: the gradients, grouped in buckets (lesson 07), leave the rank *during* the
# backward, which must not wait for them; what to keep in flight, and when to wait for it, is
# yours to decide under the memory bound the lab states. The check weighs the gradient
# memory alive at every arrival, and you predict the peak before you measure it. The tool it
# needs, `Tensor.register_post_accumulate_grad_hook`, is lesson 07's (§2).

# %% [markdown]
# **▶ `Zero2` whole, where its `step()` sends the gradients — open after your lab passes**
# (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(zero.Zero2, folded="▶ Zero2 whole — open after your lab passes")

# %% [markdown]
# Is it right? Every stage trains the same small MLP from the same start, on the same shards
# of the same batches, next to torch's `DistributedDataParallel` with the full Adam — in fp32,
# where the weights must agree to float rounding. The same launch also runs FSDP2 and
# `ZeroRedundancyOptimizer`, met in section 6. Every run trains in `train_run`, which weighs
# its gradients when the backward returns and, in `weigh`, before each collective that sums
# them. It weighs by two rules, coded and checked against the formulas in section 5:
# `zero.count_bytes` counts *storage* (a view counts once, a freed buffer zero), and
# `zero.summarize_traffic` a step's *volume*, the whole buffer each collective acts on (an
# all-gather's full output, the input of the others), an all-reduce counted twice:

# %%
import inspect

viz.show_code(experiments.equality_worker, experiments.train_run)

# %% [markdown]
# **▶ How each run is built: `ZeroConfig`, `prepare_run` (torch DDP gets a comm hook, so that
# section 5 can record its all-reduce), `TorchRun` (torch's runs behind the stages' interface;
# `p.full_tensor()` gathers an FSDP2 parameter whole, section 6)** — click the folded cell below.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(experiments.ZeroConfig, experiments.prepare_run, experiments.TorchRun,
              folded="▶ code: ZeroConfig, prepare_run, TorchRun")

# %%
cfg = experiments.ZeroConfig(steps=steps)
model = cfg.build()
n_params = sum(p.numel() for p in model.parameters())
claim(f"the MLP has Ψ = {n_params} parameters, which divides by neither 2 nor 3 (so the "
      "padding is exercised)", n_params == 2531 and n_params % 2 != 0 and n_params % 3 != 0)
runs = launch.spawn(experiments.equality_worker, world_size, cfg, backend=backend, timeout=120)


def max_diff(run, results=None):
    return max(float((r[run]["params"] - r["torch_ddp"]["params"]).abs().max())
               for r in (results or runs))


opt_cls, opt_kw = cfg.optimizer_class()
print(f"reference: torch DDP (fp32, allreduce_hook), {world_size} ranks, {opt_cls.__name__}"
      f"({opt_kw}), global batch {cfg.global_batch}, seed {cfg.seed}, same start and batches")
claim(f"ZeRO-1: weights after {steps} Adam steps == torch DDP's, on every rank (to 1e-5)",
      max_diff("zero1") < 1e-5, diff=max_diff("zero1"))
claim(f"ZeRO-2: weights after {steps} steps == torch DDP's (to 1e-5)", max_diff("zero2") < 1e-5,
      diff=max_diff("zero2"))
claim("the losses fell", runs[0]["zero1"]["losses"][-1] < runs[0]["zero1"]["losses"][0])
after_backward = {s: runs[0][s]["grads_after_backward"] for s in ("ddp", "zero1", "zero2")}
at_collective = {s: runs[0][s]["grads_at_collective"] for s in ("ddp", "zero1", "zero2")}
print("gradient bytes, backward done:", after_backward)
claim("when the backward returns, this ZeRO-2 holds every full gradient: the same bytes as "
      "ZeRO-1 and DDP (4Ψ in fp32), so its peak is no lower",
      set(after_backward.values()) == {4 * n_params})

# %% [markdown]
# **▶ The gradient bytes inside `step()`, before its collective — open after your lab
# passes** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
with viz.folded_output("▶ The gradient bytes inside step(), before its collective — open after "
                       "your lab passes"):
    print("before step()'s collective:", at_collective)
    zero_answers.grad_bytes_in_step(at_collective, n_params, world_size)
viz.show_code(zero_answers.grad_bytes_in_step,
              folded="▶ code: the claim — open after your lab passes")

# %% [markdown]
# ## 4. ZeRO-3: shard the weights too (what FSDP does)
# Now a rank keeps 1/N of every layer's weights and nothing else. A layer's full weights are
# rebuilt only while it computes: all-gathered before its forward and freed after it,
# all-gathered again before its backward (when the gradient of its output arrives — a hook
# on the output tensor, `Tensor.register_hook`, a cousin of lesson 07's hooks). Once the
# backward has produced all of the layer's gradients (`Tensor.register_post_accumulate_grad_hook`
# says when each one is in), the weights are freed *first* and the gradients reduce-scattered
# *after*. The parameters are views into one flat buffer per layer; freeing resizes that
# buffer's storage to zero bytes (`untyped_storage().resize_(0)`), so the memory really goes.
#
# That order — the weights freed first, the gradients reduce-scattered after — is also
# FSDP2's, PyTorch's ZeRO-3: section 6 reads it in torch's source.

# %% [markdown]
# `Zero3` maps each parameter to the first module that owns it (a tied parameter, used by two
# modules, makes both gather that layer), and leaves frozen parameters whole on every rank:

# %%
viz.show_code(zero.Zero3)

# %% [markdown]
# Each layer is a `ShardedLayer`: its gather (the storage given its bytes back, then the
# all-gather into it), its free (the storage resized to 0 bytes), and the forward hook that
# frees the weights and asks for them again just before the layer's backward:

# %%
viz.show_code(zero.ShardedLayer.gather, zero.ShardedLayer.free, zero.ShardedLayer._after_forward)

# %% [markdown]
# **▶ `ShardedLayer` whole, with its set-up and its gradient hook (close to lab 08's answer)
# — open after your lab passes** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(zero.ShardedLayer,
              folded="▶ ShardedLayer whole — open after your lab passes")

# %%
claim(f"ZeRO-3: weights after {steps} steps == torch DDP's (to 1e-5)", max_diff("zero3") < 1e-5,
      diff=max_diff("zero3"))

# %% [markdown]
# Real models have frozen parameters (fine-tuning) and tied ones (one `Parameter` used by two
# layers, like an embedding shared with the output layer). `ZeroConfig(frozen_and_tied=True)`
# adds both to the MLP: a frozen bias, and a square weight tied between two layers (torch's
# tools: section 6). The cell also weighs ZeRO-3's traffic by volume (section 3); its
# formula is 3Ψ elements, each layer's weights all-gathered twice and its gradients
# reduce-scattered once, Ψ padded to a multiple of N.
# `zero.traffic_per_step` computes that formula and `zero.summarize_traffic` the recorded
# volume (folded in the cell; section 5 checks the one against the other for every stage).

# %%
awkward = experiments.ZeroConfig(steps=steps, frozen_and_tied=True)
tied_runs = launch.spawn(experiments.equality_worker, world_size, awkward, backend=backend,
                         timeout=120)
claim(f"with a frozen and a tied parameter, every stage ({', '.join(zero.STAGES)}): weights "
      f"after {steps} steps == torch DDP's, on every rank (to 1e-5)",
      all(max_diff(run, tied_runs) < 1e-5 for run in zero.STAGES))
awkward_model = awkward.build()
first, square, tied_to = awkward_model[0], awkward_model[2], awkward_model[4]
frozen = [p for p in awkward_model.parameters() if not p.requires_grad]
start = torch.cat([p.detach().reshape(-1) for p in awkward_model.parameters()])
bias = slice(first.weight.numel(), first.weight.numel() + first.bias.numel())  # after weight
claim("in torch DDP and the four stages, on every rank, the frozen bias never moved (bit for "
      "bit)", all(torch.equal(r[run]["params"][bias], start[bias])
                  for r in tied_runs for run in ("torch_ddp", *zero.STAGES))
      and len(frozen) == 1 and frozen[0] is first.bias)
extra = tied_runs[0]["zero3"]["traffic"][-1]["volume"] - zero.traffic_per_step(
    "zero3", tied_runs[0]["zero3"]["units"], world_size)
tied_layer = sum(p.numel() for p in square.parameters())   # its weight is also tied_to's
print(f"ZeRO-3 with the tied layer: {extra} bytes above the 3Ψ formula")
claim("Zero3 sends more than 3Ψ here: the tied layer is all-gathered once more (for the second "
      "layer's forward)",
      extra == 4 * world_size * zero.shard_numel(tied_layer, world_size)
      and tied_to.weight is square.weight)
viz.show_code(zero.traffic_per_step, zero.summarize_traffic,
              folded="▶ code: traffic_per_step and summarize_traffic")

# %% [markdown]
# What that looks like in time: one step of `Zero3`, timed from the calls themselves. A
# worker replaces each layer's `gather` and `free` by versions that note the time before and
# after (`free`: shown below it), and times each reduce-scatter with the `before` and `after`
# hooks of lesson 07's recorder, `collectives.record_collectives` (the second of two steps, so
# nothing is measured for the first time).

# %%
viz.show_code(experiments.zero3_timeline_worker, zero.ShardedLayer.free)

# %%
events = launch.spawn(experiments.zero3_timeline_worker, world_size, cfg, backend=backend,
                      timeout=120)[0]
layer_names = [f"layer {i}\n{n} params" for i, n in enumerate(runs[0]["zero3"]["units"])]
order = {i: [kind for layer, kind, _, _ in events if layer == i]
         for i in range(len(layer_names))}
claim("every layer: all-gather (forward), free, all-gather (backward), free, reduce-scatter",
      all(kinds == ["all-gather (forward)", "free", "all-gather (backward)", "free",
                    "reduce-scatter"] for kinds in order.values()))
freed_at = {i: [t for layer, kind, t, _ in events if layer == i and kind == "free"][-1]
            for i in order}
scattered_at = {i: next(t for layer, kind, t, _ in events if layer == i
                        and kind == "reduce-scatter") for i in order}
claim("as in FSDP2, every layer's full weights are freed (storage resized to 0 bytes) before "
      "its reduce-scatter starts: during it the layer holds its gradient, not its weights",
      all(freed_at[i] <= scattered_at[i] for i in order))
first_bwd = [next(t for layer, kind, t, _ in events if layer == i and kind.endswith("(backward)"))
             for i in range(len(layer_names))]
claim("the backward gathers the layers in reverse: last layer first",
      first_bwd == sorted(first_bwd, reverse=True))

# %% [markdown]
# How long did the collectives take against the computing? From the same events: the time
# inside all-gathers and reduce-scatters, and the time a layer held its full weights outside
# any collective (where it computed).
#
# Read the ratio for what it measures: a tiny MLP (Ψ = 2,531, about Ψ multiply-adds per
# example) on the backend printed below, each call moving a few kilobytes. Below, too: a call's median time, their range, and the
# slowest two calls' share of the sum (a few slow calls move the ratio; a blocking call's
# time includes waiting for the other rank to reach it). It is not what
# ZeRO-3 costs on a real model: there a layer's compute (its parameters times the
# micro-batch's tokens) is set against the bytes gathered for it (its parameters) at the
# link's speed, and with enough tokens the compute is the larger. FSDP2's source is written
# to hide the gathers behind it, issuing the next layer's early (section 6), which no run
# here shows; this blocking `Zero3` does not try.

# %%
# NBVAL_IGNORE_OUTPUT
# Why: times measured on this machine, in this run; they vary from run to run.
import statistics

per_call = sorted(end - begin for _, kind, begin, end in events if kind != "free")
collective_ms = sum(per_call)
median_ms = statistics.median(per_call)
held_ms = 0.0
for i in range(len(layer_names)):
    since = None
    for layer, kind, begin, end in events:
        if layer != i:
            continue
        if kind.startswith("all-gather"):
            since = end
        elif kind == "free" and since is not None:
            held_ms += begin - since       # computing, from the gather's end to the free
            since = None
ratio = collective_ms / held_ms
print(f"collectives {collective_ms:.2f} ms, weights held outside a collective {held_ms:.2f} ms: "
      f"{ratio:.1f}×  (Ψ = {n_params} parameters, backend {backend}, {world_size} ranks)")
print(f"{len(per_call)} collectives: median {median_ms:.2f} ms per call, from {per_call[0]:.2f} "
      f"to {per_call[-1]:.2f} ms; the slowest two make {sum(per_call[-2:]) / collective_ms:.0%} "
      f"of the sum; at the median every call, the ratio would be "
      f"{len(per_call) * median_ms / held_ms:.1f}×")

# %%
# NBVAL_IGNORE_OUTPUT
# Why: the caption states this run's measured ratio.
viz.show(viz.zero3_timeline_figure(events, layer_names),
         "One ZeRO-3 step on rank 0, from the recorded calls: each layer's full weights are used "
         "in its green band (a green ▼ marks each, however narrow beside the collectives) and "
         "held from the start of the all-gather before it (the memory "
         "is allocated before the gather fills it) — gathered before its forward, freed after it, gathered "
         "again in the backward (last layer first), and freed before the reduce-scatter of "
         f"its gradients, as FSDP2 does. In this run (Ψ = {n_params}, {backend}) the "
         f"collectives took {ratio:.1f}× the time the layers held their weights outside one "
         f"(a call's median {median_ms:.2f} ms, its longest {per_call[-1]:.2f} ms), and "
         "nothing overlaps: every collective here is blocking, so the layer waits for it.")

# %% [markdown]
# ## 5. Counted: memory and traffic
# Now in mixed precision — bf16 weights and gradients, fp32 master and Adam state, the
# setting of the formula — at N = 2, 3 and 4. After the last step each rank counts the bytes
# behind every tensor it holds, by storage (section 3's rule). Every collective is recorded
# too. `count_bytes`'s `to_local` line is for section 6's FSDP2 parameters, *DTensors*:
# tensors that know how they are split across ranks, `to_local()` giving this rank's piece.

# %%
viz.show_code(zero.count_bytes, zero.memory_per_rank)

# %%
mp = experiments.ZeroConfig(steps=steps, mixed_precision=True)
stages = zero.STAGES
counted = {}
for n in sweep:
    counted[n] = launch.spawn(experiments.equality_worker, n, mp, stages,
                              backend=devices.backend_for(n), timeout=120)
for n in sweep:
    for stage in stages:
        rows = [r[stage] for r in counted[n]]
        print(f"N={n} {stage:>5}: " + ", ".join(
            f"{k} {rows[0]['held'][k]:6d} B" for k in ("params", "grads", "optimizer")))

# %%
claim("every rank holds exactly the formula's bytes (padding included), for every stage and N",
      all(r[stage]["held"][k] == zero.memory_per_rank(stage, r[stage]["units"], n)[k]
          for n in sweep for r in counted[n] for stage in stages
          for k in ("params", "grads", "optimizer")))
claim("DDP holds 16 bytes per parameter on every rank",
      all(r["ddp"]["held"]["total"] == 16 * n_params for n in sweep for r in counted[n]))
claim("ZeRO-3 holds 16/N bytes per parameter, but for the padding (< 1 %)",
      all(abs(r["zero3"]["held"]["total"] * n / (16 * n_params) - 1) < 0.01
          for n in sweep for r in counted[n]))

# %% [markdown]
# Those bytes are at rest. During the step a rank also holds its *working set*: the
# full-size tensors of the layers it is computing with, beyond its shards — a layer's gathered
# weights, its whole gradient. A layer's whole gradient lives until its reduce-scatter:
# `weigh` (section 3) weighed the gradients just before each one; beyond the rank's shards,
# what is left at each N:

# %%
largest = 2 * max(counted[sweep[0]][0]["zero3"]["units"])   # bf16 bytes of the largest layer
beyond = sorted(r["zero3"]["grads_at_collective"] - r["zero3"]["held"]["grads"]
                for n in sweep for r in counted[n])
print(f"N = {sweep}: {beyond[0]} to {beyond[-1]} B beyond the shards; largest layer {largest} B")
claim("ZeRO-3's working set does not shrink with N: just before a reduce-scatter every rank "
      "holds, beyond its gradient shards, at least the largest layer's whole bf16 gradient, "
      "the same at every N to 1 %",
      beyond[0] >= largest and beyond[-1] - beyond[0] < 0.01 * largest)

# %%
memory = {n: {s: counted[n][0][s]["held"] for s in stages} for n in sweep}
viz.show(viz.zero_memory_figure(memory),
         "Counted, not computed: optimizer state shrinks first (ZeRO-1), then gradients "
         "(ZeRO-2), then weights (ZeRO-3); DDP's bar does not move with N.")

# %% [markdown]
# Traffic, by section 3's volume (an all-reduce counts twice: it *is* a reduce-scatter plus
# an all-gather); on a ring a rank sends (N−1)/N of that volume — a model of the ring, not
# what gloo's own algorithms send. Lesson 07's `collectives.record_collectives` (core folded
# below) notes each call's bytes in and bytes written; `summarize_traffic` weighs one step's
# whole buffers with `zero.RING_WEIGHT`. DDP's own all-reduce runs in C++, past the recorder:
# that is why `prepare_run` gives torch DDP a comm hook.

# %%
print("weights:", zero.RING_WEIGHT)
viz.show_code(zero.summarize_traffic, zero.traffic_per_step)
from dpcourse import collectives
table = "RECORDED = {" + inspect.getsource(collectives).split("RECORDED = {")[1].split("\n}")[0] + "\n}"
viz.show_code(collectives.Recorder.wrap, collectives.describe, collectives.size_of, table,
              folded="▶ code: the recorder's core (where each call's op, nbytes, out_nbytes come from)")

# %%
volume = {n: {s: counted[n][0][s]["traffic"][-1]["volume"] for s in stages} for n in sweep}
claim("each stage's recorded volume per step == the formula, at every N",
      all(volume[n][s] == zero.traffic_per_step(s, counted[n][0][s]["units"], n, element_size=2)
          for n in sweep for s in stages))
claim("ZeRO-1 and ZeRO-2 send what DDP sends, but for padding (< 1 %)",
      all(abs(volume[n][s] / volume[n]["ddp"] - 1) < 0.01
          for n in sweep for s in ("zero1", "zero2")))
claim("ZeRO-3 sends 1.5× DDP (two all-gathers and a reduce-scatter per layer), to 1 %",
      all(abs(volume[n]["zero3"] / volume[n]["ddp"] - 1.5) < 0.015 for n in sweep))
for n in sweep:
    print(f"N={n}: ZeRO-3 / DDP = {volume[n]['zero3'] / volume[n]['ddp']:.3f}")

# %% [markdown]
# Those ratios hold because every collective here moves bf16 — the gradients travel in the
# weights' dtype. In section 1's bf16 setting (Megatron-LM's `--bf16`, FSDP2 as section 6
# runs it) they do not: the gradients are reduced in fp32, 4 bytes, the weights gathered in
# bf16, 2. `traffic_per_step`'s `grad_bytes` weighs the reductions apart from the gathers;
# DDP then all-reduces fp32 gradients (section 6 measures the ZeRO-3 row with FSDP2):

# %%
n_mix = sweep[0]
mixed = {s: zero.traffic_per_step(s, counted[n_mix][0][s]["units"], n_mix, element_size=2,
                                  grad_bytes=4) for s in stages}
for s in stages:
    print(f"{s:>5}: {mixed[s] / n_params:5.2f} bytes per parameter, "
          f"{mixed[s] / mixed['ddp']:.3f} × DDP")
claim("bf16 weights, fp32 gradients: DDP sends 2 × 4 = 8 bytes per parameter, ZeRO-1 and "
      "ZeRO-2 4 + 2 = 6, 0.75× DDP, and ZeRO-3 2 + 2 + 4 = 8, 1.0× DDP, not 1.5× (to 1 %)",
      all(abs(mixed[s] / mixed["ddp"] - 0.75) < 0.01 for s in ("zero1", "zero2"))
      and abs(mixed["zero3"] / mixed["ddp"] - 1.0) < 0.01 and mixed["ddp"] == 8 * n_params)

# %%
units = {s: counted[sweep[0]][0][s]["units"] for s in stages}
line_ns = list(range(1, 9))
viz.show(viz.zero_tradeoff_figure(
    line_ns,
    {s: [zero.memory_per_rank(s, units[s], n)["total"] for n in line_ns] for s in stages},
    {s: [zero.traffic_per_step(s, units[s], n, element_size=2) * (n - 1) / n for n in line_ns]
     for s in stages},
    {s: {n: memory[n][s]["total"] for n in sweep} for s in stages},
    {s: {n: volume[n][s] * (n - 1) / n for n in sweep} for s in stages}),
    "The trade-off in one picture: each stage saves memory that grows with N; only ZeRO-3 pays "
    "for it, with half as much traffic again — in bytes, with weights and gradients in one "
    "dtype (with bf16 weights and fp32 gradients, the cell above: ZeRO-3 1.0× DDP, ZeRO-1/2 "
    "0.75×).")

# %% [markdown]
# What traffic costs in time depends on the network (lesson 06's α-β model) and on overlap
# with the compute, which no run here shows: this lesson counts bytes, not seconds. One bound needs no run, though: when *could*
# ZeRO-3's collectives hide behind the compute? A layer of P parameters costs 2·P flops per
# token in the forward and 4·P in the backward, against 2·P bytes of bf16 weights gathered
# before the forward, and 2·P gathered plus 2·P of bf16 gradients reduce-scattered in the
# backward (a ring rank sends (N−1)/N of that, about all of it). At F flop/s and BW bytes/s
# per GPU, T tokens per GPU compute no faster than the bytes travel only when T ≥ F/BW:

# %%
f_gpu, ib_bw, nvlink_bw = 0.5 * 312e12, 25e9, 300e9   # half an A100's bf16 peak; bytes/s per GPU
for name, bw in (("InfiniBand, 200 Gb/s per GPU", ib_bw), ("NVLink 3", nvlink_bw)):
    print(f"across {name}: T ≥ F/BW = {f_gpu / bw:.0f} tokens per GPU (P cancels: "
          "2P·T/F ≥ 2P/BW forward, 4P·T/F ≥ (2 + 2)P/BW backward)")

# %% [markdown]
# With fewer tokens per GPU per micro-batch, part of ZeRO-3's traffic stays on the critical
# path however well it is scheduled (a bound from bandwidth alone: latency only raises it);
# with bf16 weights gathered but fp32 gradients reduced (FSDP2 as section 6 runs it), the
# backward needs 1.5× as many tokens; with every message in fp32 but the matmuls still at
# bf16 speed, twice as many (slower fp32 matmuls lower F, and the threshold).
#
# Note what does not shrink with N in ZeRO-3: a rank's working set. While a layer's backward
# computes, its full weights and its full gradient (weighed in section 5 at every N) are both
# alive, and with prefetching (section 6) the next layer's full weights too. Once its
# gradients are complete the weights go before the reduce-scatter (section 4).
# So where the reduce-scatter overlaps the next layer's backward (FSDP2's aim on a GPU), the
# working set is one or two blocks' weights and gradients plus whatever the reduce-scatters
# in flight keep alive, on top of 16Ψ/N.
#
# **▶ What FSDP2's reduce-scatter keeps alive, for how long, and how many it keeps in
# flight — open after your lab passes** (it is lab 08's design decision, made by torch; click
# the folded cells below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# A layer's gradient is briefly held twice: like `flatten_padded` in section 3,
# `foreach_reduce` copies the gradients into a padded full-size buffer, the reduce-scatter's
# input, before it drops them (`_fsdp_collectives.py`). That buffer outlives its
# reduce-scatter: `post_backward` keeps it in `comm_ctx.reduce_scatter_states`
# (`_fsdp_param_group.py`). The *next* group's `post_backward` makes the compute stream wait
# for that reduce-scatter, then drops the buffer before reducing its own (here each
# `fully_shard` call makes one group; of a call with several, only the last drops). One
# buffer may stay by default (`FSDPModule.set_reduce_scatter_max_input_buffers` sets how
# many). The last group's buffer waits for the root's end-of-backward callback,
# `_root_post_backward_final_callback` (the *root*, section 6: the outermost sharded module).
# That callback drops the kept buffers only on a step's last backward: `is_last_backward` is True unless
# `set_is_last_backward(False)` says more micro-batches follow. Section 6's accumulation
# leaves it True; set False, the last group's buffer waits for the next backward's first
# `post_backward`. So the next layer's backward sets a buffer's lifetime, whatever the
# collective's progress.
#
# </details>
#
# **▶ That order, read in the installed torch** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
with viz.folded_output("▶ That order, read in the installed torch — open after your lab passes"):
    zero_answers.fsdp2_drop_order()
viz.show_code(zero_answers.fsdp2_drop_order,
              folded="▶ code: the claim, read from torch's source — open after your lab passes")

# %% [markdown]
#
# ## 6. FSDP2 for real
# PyTorch's FSDP2 is ZeRO-3 with everything we skipped: prefetching, overlap, mixed-precision
# policies, checkpoints. `fully_shard(module)` turns a module's parameters into **DTensors**.
# A *device mesh* (`DeviceMesh`, made by `init_device_mesh`: `experiments.ranks_mesh` below)
# is the ranks laid out as an array, here one dimension of N ranks. A DTensor is one logical tensor
# spread over a mesh: each rank holds a local tensor (`to_local()`), and the DTensor's
# *placements*, one per mesh dimension, say how the pieces make the whole — `Shard(dim=0)`: cut
# along dimension 0, rank r holding chunk r; `Replicate()`: a full copy on every rank.
# `fully_shard` places each parameter here as `Shard(dim=0)`, as its `shard_placement_fn` is
# left at None (a function there may pick another dimension or mesh) and the parameter is a plain
# tensor; one that tensor parallelism has already cut along
# the dimension FSDP shards (a DTensor, lesson 11, §4) gets a `_StridedShard` placement on the
# data-parallel dimension instead (`_fsdp_param.py`, `FSDPParam._init_sharded_param` and
# `_init_sharding_spec_tp`). Applied to each layer and then to
# the *root* (the outermost module, here the whole MLP), it makes each layer a parameter group
# of its own (a unit, gathered on its own), as in our `Zero3`. The worker below shards the
# MLP, trains it in bf16 (`MixedPrecisionPolicy`), gathers a full state dict, saves it from
# rank 0 and loads it back, into a plain model and into a fresh sharded one.

# %%
viz.show_code(experiments.fsdp2_worker, experiments.fsdp2_shard, experiments.ranks_mesh,
              experiments.fsdp2_policy, zero.fsdp2_padded_numel)

# %%
tour = launch.spawn(experiments.fsdp2_worker, world_size, mp, backend=backend, timeout=120)
for name, kind, full, local, placement in tour[0]["shards"]:
    print(f"{name:>10}: {kind}, {placement}")
claim("with the default shard_placement_fn and plain-tensor parameters, every parameter is "
      "placed as Shard(dim=0) on the one-dimensional mesh",
      all(placement == "(Shard(dim=0),)" for *_, placement in tour[0]["shards"]))

# %% [markdown]
# What FSDP2 holds and sends here, against section 1's formula. It keeps the **fp32** shard
# itself as what the optimizer steps (no separate master copy), gets **fp32** gradients
# (sharded), and Adam's two fp32 states for its shard: (4 + 4 + 8)/N, where the paper has
# (2 + 2 + 12)/N. It all-gathers the weights in bf16 (the policy's `param_dtype`, 2 bytes,
# twice per step) and reduce-scatters the gradients in fp32 (`reduce_dtype=torch.float32`,
# which `experiments.fsdp2_policy` sets; left at None it would follow `param_dtype`): a
# collective volume (§5's convention) of 2 + 2 + 4 = 8 bytes per parameter per step, where the
# paper's fp16 ZeRO-3 has 3 × 2 = 6. On a ring a rank *sends* (N − 1)/N of the volume: 4 bytes
# per parameter at N = 2. Measured on rank 0 after the tour's last step (FSDP2 pads each
# parameter's first dimension):

# %%
units = [zero.fsdp2_padded_numel(p.shape, world_size) for p in cfg.build().parameters()]
padded = sum(units)
held, sent = tour[0]["held"], tour[0]["traffic"][-1]["by_op"]
n = world_size
rows = [("weights kept (shard)", 2 / n, 4 / n, held["params"]),
        ("gradients kept (shard)", 2 / n, 4 / n, held["grads"]),
        ("optimizer state", 12 / n, 8 / n, held["optimizer"]),
        ("volume: all-gathers (fwd, bwd)", 2 + 2, 2 + 2, sent["all_gather"]),
        ("volume: reduce-scatter", 2, 4, sent["reduce_scatter"])]
print(f"bytes per parameter, N = {n}            paper ZeRO-3  FSDP2 formula  FSDP2 measured")
for what, paper_b, fsdp_b, measured in rows:
    print(f"{what:<38} {paper_b:10.2f} {fsdp_b:14.2f} {measured / padded:15.2f}")
claim("FSDP2 holds (4 + 4 + 8)/N bytes per padded parameter on rank 0: fp32 shard, fp32 "
      "gradient, Adam's two fp32 states",
      held == zero.memory_per_rank("zero3", units, world_size, 4, 4, 8))
claim("the other ranks hold no more (Adam's state covers their unpadded rows only)",
      all(r["held"]["total"] <= held["total"] for r in tour))
claim("its collectives' volume is 2 + 2 bytes of bf16 all-gathers and 4 bytes of fp32 "
      "reduce-scatter per padded parameter", sent == {"all_gather": 2 * 2 * padded,
                                                      "reduce_scatter": 4 * padded})
ring_sent = tour[0]["traffic"][-1]["ring_bytes_per_rank"]
claim(f"of that volume a rank sends (N − 1)/N on a ring: {ring_sent / padded:g} bytes per "
      f"parameter at N = {n}", ring_sent == 8 * padded * (n - 1) / n)
fsdp2_mixed = tour[0]["traffic"][-1]["volume"]
claim("that is traffic_per_step's ZeRO-3 with bf16 weights and fp32 gradients",
      fsdp2_mixed == zero.traffic_per_step("zero3", units, n, element_size=2, grad_bytes=4))
ddp_fp32 = runs[0]["torch_ddp"]["traffic"][-1]["volume"]   # section 3's run: fp32 gradients
print(f"FSDP2 (bf16 gathers, fp32 reduce-scatter) {fsdp2_mixed / padded:g} B per padded "
      f"parameter; torch DDP in fp32 {ddp_fp32 / n_params:g} B per parameter")
claim("measured: per parameter this FSDP2 step sends what fp32 DDP's all-reduce sends, 8 "
      "bytes (1.0×, FSDP2's padding aside), not 1.5×",
      fsdp2_mixed == 8 * padded and ddp_fp32 == 8 * n_params)

# %%
claim("FSDP2's parameters are DTensors", all(s[1] == "DTensor" for s in tour[0]["shards"]))
claim("the shards stay fp32 while the layer computes in bf16 (the mixed-precision policy)",
      tour[0]["sharded_dtype"] == "torch.float32" and tour[0]["compute_dtype"] == "torch.bfloat16"
      and tour[0]["grad_dtype"] == "torch.float32")
claim("the full state dict saved by rank 0 loads into a plain nn.Module with equal weights",
      tour[0]["plain_model_equal"])
claim("loaded back into a fresh sharded model, every rank's shards are equal",
      all(r["reloaded_shards_equal"] for r in tour))

# %% [markdown]
# What `Shard(dim=0)` leaves on rank 0: the first of N chunks along dimension 0 (FSDP2 pads
# only its storage: the last ranks' tensors are shorter, or empty), every other dimension
# whole. The claim checks every parameter; the biases' shapes are printed.

# %%
for name, kind, full, local, placement in tour[0]["shards"]:
    if len(full) == 1:                             # the biases
        print(f"{name:>10}: full {full}, rank 0 holds {local}")
claim(f"for every parameter, rank 0's shard has the shape of a dim-0 chunk: ceil(size of "
      f"dim 0 / {world_size}) along dimension 0, the other dimensions whole",
      all(local[0] == zero.shard_numel(full[0], world_size) and local[1:] == full[1:]
          for name, kind, full, local, placement in tour[0]["shards"]))

# %% [markdown]
# And in fp32, FSDP2 from the first launch against torch DDP, and its traffic against the
# ZeRO-3 formula — with FSDP2's own padding, each parameter's first dimension rounded up to a
# multiple of N:

# %%
claim(f"FSDP2: weights after {steps} steps == torch DDP's (to 1e-5)", max_diff("fsdp2") < 1e-5,
      diff=max_diff("fsdp2"))
fsdp2 = runs[0]["fsdp2"]
claim("FSDP2's volume per step == the ZeRO-3 formula with its padding",
      fsdp2["traffic"][-1]["volume"] == zero.traffic_per_step("zero3", fsdp2["units"],
                                                              world_size))

# %% [markdown]
# That is 3Ψ because the root owned no parameters of its own here and the step ran one forward
# and one backward. Our `Zero3` frees every layer after its forward; FSDP2 keeps the root's
# own parameters gathered after the forward, because the backward needs them at once: when
# `reshard_after_forward` is left at its default, the root's first forward sets it to False
# for the root. `reshard_after_forward=False` on every unit sends what stage 2 sends (one
# all-gather, one reduce-scatter), still with stage 3's memory at rest. `set_reshard_after_backward(False)`
# keeps weights gathered between micro-batches only: left on across a step, the next forward
# reuses the stale gathered weights (`unshard` returns at once). Above, every
# `Linear` was its own unit. Leave the last layer to the root and its parameters are
# all-gathered once per step, not twice:

# %%
viz.show_code(experiments.fsdp2_root_worker)

# %%
rooted = launch.spawn(experiments.fsdp2_root_worker, world_size, cfg, backend=backend, timeout=120)[0]
root_units, other_units = sum(rooted["root_units"]), sum(rooted["other_units"])
by_op = rooted["traffic"][-1]["by_op"]
all_units = root_units + other_units
print(f"per padded parameter of all units: all-gathered {by_op['all_gather'] / 4 / all_units:.2f}×, "
      f"reduce-scattered {by_op['reduce_scatter'] / 4 / all_units:.2f}×")
claim("FSDP2 all-gathers the root's parameters once and the others twice: "
      "volume == 3 × others + 2 × root, below 3Ψ",
      by_op == {"all_gather": 4 * (2 * other_units + root_units),
                "reduce_scatter": 4 * (other_units + root_units)}
      and rooted["traffic"][-1]["volume"] < 3 * 4 * (other_units + root_units))

# %% [markdown]
# How FSDP2 schedules its collectives (read in its source). Before the backward it
# gathers a group the way our `Zero3` does, from a hook registered on the forward's output
# tensors. After the backward it does not hook each parameter: it wraps the module's *inputs*
# in an autograd function whose backward runs when the whole module's backward is done, and
# calls the group's `post_backward` (free, then reduce-scatter, as section 4's `Zero3`). The
# first `Linear` here has no such function (why: folded below). Its
# reduce-scatter runs from the root's final callback, a function the root queues for the end
# of the whole backward (`_root_post_backward_final_callback` runs `post_backward` for every
# group the backward did not reach).
#
# <details><summary>▶ Why — open after lab 11's part 6 (skip it until then)</summary>
#
# FSDP2 wraps only the inputs that require a gradient (`_register_post_backward_hook` returns
# early when it finds none: `_fsdp_param_group.py`, line 925), and the data requires none.
#
# </details>

# %% [markdown]
# Inside a group's `post_backward` the order is our `Zero3`'s (section 4). FSDP2 gathers and
# frees a *parameter group* at a time (here one layer; `fully_shard(module)` makes a module's
# parameters one `FSDPParamGroup` by default, several if a `shard_placement_fn` puts some
# parameters on another process group; the `set_*` methods below are its switches). When a
# group's backward is done, its `post_backward`
# puts the gradients aside, calls `reshard()` (free the full weights), then `foreach_reduce`
# (the reduce-scatter) — by default: `set_reshard_after_backward(False)` (below) skips
# the `reshard()`, `set_requires_gradient_sync(False)` the reduce-scatter. By default, then,
# a layer's full weights are gone while its gradients are reduce-scattered.
#
# **▶ Both paths, read in the installed torch (source order, indentation kept)** — click the
# folded cell below; its claim is printed under it.

# %% jupyter={"source_hidden": true}
import inspect

from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

post_backward = inspect.getsource(FSDPParamGroup.post_backward)
marks = ("if not self.reduce_grads", "return", "unsharded_grads.append(",
         "if self.reshard_after_backward", "self.reshard()",
         "if len(fsdp_params_with_grad) == 0",   # the guard on the second return
         "with record_function(self._with_fqn(\"FSDP::post_backward_reduce", ") = foreach_reduce(")
for line in post_backward[:post_backward.index("foreach_reduce(") + 15].splitlines():
    if line.strip().startswith(marks):
        print(line[12:].rstrip())
before, path = post_backward.split("fsdp_params_with_grad: list")   # path: it reduces
no_reduce = before[before.index("if not self.reduce_grads"):]
claim("FSDP2's post_backward saves the gradients, frees the full weights (reshard, if "
      "reshard_after_backward), then reduce-scatters (foreach_reduce); without reduce_grads "
      "it returns first", "return" in no_reduce and "foreach_reduce" not in no_reduce
      and path.rindex("unsharded_grads.append(") < path.index("if self.reshard_after_backward")
      < path.index("self.reshard()") < path.index("foreach_reduce("))

# %% [markdown]
# Its source also sets up three ways to overlap them with the compute on a GPU (Sources gives
# the lines); no run here shows them. In the forward each group's all-gather goes on streams
# of its own, so that the CPU can issue the next group's while this one's kernels run
# (*implicit* prefetching); `set_modules_to_forward_prefetch` names groups to all-gather early
# (*explicit*). In the backward each group by default issues the next group's all-gather
# before computing its own gradients. Reduce-scatters get a stream of their own. On a CPU,
# `torch.cpu.Stream`'s methods do nothing and gloo, called with `async_op=False` as FSDP2 calls
# it, returns only when the collective is done: so, by the source (not timed here), every FSDP2 run ran one collective after another,
# like our `Zero3`.
#
# Both counts assume one forward and one backward per optimizer step. With gradient
# accumulation over k micro-batches, FSDP2 left at its defaults gathers every non-root unit
# for each micro-batch's forward and again for its backward — 2k all-gathers —, gathers the
# root once per micro-batch (its backward reshards it) and reduce-scatters every micro-batch's
# gradients: k times the traffic of one pass. `set_requires_gradient_sync(False)` on all but
# the last micro-batch skips those reduce-scatters, and `set_reshard_after_backward(False)`
# keeps the weights gathered between micro-batches; both pay in memory (without the
# reduce-scatters each unit keeps its full gradient: ZeRO-2's saving is gone, which is why a
# ZeRO-2 reduce-scatters every micro-batch). Measured with k = 2:

# %%
viz.show_code(experiments.fsdp2_accumulation_worker)

# %%
k = 2
accumulated = launch.spawn(experiments.fsdp2_accumulation_worker, world_size, cfg, k,
                           backend=backend, timeout=120)[0]
units_count, counts = accumulated["units"], accumulated["counts"][-1]
print(f"{units_count} non-root units and the root, {k} micro-batches per step: {counts}")
claim(f"with {k} micro-batches per step every non-root unit is all-gathered 2k = {2 * k} times "
      f"and the root {k} times, and every unit reduce-scattered {k} times",
      counts == {"all_gather": 2 * k * units_count + k, "reduce_scatter": k * (units_count + 1)})
claim(f"the volume per optimizer step is {k} × that of one forward and backward",
      accumulated["traffic"][-1]["by_op"] == {op: k * v for op, v in by_op.items()})

# %% [markdown]
# `torch.distributed.optim.ZeroRedundancyOptimizer` is torch's ready ZeRO-1 for DDP: wrap the
# optimizer class, keep DDP. It assigns *whole parameters* to ranks, not equal slices, and
# after its step each rank broadcasts the parameters it owns (so 3Ψ, not 2Ψ, in our
# convention). This run is in fp32 with no master copy, so the full state is Adam's 8 bytes
# per parameter, not section 1's 12. Last, FSDP2 and `ZeroRedundancyOptimizer` on section 4's
# frozen and tied run (FSDP2 refuses a tied parameter split across two parameter groups:
# `fsdp2_shard` puts both layers in one `fully_shard([a, b])`):

# %%
zro = [r["zero_redundancy"] for r in runs]
full_state = runs[0]["torch_ddp"]["held"]["optimizer"]
print("optimizer state per rank:", [r["held"]["optimizer"] for r in zro], "bytes; full:",
      full_state)
claim(f"ZeroRedundancyOptimizer: weights after {steps} steps == torch DDP's (to 1e-5)",
      max_diff("zero_redundancy") < 1e-5)
claim("its ranks' optimizer states add up to the full state: each parameter's on one rank",
      sum(r["held"]["optimizer"] for r in zro) == full_state)
claim("its volume per step is 3Ψ (DDP's all-reduce, then each rank broadcasts its part)",
      zro[0]["traffic"][-1]["volume"] == zero.traffic_per_step("zero_redundancy", [n_params],
                                                               world_size))
claim("with section 4's frozen and tied parameters, FSDP2 and ZeroRedundancyOptimizer: weights "
      "== torch DDP's on every rank (to 1e-5), the frozen bias never moved (bit for bit)",
      all(max_diff(run, tied_runs) < 1e-5 and torch.equal(r[run]["params"][bias], start[bias])
          for run in ("fsdp2", "zero_redundancy") for r in tied_runs))

# %% [markdown]
# ## 7. When to use what
# | | memory per parameter: paper (fp16 + fp32 master) | fp32 weights (autocast, FSDP2 here) | traffic (elements; bytes in one dtype) | use it when |
# |---|---|---|---|---|
# | DDP | 16 B (torch DDP: + a second copy of the gradients in its buckets, 18 B, unless `gradient_as_bucket_view=True`) | 16 B (torch DDP: 20 B, the same; autocast's weight casts add up to 2 B from forward to backward) | 2Ψ | the model, its gradients and Adam fit on one GPU: simplest, fastest |
# | ZeRO-1 | 4 + 12/N B | 8 + 8/N B | 2Ψ | Adam's state is what does not fit: free memory, no extra traffic |
# | `ZeroRedundancyOptimizer` | — (keeps no master copy) | 12 + 8/N B under DDP's default `gradient_as_bucket_view=False` (4 weights + 4 gradients + 4 for DDP's buckets + Adam's 8/N; the run above weighs only the optimizer state), 8 + 8/N B with `gradient_as_bucket_view=True`; roughly, as whole parameters are per rank | 3Ψ | ZeRO-1 ready-made for a DDP model: one line, at the cost of a broadcast |
# | ZeRO-2 | 2 + 14/N B | 4 + 12/N B | 2Ψ (ours reduce-scatters in `step()`, so also with k accumulation micro-batches); (k+1)Ψ at k (derived, not run) for one that reduce-scatters during each backward and keeps only its shard | more memory freed, no extra traffic without accumulation — and a lower peak if the gradients are reduce-scattered during the backward (lab 08) |
# | ZeRO-3 / FSDP | 16/N B + the working set | 16/N B + the working set | 3Ψ with one forward and one backward per step and nothing tied across units (less: FSDP2's root is gathered once; more: k accumulation micro-batches gather about 2k times, tied layers) | the weights themselves do not fit: model state falls with every GPU added, the working set (one or two units' full weights and gradient) does not |
# | + tensor / pipeline parallel | | | | one layer's activations or weights exceed a GPU, or N is so large that communication dominates — a rank sends about 3Ψ per step whatever N, while its share of a fixed global batch, and so its compute, falls as 1/N: split the model itself (Megatron-LM, the Ultra-Scale Playbook) |
#
# Traffic in the table counts elements: in bytes, when gradients and weights travel in the same
# dtype. With bf16 weights and fp32 gradients (section 5) DDP sends 8 bytes per parameter,
# ZeRO-1 and ZeRO-2 6 (0.75×), ZeRO-3 8 (1.0×).
#
# The calculator: a model size, a GPU's memory, N and what you keep for activations; which
# stages fit?

# %%
viz.show_code(zero.fits)

# %%
gb, gib = 1e9, 2**30
table = zero.fits(num_params=13e9, device_bytes=40 * gib, world_size=8, activation_bytes=6 * gb)
for row in table:
    print(f"{row['stage']:>6}: {row['bytes_per_rank'] / gb:6.1f} GB per GPU "
          f"{'fits' if row['fits'] else 'does not fit'}; at most "
          f"{row['max_params'] / 1e9:5.1f} B parameters")
claim(f"a 13-B model on 8 \"40-GB\" A100s (40 GiB = {40 * gib / gb:.1f} GB each; 6 GB for "
      "activations and ZeRO-3's working set) fits only with ZeRO-3",
      [r["stage"] for r in table if r["fits"]] == ["zero3"])

# %% [markdown]
# ## Summary
# - With mixed-precision Adam a parameter costs 16 bytes: 2 + 2 + 12 in the ZeRO paper (fp16
#   weights and gradients, fp32 master and Adam state), 4 + 4 + 8 with fp32 weights (autocast,
#   FSDP2 as run here); 2 + 4 + 12 = 18 in bf16 with gradients reduced in fp32 (Megatron-LM's
#   `--bf16`). DDP keeps all of it on every rank.
# - ZeRO-1 shards the optimizer state, ZeRO-2 the gradients too, ZeRO-3 the weights too; each
#   trained like DDP here (weights equal to 1e-5), with a frozen and a tied parameter too, and
#   each held exactly the bytes the formula says. ZeRO-3's working set (a unit's full weights
#   and gradient) comes on top and does not shrink with N: a layer's whole gradient, weighed
#   just before its reduce-scatter, was the same at N = 2, 3 and 4.
# - ZeRO-1 and 2 replace DDP's all-reduce by its two halves, reduce-scatter and all-gather: the
#   same traffic when gradients and weights travel in one dtype and each step has one
#   backward (with k accumulation micro-batches: section 7's ZeRO-2 row). ZeRO-3 gathers the weights
#   twice (forward and backward): 1.5× then, with one backward per step and nothing tied
#   across units — more with a tied layer (measured) or gradient accumulation, less where
#   FSDP2 keeps its root gathered. With bf16 weights and fp32 gradients the ratios become
#   0.75× and 1.0× (FSDP2 measured).
# - A ZeRO-2 that reduce-scatters in `step()` saves memory at rest (none if `zero_grad()`
#   follows `step()` at once), not at its peak: the lab reduce-scatters during the backward.
# - FSDP2's `fully_shard` is ZeRO-3 with DTensor parameters, mixed-precision policies and
#   state-dict helpers; here it held (4 + 4 + 8)/N per parameter and sent bf16 all-gathers and
#   an fp32 reduce-scatter. `ZeroRedundancyOptimizer` is a ready ZeRO-1 for DDP.
#
# **Next:** [lesson 09](09_beyond_lockstep.ipynb) leaves lockstep: parameter servers, stale
# gradients, local SGD and large batches.
#
# ## Check yourself
#
# **▶ The quiz** — run the folded cell below and answer in the widget (or read its output,
# where the answers are folded).

# %% jupyter={"source_hidden": true}
from dpcourse import quizzes

viz.quiz(quizzes.questions("08"))

# %% [markdown]
# ## Sources
# Every statement above about what torch does was checked in the installed torch 2.14.1
# (paths relative to `site-packages`):
#
# - `torch/distributed/distributed_c10d.py` — `reduce_scatter_single`, `all_gather_single`
#   (equal pieces on every rank; `async_op` returns a `Work`, and without it the call waits on
#   that `Work` before it returns); `reduce_scatter_tensor` and `all_gather_into_tensor` are
#   deprecated aliases that warn and call them.
# - `torch/_tensor.py` — `Tensor.register_post_accumulate_grad_hook`: the hook runs once the
#   gradient has been accumulated into `p.grad` (ZeRO-3's reduce-scatter, the lab's buckets).
# - `torch/optim/optimizer.py` — `Optimizer.zero_grad(set_to_none=True)`: by default it sets
#   each `p.grad` to None, freeing the gradients (section 1's 16 bytes between steps, section
#   3's "at rest").
# - `torch/distributed/fsdp/_fully_shard/_fsdp_init.py` — `_init_param_group`: one
#   `FSDPParamGroup` per `fully_shard` call when `shard_placement_fn` is None or keeps every
#   parameter on one process group; otherwise one per process group of the meshes in the
#   `ShardPlacementResult`s it returns (`_fsdp_common.py`, `resolve_shard_placement`).
# - `torch/autograd/graph.py` — `saved_tensors_hooks`: its pack hook is called on every tensor
#   an operation saves for the backward (section 1's list of what autocast keeps).
# - `torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py` — `allreduce_hook`: the comm
#   hook registered on torch DDP so that its all-reduce goes through `torch.distributed` and is
#   recorded.
# - `torch/distributed/fsdp/_fully_shard/_fully_shard.py` — `fully_shard`: parameters become
#   DTensors; `reshard_after_forward` left at None is True, and set to False for the root;
#   False "keeps the unsharded parameters in memory after forward and avoids the all-gather
#   in backward" (its docstring), while `reshard_after_backward` stays True
#   (`_fsdp_param_group.py`, `FSDPParamGroup.__init__`).
# - `torch/distributed/fsdp/_fully_shard/_fsdp_state.py` — `FSDPState._lazy_init`: the first
#   module to run forward is the root, and its groups are not resharded after the forward;
#   `FSDPState._validate_no_duplicate_params`: a parameter in two groups is refused (tied
#   layers go in one `fully_shard([a, b])` group); `FSDPState._register_pre_backward_hook`:
#   `register_hook` on the forward's output tensors, which gathers before the backward.
# - `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py` — `FSDPCommContext.lazy_init`
#   (lines 85–93): the `all_gather_copy_in_stream`, `all_gather_stream` and
#   `reduce_scatter_stream`, made by the device's `Stream` (a no-op on a CPU);
#   `FSDPCommContext.get_all_gather_streams` (117–127): in the forward and pre-backward, the
#   separate all-gather streams "for implicit prefetching"; `FSDPParamGroup.pre_backward`
#   (592–604) and `_backward_prefetch` (821): the next group's all-gather issued by default in
#   the backward (`FSDPState._pre_backward` in `_fsdp_state.py`, 386–392, sets the default);
#   the all-gathers are called with `async_op=False` unless `unshard_async_op` is set;
#   `_register_post_backward_hook` (917–932) and `RegisterPostBackwardFunction` (1141): section
#   6's post-backward function. `FSDPParamGroup.post_backward`: it saves the unsharded gradients,
#   calls `reshard()` (frees the full weights) if `reshard_after_backward`, then
#   `foreach_reduce` (in `_fsdp_collectives.py`: the reduce-scatter) — the weights go before
#   the reduce-scatter; with `reduce_grads` False it returns before saving or reducing,
#   the unsharded gradient kept to accumulate into (`FSDPParam.to_accumulated_grad_if_needed`
#   and `accumulate_unsharded_grad_if_needed`, `_fsdp_param.py`).
#   `FSDPModule.set_requires_gradient_sync` sets `reduce_grads` (`_fully_shard.py`).
# - `torch/distributed/tensor/_api.py` — `DTensor`, `DTensor.to_local`;
#   `torch/distributed/tensor/placement_types.py` — `Shard`, `Replicate`;
#   `torch/distributed/device_mesh.py` — `init_device_mesh`;
#   `torch/distributed/fsdp/_fully_shard/_fsdp_param.py` — `FSDPParam._init_sharded_param`:
#   the placement is `Shard(0)` unless a shard-placement function says otherwise;
#   `FSDPParam._init_sharding_spec_tp`: a DTensor parameter already cut along the shard
#   dimension gets `_StridedShard(shard_dim, split_factor)` on the data-parallel dimension,
#   `_init_sharding_spec_plain`: a plain tensor gets the placement itself.
# - `torch/distributed/fsdp/_fully_shard/_fsdp_state.py` —
#   `FSDPState._root_post_backward_final_callback`: at the end of the backward it runs
#   `post_backward` for every group whose autograd function never ran.
# - `torch/distributed/fsdp/_fully_shard/_fully_shard.py` —
#   `FSDPModule.set_requires_gradient_sync` (gradient accumulation without reduce-scatters)
#   and `FSDPModule.set_reshard_after_backward` (keep the weights gathered between
#   micro-batches, "during gradient accumulation"); `fully_shard`'s `reshard_after_forward`;
#   `FSDPParamGroup.unshard`: `if self.is_unsharded: return  # no-op`.
# - `torch/distributed/fsdp/_fully_shard/_fully_shard.py` —
#   `FSDPModule.set_modules_to_forward_prefetch`: explicit forward prefetching.
# - `torch/cpu/__init__.py` — `Stream` (lines 136–151): exists "only to facilitate
#   device-agnostic code"; its methods do nothing, so on a CPU FSDP2's streams do not overlap
#   anything.
# - `torch/distributed/fsdp/_fully_shard/_fsdp_param.py` — `alloc_storage`, `free_storage`:
#   the unsharded parameter's storage is resized up for a unit's gather and down to 0 at its
#   reshard — the working set that does not shrink with N.
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel` (`gradient_as_bucket_view`,
#   docstring lines 731–742): without it the all-reduce buckets are a second copy of the
#   gradients ("the saved memory size will be equal to the total gradients size"); the lesson
#   cites this, it does not count the buckets.
# - `torch/_tensor.py` — `Tensor.register_hook`: a hook on a tensor's gradient (ZeRO-3
#   gathers a layer's weights again when its output's gradient arrives).
# - `torch/distributed/fsdp/_fully_shard/_fsdp_param.py` — `FSDPParam._init_sharded_param`
#   (each parameter chunked along dim 0, the chunks padded to equal size) and
#   `FSDPParam.init_dtype_attrs` (`reduce_dtype` equal to `param_dtype` means no cast).
# - `torch/distributed/fsdp/_fully_shard/_fsdp_api.py` — `MixedPrecisionPolicy`: `param_dtype`
#   for compute and the all-gather, the sharded parameter (what the optimizer steps) keeps its
#   original dtype; `reduce_dtype` None follows `param_dtype`.
# - `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py` — `foreach_all_gather`,
#   `foreach_reduce`: one all-gather and one reduce-scatter of the padded flat buffer per group,
#   `DefaultAllGather.__call__` and `DefaultReduceScatter.__call__` call
#   `dist.all_gather_single` and `dist.reduce_scatter_single` (module attributes, so
#   `collectives.record_collectives` sees them).
# - `torch/amp/autocast_mode.py` — `autocast`: operations run in the lower precision on casts
#   of their inputs; the module's parameters stay in their own dtype (fp32); `cache_enabled`
#   (docstring, line 218, default True): the weight casts are cached inside the autocast
#   region (section 1 measures the one autograd saves for the backward).
# - `torch/distributed/checkpoint/state_dict.py` — `get_model_state_dict`,
#   `set_model_state_dict` (`full_state_dict`, `cpu_offload`, `broadcast_from_rank0`).
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel.__init__`:
#   `gradient_as_bucket_view=False` by default, so under `ZeroRedundancyOptimizer` DDP's
#   buckets still hold a second full copy of the gradients.
# - `torch/distributed/optim/zero_redundancy_optimizer.py` — `ZeroRedundancyOptimizer`
#   (`_partition_parameters`: whole parameters assigned to ranks; `_sync_params`: each rank
#   broadcasts the parameters it stepped; `_broadcast_params_from_rank`: with `dist.broadcast`).
#
# Papers: Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training Trillion Parameter
# Models*, SC 2020 (Figure 1, the 2 + 2 + 12 split, fp16 with fp32 master weights); Zhao et al., *PyTorch FSDP*, VLDB 2023.
#
# Megatron-LM (github.com/NVIDIA/Megatron-LM, not installed here; lesson 11's Sources give the
# commit): `megatron/training/arguments.py` — with `--bf16`, `accumulate_allreduce_grads_in_fp32`
# is turned on unless told otherwise ("bfloat16 requires gradient accumulation and all-reduce
# to be done in fp32"): section 1's 2 + 4 + 12 = 18.
#
# **▶ The sources of what FSDP2's reduce-scatter keeps alive, and how many it keeps in flight
# — open after your lab passes** (it is lab 08's design decision; click the folded cell below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# ### Sources, continued
#
# - `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py` — `FSDPParamGroup.post_backward`
#   (661–682): before its own `foreach_reduce`, waits on and drops the reduce-scatter inputs
#   kept by earlier groups until fewer than `reduce_scatter_max_input_buffers` remain (1 by
#   default, line 230), only in a `fully_shard` call's last parameter group (line 672);
#   (741–743) keeps its own in `comm_ctx.reduce_scatter_states`.
# - `torch/distributed/fsdp/_fully_shard/_fully_shard.py` —
#   `FSDPModule.set_reduce_scatter_max_input_buffers` (lines 707–756): the public setter of
#   each group's cap; `_fsdp_state.py` `FSDPState._init_shared_state` (lines 232–253) keeps the
#   largest as `comm_ctx.reduce_scatter_max_input_buffers`, which `post_backward` reads.
# - `torch/distributed/fsdp/_fully_shard/_fsdp_state.py` —
#   `FSDPState._root_post_backward_final_callback` (lines 427–437): waits on and drops the
#   reduce-scatter inputs still kept, on the last backward of a step only.
# - `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py` — `foreach_reduce` (lines
#   597–606): the gradients copied into the padded reduce-scatter input before they are
#   dropped.
#
# </details>
