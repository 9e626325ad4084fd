"""Which mix of data, tensor and pipeline parallelism fits a transformer on a cluster, and what
each costs per step (lesson 11).

A back-of-the-envelope planner in the spirit of Megatron-LM's takeaways (Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021,
section 3): tensor parallelism inside a node, where the links are fast; pipeline parallelism
across nodes; data parallelism over what is left. For every (tensor t, pipeline p, data D)
with t·p·D GPUs it computes, per GPU (d is the model's width throughout):

* **memory**: model state ``Ψ/(t·p)`` parameters × lesson 08's bytes per parameter
  (:func:`dpcourse.zero.bytes_per_param`, for DDP or a ZeRO stage over the D data-parallel
  ranks), plus activations (:func:`activation_bytes_per_layer`, Korthikanti et al. 2022),
  which **do not shrink with D**: a data-parallel rank always runs whole layers on a whole
  micro-batch; with 1F1B the first pipeline stage holds ``min(p, m)`` micro-batches of its L/p
  layers. ZeRO-3 adds its working set: the full weights of two layers (one computing, one
  prefetched) and one layer's full gradient;
* **messages and bytes per step**, per GPU and dimension: tensor (all-reduces of the activations,
  four per layer per micro-batch — two in the forward, two in the backward — and two more when
  the forward is recomputed), pipeline (one activation forward and one gradient backward per
  micro-batch and stage boundary), data (lesson 08's 2Ψ or 3Ψ of the GPU's parameters, at
  ``grad_bytes`` per gradient: once per step for DDP and ZeRO-1, the reduce-scatter once per
  micro-batch for ZeRO-2, everything once per micro-batch for ZeRO-3, :func:`plan_row`);
* **an estimated step time**: compute (``6Ψ`` flops per token, ``8Ψ`` with recomputation, at a
  stated fraction of the GPU's peak) stretched by the pipeline's fill and drain: a step of m
  micro-batches on p stages lasts ``m + p − 1`` slots of which each stage works m, so the
  compute is multiplied by ``1 + (p−1)/m`` (the row's ``idle_over_work``: idle time over
  working time; the idle share of the step, ``(p−1)/(m+p−1)``, is lesson 11 §3's bubble and
  the row's ``idle_share``), plus every byte sent at its link's bandwidth (ring all-reduces: 2(n−1)/n
  of the buffer), with nothing overlapped — an estimate at that assumed efficiency (not a
  bound: a run that reaches more of the peak, or overlaps its messages, is faster), good for
  ranking, not a prediction. A dimension whose groups stay inside a node is priced at
  ``intra_bw``; one whose groups cross a node boundary anywhere — a tensor size that does not
  divide the GPUs of a node, say t = 3 or 6 on 8-GPU nodes — at ``inter_bw``: its slowest group
  sets the pace. Which groups stay inside a node depends on how the ranks are laid out:
  ``order="tp-pp-dp"`` (the default here) numbers them tensor first, then pipeline, then data
  (a pipeline spans t·p consecutive ranks); ``"tp-dp-pp"`` is Megatron-LM's default
  (``megatron/core/parallel_state.py``, ``initialize_model_parallel(order="tp-cp-ep-dp-pp")``),
  where data parallelism comes before pipeline (a data-parallel group spans t·D consecutive
  ranks, and pipeline neighbours are t·D ranks apart).

The estimate has no per-message (latency) term, so configurations that send the same bytes tie
exactly — with 16-bit gradients, DDP and ZeRO-1 (a reduce-scatter plus an all-gather is an
all-reduce). :func:`plan` breaks such ties by the fewer messages per GPU and step (the latency
the estimate leaves out), then by the less memory, and says so in each row's ``tied_with``.

Everything here is arithmetic on the formulas; nothing runs on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import zero

__all__ = [
    "Transformer",
    "Cluster",
    "activation_bytes_per_layer",
    "within_nodes",
    "activation_message_bytes",
    "tp_traffic",
    "plan_row",
    "plan",
    "GPT3_175B",
    "GPT_145B",
    "MEGATRON_A100_CLUSTER",
    "MEGATRON_TABLE1_145B",
    "MEGATRON_TABLE2_175B",
    "megatron_flops_per_step",
    "TP_MESSAGES_PER_LAYER",
    "ORDERS",
]

# Tensor parallelism's collectives per transformer layer and micro-batch, pass by pass
# (attention and MLP each have an f and a g); a recomputed forward runs the forward's again.
# Lab 11 counts them for one MLP; lesson 11 prints and checks these numbers after its pointer.
TP_MESSAGES_PER_LAYER = {"forward": 2, "backward": 2}

# The rank layouts plan_row prices (the module's docstring): ours, and Megatron-LM's default.
ORDERS = ("tp-pp-dp", "tp-dp-pp")


@dataclass(frozen=True)
class Transformer:
    """A GPT-style transformer: ``layers`` blocks of width ``hidden`` with ``heads`` attention
    heads, trained on sequences of ``seq_len`` tokens over a vocabulary of ``vocab``.
    ``hidden`` is the width d, not section 2's hidden size h = 4d. Shown in lesson 11, §1.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int

    @property
    def num_params(self) -> float:
        """Narayanan et al. 2021, section 5.1 (the width written d):
        12·l·d²·(1 + 13/(12d) + (V + s)/(12·l·d)), with V the vocabulary."""
        l, d = self.layers, self.hidden
        return 12 * l * d * d * (1 + 13 / (12 * d) + (self.vocab + self.seq_len) / (12 * l * d))


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` GPUs with ``gpu_bytes`` of memory each. Bandwidths
    are bytes per second one GPU sends: ``intra_bw`` inside a node (NVLink), ``inter_bw``
    across nodes (the node's network cards shared by its GPUs). ``peak_flops`` is the GPU's
    dense 16-bit (fp16 or bf16) peak, ``efficiency`` the fraction of it a training step reaches.
    Shown in lesson 11, §5.
    """

    gpu_bytes: float
    gpus_per_node: int
    nodes: int
    peak_flops: float
    intra_bw: float
    inter_bw: float
    efficiency: float = 0.5

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


def activation_bytes_per_layer(model: Transformer, micro_batch: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: bool = False,
                               flash_attention: bool = False) -> float:
    """Bytes of activations one transformer layer keeps for its backward, on one GPU, in 16-bit
    floats (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
    Models", 2022, section 4; the width written d): ``s·b·d·(34 + 5·a·s/d)`` on one
    GPU; with tensor parallelism of size t ``s·b·d·(10 + 24/t + 5·a·s/(d·t))``: the 10·s·b·d
    not divided by t: the two layer norms' inputs (4·sbd), the two dropout masks after
    attention and MLP (2·sbd), and the inputs of the QKV matmul and of the MLP's first matmul
    (2·sbd each); with sequence parallelism too, everything divided by t (Korthikanti et al.'s
    count, for Megatron-LM's implementation; lesson 11, §2, says what torch's layout saves).
    With full recomputation only the layer's input is kept: ``2·s·b·d`` (divided by t with
    sequence parallelism).

    The ``5·a·s/d`` term (``5·a·s²·b`` bytes) is the attention matrix, a × s × s per sequence,
    stored three times over: the softmax's output (2 bytes an entry), the dropout mask (1) and
    the dropout's output (2). A fused, *flash* attention kernel never stores it: torch's
    ``_scaled_dot_product_flash_attention`` keeps for its backward a logsumexp of shape
    (b, heads, s) in fp32 (``torch/_meta_registrations.py``); with ``flash_attention`` that
    term becomes ``4·a·s·b`` bytes (its heads divided by t like the rest of attention).

    Shown in lesson 11, §1.
    """
    if micro_batch < 1 or tp < 1:
        raise ValueError(f"micro_batch and tp must be >= 1, got {micro_batch} and {tp}")
    s, b, d, a = model.seq_len, micro_batch, model.hidden, model.heads
    if recompute:
        return 2 * s * b * d / (tp if sequence_parallel else 1)
    attention = (4 * a * s * b if flash_attention else 5 * a * s * s * b) / tp
    if sequence_parallel:
        return s * b * d * 34 / tp + attention
    return s * b * d * (10 + 24 / tp) + attention


def within_nodes(span: int, gpus_per_node: int) -> bool:
    """Whether every group of ``span`` consecutive ranks stays inside one node of
    ``gpus_per_node`` GPUs: ``span`` must divide the GPUs of a node (t = 3 on 8-GPU nodes puts
    ranks 6, 7, 8 in one group, across two nodes). Shown in lesson 11, §5."""
    return span <= gpus_per_node and gpus_per_node % span == 0


def activation_message_bytes(model: Transformer, micro_batch: int) -> int:
    """The bytes of one 16-bit activation of ``micro_batch`` sequences, s·b·d elements: what a
    tensor-parallel all-reduce (:func:`tp_traffic`) and a pipeline message (:func:`plan_row`)
    carry. Shown in lesson 11, §5."""
    return 2 * model.seq_len * micro_batch * model.hidden


def tp_traffic(model: Transformer, tp: int, micro_batch: int, layers: int, micro_batches: int,
               recompute: bool = True) -> tuple:
    """Tensor parallelism's messages per GPU and step, and the bytes one GPU sends in them, for
    ``layers`` transformer layers run on ``micro_batches`` micro-batches of ``micro_batch``
    sequences over t = ``tp`` GPUs: :data:`TP_MESSAGES_PER_LAYER` all-reduces per layer and
    micro-batch (the forward's once more when it is ``recompute``-d), each of one 16-bit
    activation (s·b·d elements), of which a ring all-reduce has each rank send 2(t−1)/t;
    (0, 0.0) when t is 1. :func:`plan_row` prices its tensor dimension with it.
    Shown in lesson 11, §5."""
    if tp <= 1:
        return 0, 0.0
    act_msg = activation_message_bytes(model, micro_batch)
    ring = (lambda k: 2 * (k - 1) / k)                # a TP message's share one rank sends, k ranks
    per_layer = TP_MESSAGES_PER_LAYER["forward"] * (2 if recompute else 1) \
        + TP_MESSAGES_PER_LAYER["backward"]
    tp_msgs = layers * micro_batches * per_layer
    return tp_msgs, tp_msgs * act_msg * ring(tp)


def plan_row(model: Transformer, cluster: Cluster, tp: int, pp: int, global_batch: int,
             micro_batch: int = 1, stage: str = "ddp", recompute: bool = True,
             sequence_parallel: bool = False, bucket_bytes: float = 25 * 2**20,
             grad_bytes: float = 2, order: str = "tp-pp-dp",
             optimizer_bytes: float = 12) -> dict:
    """Memory, traffic and an estimated step time for one configuration (t = ``tp``,
    p = ``pp``, D = GPUs / (t·p), the row's ``dp``), as described in the module's docstring.
    ``stage`` is the data-parallel flavour over the D ranks: "ddp", "zero1", "zero2" or
    "zero3". Model state uses lesson 08's mixed-precision Adam with gradients of
    ``grad_bytes``: 2 + 2 + 12 = 16 bytes per parameter with 16-bit gradients (the ZeRO
    paper's accounting; Megatron-LM's ``--fp16`` keeps an fp32 copy of them as well, 20 bytes
    in its own table: ``optimizer_bytes=16``, the copy sharded with the optimizer state as in
    that table's ``4 + 16/d``), 2 + 4 + 12 = 18 with
    ``grad_bytes=4`` (its ``--bf16`` default: gradients accumulated and all-reduced in fp32,
    ``megatron/training/arguments.py``). Data-parallel
    traffic: an all-reduce of the gradients (DDP), a reduce-scatter of the gradients and an
    all-gather of the 16-bit weights (ZeRO-1/2), the weights all-gathered twice and the
    gradients reduce-scattered (ZeRO-3); once per step for DDP and ZeRO-1 (as with DDP's
    ``no_sync()`` over every micro-batch but the last: both keep a full gradient to accumulate
    into), while ZeRO-2 keeps only its gradient shard, so it reduce-scatters after every
    micro-batch (m reduce-scatters, then one all-gather of the weights per step), and ZeRO-3
    gathers and reduce-scatters once per micro-batch: it reshards
    between micro-batches, as FSDP2 does at its defaults (lesson 08 measures 2k all-gathers at
    k micro-batches), so its traffic and messages grow with the micro-batches per step;
    messages: one all-reduce per ``bucket_bytes`` of
    gradients (DDP's default bucket, 25 MiB), a reduce-scatter and an all-gather per bucket for
    ZeRO-1 (m reduce-scatters per bucket for ZeRO-2), three collectives per layer and
    micro-batch for ZeRO-3. The tensor dimension's messages and bytes come from
    :func:`tp_traffic`. A pipeline message is a
    full activation per GPU (no scatter-gather over the t ranks). Returns a dict with every number the
    lesson prints, and ``fits``. ``order`` is the rank layout that decides which links a
    dimension's groups use (the module's docstring): "tp-pp-dp" or Megatron-LM's "tp-dp-pp".
    Shown in lesson 11, §5.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    n = cluster.gpus
    if tp < 1 or pp < 1 or n % (tp * pp):
        raise ValueError(f"t·p = {tp}·{pp} must divide the {n} GPUs")
    dp = n // (tp * pp)
    if model.layers % pp or model.heads % tp:
        raise ValueError(f"p = {pp} must divide the {model.layers} layers and t = {tp} the "
                         f"{model.heads} heads")
    if global_batch % (dp * micro_batch):
        raise ValueError(f"a global batch of {global_batch} does not split into {dp} "
                         f"data-parallel ranks of micro-batches of {micro_batch}")
    m = global_batch // (dp * micro_batch)           # micro-batches per step per pipeline
    psi = model.num_params
    per_gpu = psi / (tp * pp)
    if grad_bytes not in (2, 4):
        raise ValueError(f"grad_bytes must be 2 (16-bit gradients) or 4 (fp32), got {grad_bytes}")
    state = per_gpu * zero.bytes_per_param(stage, dp, grad_bytes=grad_bytes,
                                           optimizer_bytes=optimizer_bytes)
    layers_here = model.layers // pp
    in_flight = min(pp, m)                            # 1F1B, first stage
    act_layer = activation_bytes_per_layer(model, micro_batch, tp, sequence_parallel, recompute)
    activations = layers_here * in_flight * act_layer
    if recompute:                                     # one layer recomputed in full at a time
        activations += activation_bytes_per_layer(model, micro_batch, tp, sequence_parallel)
    layer_params = 12 * model.hidden ** 2 / tp
    working = layer_params * (2 * 2 + grad_bytes) if stage == "zero3" else 0.0
    total = state + activations + working

    act_msg = activation_message_bytes(model, micro_batch)
    tp_msgs, tp_bytes = tp_traffic(model, tp, micro_batch, layers_here, m, recompute)
    pp_msgs = 2 * m if pp > 1 else 0                  # a middle stage: one each way per micro-batch
    pp_bytes = pp_msgs * act_msg
    dp_volume = per_gpu * {"ddp": 2 * grad_bytes,                 # all-reduce of the gradients
                           "zero1": grad_bytes + 2,               # RS grads, AG weights
                           "zero2": m * grad_bytes + 2,           # RS every micro-batch's
                           "zero3": m * (2 * 2 + grad_bytes)}[stage]  # per micro-batch: AG twice, RS
    buckets = math.ceil(per_gpu * grad_bytes / bucket_bytes)   # DDP's gradient buckets (lesson 07)
    dp_msgs = ({"ddp": buckets, "zero1": 2 * buckets, "zero2": (m + 1) * buckets,
                "zero3": 3 * layers_here * m}[stage] if dp > 1 else 0)
    dp_bytes = dp_volume * (dp - 1) / dp if dp > 1 else 0.0

    g = cluster.gpus_per_node
    tp_link = cluster.intra_bw if within_nodes(tp, g) else cluster.inter_bw
    pp_span, dp_span = (tp * pp, n) if order == "tp-pp-dp" else (n, tp * dp)  # consecutive ranks
    pp_link = cluster.intra_bw if within_nodes(pp_span, g) else cluster.inter_bw
    dp_link = cluster.intra_bw if within_nodes(dp_span, g) else cluster.inter_bw
    flops = (8 if recompute else 6) * psi * global_batch * model.seq_len
    compute_s = flops / (n * cluster.peak_flops * cluster.efficiency)
    idle_over_work = (pp - 1) / m                     # idle over working time
    time_s = (compute_s * (1 + idle_over_work) + tp_bytes / tp_link + pp_bytes / pp_link
              + dp_bytes / dp_link)
    return {"tp": tp, "pp": pp, "dp": dp, "stage": stage, "micro_batches": m,
            "state_bytes": state, "activation_bytes": activations, "working_bytes": working,
            "total_bytes": total, "fits": total <= cluster.gpu_bytes,
            "tp_messages": tp_msgs, "tp_bytes": tp_bytes, "pp_messages": pp_msgs,
            "pp_bytes": pp_bytes, "dp_messages": dp_msgs, "dp_bytes": dp_bytes,
            "idle_over_work": idle_over_work, "idle_share": (pp - 1) / (m + pp - 1), "tp_link": tp_link,
            "pp_link": pp_link, "dp_link": dp_link, "order": order,
            "compute_s": compute_s, "time_s": time_s}


def plan(model: Transformer, cluster: Cluster, global_batch: int, micro_batch: int = 1,
         stages=("ddp", "zero1", "zero3"), recompute: bool = True,
         grad_bytes: float = 2, order: str = "tp-pp-dp",
         optimizer_bytes: float = 12) -> list[dict]:
    """Every configuration that fits, fastest estimate first: each tensor size t dividing the
    heads and the GPUs of a node (:func:`within_nodes`: tensor parallelism communicates in every
    layer, so its groups stay on the node's fast links), each pipeline size p dividing the
    layers, each data-parallel flavour
    in ``stages``, where the GPUs and the global batch split evenly; ``grad_bytes``,
    ``optimizer_bytes`` and ``order`` as in :func:`plan_row`. Rows whose estimates are equal
    are ordered by their messages per step (fewer first: the latency the estimate leaves out), then by their memory
    (less first); each row's ``tied_with`` counts the other rows with its exact estimate.
    Shown in lesson 11, §5.
    """
    rows = []
    n = cluster.gpus
    for tp in range(1, cluster.gpus_per_node + 1):
        if model.heads % tp or n % tp or not within_nodes(tp, cluster.gpus_per_node):
            continue
        for pp in range(1, model.layers + 1):
            if model.layers % pp or n % (tp * pp):
                continue
            dp = n // (tp * pp)
            if global_batch % (dp * micro_batch):
                continue
            for stage in stages:
                row = plan_row(model, cluster, tp, pp, global_batch, micro_batch, stage,
                               recompute, grad_bytes=grad_bytes, order=order,
                               optimizer_bytes=optimizer_bytes)
                if row["fits"]:
                    rows.append(row)
    for r in rows:
        r["messages"] = r["tp_messages"] + r["pp_messages"] + r["dp_messages"]
        r["tied_with"] = sum(o["time_s"] == r["time_s"] for o in rows) - 1
    return sorted(rows, key=lambda r: (r["time_s"], r["messages"], r["total_bytes"]))


# The published configurations the lesson checks the planner against, from Narayanan et al.,
# "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021
# (sequence length 2048 and vocabulary 51,200 throughout, section 5.1; DGX A100 nodes of 8
# A100 80-GB GPUs joined by NVLink/NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node, section 5):
#
# * Table 1, the 145.6-billion-parameter row: 96 heads, hidden size 12288, 80 layers,
#   tensor-parallel size 8, pipeline-parallel size 8, 1536 GPUs, batch size 2304, 148
#   teraFLOP/s achieved per GPU (47 % of peak), counted with their equation 3;
# * Table 2, GPT-3 (174.6 B: 96 layers, hidden size 12288, 96 heads) with batch size 1536 on
#   1536 GPUs: PTD parallelism with model-parallel size t·p = 96 reached 141 teraFLOP/s per
#   GPU, ZeRO-3 without model parallelism 44.
GPT3_175B = Transformer("GPT-3 175B", layers=96, hidden=12288, heads=96, seq_len=2048,
                        vocab=51200)
GPT_145B = Transformer("GPT 145.6B", layers=80, hidden=12288, heads=96, seq_len=2048,
                       vocab=51200)
# gpu_bytes is a planning budget, 80e9 bytes: an "80-GB" A100 has 80 GiB = 85.9e9 bytes; the
# 5.9e9 between them is left for what the planner does not count (the CUDA context, NCCL's
# buffers, the allocator's fragmentation, temporaries).
MEGATRON_A100_CLUSTER = Cluster(gpu_bytes=80e9, gpus_per_node=8, nodes=192,
                                peak_flops=312e12,   # A100 dense fp16 or bf16
                                intra_bw=300e9,      # NVLink 3: 600 GB/s both ways
                                inter_bw=25e9)       # 200 Gb/s per GPU
MEGATRON_TABLE1_145B = {"tp": 8, "pp": 8, "dp": 24, "global_batch": 2304, "tflops": 148}


def megatron_flops_per_step(model: Transformer, global_batch: int) -> float:
    """Narayanan et al. 2021, equation 3: the flops of one step with activation recomputation,
    ``96·β·s·l·d²·(1 + s/(6d) + V/(16·l·d))`` (β the global batch, the width written d, V the
    vocabulary) — how their Table 1 turns a step time into teraFLOP/s per GPU.
    Shown in lesson 11, §5."""
    s, l, d, v = model.seq_len, model.layers, model.hidden, model.vocab
    return 96 * global_batch * s * l * d * d * (1 + s / (6 * d) + v / (16 * l * d))
MEGATRON_TABLE2_175B = {"model_parallel": 96, "global_batch": 1536, "gpus": 1536,
                        "ptd_tflops": 141, "zero3_tflops": 44}
