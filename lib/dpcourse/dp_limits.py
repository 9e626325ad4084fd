"""Where data parallelism ends (lesson 11, the sections before tensor parallelism): what a
rank holds when FSDP2 shards the parameters but not the activations
(:func:`attention_saved`, :func:`activation_memory_worker`), and how far a larger global batch
keeps helping — the gradient noise scale measured inside a DDP run (McCandlish et al. 2018,
appendix A: :func:`noise_scale_from_norms`, :func:`noise_scale_worker`,
:func:`per_example_noise_scale`).

Workers take ``(rank, world_size)`` first, for :func:`dpcourse.launch.spawn`. Every name is
importable from :mod:`dpcourse.tensor_parallel` too, where lesson 11 calls them.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _quiet():
    """FSDP2 and DTensor warn about things that do not matter here (a view returned by the
    root, two all-gathers to print a full tensor); the notebook should show the results."""
    import logging

    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


# --------------------------------------------------------------------------------------------
# 4. Where data parallelism ends: activations do not shard
# --------------------------------------------------------------------------------------------


def attention_saved(seq: int = 256, heads: int = 4, head_dim: int = 16,
                    fused: bool = True) -> list:
    """The shapes of the tensors autograd keeps for the backward of one attention (one
    sequence): with ``fused``, torch's flash kernel (``F.scaled_dot_product_attention`` held
    to ``SDPBackend.FLASH_ATTENTION``); without, written out as softmax(Q·Kᵀ/√d_h)·V.

    Shown in lesson 11, §1.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, head_dim, generator=gen).requires_grad_()
               for _ in range(3))
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if fused:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(q, k, v)
        else:
            torch.softmax(q @ k.transpose(-2, -1) / head_dim ** 0.5, dim=-1) @ v
    return shapes


def activation_memory_worker(rank: int, world_size: int, micro_batch: int = 8, width: int = 48,
                             depth: int = 4) -> dict:
    """ZeRO-3 as FSDP2 runs it (``fully_shard`` on every layer, then the root) on a stack of
    ``depth`` Linear(width, width) + GeLU layers, each rank with its own micro-batch. Counts,
    on this rank, the bytes of its parameter shards and the bytes autograd saves for the
    backward during one forward (``torch.autograd.graph.saved_tensors_hooks``), split into
    activations (tensors whose first dimension is the micro-batch) and the rest (the
    all-gathered weights a layer keeps for its backward), and, once the forward has returned,
    the bytes those other tensors' storages still hold (``other_resident``: FSDP2 resizes a
    unit's gathered storage to 0 at its reshard, so autograd keeps a reference, not the bytes).
    The same forward without any sharding, in this process, gives the activations of one
    device.
    Shown in lesson 11, §1.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _quiet()
    torch.set_num_threads(1)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width),
                                                                    nn.GELU())])

    def saved_bytes(model, x):
        kinds = {"activations": 0, "other": 0}
        others = []

        def pack(t):
            kind = "activations" if t.dim() and t.shape[0] == micro_batch else "other"
            kinds[kind] += t.numel() * t.element_size()
            if kind == "other":
                others.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x).pow(2).mean()
        kinds["other_resident"] = sum(t.untyped_storage().nbytes() for t in others)
        others.clear()
        loss.backward()
        return kinds

    x = torch.randn(micro_batch, width, generator=torch.Generator().manual_seed(rank))
    one_device = saved_bytes(build(), x)
    model = build()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = saved_bytes(model, x)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in build().parameters())
    return {"shard_bytes": shard_bytes, "full_bytes": full_bytes,
            "activations": sharded["activations"], "other_saved": sharded["other"],
            "other_resident": sharded["other_resident"],
            "one_device_activations": one_device["activations"]}


# --------------------------------------------------------------------------------------------
# 5. The gradient noise scale, inside a DDP run (McCandlish et al. 2018, appendix A)
# --------------------------------------------------------------------------------------------


def noise_scale_from_norms(small_sq: float, big_sq: float, b_small: int, b_big: int) -> dict:
    """McCandlish et al.'s unbiased estimates from two gradient norms of one step.

    ``small_sq``: |G|² of a gradient averaged over ``b_small`` examples (one rank's, averaged
    over the ranks); ``big_sq``: |G|² of the all-reduced gradient, over ``b_big`` examples.
    Since E|G_B|² = |G|² + tr(Σ)/B, two batch sizes give both unknowns:

    * |G|² ≈ (b_big·big_sq − b_small·small_sq) / (b_big − b_small)
    * tr(Σ) ≈ (small_sq − big_sq) / (1/b_small − 1/b_big)

    Average each over many steps before dividing: B_simple = tr(Σ) / |G|².
    Shown in lesson 11, §1.
    """
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small} and {b_big}")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return {"grad_sq": g2, "trace": trace}


def noise_task(seed: int = 0, n: int = 4096, d: int = 20, classes: int = 5, noise: float = 1.0):
    """The noise-scale run's fixed data set: ``n`` Gaussian inputs of ``d`` features, each
    labelled with the class a random linear teacher scores highest after Gaussian noise is
    added to its scores (so the labels, and the gradients, are noisy). Shown in lesson 11, §1.
    """
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d, classes, generator=g)
    X = torch.randn(n, d, generator=g)
    y = (X @ teacher + noise * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return X, y


def noise_model(d: int = 20, classes: int = 5, seed: int = 1) -> nn.Module:
    """The model whose noise scale lesson 11 measures: ``d → 32 → classes``, tanh between.
    Shown in lesson 11, §1."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, classes))


def noise_scale_worker(rank: int, world_size: int, per_rank: int = 8, steps: int = 40,
                       seed: int = 0, sample_seed: int = 0) -> dict:
    """Measure the gradient noise scale inside a DDP run. A comm hook (``sq_norm_hook``) sees
    each bucket of THIS rank's gradient before the all-reduce and adds its squared norm; after
    the backward, ``p.grad`` holds the all-reduced mean. Per step: |G_small|² (b = per_rank:
    the ranks' local squared norms, averaged with one more all-reduce) and |G_big|² (b =
    per_rank × N). The weights stay fixed (lr 0) so every step samples the same
    distribution (``seed`` picks the data set and the weights, ``sample_seed`` the batches).
    Returns the per-step norms. Shown in lesson 11, §1.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    X, y = noise_task(seed)
    model = DDP(noise_model())
    local_sq = [0.0]

    def sq_norm_hook(state, bucket):
        local_sq[0] += float(bucket.buffer().pow(2).sum())      # this rank's, before averaging
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, sq_norm_hook)
    g = torch.Generator().manual_seed(1000 * sample_seed + seed + 17)
    rows = []
    for _ in range(steps):
        idx = torch.randperm(X.shape[0], generator=g)[:per_rank * world_size]
        mine = idx[rank * per_rank:(rank + 1) * per_rank]
        local_sq[0] = 0.0
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(X[mine]), y[mine]).backward()
        big_sq = float(sum(p.grad.pow(2).sum() for p in model.parameters()))
        small = torch.tensor([local_sq[0]])
        dist.all_reduce(small)
        rows.append((float(small) / world_size, big_sq))
    return {"rows": rows, "b_small": per_rank, "b_big": per_rank * world_size}


def per_example_noise_scale(seed: int = 0) -> dict:
    """The same quantities computed directly, for reference: per-example gradients of the
    whole data set at the same weights (``torch.func``), their mean G and the trace of their
    covariance. Shown in lesson 11, §1.
    """
    from torch.func import functional_call, grad, vmap

    X, y = noise_task(seed)
    model = noise_model()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, x, t):
        return F.cross_entropy(functional_call(model, p, (x[None],)), t[None])

    per = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, X, y)
    flat = torch.cat([v.reshape(X.shape[0], -1) for v in per.values()], dim=1).double()
    mean = flat.mean(dim=0)
    trace = float((flat - mean).pow(2).sum(dim=1).mean())
    return {"grad_sq": float(mean.pow(2).sum()), "trace": trace,
            "b_simple": trace / float(mean.pow(2).sum())}
