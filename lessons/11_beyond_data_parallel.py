# %% [markdown]
# # 11 · Where data parallelism ends: tensor and pipeline parallelism, a 2-D mesh, a planner
#
# **Prerequisites:** lesson 03 (all-reduce, DDP), lesson 06 (point-to-point `send`/`recv`, the
# ring's cost), lesson 07 (DDP's communication hooks) and lesson 08 (16 bytes per parameter,
# ZeRO-3 and FSDP2's `fully_shard`), and the shape of a transformer layer (attention, then
# a two-layer MLP of width d with 4d hidden features, each behind a layer norm; sections 1
# and 5 count its bytes and flops). New here, each explained where it first appears: a
# custom `torch.autograd.Function` (a forward and a backward you write yourself), a
# two-dimensional `DeviceMesh` (lesson 08 met DTensor on a one-dimensional one), and the
# gradient noise scale.
#
# **You will be able to:**
# - say, with numbers, the two places where data parallelism stops helping: a model whose
#   activations at batch 1, stored for the backward rather than recomputed, do not fit however
#   far ZeRO-3 shards the rest, and a global batch
#   grown past the **critical batch size**, which the gradient noise scale predicts — the
#   noise scale measured here inside a DDP run (at one point of training: fixed weights);
# - explain Megatron-LM's tensor-parallel MLP (a column-parallel then a row-parallel linear
#   layer, and the two operations *f* and *g* that carry its communication) and count its
#   messages per step — reached through the lab, or its folded answers if you skip it;
#   check it against the plain MLP and against torch's `parallelize_module`;
# - run a pipeline (GPipe, 1F1B) over send/recv, measure its bubble against (K−1)/(M+K−1) and
#   count the activations 1F1B saves (micro-batches held, and their bytes);
# - compose tensor and data parallelism on a 2 × 2 `DeviceMesh`, prove it equal to one device
#   and count each dimension's traffic;
# - choose tensor × pipeline × data sizes for a model and a cluster, and check the choice
#   against published ones (Megatron-LM's runs on 1536 A100 GPUs).
#
# **Time:** about 95 minutes to read and run — most of it reading the code shown (the lab
# is extra).
#
# **Lab:** [lab11_tensor_parallel](../labs/lab11_tensor_parallel.ipynb) — write the column-
# and row-parallel layers and their two autograd operations; the check runs your MLP on 2 and
# 3 ranks next to the plain one and names the classic mistakes. Stretch: the GPipe schedule,
# with its bubble measured.
#
# Every lesson so far gave each rank a whole model, or (lesson 08) a slice of its state that
# is gathered back whole before a layer computes. Either way a rank runs **whole layers on its
# own examples**. This lesson is about what comes after: cutting the layers themselves
# (tensor parallelism), cutting the model into consecutive stages (pipeline parallelism), and
# combining them with data parallelism. The code lives in `dpcourse.tensor_parallel`,
# `dpcourse.pipeline_parallel` and `dpcourse.planner`. Every launch below runs gloo between
# CPU processes, on any machine: the point here is equality and counted messages, not speed
# (on GPUs the same calls take the NCCL backend and `init_device_mesh("cuda", ...)`).
#
# **Notation**, the same in every section (units in brackets):
#
# | symbol | meaning |
# |---|---|
# | N, D | data-parallel ranks: N as in lesson 08; D = GPUs / (t·p) in sections 2 and 5 |
# | t | tensor-parallel size [ranks that share each layer] |
# | K = p | pipeline stages [ranks]: K in section 3, p in section 5, as Megatron-LM writes it |
# | M | micro-batches per step and pipeline |
# | s, b | tokens per sequence; sequences (examples) per micro-batch, per rank |
# | d, h, a | the model's width [features]; the MLP's hidden features (h = 4d); attention heads |
# | Ψ | the parameters of the model at hand [numbers] |

# %% tags=["parameters"]
tp_ranks = 2                       # ranks of the tensor-parallel MLP (section 2): 2, 4 or 8
stages = 4                         # pipeline stages (section 3)
micro = (1, 2, 4, 8)               # micro-batch counts of the pipeline runs
delay_s = 0.004                    # "device time" of a pipeline forward (backward: twice)
gns_ranks, gns_per_rank, gns_steps = 4, 16, 100   # the noise-scale run (section 1)

# %%
import math

import numpy as np
import torch

from dpcourse import launch, pipeline_parallel, planner, tensor_parallel, tp_answers, viz, zero
from dpcourse.checks import claim

torch.set_num_threads(1)

# %% [markdown]
# ## 1. Where data parallelism ends
# ### Memory: activations do not shard
# Lesson 08's ZeRO-3 divides the model state — 16 bytes per parameter with mixed-precision
# Adam — by N. It does not touch the **activations**: the tensors a layer
# keeps from its forward for its backward. Each data-parallel rank runs every layer on its
# own micro-batch, so its activations are those of a whole layer on a whole micro-batch,
# whatever N is. For a transformer layer Korthikanti et al. (2022) count them, in 16-bit
# floats: `s·b·d·(34 + 5·a·s/d)` bytes.
# *Tensor parallelism* of size t (t ranks each keep a slice of every layer's weight
# matrices and compute that slice's share of the layer; section 2 builds it) divides all but
# `10·s·b·d` of it by t; those are the tensors every tensor-parallel rank holds whole:
# the two layer norms' inputs, the two dropout masks after attention and MLP, and the inputs
# of the QKV matmul and of the MLP's first matmul (their section 4.2.2). Their *sequence
# parallelism* (the end of section 2) splits those too, each rank keeping its share of the
# sequence's tokens there.
# Recomputing the layer in the backward (*activation checkpointing*) keeps only its input,
# `2·s·b·d`. Most of it, though, for long sequences, is the `5·a·s/d` term: the attention
# matrix (a heads × s × s per sequence) stored three times over — the softmax's output, the
# dropout's mask and its output. A fused *flash attention* kernel never stores that matrix:
# it recomputes it block by block in the backward from a much smaller summary:

# %%
viz.show_code(tensor_parallel.attention_saved)

# %%
seq_demo = 256
written = tensor_parallel.attention_saved(seq_demo, fused=False)
fused = tensor_parallel.attention_saved(seq_demo, fused=True)
print("written out, saved for the backward:", written)
print("torch's flash kernel, saved:        ", fused)
claim(f"written out, one attention over s = {seq_demo} tokens saves tensors of s × s = "
      f"{seq_demo * seq_demo} entries per head (the attention matrix); torch's flash kernel saves "
      f"none of that size: Q, K, V, its output, and a logsumexp of shape (batch, heads, s)",
      any(sh[-2:] == (seq_demo, seq_demo) for sh in written)
      and not any(sh[-2:] == (seq_demo, seq_demo) for sh in fused)
      and (1, 4, seq_demo) in fused)

# %%
viz.show_code(planner.Transformer, planner.activation_bytes_per_layer)

# %% [markdown]
# GPT-3 175B (its shape printed below) at the smallest
# possible batch, one sequence per GPU, with lesson 08's calculator `zero.fits` given those
# activations and ZeRO-3's working set (two layers' 16-bit weights, one computing and one
# prefetched, and one layer's 16-bit gradient: 12d² parameters a layer). Units: GB is 10⁹
# bytes; an "80-GB" A100 has 80 GiB = 81920 MiB (what `nvidia-smi` reports) = 85.9 GB.

# %%
viz.show_code(zero.fits)

# %%
gpt3 = planner.GPT3_175B
gb = 1e9
act_batch1 = gpt3.layers * planner.activation_bytes_per_layer(gpt3, micro_batch=1)
act_flash = gpt3.layers * planner.activation_bytes_per_layer(gpt3, micro_batch=1,
                                                             flash_attention=True)
matrix_share = 5 * gpt3.heads * gpt3.seq_len / gpt3.hidden
print(f"{gpt3.name}: {gpt3.layers} layers, width {gpt3.hidden}, {gpt3.heads} heads, "
      f"sequences of {gpt3.seq_len} tokens, a vocabulary of V = {gpt3.vocab} (the "
      "Megatron-LM paper's, section 5.1)")
print(f"{gpt3.name}: Ψ = {gpt3.num_params / 1e9:.1f} B parameters; activations at batch 1: "
      f"{act_batch1 / gb:.0f} GB per GPU with the attention matrix stored (5·a·s/d = "
      f"{matrix_share:.0f} of the {34 + matrix_share:.0f} units), {act_flash / gb:.0f} GB with "
      "flash attention")
gpu = 80 * 2**30                                 # an "80-GB" A100: 85.9e9 bytes
# ZeRO-3: two layers' weights, one's gradient (a lower bound: what the reduce-scatters in
# flight keep alive comes on top, zero.fits's docstring above)
working = 12 * gpt3.hidden ** 2 * (2 + 2 + 2)
ns = (8, 64, 512, 4096)
for n in ns:
    row = zero.fits(gpt3.num_params, gpu, n, activation_bytes=act_flash + working)[-1]
    print(f"N = {n:5d}: ZeRO-3 model state {gpt3.num_params * row['bytes_per_param'] / gb:7.1f} GB"
          f" + activations {act_flash / gb:.1f} GB (flash) + working set {working / gb:.1f} GB"
          f" = {row['bytes_per_rank'] / gb:7.1f} GB of {gpu / gb:.1f}")
claim(f"at batch 1, with every layer's activations stored for the backward (no recomputation), "
      f"no ZeRO stage fits GPT-3 175B on 80-GB GPUs ({gpu / gb:.1f} GB), at any of these N, "
      f"with or without flash attention: with flash attention the activations alone "
      f"({act_flash / gb:.1f} GB) leave {(gpu - act_flash) / gb:.1f} GB, less than ZeRO-3's "
      f"working set ({working / gb:.1f} GB); the other stages' model state does not shrink "
      f"below 2Ψ bytes",
      act_flash < gpu < act_flash + working and act_batch1 > gpu
      and not any(r["fits"] for act in (act_batch1, act_flash) for n in ns
                  for r in zero.fits(gpt3.num_params, gpu, n, activation_bytes=act + working)))

# %%
state_gb = [gpt3.num_params * zero.bytes_per_param("zero3", n) / gb for n in ns]
viz.show(viz.memory_wall_figure(
    ns, state_gb, [act_flash / gb] * len(ns), gpu / gb,
    f"{gpt3.name} at batch 1, flash attention: ZeRO-3 per GPU", working_gb=working / gb),
    f"Linear axis, stacked: what one GPU must hold. ZeRO-3's share of the model state falls "
    f"with every GPU added ({state_gb[0]:.0f} GB → {state_gb[-1]:.1f} GB); the activations of "
    f"one sequence, stored without recomputation, stay at {act_flash / gb:.0f} GB even with "
    f"flash attention ({act_batch1 / gb:.0f} GB with the attention matrix); with ZeRO-3's "
    f"working set on top every total is above the GPU's {gpu / gb:.1f} GB (dashed).")

# %% [markdown]
# Measured, on a small scale: FSDP2 (lesson 08's ZeRO-3) on a stack of four
# `Linear(48, 48)` + GeLU layers, every rank with a micro-batch of 8, on 2 and then 4 ranks.
# `torch.autograd.graph.saved_tensors_hooks(pack, unpack)` calls `pack` on every tensor
# autograd keeps for the backward; the worker adds up those whose first dimension is the
# micro-batch (the activations) and the rest apart (`other_saved`: the gathered weights the
# layers' backward needs; `other_resident`: the bytes their storage still holds after the
# forward), and the bytes of the rank's parameter shards.

# %%
viz.show_code(tensor_parallel.activation_memory_worker)

# %%
held = {n: launch.spawn(tensor_parallel.activation_memory_worker, n, backend="gloo",
                        timeout=120) for n in (2, 4)}
for n, rs in held.items():
    print(f"N = {n}: parameter shard {rs[0]['shard_bytes']} bytes of {rs[0]['full_bytes']}, "
          f"activations saved {rs[0]['activations']} bytes")
claim("from 2 to 4 ranks each rank's parameter shard halves, while the activations it saves "
      "stay the same — those of one device on the same micro-batch",
      all(r["shard_bytes"] * n == r["full_bytes"] and
          r["activations"] == r["one_device_activations"] == held[2][0]["activations"]
          for n, rs in held.items() for r in rs))
print("bytes of whole weights still held once the forward returns:",
      {n: rs[0]["other_resident"] for n, rs in held.items()})
claim("autograd also references whole weights, not shards (how many, which, and why: folded "
      "below), but holds none of their bytes after the forward: FSDP2 frees each "
      "unit's gathered storage at its reshard and gathers it again in the backward "
      "(lesson 08's working set, one unit at a time)",
      all(r["other_saved"] > 0 and r["other_resident"] == 0
          for rs in held.values() for r in rs))

# %% [markdown]
# <details><summary>▶ Which ones, and why — open after lab 11's part 6 passes</summary>
#
# The three are the weights of every layer but the first. A `Linear` saves its weight for the gradient of
# its input only, and the first layer's input, the data, needs no gradient. The folded cell
# below checks it.
#
# </details>

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
with viz.folded_output("▶ Which ones, checked — open after lab 11's part 6 passes"):
    tp_answers.whole_weights_referenced(held)
    tp_answers.linear_saves_weight(torch.randn(8, 48))
viz.show_code(tp_answers.whole_weights_referenced, tp_answers.saved_by_linear,
              tp_answers.linear_saves_weight,
              folded="▶ code: the claim — open after lab 11's part 6 passes")

# %% [markdown]
# Recomputation rescues the memory (section 5's planner counts it: about 20 GB per GPU on
# 1536 GPUs), but not the traffic: a ZeRO-3 rank sends about 3Ψ per step *whatever N*
# (lesson 08, one micro-batch per step; k accumulated micro-batches send k times that), while — at a fixed global batch, the examples split over more ranks — its
# share of the compute falls as 1/N. (With a fixed batch per rank the compute per rank stays,
# and the global batch grows with N instead: the next subsection's limit.) Section 5 puts
# numbers on that.
#
# ### Batch: the critical batch size
# Data parallelism with a fixed batch per rank grows the **global** batch with N. A bigger
# batch gives a less noisy gradient, so fewer steps reach a given loss — but only up to a
# point. McCandlish et al. ("An Empirical Model of Large-Batch Training", 2018) model the
# steps S needed at a batch of β examples as `S = S_min·(1 + B_noise/β)`, with the learning
# rate tuned for each β (SGD, their §2.2): far below
# B_noise, doubling β halves the steps (perfect scaling); far above it, doubling β saves
# almost nothing: the extra GPUs are wasted. The **critical batch size** is the knee between the two: the batch at
# which training takes twice the fewest steps and twice the fewest examples (S = 2·S_min,
# E = 2·E_min, the examples E = β·S); in this model it is B_noise itself, and in their
# experiments the critical batch found by training at many batch sizes tracks the noise
# scale. B_noise = tr(∇²L·Σ)/(Gᵀ·∇²L·G) needs the loss's Hessian ∇²L; its cheap stand-in,
# which they measure and find predictive, is the **simple noise scale**
# `B_simple = tr(Σ)/|G|²` (equal to B_noise when ∇²L is a multiple of the identity): the
# per-example gradient's variance Σ, summed over parameters, against the true gradient G's
# squared norm.
#
# Their appendix A measures it for free inside a data-parallel run. The expected squared norm
# of a gradient averaged over β examples is `|G|² + tr(Σ)/β`. A DDP step sees two batch
# sizes: each rank's own gradient (b examples) *before* the all-reduce, and the averaged one
# (N·b examples) *after* it. Two equations, two unknowns:

# %%
viz.show_code(tensor_parallel.noise_scale_from_norms)

# %% [markdown]
# The model and its data: a small classifier on a fixed synthetic task, so that the exact
# answer can be computed below.

# %%
viz.show_code(tensor_parallel.noise_task, tensor_parallel.noise_model)

# %% [markdown]
# The per-rank norm comes from a DDP communication hook (lesson 07), which sees each bucket
# of this rank's gradient just before the all-reduce; the all-reduced one from `p.grad`
# afterwards. The weights stay fixed (no optimizer step) so that every step samples the same
# distribution, and we average numerator and denominator over the steps before dividing, as
# the paper does:

# %%
viz.show_code(tensor_parallel.noise_scale_worker)

# %%
gns = launch.spawn(tensor_parallel.noise_scale_worker, gns_ranks, gns_per_rank, gns_steps,
                   backend="gloo", timeout=120)[0]
rows = np.array(gns["rows"])
est = tensor_parallel.noise_scale_from_norms(rows[:, 0].mean(), rows[:, 1].mean(),
                                             gns["b_small"], gns["b_big"])
b_simple = est["trace"] / est["grad_sq"]
print(f"{gns_steps} DDP steps on {gns_ranks} ranks, b = {gns['b_small']}, N·b = "
      f"{gns['b_big']}: |G|² ≈ {est['grad_sq']:.4f}, tr(Σ) ≈ {est['trace']:.3f}, "
      f"B_simple ≈ {b_simple:.1f}")

# %% [markdown]
# Is it right? With this small model we can also compute the same quantities directly, from
# the gradient of every single example of the data set at the same weights
# (`torch.func.vmap` over `torch.func.grad`): their mean is G, their spread around it gives
# tr(Σ).

# %%
viz.show_code(tensor_parallel.per_example_noise_scale)

# %%
direct = tensor_parallel.per_example_noise_scale()
print(f"direct, from {4096} per-example gradients: |G|² = {direct['grad_sq']:.4f}, "
      f"tr(Σ) = {direct['trace']:.3f}, B_simple = {direct['b_simple']:.1f}")
claim("the estimate from the DDP run's two norms is within 15 % of the direct B_simple",
      abs(b_simple / direct["b_simple"] - 1) < 0.15, ddp=b_simple, direct=direct["b_simple"])

# %%
ranks = (1, 2, 4, 8, 16, 32)
steps_rel = {n: 1 + b_simple / (n * gns_per_rank) for n in ranks}
gain_4_to_32 = steps_rel[4] / steps_rel[32]
print("steps / fewest steps, at b = 16 per rank: " + ", ".join(
    f"N={n}: {steps_rel[n]:.2f}" for n in ranks))
claim(f"by this model, with B_simple for B_noise, from 4 to 32 ranks (8× the GPUs) the steps "
      f"fall only {gain_4_to_32:.2f}×, not 8×", gain_4_to_32 < 2.5)
viz.show(viz.noise_scale_figure(b_simple, gns_per_rank, ranks),
         "McCandlish et al.'s model S/S_min = 1 + B_noise/β (learning rate tuned at each β) "
         "evaluated (no training run), "
         f"with B_simple ≈ {b_simple:.0f} (measured above) standing in for B_noise: going from "
         f"4 to 32 data-parallel ranks of 16 examples cuts the steps {gain_4_to_32:.2f}×, not "
         "8× — past the critical batch, more data parallelism buys little.")

# %% [markdown]
# For a large language model B_noise is large (and it grows as the loss falls, McCandlish et
# al. find), but so are the clusters:
# 16,384 GPUs at even one sequence of 8,192 tokens each is 134 M tokens per step. Beyond the
# critical batch, the rest of the GPUs must go into splitting the model — which also cuts
# the memory per GPU.
#
# ## 2. Tensor parallelism: Megatron-LM's MLP
# A transformer's MLP is `Y = GeLU(X·A)·B`: X is tokens × d, A is d × h, B is h × d, with
# h = 4d (and b₁, b₂ are biases). Shoeybi et al. (*Megatron-LM*, 2019) cut it over t ranks
# so that no weight ever travels: the ranks exchange only activations and their gradients:
#
# 1. **column-parallel** first layer: rank r keeps the r-th block of A's *columns*
#    (d × h/t), and computes `Z_r = X·A_r`: its own h/t of the hidden features before the
#    activation (what the GeLU then needs, and from which ranks, is the lab's to say);
# 2. **row-parallel** second layer: rank r keeps the r-th block of B's *rows* (h/t × d) and
#    multiplies its own hidden features by it. What that product is next to the layer's
#    output `Y = H·B` (H = GeLU(X·A), the hidden features), and what it costs to get Y on
#    every rank, is lab 11's part 2.
#    (And the biases, `+ b₁` and `+ b₂`? That is for you to decide in the lab too.)
#
# A and B are the paper's matrices, in its `X·A` convention. Whether torch's `nn.Linear`
# stores them as they are or otherwise, and so which dimension of each torch weight holds a
# rank's block, is the lab's to find out.

# %%
viz.show(viz.tp_shards_figure(16, 64, tp_ranks),
         f"The MLP of this section (d = 16, h = 64) on {tp_ranks} ranks, in Megatron's layout: "
         "each rank holds one colour — a block of A's columns, the same block of B's rows.")

# %% [markdown]
# Now the backward. Megatron puts the communication of both passes — which pass needs it,
# and what each rank holds whole or only in part on either side, is lab 11's part 2
# — into two operations, *f* (at the column layer's input) and *g* (at the row layer's
# output), each with a forward and a backward. (The paper calls them *conjugate*; what that
# word says about them is part of the lab's answer, so the folded reference answer below
# defines it.)
#
# Each is a `torch.autograd.Function`: a class with a static `forward(ctx, ...)` and a static
# `backward(ctx, grad)` that autograd calls with the gradient of the output and that returns
# the gradient of each input — so a collective can sit on either pass. The library's MLP is
# used like this, on every rank (`group=None`: every rank is in the tensor-parallel group):
#
# ```python
# plain = tensor_parallel.plain_mlp(d=16, h=64)           # the same weights on every rank
# tp_mlp = tensor_parallel.TensorParallelMLP(plain)       # keeps this rank's slices
# y = tp_mlp(x)                                           # == plain(x), on every rank
# ```
#
# ### Lab 11: write the column and row layers
# Open [lab11_tensor_parallel](../labs/lab11_tensor_parallel.ipynb) and write the two
# autograd operations and the two layers, then the MLP, on 2 and 3 ranks. Decide for each
# operation which pass communicates, and with which collective once the activations around
# the MLP are cut along the tokens; along which dimension each weight is cut, in torch's layout
# and in Keras's (each written down before the code runs); and where the biases go. The
# library's answer is folded below, and so is everything in the rest of this lesson that
# would give it away (how the check below compares the shards, the collectives of each
# pass, torch's placements, where torch puts f and g, sequence parallelism's collectives).

# %% [markdown]
# **▶ The reference answer — open after your lab passes**: f
# and g pass by pass, where the biases go, the library's code, and why one of the four methods
# may pass its gradient on untouched.
#
# <details><summary>▶ open</summary>
#
# - *f*, before the column layer: forward identity (every rank uses the same X); backward
#   all-reduce (∂L/∂X = Σ_r ∂L/∂Z_r·A_rᵀ).
# - *g*, after the row layer: forward all-reduce (Y = Σ_r Y_r); backward identity (the
#   gradient of Y arrives replicated).
# - torch weights: `nn.Linear(d, h)` stores A transposed, as an h × d weight (and B as a
#   d × h one); the first is cut along dim 0 (its rows are A's columns), with the same slice
#   of b₁; the second along dim 1 (its columns are B's rows).
# - b₂: whole on every rank, added once, after *g* (added before the sum it would count t
#   times).
# - The count, per MLP and micro-batch: one all-reduce in the forward (*g*'s); one in the
#   backward (*f*'s) only when the MLP's input needs a gradient — otherwise autograd never
#   runs *f*'s backward; and *g*'s once more if the forward is recomputed.
#
# </details>

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(tensor_parallel.CopyToTensorParallel, tensor_parallel.ReduceFromTensorParallel,
              tensor_parallel.copy_to_tensor_parallel, tensor_parallel.reduce_from_tensor_parallel,
              tensor_parallel.shard_bounds, tensor_parallel.ColumnParallelLinear,
              tensor_parallel.RowParallelLinear, tensor_parallel.TensorParallelMLP,
              folded="▶ The reference answer's code — open after your lab passes")

# %% [markdown]
# <details><summary>▶ open</summary>
#
# **Why Megatron calls *f* and *g* conjugate.** Each one's forward is the other's backward:
# *f* is the identity forward and an all-reduce backward, *g* an all-reduce forward and the
# identity backward (Shoeybi et al. 2019, §3, the caption of its Figure 3).
#
# **Why *g*'s backward may be the identity.** In general, the backward of a sum all-reduce
# is itself an all-reduce: if rank i's output Y feeds rank i's own loss term, the gradient
# of each Y_r is the sum over the ranks of theirs. Here everything after *g* runs identically
# on every rank — the same Y, the same bias, the same loss — so the gradient arriving at *g*
# is already the same everywhere (*replicated*), and each Y_r, which entered Y with weight 1,
# takes it as it is. Summing it once more would count it t times. torch's DTensor (below)
# writes the same rule with its *placements* — `Partial()`, a sum still to be done over the
# ranks, and `Replicate()`, the same whole tensor on every rank: in `_redistribute_backward`
# (`torch/distributed/tensor/_redistribute.py`) a gradient whose forward went from Partial to
# Replicate stays Replicate, not turned back into Partial.
#
# **The overlap Megatron-LM makes.** *f*'s all-reduce, in the backward, carries the input's
# gradient ∂L/∂X, which the column layer's weight gradient (∂L/∂A_r = Xᵀ·∂L/∂Z_r) does not
# need: Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication`
# (`megatron/core/tensor_parallel/layers.py`) starts that all-reduce asynchronously and
# computes the weight's gradient while it travels. `ColumnParallelLinear.__init__` turns it on
# (`allreduce_dgrad = world_size > 1 and not sequence_parallel and not disable_grad_reduce`)
# for every column layer, so in a transformer layer built from these layers both *f*'s can
# overlap — the QKV layer's and the MLP's first layer's. Built from these layers means
# `--transformer-impl local`: Megatron-LM's default, `transformer_engine`
# (`TransformerConfig.transformer_impl`), builds attention and MLP from Transformer Engine's
# linear layers instead, whose own overlap of these all-reduces this lesson did not read. With sequence parallelism
# the input gradient is reduce-scattered instead, asynchronously with the same weight
# gradient. *Can*: the overlap holds only if the GPU starts the all-reduce before the weight-gradient matmul, and
# Megatron-LM gets that order from the environment: `CUDA_DEVICE_MAX_CONNECTIONS=1`, which
# "forces the kernels to be scheduled in the order they are called". Its code says "Here we
# rely on CUDA_DEVICE_MAX_CONNECTIONS=1 to ensure that the all-reduce is scheduled before the
# weight gradient computation"; the docstring of
# `linear_with_grad_accumulation_and_async_allreduce` says its use "requires" the variable
# ("necessary for a speedup but not for correctness"), and the function warns when it is not
# 1. Without it the result is the same, and the overlap is not guaranteed. *g*'s all-reduce,
# in the forward, has no such companion: the next layer needs its sum.
#
# </details>

# %% [markdown]
# ### Checked, and counted
# On every rank the worker builds the plain MLP and ours from the same weights, runs one
# forward and backward on the same input, and compares. Then the same with torch:
# `parallelize_module` with `ColwiseParallel` for the first layer and `RowwiseParallel` for
# the second, on a one-dimensional `DeviceMesh` (the ranks arranged as a named grid; here a line). Every
# collective is recorded with `dpcourse.collectives.record_collectives` (its core: lesson 08,
# §5's fold); torch's also by
# its own counter, `CommDebugMode`. The worker's code names the dimension of every slice it
# compares — lab 11's part 3 — so it is folded:

# %%
viz.show_code(tensor_parallel.plain_mlp, tensor_parallel.TPConfig)

# %% [markdown]
# **▶ The worker that checks it, and what each rank holds — open after your lab passes**.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(tensor_parallel.slice_of, tensor_parallel.tensor_parallel_worker,
              folded="▶ The worker that checks it — open after your lab passes")

# %% [markdown]
# The two claims below compare whole tensors, so their lines can be read here, taken
# from its source: the plain MLP's and ours run on the same input, which asks for a
# gradient, and the worker returns the largest differences of the outputs and of the
# inputs' gradients:

# %%
import inspect
import textwrap


def excerpt(function, first, last):
    """The lines of ``function``'s source from the first that contains ``first`` to the next
    that contains ``last``, dedented."""
    lines = inspect.getsource(function).splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    stop = next(i for i in range(start, len(lines)) if last in lines[i])
    return textwrap.dedent("\n".join(lines[start:stop + 1]))


viz.show_code(excerpt(tensor_parallel.tensor_parallel_worker, "x_plain = cfg.inputs()",
                      "cfg.loss(y_ours).backward()"),
              excerpt(tensor_parallel.tensor_parallel_worker, '"out_diff":',
                      '"input_grad_diff":'))

# %%
cfg = tensor_parallel.TPConfig()
tp_runs = launch.spawn(tensor_parallel.tensor_parallel_worker, tp_ranks, cfg, backend="gloo",
                       timeout=120)
r0 = tp_runs[0]
claim(f"on {tp_ranks} ranks, our MLP's output == the plain MLP's (to 1e-6)",
      max(r["out_diff"] for r in tp_runs) < 1e-6)
claim("the gradient of the input == the plain MLP's (to 1e-6)",
      max(r["input_grad_diff"] for r in tp_runs) < 1e-6)

# %% [markdown]
# **▶ The gradients, checked with the worker's slices and joined across the ranks without
# them — open after your lab passes**. It proves that every
# parameter's gradient, on every rank, equals its part of the plain MLP's (to 1e-6); how each
# parameter is held is part of lab 11's answer.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
def put_together(pieces, full_shape):
    """The ranks' pieces joined along the one dimension where they are smaller than the full
    tensor; a piece that is whole on every rank is returned as it is."""
    cut = [d for d in range(len(full_shape)) if pieces[0].shape[d] != full_shape[d]]
    return torch.cat(pieces, dim=cut[0]) if cut else pieces[0]


joined = [put_together([r["grads"][i] for r in tp_runs], full.shape)
          for i, full in enumerate(r0["plain_grads"])]
with viz.folded_output("▶ The gradients, checked with the worker's slices and joined across "
                       "the ranks without them — open after your lab passes"):
    claim("the worker's own check, with its slices: every rank's weight and bias gradients == "
          "the same slice of the plain MLP's (to 1e-6)",
          max(r["grad_diff"] for r in tp_runs) < 1e-6)
    claim("checked here, without the worker's slices: each parameter's gradients, joined "
          "across the ranks where they are cut, == the plain MLP's whole gradient (to 1e-6), "
          "and a gradient that is not cut is the same on every rank",
          all(torch.allclose(j, full, atol=1e-6) for j, full in zip(joined, r0["plain_grads"]))
          and all(torch.allclose(r["grads"][i], r0["grads"][i], atol=1e-6)
                  for i, full in enumerate(r0["plain_grads"])
                  if r0["grads"][i].shape == full.shape for r in tp_runs))

# %% [markdown]
# **▶ The collectives of each pass, counted — open after your lab passes**. It proves, from
# the recorded calls, which collective each pass makes and over how many numbers; both are
# part of lab 11's answer.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
with viz.folded_output("▶ The collectives of each pass, counted — open after your lab passes"):
    print("forward:", r0["forward"], " backward:", r0["backward"], " (op, elements, bytes)")
    tp_answers.tp_passes(tp_runs, cfg)
viz.show_code(tp_answers.tp_passes, tp_answers.activation_all_reduce,
              folded="▶ code: the claim — open after your lab passes")

# %% [markdown]
# <details><summary>▶ Tensor parallelism's messages weighed against data parallelism's, here
# and in GPT-3's MLP (their size is lab 11's answer again) — open after your lab
# passes</summary>
#
# DDP all-reduces the MLP's *gradients*, Ψ = 2dh + h + d numbers,
# once per step (with `no_sync()` over the micro-batches; by default torch DDP all-reduces
# after every backward); each of tensor parallelism's messages is over *activations*, tokens × d
# numbers, and they come back with every micro-batch. One
# grows with the model, the other with the tokens: the folded cell below.
#
# </details>

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
with viz.folded_output("▶ Tensor parallelism's messages weighed against data parallelism's, "
                       "here and in GPT-3's MLP — open after your lab passes"):
    tp_answers.tp_messages_weighed(cfg, gpt3)
viz.show_code(tp_answers.tp_messages_weighed,
              folded="▶ code: the claim — open after your lab passes")

# %% [markdown]
# A real step holds many sequences. Section 5's published run splits its batch over D
# data-parallel replicas, each of them a *pipeline* (the model cut into consecutive stages,
# section 3) fed its share of the batch in *micro-batches*, slices that follow each other
# through the stages:

# %%
pub1 = planner.MEGATRON_TABLE1_145B
m_pub = pub1["global_batch"] // pub1["dp"]
print(f"section 5's published run: {pub1['global_batch']} sequences per step over "
      f"D = {pub1['dp']} data-parallel replicas = {m_pub} micro-batches of one sequence each "
      "(the planner's micro-batch; the paper's table gives none), per replica and step")

# %% [markdown]
# What those micro-batches do to the bytes is in the fold "Tensor parallelism's messages
# weighed against data parallelism's" above (lab 11's answer). In short, tensor
# parallelism communicates inside every layer of every micro-batch; data parallelism once
# per step, and it can overlap the backward (lesson 07).
# Which of tensor parallelism's messages wait on the critical path, the fold below says;
# those hide only with communication–matmul overlap, which
# pipelines a collective with the matmul that uses it, piece by piece: Megatron-Core's
# `tp_comm_overlap` and torch's async tensor parallelism, both off by default and both only
# in sequence parallelism's layout (the end of this section). So Megatron-LM keeps t ≤ the
# GPUs of one node, on NVLink.
#
# **▶ Which of them sit on the critical path, which Megatron-LM hides, and what torch's async
# tensor parallelism fuses — open after your lab passes**: where
# each sits is lab 11's answer again.

# %% [markdown]
# <details><summary>▶ open</summary>
#
# Tensor parallelism's collectives sit **on the critical path**: the tensor-parallel
# all-reduces sit between one matmul and the next, which waits for the sum — four times per
# transformer layer and micro-batch (attention and MLP each have an *f* and a *g*) — and
# each rank's matmuls shrink by t. Not all of them, though: Megatron-LM hides two of a
# layer's four, those of its two *f*'s, when it builds the layer from its own layers
# (`--transformer-impl local`; its default, `transformer_engine`, uses Transformer Engine's
# linear layers, whose overlap of these all-reduces is not read here) — attention's QKV layer and the MLP's first layer are
# both column-parallel, and every `ColumnParallelLinear` overlaps its all-reduce with a
# matmul that does not need its result, when the run sets `CUDA_DEVICE_MAX_CONNECTIONS=1`
# (which matmul, why it can, and why the variable, is in the reference answer folded after lab
# 11's pointer); with sequence parallelism the reduce-scatters that replace them overlap the
# same way, under the same condition. In torch, *f* here sends nothing in the forward
# (its input is already `Replicate()`, the layout `ColwiseParallel` wants), and its backward
# all-reduce runs synchronously inside `_FromTorchTensor.backward`
# (`redistribute_local_tensor`, `async_op=False`); *g*'s forward redistribution, and
# `ColwiseParallel`'s input redistribution when the layouts differ (sequence parallelism),
# pass `async_op=True`, but in eager mode that returns an `AsyncCollectiveTensor`, which
# waits for the collective before its first use — the very next operation. So nothing
# overlaps there either (the folded cell below reads those lines). torch's
# *async tensor parallelism*
# (`torch._inductor.config._micro_pipeline_tp`, compiled models only) cuts a collective and
# its matmul into pieces that overlap, but it matches only an all-gather feeding a matmul
# and a matmul feeding a reduce-scatter (`fused_all_gather_matmul`,
# `fused_matmul_reduce_scatter`): the layout of *sequence parallelism* (Korthikanti et al.),
# where each of the all-reduces here becomes an all-gather and a reduce-scatter around the
# layer norms and dropouts; the plain all-reduces of this MLP are not matched. Megatron-Core's
# `tp_comm_overlap` does the same for that layout, in Transformer Engine's layers
# (`megatron/core/extensions/transformer_engine.py`): it pipelines each all-gather with the
# matmul that uses it and each reduce-scatter with the matmul that feeds it. Without either,
# the sums that a matmul waits for stay in the way, and they pay only on very fast links:
# NVLink inside a node, not the network between nodes.
#
# </details>

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
with viz.folded_output("▶ Where torch's f and g redistribute, read in its source — open after "
                       "your lab passes"):
    tp_answers.torch_tp_redistributions()
viz.show_code(tp_answers.torch_tp_redistributions,
              folded="▶ code: the claims — open after your lab passes")

# %% [markdown]
# ### torch's version: `parallelize_module` and DTensor
# torch writes the same plan as a dictionary from submodule names to *styles*; the
# parameters become **DTensors**, tensors that know their *placement* on the mesh:
# `Shard(dim)` (cut along dim), `Replicate()` (whole on every rank), or `Partial()` (a sum
# still to be done):

# %%
viz.show_code("""\
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

mesh = init_device_mesh("cpu", (world_size,))
model = parallelize_module(plain_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
""")

# %% [markdown]
# **▶ torch's results beside ours** — click the folded cell below: torch's output, input
# gradient and every shard's gradient equal ours (to 1e-6).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
with viz.folded_output("▶ torch's results beside ours"):
    claim("torch's output, input gradient and every shard's gradients == ours (to 1e-6)",
          max(max(r["torch_out_diff"], r["torch_input_grad_diff"], r["torch_grad_diff"])
              for r in tp_runs) < 1e-6)

# %% [markdown]
# **▶ Its collectives beside ours — open after your lab passes**: torch sends the same
# collectives as ours, with the same sizes (its own `CommDebugMode` and our recorder agree);
# its counts, pass by pass, are lab 11's answer again.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
with viz.folded_output("▶ torch's collectives beside ours — open after your lab passes"):
    print("CommDebugMode, after the forward:", r0["torch_forward_counts"],
          "; after the backward:", r0["torch_counts"])
    print("recorded:", r0["torch_recorded"])
    tp_answers.torch_sends_what_we_send(tp_runs, cfg)
viz.show_code(tp_answers.torch_sends_what_we_send, tp_answers.activation_all_reduce,
              folded="▶ code: the claim — open after your lab passes")

# %% [markdown]
# **▶ What each rank holds, torch's placements, and where torch puts *f* and *g* (the lab's
# answer again) — open after your lab passes**. It proves
# which dimension torch cuts each weight and bias along, from its own placements.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
import inspect

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

with viz.folded_output("▶ What each rank holds, and torch's placements (the lab's answer "
                       "again) — open after your lab passes"):
    print("plain:", r0["plain_shapes"])
    print("ours, rank 0:", r0["ours_shapes"])
    for name, kind, full, local, placement in r0["torch_params"]:
        print(f"{name:>9}: {kind}, full {full}, rank 0 holds {local}, placement {placement}")
    tp_answers.torch_placements(r0)
viz.show_code(tp_answers.torch_placements, folded="▶ code: the claim — open after your lab passes")
viz.show_code(inspect.getsource(ColwiseParallel._prepare_input_fn) + "\n"
              + inspect.getsource(RowwiseParallel._prepare_output_fn),
              folded="▶ Where torch puts f and g — open after your lab passes")

# %% [markdown]
# <details><summary>▶ open</summary>
#
# Where torch does it. Its *f* is `ColwiseParallel`'s input hook: the plain input becomes a
# DTensor with `DTensor.from_local(..., Replicate())`, and `from_local`'s backward
# (`_FromTorchTensor.backward`, `torch/distributed/tensor/_api.py`) redistributes the
# gradient to the input's placement, Replicate — the gradient of X comes out of the sharded
# matmul as Partial, so that redistribution is the all-reduce. Its *g* is `RowwiseParallel`'s
# output hook, Partial → Replicate, in the forward (both hooks shown above).
#
# </details>

# %% [markdown]
# ### Sequence parallelism: the activations outside the MLP, cut along the tokens
# Outside the MLP — the layer norms, the dropouts — the tokens × d activation sits whole on
# every tensor-parallel rank (section 1's undivided 10·s·b·d). Korthikanti et al.'s
# *sequence parallelism* gives each rank only its share of the tokens there. torch writes it
# as the same plan with two layouts named, the input and the output sharded along the
# tokens, `Shard(0)`; each rank's loss is its tokens' share of the plain MLP's, so that the
# ranks' losses add up to it. Which collective each pass then makes follows from lab 11's
# first answer, so the run and its count are folded.
#
# Section 1's sequence-parallel count, everything divided by t, is Megatron-LM's: its layers
# keep only a rank's share even of the matmuls' inputs, at the price of more communication
# in the backward. torch's layout stores more (the folded run measures it); section 5's
# planner prices neither, running without sequence parallelism.

# %% [markdown]
# **▶ Sequence parallelism run, checked and its collectives counted — open after your lab
# passes**. It proves that torch's sequence-parallel MLP equals
# the plain MLP on each rank's tokens (output, dL/dx and every gradient, to 1e-6), that its
# collectives send the bytes section 2's do, and what the column layer saves of its input
# (the fold says what that means for section 1's /t); which collectives they are is lab
# 11's answer.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(tensor_parallel.sequence_parallel_worker,
              folded="▶ The sequence-parallel worker — open after your lab passes")
sp_runs = launch.spawn(tensor_parallel.sequence_parallel_worker, tp_ranks, cfg, backend="gloo",
                       timeout=120)
with viz.folded_output("▶ Sequence parallelism run, checked and its collectives counted "
                       "— open after your lab passes"):
    print("forward:", sp_runs[0]["forward"], " backward:", sp_runs[0]["backward"],
          " (op, elements in, bytes in)")
    tp_answers.sp_collectives(sp_runs, cfg, tp_ranks)
viz.show_code(tp_answers.sp_collectives, folded="▶ code: the claims — open after your lab passes")

# %% [markdown]
# <details><summary>▶ open</summary>
#
# Entering the MLP the token shares are all-gathered (*f*'s forward, which now has something
# to do: X is no longer whole on every rank), and leaving it the partial outputs are
# reduce-scattered back to the shares (*g*'s forward); the backward mirrors both. The
# all-gather and the reduce-scatter are the two halves of one ring all-reduce, so the bytes
# torch's layout sends are section 2's. Its memory is not Megatron-LM's: the claim above
# shows the column layer saving the all-gathered input, all the tokens, so that input is not
# divided by t. Megatron-LM's column layer (`LinearWithGradAccumulationAndAsyncCommunication`)
# saves only the rank's share (`ctx.save_for_backward(input, weight)` before its all-gather)
# and all-gathers it once more in the backward for the weight gradient: a third collective
# per column layer and backward, traded for the /t that section 1's 34·s·b·d/t assumes.
#
# </details>

# %% [markdown]
# ## 3. Pipeline parallelism: stages, micro-batches, the bubble
# Tensor parallelism cuts every layer; **pipeline parallelism** cuts the model into K
# **stages** of consecutive layers, one per rank, and
# passes activations forward (`send`/`recv`, lesson 06) and their gradients backward. With one batch only one stage
# works at a time, so the batch is cut into M **micro-batches** that follow each other
# through the stages (GPipe, Huang et al. 2019); each stage *accumulates* the M micro-batches'
# gradients, which must come out as the whole batch's. Stages
# still sit idle while the pipeline fills and drains: with equal stage times a step lasts
# M + K − 1 slots of which each stage works M, an idle share — the **bubble** — of (K − 1)/(M + K − 1).
# (Megatron-LM and the Ultra-Scale Playbook quote the idle time over the work instead,
# (K − 1)/M: the **idle-to-work ratio**, which section 5 prints beside the bubble.)
#
# **▶ How the M micro-batches' gradients become the whole batch's — open after lab 11's
# stretch passes**.

# %% [markdown]
# <details><summary>▶ open</summary>
#
# Their sum is the gradient of the whole batch's mean loss once each micro-batch's mean loss
# is divided by M, with micro-batches of equal size (or once the loss is a sum over the
# examples): the division of gradient accumulation, lesson 04 §7's `/ accum`. torch's
# schedules divide the summed gradients by M instead, once the step's backwards are done
# (`scale_grads=True`, their default: `perform_reduce_grad` calls `scale_grads`,
# `pipelining/stage.py`), for a loss that is each micro-batch's mean.
#
# </details>

# %% [markdown]
# The schedules in `dpcourse.pipeline_parallel` list each stage's actions, F i
# (forward of micro-batch i) and B i (backward). **GPipe** runs every forward, then every
# backward. **1F1B** (one forward, one backward: PipeDream, Narayanan et al., SOSP 2019)
# starts the backwards as early as possible: the same actions and — with
# equal stage times and free messages — the same bubble, but stage k holds at most
# min(K − k, M) micro-batches' activations instead of M. Its synchronous, flushed form,
# *PipeDream-Flush* (Narayanan et al., ICML 2021), is the schedule Megatron-LM runs without
# virtual stages; with v of them per rank, the interleaved schedule (Narayanan et al., SC
# 2021, §2.2.2) cuts the idle-to-work ratio from (K − 1)/M to (K − 1)/(v·M). Stages are numbered from 0 here,
# k = 0, …, K − 1, as ranks are: the first stage holds min(K, M). The papers number them from
# 1 (stage i = k + 1), so there the same bound reads min(K − i + 1, M).

# %%
viz.show_code(pipeline_parallel.gpipe_schedule, pipeline_parallel.one_f_one_b_schedule,
              pipeline_parallel.ideal_bubble, pipeline_parallel.messages_per_step)

# %% [markdown]
# Try it: stages × micro-batches → the bubble, from the schedule played with fixed times
# (forward 1, backward 2, no communication) by `simulate_timeline`, which also draws the
# "ideal" halves of the Gantt charts below:

# %%
viz.show_code(pipeline_parallel.simulate_timeline)

# %%
bubble_explorer = viz.explorer(
    viz.bubble_figure, {"stages": (stages, 2, 8), "micro_batches": (4, 1, 16)},
    caption="the ideal GPipe step: the idle share (K−1)/(M+K−1) shrinks as micro-batches are "
            "added, and grows with every stage.",
    description="pipeline bubble explorer (stages, micro-batches)")

# %% [markdown]
# Now for real, on 4 ranks. Each stage runs its schedule with `run_stage`, and a measured
# timeline's bubble is `measured_bubble`'s idle share of it: both folded below, since the
# lab's stretch asks you to write one GPipe step and to measure its bubble. Our CPU ranks
# would fight over the machine's cores, so each forward also sleeps `delay_s` (each backward twice that): a stand-in for an
# accelerator, which computes without taking a CPU core. The sleep makes each action long
# against its CPU work, but that work still shares the cores, so on a loaded machine some
# actions stretch and some ranks stall. Every (schedule, M) runs in one
# launch and is compared with the unsplit model on the whole batch — the model, its cut into
# stages, the data and the reference:

# %%
viz.show_code(pipeline_parallel.make_mlp, pipeline_parallel.split_stages,
              pipeline_parallel.micro_batches, pipeline_parallel.sample_batch, pipeline_parallel.mse_loss,
              pipeline_parallel.reference_step)

# %% [markdown]
# **▶ One stage's loop, its launcher and the measured bubble — open after lab 11's stretch
# passes**.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(pipeline_parallel.run_stage, pipeline_parallel.pipeline_worker,
              pipeline_parallel.run_pipeline, pipeline_parallel.measured_bubble,
              folded="▶ One stage's loop, its launcher and the measured bubble — open after "
                     "lab 11's stretch passes")

# %% [markdown]
# The two claims below rest on these lines, read from the source: `pipeline_worker` counts
# its rank's sends during the step, and `run_pipeline` compares every stage's gradients and
# the last stage's loss with `reference_step`'s on the whole batch:

# %%
viz.show_code(excerpt(pipeline_parallel.pipeline_worker, "with record_collectives() as calls",
                      "loss_fn=mse_loss"),
              excerpt(pipeline_parallel.pipeline_worker, '"messages": len(', '"messages"'),
              excerpt(pipeline_parallel.run_pipeline, "ref_loss, ref_grads = reference_step",
                      "and abs(loss - ref_loss)"),
              excerpt(pipeline_parallel.run_pipeline, "messages=sum(", "messages=sum("))

# %%
pipe = pipeline_parallel.run_pipeline(stages, micro, ("gpipe", "1f1b"), delay_s=delay_s,
                                      repeats=1, timeout=120)
claim(f"every pipeline run ({stages} stages, GPipe and 1F1B, M in {micro}): loss and gradients "
      f"== the unsplit model's on the whole batch (rtol {pipeline_parallel.RTOL}, atol "
      f"{pipeline_parallel.ATOL})", all(r.equal for r in pipe))
claim("each step sent 2·M·(K−1) messages: an activation forward and a gradient back per "
      "micro-batch and boundary",
      all(r.messages == pipeline_parallel.messages_per_step(stages, r.m) for r in pipe))

# %%
# NBVAL_IGNORE_OUTPUT
# Why: measured idle shares, which vary from run to run.
for r in pipe:
    print(f"{r.schedule:>5} M={r.m}: measured bubble {r.bubble:.2f}, ideal {r.ideal:.2f}")

# %%
gpipe = {r.m: r for r in pipe if r.schedule == "gpipe"}
claim("the measured bubble is never below the ideal (by more than 0.03), and falls as M grows "
      f"from {micro[0]} to {micro[-1]}",
      all(r.bubble > r.ideal - 0.03 for r in pipe)
      and gpipe[micro[-1]].bubble < gpipe[micro[0]].bubble - 0.2)
played = {(name, m): pipeline_parallel.measured_bubble(
    pipeline_parallel.simulate_timeline(stages, m, name)) for name in ("gpipe", "1f1b")
    for m in micro}
claim(f"played with fixed times and free messages, GPipe and 1F1B have the same bubble, "
      f"(K−1)/(M+K−1), for every M in {micro} ({stages} stages)",
      all(math.isclose(played[("gpipe", m)], played[("1f1b", m)])
          and math.isclose(played[("gpipe", m)], pipeline_parallel.ideal_bubble(stages, m))
          for m in micro))

# %% [markdown]
# Measured, the two need not agree (the excess of each over the ideal is printed below).
# What a measurement adds to the ideal is idle time the schedule does not contain: a stage
# waiting for its neighbour's message, Python and `isend` between two actions, a rank
# stalled while the others hold the cores. The two
# orders meet those waits at different moments (GPipe's last stage receives M activations in
# a row, then sends M gradients in a row; 1F1B interleaves them), so their excess differs
# from run to run and from machine to machine; only the ideal bubble is a property of the
# schedule.

# %%
# NBVAL_IGNORE_OUTPUT
# Why: measured idle shares, which vary from run to run.
for m in micro:
    g, o = gpipe[m], next(r for r in pipe if r.schedule == "1f1b" and r.m == m)
    print(f"M={m}: ideal {g.ideal:.2f}; measured excess over it: GPipe "
          f"{g.bubble - g.ideal:+.2f}, 1F1B {o.bubble - o.ideal:+.2f}")

# %%
# NBVAL_IGNORE_OUTPUT
# Why: the top chart and the caption are this run's measured timeline.
m_show = micro[-1]
run = gpipe[m_show]
f0 = sorted((a, b) for k, kind, i, a, b in run.events if k == 0 and kind == "F")
gaps_ms = 1e3 * sum(f0[i + 1][0] - f0[i][1] for i in range(len(f0) - 1))
bl = sorted((a, b) for k, kind, i, a, b in run.events if k == stages - 1 and kind == "B")
gaps_last_ms = 1e3 * sum(bl[i + 1][0] - bl[i][1] for i in range(len(bl) - 1))
stretch = max((b - a) / (delay_s * (1 if kind == "F" else 2)) for _, kind, _, a, b in run.events)
span_ms = 1e3 * (max(e[4] for e in run.events) - min(e[3] for e in run.events))
viz.show(viz.pipeline_gantt_figure(
    run.events, pipeline_parallel.simulate_timeline(stages, m_show, "gpipe"), stages,
    m_show, run.bubble, run.ideal),
    f"GPipe, {stages} stages, {m_show} micro-batches: measured (top) and ideal (bottom). The "
    f"fill and drain triangles are the bubble — {run.bubble:.0%} measured against "
    f"{run.ideal:.0%} ideal. Stage 0 receives nothing before its forwards, the last stage "
    f"nothing before its backwards, yet they lose {gaps_ms:.1f} and {gaps_last_ms:.1f} ms "
    f"between those actions, of a {span_ms:.0f}-ms step: Python, isend, and stalls while {stages} ranks "
    f"share the cores (the slowest action took {stretch:.1f}× its sleep). Only the other "
    f"gaps can also be a wait for a neighbour's message.")

# %% [markdown]
# 1F1B's point is memory. In its Gantt chart the backwards start as soon as the last stage
# has a micro-batch's loss, and each stage then alternates one forward and one backward:

# %%
# NBVAL_IGNORE_OUTPUT
# Why: the top chart and the caption are this run's measured timeline.
ofob = {r.m: r for r in pipe if r.schedule == "1f1b"}
viz.show(viz.pipeline_gantt_figure(
    ofob[m_show].events, pipeline_parallel.simulate_timeline(stages, m_show, "1f1b"), stages,
    m_show, ofob[m_show].bubble, ofob[m_show].ideal, schedule="1F1B"),
    f"1F1B, {stages} stages, {m_show} micro-batches: the same actions as GPipe in another "
    f"order, the same ideal bubble ({ofob[m_show].ideal:.0%}; {ofob[m_show].bubble:.0%} "
    f"measured), but stage 0 never holds more than {stages} micro-batches between their forward "
    "and backward.")

# %% [markdown]
# Counted while running, the most micro-batches whose activations each stage held at once,
# and the bytes autograd saved for them at that moment. `run_stage` wraps each forward in
# `saved_tensors_hooks` with this pack hook — not section 1's: this one counts each saved
# tensor once by its start address, its own elements (a Linear saves its input, which is the
# activation before it saved too: one address; two views starting at different places in one
# storage would each count their own elements) and leaves the weights' storages out, so it counts a micro-batch's activations and nothing else. The last
# stage also keeps its loss's inputs, so it holds more per micro-batch. Below it, the lines
# of `run_stage` that count, read from its source: `held` has one entry per micro-batch
# between its forward and its backward, its saved bytes last (`h[2]`; the rest is in the
# folded `run_stage` above), and after each forward the peaks are updated.

# %%
import inspect

viz.show_code(pipeline_parallel.saved_bytes_counter)
counting = [line[12:] for line in inspect.getsource(pipeline_parallel.run_stage).splitlines()
            if any(key in line for key in ("record.peak", "sum(h[2]"))]
viz.show_code("\n".join(counting))

# %%
print(f"M = {m_show}: GPipe holds {gpipe[m_show].peak_in_flight}, "
      f"1F1B {ofob[m_show].peak_in_flight} micro-batches per stage")
print(f"bytes saved at the peak: GPipe {gpipe[m_show].peak_activation_bytes}, "
      f"1F1B {ofob[m_show].peak_activation_bytes}")
claim(f"for every M in {micro}, GPipe holds all M micro-batches on every stage; 1F1B holds "
      f"min(K − k, M) on stage k (K − k at M = {m_show})",
      all(gpipe[m].peak_in_flight == [m] * stages
          and ofob[m].peak_in_flight == [min(stages - k, m) for k in range(stages)]
          for m in micro))
claim(f"and the bytes follow: on stage k 1F1B keeps min(K − k, M)/M of GPipe's activation bytes "
      f"(M = {m_show}, stage 0: {ofob[m_show].peak_activation_bytes[0]} against "
      f"{gpipe[m_show].peak_activation_bytes[0]})",
      all(ofob[m].peak_activation_bytes[k] * m
          == gpipe[m].peak_activation_bytes[k] * min(stages - k, m)
          for m in micro for k in range(stages)))

# %% [markdown]
# torch has the same thing, `torch.distributed.pipelining`: a `PipelineStage` around each
# rank's module and a schedule (`ScheduleGPipe`, `Schedule1F1B`, and interleaved ones) that
# runs it. On the same model, batch and schedule (one launch each):

# %%
viz.show_code(pipeline_parallel.torch_pipelining_worker,
              pipeline_parallel.compare_with_torch_pipelining,
              folded="▶ torch's pipeline worker and the comparison (no lab answer: open "
                     "any time)")

# %% [markdown]
# The message claim below rests on these lines of torch's worker: it runs two steps and
# records each one's sends; a step's messages are the second's, the setup's what the first
# adds:

# %%
viz.show_code(excerpt(pipeline_parallel.torch_pipelining_worker, "sends = []",
                      '"setup_messages"'))

# %%
versus = pipeline_parallel.compare_with_torch_pipelining(stages, m_show, "1f1b", timeout=120)
claim(f"torch's Schedule1F1B ({stages} stages, M = {m_show}): gradients == ours and the "
      "unsplit model's (to 1e-6)",
      versus["torch_vs_ours"] < 1e-6 and versus["torch_vs_reference"] < 1e-6)
print(f"point-to-point sends per step: torch {versus['torch_messages']} "
      f"({versus['torch_message_bytes']} bytes), ours {versus['our_messages']} "
      f"({versus['our_message_bytes']} bytes); torch's first step adds "
      f"{versus['torch_setup_messages']} to set its stages up")
claim("a step of torch's sends what ours sends; only its first step adds setup messages "
      "(which, read in stage.py: Sources)",
      versus["torch_messages"] == versus["our_messages"]
      and versus["torch_message_bytes"] == versus["our_message_bytes"]
      and versus["torch_setup_messages"] > 0)

# %% [markdown]
# <details><summary>▶ how the sends are counted (the recorder's side)</summary>
#
# One consequence matters for the counts above: inside `record_collectives`, torch's
# pipelining sends every batch through `dist.batch_isend_irecv`, which the recorder counts
# as one send or receive per op — the count torch's op-by-op path makes.
#
# How the recorder gets there: torch's schedules hand each batch of sends and receives to
# `_batch_p2p` (`pipelining/schedules.py`), which calls each op itself when all of a batch's
# ops are `dist.isend` (or all `dist.irecv`), and `dist.batch_isend_irecv` otherwise. Inside
# `record_collectives` (lesson 07), `dist.isend` and `dist.irecv` are the recorder's
# wrappers, which torch's own `P2POp` refuses (its `__new__` accepts torch's `isend` and
# `irecv` only). So the recorder also puts `p2pop_unwrapping`'s subclass in the place of
# `dist.P2POp`: handed the recorder's `dist.isend`, it stores the real one. That is why the
# test in `_batch_p2p` never holds inside the block: every batch reaches the recorder's
# `batch_isend_irecv`, `Recorder.wrap_batch`'s function, which records one send or receive
# per `P2POp`.
#
# The folded cell below reads and runs both, with `_real` (the op under the wrappers) and
# lesson 10's `Recorder.run`, on a one-rank process group; a `before` hook refuses the batch
# once both of its ops are recorded, so nothing is sent. Its claim is folded under it.
#
# </details>

# %% jupyter={"source_hidden": true}
import torch.distributed as dist
from torch.distributed.pipelining import schedules

from dpcourse import collectives

viz.show_code(collectives.p2pop_unwrapping, inspect.getsource(collectives._real),
              collectives.Recorder.wrap_batch, collectives.Recorder.run,
              folded="▶ The recorder's P2POp stand-in, wrap_batch, _real and Recorder.run")


class Refused(Exception):
    """Raised by the hook below, so that the batch is recorded but never sent."""


def refuse_the_receive(call):
    if call.op == "recv":
        raise Refused


batch_p2p = inspect.getsource(schedules._batch_p2p)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    with collectives.record_collectives(before=refuse_the_receive) as batch:
        ops = [dist.P2POp(dist.isend, torch.zeros(3), 0), dist.P2POp(dist.irecv, torch.zeros(3), 0)]
        holds_real = all(op.op is not wrapped and op.op is wrapped._recording_of
                         for op, wrapped in zip(ops, (dist.isend, dist.irecv)))
        try:
            dist.batch_isend_irecv(ops)
        except Refused:
            pass
finally:
    dist.destroy_process_group()
with viz.folded_output("▶ what the recorder recorded, and the claim"):
    print("recorded:", [(c.function, c.op, c.nbytes, c.out_nbytes) for c in batch])
    claim("torch's _batch_p2p calls the ops itself only when every one is dist.isend (or every "
          "one dist.irecv), else dist.batch_isend_irecv; inside record_collectives a P2POp holds "
          "torch's real isend and irecv, not the recorder's dist.isend and dist.irecv, and the "
          "recorder's batch_isend_irecv records a batch of two P2POps as one send and one "
          "receive",
          "op_types == {dist.isend}" in batch_p2p and "op_types == {dist.irecv}" in batch_p2p
          and "return dist.batch_isend_irecv(p2p_ops)" in batch_p2p and holds_real
          and [(c.function, c.op) for c in batch] == [("batch_isend_irecv", "send"),
                                                      ("batch_isend_irecv", "recv")])

# %% [markdown]
# ## 4. Composing them: a 2-D mesh
# Real runs combine tensor parallelism inside a group of GPUs with data parallelism across
# the groups. A `DeviceMesh` names the ranks as a grid: 4 ranks as 2 × 2, dimension `dp`
# down, `tp` across. Each row is one tensor-parallel MLP, fed its half of every batch; each
# column is a data-parallel group, the ranks that shard and reduce-scatter one weight shard
# together (FSDP2's `fully_shard` over `dp`: lesson 08's ZeRO-3), so a row holds half of
# every weight, not a replica. `mesh["tp"]` is the one-dimensional mesh of this rank's row,
# `mesh["tp"].get_group()` its process group.
#
# The worker trains two versions for a few Adam steps next to one device on the whole
# batch: ours (`TensorParallelMLP` on the row's group, then `fully_shard` on the column) and
# torch's (`parallelize_module` on `mesh["tp"]`, then `fully_shard` on `mesh["dp"]`). A
# `before` hook of the recorder notes which group each call uses. Ours is then compared with
# the one device, shard by shard, against the slice that torch's placement of the same
# parameter on `tp` names.

# %%
viz.show_code(tensor_parallel.mesh_2d_worker)

# %%
mesh_runs = launch.spawn(tensor_parallel.mesh_2d_worker, 4, cfg, backend="gloo", timeout=120)
claim(f"ours on the 2 × 2 mesh == one device on the whole batch after {cfg.steps} Adam steps, "
      "every rank's shards (to 1e-6)", max(r["ours_diff"] for r in mesh_runs) < 1e-6)
claim(f"torch's (parallelize_module + fully_shard) == one device after {cfg.steps} steps "
      "(to 1e-6)", max(r["torch_diff"] for r in mesh_runs) < 1e-6)

# %% [markdown]
# **▶ What each rank holds on the mesh (its shapes show section 2's answer) — open after your
# lab passes**.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show(viz.mesh_2d_figure(mesh_runs, cfg.d, cfg.h),
         "Read a row of the mesh, then a column: the two ranks of a row hold different blocks "
         "of each weight and all-reduce activations with each other (tp group); the two "
         "ranks of a column hold the same block and split it in half between steps, so they "
         "all-gather it and reduce-scatter its gradient (dp group). Bytes: the last step's, "
         "on each rank.",
         folded="▶ What each rank holds on the mesh (its shapes show section 2's answer) — "
                "open after your lab passes")

# %% [markdown]
# **▶ One step's traffic on the mesh, each collective counted and explained — open after your
# lab passes**.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
with viz.folded_output("▶ One step's traffic on the mesh, each collective counted and "
                       "explained — open after your lab passes"):
    tp_answers.mesh_traffic(mesh_runs, cfg)
viz.show_code(tp_answers.mesh_traffic, folded="▶ code: the claim — open after your lab passes")

# %% [markdown]
# <details><summary>▶ open</summary>
#
# Two counts differ from section 2's and lesson 08's, and both are right. Only **one**
# tensor-parallel all-reduce: the MLP is the first layer here and its input is data, which
# needs no gradient, so autograd never runs *f*'s backward (lab 11's part 6). Only
# **one** all-gather: the MLP is FSDP2's *root*, which keeps its weights gathered between
# forward and backward (lesson 08, section 6). torch's DTensors carry both dimensions at once.
#
# </details>

# %% [markdown]
# **▶ torch's placements on the mesh (they show section 2's answer) — open after your lab
# passes**.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
with viz.folded_output("▶ torch's placements on the mesh (they show section 2's answer) — "
                       "open after your lab passes"):
    for name, placement in mesh_runs[0]["torch_placements"].items():
        print(f"{name:>9}: {placement}")

# %% [markdown]
# <details><summary>▶ open</summary>
#
# `Shard(dim=1)` on `tp` for the second weight, as in section 2; on `dp`, FSDP2 cuts dim 0
# once more. For the first weight both dimensions cut dim 0: `_StridedShard(dim=0, sf=2)`
# records that the `dp` cut applies to each `tp` slice (interleaved rows), not to the
# whole.
#
# </details>

# %% [markdown]
# ## 5. A planner
# Which sizes, then, for a real model on a real cluster? `dpcourse.planner` tries every
# tensor size t dividing a node's GPUs (no tensor-parallel group straddles two nodes), every
# number of stages p dividing the layers, and DDP,
# ZeRO-1 and ZeRO-3, with D = GPUs / (t·p) data-parallel replicas.
# For each it computes per GPU the model state, the
# activations, each dimension's messages and bytes per step, and a step time: compute at an
# assumed half of the peak,
# stretched by the pipeline's fill and drain, plus every byte at its link's speed, nothing
# overlapped. An estimate for ranking, not a prediction or a bound (the published row below
# ran at 47 % of peak). Its assumptions:
#
# | assumption | effect on the ranking | where checked |
# |---|---|---|
# | 16 bytes per parameter over Ψ/(t·p) (lesson 08: 2 + 2 + 12, 16-bit gradients) | Megatron-LM's `--bf16` keeps fp32 gradients (2 + 4 + 12 = 18 bytes, twice the bytes on the wire), its `--fp16` adds a 4-byte fp32 gradient copy (2 + 2 + 4 + 12 = 20): with either the fastest row no longer fits | re-ranked after the ranking, below (`grad_bytes=4`; `optimizer_bytes=16`) |
# | activations: layers recomputed, 1F1B's first stage holds min(p, M) micro-batches, no sequence parallelism (newer than the 2021 runs) | each of the t ranks keeps a layer's whole input | ranking cell's claim |
# | DDP all-reduces once per step (`no_sync()`, 25 MiB buckets); ZeRO-3 gathers and reduce-scatters every micro-batch, as FSDP2's defaults (torch's pipeline stages defer resharding and sync to the last micro-batch, `stage.py`: unpriced) | favours DDP by construction | ranking cell (DP msgs) |
# | ranks numbered tensor, pipeline, data (`order="tp-pp-dp"`); a dimension whose groups cross a node anywhere is priced at the network's speed | sets the links each dimension uses (Megatron-LM numbers data before pipeline) | after the ranking |
# | a pipeline message carries a full activation per GPU | the paper's scatter-gather sends 1/t | ranking cell (PP GB ÷ t) |
# | ties: fewer messages first, then less memory | stands for a latency left out | the tie, below |
# | 80 GB (10⁹ bytes) planned: the A100's 85.9 GB less CUDA context, NCCL buffers, fragmentation | rows needing between 80 and 85.9 GB are dropped | the cluster, printed below |

# %%
viz.show_code(planner.Cluster, planner.within_nodes, planner.plan)

# %% [markdown]
# **▶ `planner.plan_row`: how each row is priced, as described above** — click the folded
# cell below.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(planner.plan_row, planner.activation_message_bytes,
              folded="▶ planner.plan_row: how each row is priced")

# %% [markdown]
# **▶ `planner.tp_traffic`**, where `plan_row` gets its tensor-parallel messages: it prices lab
# 11's answer, so open it after your lab passes.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(planner.tp_traffic, folded="▶ planner.tp_traffic — open after your lab passes")

# %% [markdown]
# **▶ `planner.TP_MESSAGES_PER_LAYER`, the tensor-parallel messages `plan_row` counts, held
# against section 2's MLP — open after your lab passes**.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
with viz.folded_output("▶ planner.TP_MESSAGES_PER_LAYER, the tensor-parallel messages "
                       "plan_row counts, held against section 2's MLP — open after your lab "
                       "passes"):
    tp_answers.planner_per_layer(r0)
viz.show_code(tp_answers.planner_per_layer,
              folded="▶ code: the claim — open after your lab passes")

# %% [markdown]
# The check: Narayanan et al. (*Efficient Large-Scale Language Model Training on GPU
# Clusters Using Megatron-LM*, SC 2021) list in their Table 1 the configurations they ran on
# DGX A100 nodes (8 A100 80-GB GPUs each). One row has GPT-3's width — 96 heads, width
# 12288 — with 80 layers: 145.6 B parameters, **tensor-parallel size 8, pipeline-parallel
# size 8**, 1536 GPUs (so data-parallel size 24), batch 2304 sequences of 2048 tokens. Their
# takeaways (section 3): tensor parallelism up to the GPUs of a node, pipeline parallelism
# across nodes, data parallelism over the rest.

# %%
cluster = planner.MEGATRON_A100_CLUSTER
print(f"the cluster: {cluster.nodes} nodes × {cluster.gpus_per_node} GPUs of "
      f"{cluster.gpu_bytes / gb:.0f} GB; peak {cluster.peak_flops / 1e12:.0f} teraFLOP/s (A100, "
      f"dense fp16 or bf16) at {cluster.efficiency:.0%} efficiency; "
      f"{cluster.intra_bw / gb:.0f} GB/s per GPU inside a node (NVLink 3), {cluster.inter_bw / gb:.0f} GB/s across nodes "
      "(one 200 Gb/s InfiniBand card per GPU)")
model = planner.GPT_145B
print(f"the model: {model.layers} layers of width {model.hidden}, {model.heads} heads, "
      f"sequences of {model.seq_len} tokens, a vocabulary of {model.vocab} (the paper's "
      "section 5.1, for every row of its Table 1)")
published = planner.MEGATRON_TABLE1_145B
options = planner.plan(model, cluster, published["global_batch"])
best = options[0]
pub = planner.plan_row(model, cluster, published["tp"], published["pp"],
                       published["global_batch"])
claim(f"the paper's parameter count (its equation 2) gives {model.num_params / 1e9:.1f} B for "
      "this shape, as its Table 1 says", round(model.num_params / 1e9, 1) == 145.6)
print(f"{len(options)} configurations fit on {cluster.gpus} GPUs. Fastest estimates:")
print("    t   p    D    M  DP flavour  GB/GPU  s/step  PP msgs  PP GB  DP msgs  DP GB"
      "  (p−1)/M")
for r in options[:6] + [pub]:
    print(f"{r['tp']:5d} {r['pp']:3d} {r['dp']:4d} {r['micro_batches']:4d}  {r['stage']:>10}"
          f"  {r['total_bytes'] / gb:6.1f}  {r['time_s']:6.1f}  {r['pp_messages']:7d}"
          f" {r['pp_bytes'] / gb:6.1f}  {r['dp_messages']:7d} {r['dp_bytes'] / gb:6.1f}"
          f"  {r['idle_over_work']:7.3f}")
print("(M: micro-batches per step per pipeline; messages and GB per GPU per step; the TP "
      "columns are folded below)")
print("(last row: the published configuration)")
spread = options[5]["time_s"] / best["time_s"] - 1
sg = min(options, key=lambda r: r["time_s"] - r["pp_bytes"] / r["pp_link"] * (1 - 1 / r["tp"]))
sg_s = sg["time_s"] - sg["pp_bytes"] / sg["pp_link"] * (1 - 1 / sg["tp"])
print(f"the six fastest are within {spread:.1%} of each other; with PP GB divided by t "
      f"(scatter-gather) the fastest would be t = {sg['tp']}, p = {sg['pp']} at {sg_s:.2f} s, "
      f"{1 - sg_s / best['time_s']:.1%} below this ranking's best")
zero3_rows = [r for r in options if r["stage"] == "zero3" and r["dp"] > 1]
z3 = zero3_rows[0]
print(f"ZeRO-3's DP msgs, plan_row's formula: 3 × (layers / p) × M = 3 × {model.layers // z3['pp']}"
      f" × {z3['micro_batches']} = {z3['dp_messages']} (two gathers, one reduce-scatter per layer "
      "and micro-batch: lesson 08's 2k all-gathers at k micro-batches)")
claim(f"none of ZeRO-3's {len(zero3_rows)} rows that fit is among the six fastest",
      len(zero3_rows) > 0 and all(r["stage"] != "zero3" for r in options[:6]))
claim(f"no sequence parallelism in any row: a recomputed layer keeps its input, 2·s·b·d = "
      f"{2 * model.seq_len * model.hidden / 1e6:.0f} MB at b = 1, whole on each of the t ranks",
      all(math.isclose(r["activation_bytes"],
                       model.layers // r["pp"] * min(r["pp"], r["micro_batches"])
                       * 2 * model.seq_len * model.hidden
                       + planner.activation_bytes_per_layer(model, 1, r["tp"]))
          for r in options))
claim(f"the last column is the pipeline's idle-to-work ratio, (p−1)/M: the step "
      f"lasts M + p − 1 slots for M of work, so the compute is stretched by 1 + (p−1)/M. "
      f"Section 3's bubble is the idle share of the step, (p−1)/(M+p−1): for the published "
      f"row 7/{pub['micro_batches']} = {pub['idle_over_work']:.3f} over work, "
      f"7/{pub['micro_batches'] + 7} = {pub['idle_share']:.3f} of the step",
      all(math.isclose(r["idle_over_work"] / (1 + r["idle_over_work"]), r["idle_share"])
          and math.isclose(r["idle_share"], pipeline_parallel.ideal_bubble(r["pp"],
                                                                           r["micro_batches"]))
          for r in options))
best_per_t = {t: min((r for r in options if r["tp"] == t), key=lambda r: r["time_s"])
              for t in sorted({r["tp"] for r in options})}
for t, r in best_per_t.items():
    print(f"best for t = {t}: {r['time_s']:5.1f} s — p = {r['pp']:2d}, D = {r['dp']:4d}, "
          f"{r['stage']:>5}, M = {r['micro_batches']:3d} micro-batches per pipeline, "
          f"(p−1)/M = {r['idle_over_work']:.2f}, {r['total_bytes'] / gb:.0f} GB")
times = [r["time_s"] for r in best_per_t.values()]
claim(f"over the tensor sizes the planner tries (those dividing one node's "
      f"{cluster.gpus_per_node} GPUs: Megatron-LM's takeaway is the planner's input here, not "
      "a finding) the best estimate falls as t grows (under the planner's assumptions, "
      "below); the planner's best has the largest, t = 8, as the paper's row does",
      times == sorted(times, reverse=True) and max(best_per_t) == cluster.gpus_per_node
      and best["tp"] == published["tp"] == cluster.gpus_per_node)
claim(f"the published t = 8 × p = 8 × D = 24 fits ({pub['total_bytes'] / gb:.0f} GB of the 80 planned) and "
      f"its estimated step is within 1 % of the planner's best (t = {best['tp']}, "
      f"p = {best['pp']}, {best['stage']}, {best['total_bytes'] / gb:.0f} GB)",
      pub["fits"] and pub["dp"] == published["dp"] and pub["time_s"] < 1.01 * best["time_s"])
across = planner.plan_row(model, cluster, 6, 8, published["global_batch"])
claim(f"a tensor size that does not divide the node's {cluster.gpus_per_node} GPUs puts some "
      f"groups across two nodes: t = 6, p = 8 is priced at the network's "
      f"{cluster.inter_bw / gb:.0f} GB/s, {across['time_s']:.0f} s a step against "
      f"{pub['time_s']:.0f} s",
      across["tp_link"] == cluster.inter_bw and across["time_s"] > 1.3 * pub["time_s"])

# %% [markdown]
# **▶ The ranking's TP msgs and TP GB columns, and what TP msgs counts per layer — open after
# your lab passes**.

# %% jupyter={"source_hidden": true}
with viz.folded_output("▶ TP msgs per layer — open after your lab passes"):
    tp_answers.planner_tp_columns(options, pub, model, gb)
viz.show_code(tp_answers.planner_tp_columns,
              folded="▶ code: the claim — open after your lab passes")

# %% [markdown]
# That ranking assumes the ZeRO paper's 16-bit gradients. With `--bf16`, Megatron-LM accumulates and
# all-reduces the gradients in fp32 unless told otherwise (`megatron/training/arguments.py`:
# "bfloat16 requires gradient accumulation and all-reduce to be done in fp32"): 2 + 4 + 12 =
# 18 bytes per parameter and twice the gradient bytes on the wire (the planner's
# `grad_bytes=4`). With `--fp16` the gradients stay 16-bit on the wire, but the optimizer
# gives its fp32 main weights an fp32 copy of them (`_copy_model_grads_to_main_grads`):
# 2 + 2 + 4 + 12 = 20 bytes, the copy sharded with the optimizer state, as Megatron-LM's
# table's "4 + 16/d", its d the data-parallel size, our D (`optimizer_bytes=16`):

# %%
options32 = planner.plan(model, cluster, published["global_batch"], grad_bytes=4)
top16_32 = planner.plan_row(model, cluster, best["tp"], best["pp"], published["global_batch"],
                            stage=best["stage"], grad_bytes=4)
pub32 = planner.plan_row(model, cluster, published["tp"], published["pp"],
                         published["global_batch"], grad_bytes=4)
print(f"fp32 gradients: {len(options32)} configurations fit; fastest t = {options32[0]['tp']}, "
      f"p = {options32[0]['pp']}, {options32[0]['stage']}, {options32[0]['total_bytes'] / gb:.1f} "
      f"GB, {options32[0]['time_s']:.1f} s")
claim(f"with fp32 gradients the 16-bit ranking's fastest row (t = {best['tp']}, p = "
      f"{best['pp']}, {best['stage']}) needs {top16_32['state_bytes'] / gb:.1f} GB of model state "
      f"alone ({model.num_params / 1e9:.1f} B / {best['tp'] * best['pp']} × 18 bytes), "
      f"{top16_32['total_bytes'] / gb:.1f} GB with its activations: above the 80 planned and "
      f"the card's 85.9. The published t = 8, p = 8 still fits ({pub32['total_bytes'] / gb:.0f} GB), "
      f"and is now the fastest shape (t = {options32[0]['tp']}, p = {options32[0]['pp']})",
      best["fits"] and not top16_32["fits"] and top16_32["total_bytes"] > 80 * 2**30
      and pub32["fits"]
      and (options32[0]["tp"], options32[0]["pp"]) == (published["tp"], published["pp"]))
options20 = planner.plan(model, cluster, published["global_batch"], optimizer_bytes=16)
kept20 = {(r["tp"], r["pp"], r["stage"]) for r in options20}
dropped20 = [r for r in options[:6] if (r["tp"], r["pp"], r["stage"]) not in kept20]
top16_20 = planner.plan_row(model, cluster, best["tp"], best["pp"], published["global_batch"],
                            stage=best["stage"], optimizer_bytes=16)
claim(f"with --fp16's 20 bytes {len(options20)} of the {len(options)} configurations fit; of "
      f"the six fastest only the first drops (t = {best['tp']}, p = {best['pp']}, "
      f"{best['stage']}: {top16_20['total_bytes'] / gb:.1f} GB, above the card's 85.9), and its "
      f"tie, {options[1]['stage']} at the same t and p, is now the fastest "
      f"({options20[0]['total_bytes'] / gb:.1f} GB, the same {options20[0]['time_s']:.2f} s: "
      "16-bit gradients on the wire)",
      dropped20 == [best] and not top16_20["fits"] and top16_20["total_bytes"] > 80 * 2**30
      and (options20[0]["tp"], options20[0]["pp"], options20[0]["stage"])
      == (best["tp"], best["pp"], options[1]["stage"]) == (8, 4, "zero1")
      and options20[0]["time_s"] == options[1]["time_s"])

# %%
shown = list(best_per_t.values()) + [pub]
labels = [f"best t = {r['tp']}: p = {r['pp']}, D = {r['dp']}, {r['stage']}"
          for r in best_per_t.values()] + [f"published: t = {pub['tp']}, p = {pub['pp']}, "
                                           f"D = {pub['dp']}, {pub['stage']}"]
fill = [r["compute_s"] * r["idle_over_work"] for r in best_per_t.values()]
print(f"compute, by plan_row's formula the same for every row (8Ψ flops per token, all GPUs): "
      f"{options[0]['compute_s']:.1f} s")
claim("what the best row of each t loses to the pipeline's fill and drain falls as t grows: "
      f"{', '.join(f'{s:.1f}' for s in fill)} s", fill == sorted(fill, reverse=True))
viz.show(viz.planner_figure(shown, labels, cluster.gpu_bytes / 1e9, cluster),
         "Where the planner's ranking comes from: the compute (dark grey) is the same for "
         "every row; small t leaves the GPUs to pipeline stages, whose fill and drain (light "
         "grey) dominates what differs, while t = 8's tensor-parallel traffic (red) stays inside a node. "
         "Left: each row's memory per GPU against the 80 GB planned.")

# %% [markdown]
# Among the fastest, the estimates differ by fractions of a second: the compute is the same
# for all, and more pipeline stages trade a slightly larger bubble for less data-parallel
# traffic and memory per GPU. This model cannot split hairs that fine, and at the very top
# it cannot split them at all: its two fastest rows tie exactly (below), so which comes first
# is the tie-break's choice, not the model's (at Megatron-LM's 18 or 20 bytes the DDP one does
# not fit, above); the paper chose by measuring. Its ranking of
# the tensor size follows from two of its assumptions, not from a measurement: `plan_row`
# gives every row the same compute time, as if each rank's matmuls, t times smaller, ran at
# the same efficiency, and it prices a tensor-parallel collective by its bytes alone, with no
# fixed cost per call, though t > 1 makes thousands of them per GPU per step (TP msgs, in
# the fold above). Were the efficiency to fall with t, or each collective to cost a latency, the large
# t would pay for it, and only a measurement could rank them. Under those assumptions, small
# t is slow not for want of memory (even
# t = p = 1 fits GPT-3 as ZeRO-3, below) but because t·p·D = 1536: the GPUs that t does not
# take go to pipeline stages or data-parallel ranks. More data-parallel ranks leave fewer
# micro-batches per pipeline (M = 2304/D), so with p stages a larger (p−1)/M; fewer stages
# leave more parameters per GPU, which fit only with ZeRO, and its traffic. The best row of
# each t, printed above, shows the trade: the smaller t, the smaller M or the larger p.

# %%
first, second = options[0], options[1]
claim(f"the two fastest rows tie: t = {first['tp']}, p = {first['pp']} with {first['stage']} "
      f"and with {second['stage']}, {first['time_s']:.2f} s each (with 16-bit gradients a "
      f"reduce-scatter and an all-gather weigh what an all-reduce does); {first['stage']} is "
      f"first for its fewer messages ({first['messages']} against {second['messages']}), "
      f"though it holds {first['total_bytes'] / gb:.0f} GB to {second['total_bytes'] / gb:.0f}",
      first["time_s"] == second["time_s"] and first["tied_with"] == 1
      and {first["stage"], second["stage"]} == {"ddp", "zero1"}
      and first["messages"] < second["messages"])
megatron = planner.plan(model, cluster, published["global_batch"], order="tp-dp-pp")
ours = {(r["tp"], r["pp"], r["stage"]): r for r in options}
moved = [r for r in megatron if r["time_s"] != ours[r["tp"], r["pp"], r["stage"]]["time_s"]]
claim(f"numbered as Megatron-LM numbers its ranks by default (tp-cp-ep-dp-pp: data before "
      f"pipeline, so pipeline neighbours are t·D ranks apart), {len(moved)} of the "
      f"{len(megatron)} rows cost more, all with t·p ≤ {cluster.gpus_per_node} (a pipeline "
      "inside one node in our numbering, e.g. t = 2, p = 4); the six fastest rows and every "
      "t's best are unchanged",
      len(megatron) == len(options) and 0 < len(moved)
      and all(1 < r["tp"] * r["pp"] <= cluster.gpus_per_node and r["pp"] > 1 for r in moved)
      and all((a["tp"], a["pp"], a["stage"], a["time_s"]) == (b["tp"], b["pp"], b["stage"],
                                                               b["time_s"])
              for a, b in zip(options[:6], megatron[:6]))
      and all(next((r["pp"], r["stage"]) for r in megatron if r["tp"] == t)
              == (best_per_t[t]["pp"], best_per_t[t]["stage"]) for t in best_per_t))

# %% [markdown]
# Is the estimate anywhere near a measurement? Table 1 reports, for the published row,
# **148** teraFLOP/s per GPU, counting the flops of a step with their equation 3:

# %%
viz.show_code(planner.megatron_flops_per_step)

# %%
step_measured = (planner.megatron_flops_per_step(model, published["global_batch"])
                 / (cluster.gpus * published["tflops"] * 1e12))
claim(f"Table 1's 148 teraFLOP/s per GPU means a step of {step_measured:.1f} s "
      f"({published['tflops'] / (cluster.peak_flops / 1e12):.0%} of the peak); the planner's "
      f"estimate for that row at {cluster.efficiency:.0%} of the peak, nothing overlapped, "
      f"{pub['time_s']:.1f} s, is above it by {pub['time_s'] / step_measured - 1:.0%} (the "
      f"planner counts 8Ψ flops per token, equation 3 a little more: the two differ in flops "
      f"as well as in efficiency)",
      step_measured < pub["time_s"] < 1.2 * step_measured)

# %% [markdown]
# Where section 1 left off: data parallelism alone. The paper's Table 2 measured exactly
# that, for GPT-3 175B on 1536 GPUs with batch 1536: PTD parallelism (the paper's name for
# pipeline, tensor and data parallelism combined; model-parallel size t·p = 96) reached **141** teraFLOP/s per GPU, ZeRO-3 without model parallelism **44**.

# %%
table2 = planner.MEGATRON_TABLE2_175B
for stage in zero.STAGES:
    r = planner.plan_row(gpt3, cluster, 1, 1, table2["global_batch"], stage=stage)
    print(f"t = p = 1, {stage:>5}: {r['total_bytes'] / gb:7.0f} GB per GPU, "
          f"{'fits' if r['fits'] else 'does not fit'}; data-parallel traffic "
          f"{r['dp_bytes'] / gb:5.0f} GB per GPU per step")
only_dp = planner.plan_row(gpt3, cluster, 1, 1, table2["global_batch"], stage="zero3")
ptd = min((r for r in planner.plan(gpt3, cluster, table2["global_batch"])
           if r["tp"] * r["pp"] == table2["model_parallel"]), key=lambda r: r["time_s"])
comm_s = only_dp["dp_bytes"] / cluster.inter_bw
ratio = only_dp["time_s"] / ptd["time_s"]
measured = table2["ptd_tflops"] / table2["zero3_tflops"]
claim(f"data parallelism alone fits GPT-3 only as ZeRO-3 (with recomputation), and then each "
      f"GPU sends {only_dp['dp_bytes'] / 1e12:.1f} TB per step: {comm_s:.0f} s at 25 GB/s, "
      f"more than the step's {only_dp['compute_s']:.0f} s of compute",
      [s for s in zero.STAGES if planner.plan_row(gpt3, cluster, 1, 1, table2["global_batch"],
                                                  stage=s)["fits"]] == ["zero3"]
      and comm_s > only_dp["compute_s"])
claim(f"the planner puts ZeRO-3 alone at {ratio:.1f}× the step time of its best t·p = 96 "
      f"(t = {ptd['tp']}, p = {ptd['pp']}); the paper measured {measured:.1f}× "
      f"({table2['ptd_tflops']} against {table2['zero3_tflops']} teraFLOP/s per GPU)",
      2 < ratio < measured + 1 and ptd["tp"] == 8)

# %% [markdown]
# ## Summary
# - Data parallelism ends in two places. **Memory**: ZeRO-3 divides the model state by N, but
#   a rank's activations are those of whole layers on a whole micro-batch — GPT-3 at one
#   sequence needs 275 GB of them, stored without recomputation, and still 82 GB with flash
#   attention, which drops the attention matrix (recomputing the layers
#   brings ZeRO-3 back within 80 GB, at the price of its traffic). **Batch**: N ranks grow the global batch; past the
#   critical batch size, near the gradient noise scale B_simple = tr(Σ)/|G|² (measured here
#   inside DDP from two gradient norms, within 15 % of the direct value), more ranks barely
#   cut the steps.
# - **Tensor parallelism** (Megatron-LM): a column-parallel layer then a row-parallel one,
#   with two operations *f* and *g* carrying the communication (which pass of each, and
#   why they are called *conjugate*, is lab 11; the folded reference answer in section 2).
#   Communication in every MLP and attention block (what it carries: lab 11), on the
#   critical path unless hidden behind a matmul (which ones, and how: folded in section 2):
#   keep it inside a node.
#   torch's `parallelize_module` (`ColwiseParallel`, `RowwiseParallel`, DTensor) does the same and
#   sends the same.
# - **Pipeline parallelism**: K stages, M micro-batches, gradients accumulated into the whole
#   batch's; idle share
#   (K−1)/(M+K−1); 1F1B keeps min(K − k, M) micro-batches in flight instead of M, and
#   min(K − k, M)/M of GPipe's activation bytes.
# - **2-D**: tensor parallel along one mesh dimension, FSDP2 along the other, equal to one
#   device; each dimension's traffic counted by the group it used.
# - **Planning**: tensor parallelism up to a node (Megatron-LM's rule, which our planner takes
#   as an input: it tries no t beyond a node), pipeline across nodes, data parallelism
#   over the rest. For Megatron-LM's 145.6-B model on 1536 A100s the planner's best estimate
#   has t = 8 and the published t = 8, p = 8 is within 1 % of it (an estimate at 50 % of
#   peak, about 9 % above the step time the paper measured at 47 %); for GPT-3, data
#   parallelism alone fits only as ZeRO-3, estimated 2.7× slower per step (measured in the
#   paper: 3.2×). All with the ZeRO paper's 16-bit gradients; with the fp32 gradients of Megatron-LM's `--bf16`
#   (18 bytes per parameter) the planner's fastest 16-bit row (DDP, t = 8, p = 4) no longer
#   fits, and the published t = 8, p = 8 becomes its fastest shape; with `--fp16`'s fp32
#   gradient copy (20 bytes) that DDP row drops too, and its ZeRO-1 tie leads.
#
# This is the course's last lesson. The references that go further: the Ultra-Scale
# Playbook (Hugging Face, 2025), *How to Scale Your Model* (Google DeepMind, 2025), Stanford
# CS336's systems lectures — sequence and context parallelism, expert parallelism,
# interleaved and zero-bubble pipelines.
#
# ## Check yourself
#
# **▶ The quiz** — run the folded cell below and answer in the widget (or read its output,
# where the answers are folded).

# %% jupyter={"source_hidden": true}
from dpcourse import quizzes

viz.quiz(quizzes.questions("11"))

# %% [markdown]
# ## Sources
# Every statement above about what torch does was checked in the installed torch 2.14.1
# (paths relative to `site-packages`):
#
# - `torch/distributed/tensor/parallel/api.py` — `parallelize_module`: applies a style to each
#   named submodule of the plan.
# - `torch/distributed/tensor/parallel/style.py` — `ColwiseParallel`, `RowwiseParallel` (their
#   placements of input, weight, bias and output, printed in section 2's folded cells; where
#   their hooks communicate, and sequence parallelism's layout: the folded part below).
# - `torch/distributed/tensor/_api.py` — `DTensor.from_local`;
#   `torch/distributed/tensor/_redistribute.py`; `torch/distributed/tensor/placement_types.py`
#   — `Partial`; `torch/distributed/_functional_collectives.py` (what each does for *f* and
#   *g*: the folded part below).
# - `torch/_inductor/config.py` — `_micro_pipeline_tp` (async tensor parallelism, off by
#   default); `torch/_inductor/fx_passes/micro_pipeline_tp.py` — `micro_pipeline_tp_pass`
#   (which collectives it matches: the folded part of these sources);
#   `torch/distributed/_symmetric_memory/__init__.py` — the ops it fuses into (a collective cut
#   into pieces that overlap their matmul).
# - `torch/distributed/device_mesh.py` — `init_device_mesh` (a mesh of a shape, with
#   `mesh_dim_names`), `DeviceMesh.__getitem__` (a sub-mesh by name), `DeviceMesh.get_group`,
#   `get_local_rank`.
# - `torch/distributed/tensor/debug/_comm_mode.py` — `CommDebugMode`, `get_comm_counts`:
#   torch's own count of DTensor's (functional) collectives.
# - `torch/distributed/fsdp/_fully_shard/_fully_shard.py` — `fully_shard(module, mesh=...)`;
#   `torch/distributed/fsdp/_fully_shard/_fsdp_param.py` — `FSDPParam._init_sharded_param`: a
#   parameter already sharded on the tensor-parallel mesh along the same dimension gets
#   `_StridedShard` on the data-parallel one; `_fsdp_state.py` — the root is not resharded
#   after its forward (one all-gather per step); `_fsdp_param.py` — `free_storage` (line
#   1306): at a unit's reshard the gathered weight's storage is resized to 0 bytes, so what
#   autograd saved references it without holding its bytes (section 1's `other_resident`).
# - `torch/distributed/pipelining/stage.py` — `PipelineStage`; `perform_reduce_grad` calls
#   `scale_grads` (`scale_grads=True`, the schedules' default; what it does: section 3's
#   folded cell); the first step's setup sends: `_warmup_forward_vote` and
#   `_warmup_backward_result` (lines 1851, 1893: one int32 each way per boundary, called from
#   `schedules.py` lines 397, 401) and `_send_meta` (line 1837, `send_object_list`);
#   `torch/distributed/pipelining/schedules.py` — `ScheduleGPipe`, `Schedule1F1B` (refuses
#   fewer micro-batches than stages); `_batch_p2p` (lines 768–814): a batch of sends only, or
#   of receives only, is issued op by op (`op_types == {dist.isend}`), any other through
#   `dist.batch_isend_irecv`; `torch/distributed/distributed_c10d.py` — `P2POp.__init__`
#   (takes the default group when none is given), `P2POp.__new__` (calls `_check_op`, lines
#   1860–1867: an op other than this module's `isend` or `irecv` is refused with a
#   `ValueError`, so a recorder's wrapper is).
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel.no_sync` (line 1660):
#   gradients accumulate without an all-reduce inside it; outside, every backward all-reduces
#   (the planner prices DDP as if `no_sync()` covered all micro-batches but the last);
#   `torch/distributed/pipelining/stage.py` — `backward_maybe_with_nosync` (lines 873–940):
#   DDP stages run `no_sync()`, FSDP2 stages `set_reshard_after_backward(False)` and
#   `set_requires_gradient_sync(False)` until the last micro-batch.
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel.register_comm_hook`;
#   `torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py` — `allreduce_hook`;
#   `GradBucket.buffer()` (`torch/distributed/__init__.py` exports it from C++): the flat
#   bucket of this rank's gradients, before the all-reduce.
# - `torch/nn/modules/linear.py` — `Linear.__init__` (the shape it gives `weight`: which
#   dimension holds which features is lab 11's part 3, so this lesson states it only in
#   folded cells, and lesson 08 prints only its FSDP2 biases' shapes) and
#   `Linear.forward` (`F.linear(input, self.weight, self.bias)`).
# - `torch/_meta_registrations.py` — `meta__scaled_dot_product_flash_attention`: the flash
#   kernel's outputs, the attention and a logsumexp of shape (batch, heads, s) in fp32, which
#   its backward uses instead of the attention matrix (section 1's claim counts what autograd
#   saves on this machine's CPU kernel, `ScaledDotProductFlashAttentionForCpuBackward0`);
#   `torch/nn/attention/__init__.py` — `sdpa_kernel`, `SDPBackend` (holding
#   `scaled_dot_product_attention` to one kernel).
# - `torch/autograd/function.py` — `Function` (static `forward(ctx, ...)` and
#   `backward(ctx, grad)`).
# - `torch/autograd/graph.py` — `saved_tensors_hooks`: `pack` sees every tensor saved for the
#   backward, the weights included, a tensor saved twice seen twice (section 1 counts what
#   `pack` sees; section 3's `saved_bytes_counter` counts a tensor saved twice once, by its
#   start address, and leaves the weights' storages out).
# - `torch/_functorch/apis.py` — `vmap`, `grad`; `torch/_functorch/functional_call.py` —
#   `functional_call` (per-example gradients).
#
# Megatron-LM's own code (github.com/NVIDIA/Megatron-LM, not installed here; read at commit
# d98e8a6 of the main branch, `parallel_state.py` at 00caa53):
# `megatron/core/parallel_state.py` — `initialize_model_parallel(..., order="tp-cp-ep-dp-pp")`
# numbers tensor ranks first, then data, then pipeline (its docstring's 16 GPUs with t = 2,
# p = 4: pipeline groups `[g0, g4, g8, g12]`, ...), the layout section 5 checks with
# `order="tp-dp-pp"`; `megatron/core/tensor_parallel/layers.py` —
# `LinearWithGradAccumulationAndAsyncCommunication`, `ColumnParallelLinear.__init__` and
# `linear_with_grad_accumulation_and_async_allreduce` (what they do, and under which
# environment: the folded part of these sources);
# `megatron/core/model_parallel_config.py` — `ModelParallelConfig.tp_comm_overlap` (default
# `False`; "allows overlapping of Linear layer execution with tensor parallel communication
# collectives"), and `megatron/training/arguments.py` — `validate_args` refuses it without
# sequence parallelism ("Tensor parallel communication/GEMM overlap can happen only when
# sequence parallelism is enabled"): section 2's communication–matmul overlap;
# `megatron/training/arguments.py` — with
# `--bf16`, `accumulate_allreduce_grads_in_fp32` is turned on unless `--grad-reduce-in-bf16`
# or `--main-grads-dtype bf16` is given (the comment: "bfloat16 requires gradient
# accumulation and all-reduce to be done in fp32"), and `megatron/training/training.py` passes
# it to the DDP config as `grad_reduce_in_fp32`, which
# `megatron/core/distributed/param_and_grad_buffer.py` turns into the gradient buffer's dtype
# (`torch.float`, else the parameter's): section 5's 18 bytes. With `--fp16` the flag stays
# off (its default) and the gradients are reduced in 16 bits, but
# `megatron/core/optimizer/optimizer.py` (`_copy_model_grads_to_main_grads`:
# `main_param.grad = model_param.main_grad.float()`) gives the fp32 main weights an fp32
# gradient too: 20 bytes, as `docs/user-guide/features/dist_optimizer.md` tabulates
# ("`fp16` parameters, `fp16` gradients | 20 | 4 + 16/d": the copy sharded with the optimizer
# state, section 5's `optimizer_bytes=16`), not the 16 of section 5's ranking, which is the
# ZeRO paper's accounting (Rajbhandari et al., 2 + 2 + 12).
#
# Papers: Shoeybi et al., *Megatron-LM: Training Multi-Billion Parameter Language Models Using
# Model Parallelism*, 2019 (section 3, the MLP, f and g); Narayanan et al., *Efficient
# Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*, SC 2021 (Table 1:
# the 145.6-B row, t = 8, p = 8, 1536 GPUs, batch 2304, 148 teraFLOP/s per GPU; equation 3,
# the flops of a step; Table 2, GPT-3 with PTD against ZeRO-3; the takeaways of section 3;
# their schedule is PipeDream-Flush, or, with virtual stages, the interleaved one of
# section 2.2.2; section 4.1, the scatter/gather optimisation: each of a
# stage's t GPUs sends 1/t of the activation to the next stage); Narayanan et al., *PipeDream: Generalized Pipeline
# Parallelism for DNN Training*, SOSP 2019 (1F1B); Narayanan et al., *Memory-Efficient
# Pipeline-Parallel DNN Training*, ICML 2021 (PipeDream-Flush, PipeDream-2BW); Korthikanti
# et al., *Reducing Activation Recomputation in Large Transformer Models*, 2022 (activation
# bytes per layer, section 4: the 10·sbd, in this lesson's letters, that tensor parallelism
# does not divide; sequence parallelism, section 4.2.2); Huang et al., *GPipe*, NeurIPS 2019 (micro-batches, the
# bubble); McCandlish et al., *An Empirical Model of Large-Batch Training*, 2018 (the noise
# scale, appendix A; the steps S = S_min·(1 + B_noise/β) at each β's best learning rate,
# §2.2, eqs. 2.6–2.7, and §2.3); Rajbhandari et al., *ZeRO*, SC 2020.
#
# **▶ The sources of torch's *f* and *g*, Megatron-LM's overlap and async tensor parallelism's
# patterns — open after your lab passes** (they say which collective each pass makes; click
# the folded cell below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# ### Sources, continued
#
# - `torch/distributed/tensor/parallel/style.py` — `ColwiseParallel._prepare_input_fn`
#   (torch's *f*: it redistributes, with `async_op=True`, only `if input_layouts !=
#   desired_input_layouts`, so not in the plain layout) and `RowwiseParallel._prepare_output_fn`
#   (torch's *g*: `outputs.redistribute(..., async_op=True)`).
#   `ColwiseParallel(input_layouts=Shard(0))` and
#   `RowwiseParallel(output_layouts=Shard(0))`, sequence parallelism's layout: the hooks
#   redistribute between `Shard(0)` and the layer's own placements (the comment in
#   `RowwiseParallel._prepare_output_fn`; what each costs: section 2's folded
#   sequence-parallelism cell).
# - `torch/distributed/tensor/_api.py` — `_FromTorchTensor.backward` (the backward of
#   `DTensor.from_local`; what it does for *f*: section 2's folded answer; it calls
#   `redistribute_local_tensor` without `async_op`, whose default is `False`);
#   `torch/distributed/tensor/_redistribute.py` — `redistribute_local_tensor` (the
#   `async_op: bool = False` default) and `_redistribute_backward` (what it does for
#   *g*: the same).
# - `torch/distributed/tensor/placement_types.py` — `Partial._reduce_value`: a Partial DTensor
#   becomes Replicate through `funcol.all_reduce`, a functional collective
#   (`torch/distributed/_functional_collectives.py`), which our recorder sees as
#   `funcol.all_reduce`.
# - `torch/distributed/_functional_collectives.py` — `AsyncCollectiveTensor`: a functional
#   collective's result that calls `wait` before its first use (`__torch_dispatch__` unwraps
#   it with `trigger_wait` for any op but a view): `RowwiseParallel`'s `async_op=True`
#   overlaps nothing in eager mode.
# - `torch/distributed/tensor/parallel/style.py` — `ColwiseParallel.__init__` sets
#   `desired_input_layouts = (Replicate(),)` and `_prepare_input_fn` redistributes a
#   `Shard(0)` input to it before the matmul, so autograd saves the gathered input (section
#   2's folded sequence-parallelism claim measures its shape).
# - Megatron-LM, `megatron/core/tensor_parallel/layers.py` (commit d98e8a6):
#   `LinearWithGradAccumulationAndAsyncCommunication.forward` calls
#   `ctx.save_for_backward(input, weight)` before it all-gathers the input under
#   `sequence_parallel`, and its `backward` all-gathers the saved share again
#   (`dist_all_gather_func(all_gather_buffer, input, ..., async_op=True)`) for the weight
#   gradient.
# - Megatron-LM, `megatron/core/tensor_parallel/layers.py` (commit d98e8a6):
#   `ColumnParallelLinear.__init__` sets `allreduce_dgrad = world_size > 1 and not
#   sequence_parallel and not disable_grad_reduce` for every column-parallel layer — both of a
#   transformer layer's *f*'s (QKV, the MLP's first layer) — and passes it to
#   `linear_with_grad_accumulation_and_async_allreduce`;
#   `LinearWithGradAccumulationAndAsyncCommunication.backward` starts
#   `torch.distributed.all_reduce(grad_input, ..., async_op=True)` before the weight
#   gradient's matmul, with the comment "Here we rely on CUDA_DEVICE_MAX_CONNECTIONS=1 to
#   ensure that the all-reduce is scheduled before the weight gradient computation" (and the
#   same for the reduce-scatter that replaces it with sequence parallelism); the docstring of
#   `linear_with_grad_accumulation_and_async_allreduce` says the same overlap is made with
#   sequence parallelism and that its use "requires that the environment variable
#   CUDA_DEVICE_MAX_CONNECTIONS=1" ("necessary for a speedup but not for correctness"), and
#   the function warns once when the variable is not 1. All of this is Megatron-LM's own
#   `ColumnParallelLinear`, used with `--transformer-impl local`:
#   `megatron/core/transformer/transformer_config.py` — `TransformerConfig.transformer_impl`
#   defaults to `"transformer_engine"` ("Options are 'transformer_engine' for Transformer
#   Engine and 'local' for MCore"), whose linear layers come from Transformer Engine, not
#   read here.
# - `torch/_inductor/fx_passes/micro_pipeline_tp.py` — `micro_pipeline_tp_pass` looks for
#   all-gathers and reduce-scatters only (`find_all_gather_patterns`,
#   `find_reduce_scatter_patterns`), fused by `fuse_all_gather_matmul` and
#   `fuse_matmul_reduce_scatter` into `torch/distributed/_symmetric_memory/__init__.py`'s
#   `fused_all_gather_matmul` and `fused_matmul_reduce_scatter`: torch's async tensor
#   parallelism overlaps only sequence parallelism's collectives, in compiled models.
# - Megatron-LM, `megatron/core/extensions/transformer_engine.py` (commit d98e8a6): with
#   `config.tp_comm_overlap` its Transformer Engine linear layers are built with
#   `ub_overlap_ag` and `ub_overlap_rs` (`tp_comm_overlap_ag`, `tp_comm_overlap_rs` in
#   `megatron/core/model_parallel_config.py`: "All-Gather overlap with GEMM by pipelining the
#   GEMM and All-Gather", the same for the Reduce-Scatter).
#
# </details>
