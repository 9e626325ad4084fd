"""What ZeRO costs and saves, counted (lesson 08): the bytes of model state one rank holds at each
stage — the ZeRO paper's formula (:func:`bytes_per_param`), the same with the padding of equal
shards (:func:`memory_per_rank`), what fits on a device (:func:`fits`) and the bytes a rank
really holds, counted from storages (:func:`count_bytes`) — and what each rank sends per step
(:func:`summarize_traffic` weighs recorded calls, :func:`traffic_per_step` predicts them).
Lesson 08 checks counted == formula for both.

The stages themselves, which these numbers describe, are in :mod:`dpcourse.zero`; every name
here is also importable from there.
"""

from __future__ import annotations

import math

import torch


STAGES = ("ddp", "zero1", "zero2", "zero3")   # "ddp" is stage 0: nothing sharded


def _check(stage: str, world_size: int, stages=STAGES) -> None:
    if stage not in stages:
        raise ValueError(f"stage must be one of {stages}, got {stage!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


# --------------------------------------------------------------------------------------------
# 1. Memory: the formula, and counting what is really held
# --------------------------------------------------------------------------------------------


def bytes_per_param(stage: str, world_size: int, param_bytes: float = 2,
                    grad_bytes: float = 2, optimizer_bytes: float = 12) -> float:
    """Bytes of model state per parameter on one rank (the ZeRO paper's Figure 1).

    The defaults are mixed-precision Adam: bf16 weights (2), bf16 gradients (2), and K = 12
    for the optimizer (fp32 master weights 4 + momentum 4 + variance 4). Activations, buffers
    and temporaries are not model state and are not counted.

    Shown in lesson 08, §1.
    """
    _check(stage, world_size)
    n = world_size
    p, g, k = param_bytes, grad_bytes, optimizer_bytes
    return {"ddp": p + g + k,                 # everything replicated
            "zero1": p + g + k / n,           # optimizer state sharded
            "zero2": p + (g + k) / n,         # ... and the gradients
            "zero3": (p + g + k) / n}[stage]  # ... and the weights


def shard_numel(numel: int, world_size: int) -> int:
    """Elements per rank when ``numel`` is cut in ``world_size`` equal pieces: we pad the flat
    buffer with zeros up to a multiple of N, so the last pieces may hold some padding.

    Shown in lesson 08, §2.
    """
    return -(-numel // world_size)


def memory_per_rank(stage: str, units, world_size: int, param_bytes: int = 2,
                    grad_bytes: int = 2, optimizer_bytes: int = 12) -> dict:
    """Exact bytes of model state on one rank, padding included, by category.

    ``units`` are the sizes of the flat buffers that get sharded, each padded to a multiple of
    N on its own: our ZeRO-1 and ZeRO-2 shard the whole model as one buffer (``[Ψ]``), our
    ZeRO-3 shards each layer separately (one size per layer). What is replicated is not padded.
    When every unit divides by N this is Ψ × :func:`bytes_per_param`, exactly.

    Shown in lesson 08, §5.
    """
    _check(stage, world_size)
    units = [units] if isinstance(units, int) else list(units)
    full = sum(units)                                          # Ψ
    shard = sum(shard_numel(u, world_size) for u in units)     # this rank's slice, per unit
    params = full if stage in ("ddp", "zero1", "zero2") else shard
    grads = full if stage in ("ddp", "zero1") else shard
    optim = full if stage == "ddp" else shard
    out = {"params": params * param_bytes, "grads": grads * grad_bytes,
           "optimizer": optim * optimizer_bytes}
    out["total"] = sum(out.values())
    return out


def fits(num_params: int, device_bytes: float, world_size: int, activation_bytes: float = 0,
         param_bytes: float = 2, grad_bytes: float = 2, optimizer_bytes: float = 12) -> list[dict]:
    """Which stages fit a model of ``num_params`` parameters into ``device_bytes`` per rank.

    One row per stage: the bytes a rank needs (model state + the ``activation_bytes`` you
    allow for activations and temporaries), whether that fits, and the largest model that
    would fit at this world size. Activations are the part this ignores by default: they do
    not shrink with N (each rank still runs its whole micro-batch), so leave room for them.
    With ZeRO-3 ``activation_bytes`` must also cover its working set, which does not shrink
    with N either: the full (unsharded) weights of the unit computing, of the unit being
    prefetched, and the computing unit's full gradient before its reduce-scatter, plus
    whatever the reduce-scatters in flight keep alive (FSDP2's choice: lesson 08, §5, folded
    until lab 08 passes).

    Shown in lesson 08, §7; lesson 11, §1.
    """
    if num_params < 0 or device_bytes <= 0 or activation_bytes < 0:
        raise ValueError("num_params and activation_bytes must be >= 0 and device_bytes > 0, got "
                         f"{num_params}, {activation_bytes} and {device_bytes}")
    rows = []
    for stage in STAGES:
        per = bytes_per_param(stage, world_size, param_bytes, grad_bytes, optimizer_bytes)
        need = num_params * per + activation_bytes
        rows.append({"stage": stage, "bytes_per_param": per, "bytes_per_rank": need,
                     "fits": need <= device_bytes,
                     "max_params": max(0, int((device_bytes - activation_bytes) // per))})
    return rows


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors an optimizer holds: the ones it steps (for our stages the fp32 master copy;
    for a plain optimizer the model's own weights) and its state (Adam's exp_avg and
    exp_avg_sq, SGD's momentum_buffer). Adam's 0-d ``step`` counters are left out: 4 bytes
    per tensor, whatever its size, which the formula ignores too.

    Shown in lesson 08, §2.
    """
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    for state in optimizer.state.values():
        tensors += [t for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    return tensors


def count_bytes(held: dict) -> dict:
    """Count the memory behind the tensors in ``held`` ({category: tensors}), by category.

    We count *storages*, not tensor sizes, because that is what memory is: views of one buffer
    count once (and the whole buffer, padding included), a tensor whose storage was freed
    (``untyped_storage().resize_(0)``, as ZeRO-3 does) counts 0, and a storage named under two
    categories counts under the first (a plain optimizer's parameters are the model's weights,
    already counted). A DTensor (FSDP2) counts its local shard.

    Shown in lesson 08, §5.
    """
    seen, out = set(), {}
    for category, tensors in held.items():
        total = 0
        for t in tensors:
            if hasattr(t, "to_local"):
                t = t.to_local()
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        out[category] = total
    out["total"] = sum(out.values())
    return out


# --------------------------------------------------------------------------------------------
# 4. Traffic: what each rank sends per step
# --------------------------------------------------------------------------------------------
#
# The convention, used by both the counting and the formula, so that they agree exactly:
# a collective weighs the size M of the *whole* buffer it acts on (the tensor that
# is all-reduced or broadcast, the input of a reduce-scatter, the output of an all-gather),
# not a rank's shard. On a ring (lesson 06) each rank sends (N-1)/N · M for a reduce-scatter,
# an all-gather or a pipelined broadcast, and twice that for an all-reduce, which *is* a
# reduce-scatter followed by an all-gather. So a step's "volume" is Σ weight · M, with weight
# 2 for an all-reduce and 1 for the others, and a rank sends (N-1)/N of the volume. gloo's own
# algorithms may differ in detail; the model is the one the ZeRO paper uses.

RING_WEIGHT = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1}


def summarize_traffic(calls, world_size: int) -> dict:
    """One step's calls (recorded by :func:`dpcourse.collectives.record_collectives`): how many,
    the bytes of the whole buffers per kind (see the convention above), the volume and the
    bytes a rank sends on a ring ((N-1)/N of the volume). Barriers carry no bytes and are left
    out; any other kind of call has no ring weight here and is refused.

    Shown in lesson 08, §4 (folded) and §5.
    """
    by_op: dict[str, int] = {}
    counted = [c for c in calls if c.op != "barrier"]
    for c in counted:
        if c.op not in RING_WEIGHT:
            raise ValueError(f"no ring weight for a {c.op} ({c.function}): the traffic model "
                             f"knows {sorted(RING_WEIGHT)}")
        whole = c.out_nbytes if c.op == "all_gather" else c.nbytes   # the whole buffer
        by_op[c.op] = by_op.get(c.op, 0) + whole
    volume = sum(RING_WEIGHT[op] * nbytes for op, nbytes in by_op.items())
    return {"calls": len(counted), "by_op": by_op, "volume": volume,
            "ring_bytes_per_rank": volume * (world_size - 1) / world_size}


def traffic_per_step(stage: str, units, world_size: int, element_size: int = 4, *,
                     grad_bytes: int | None = None) -> int:
    """The volume a step should record (bytes; see the convention above), for one forward and
    one backward per step. With k accumulation micro-batches ZeRO-3 gathers and reduce-scatters
    k times, as does a ZeRO-2 that reduce-scatters in each backward (``Zero2``: in step()).

    * ``ddp``: one all-reduce of the Ψ gradients: 2Ψ;
    * ``zero1``, ``zero2``: reduce-scatter the gradients, all-gather the weights, each over the
      padded buffer: 2 × (Ψ padded to a multiple of N) — the same as DDP, but for padding;
    * ``zero3``: per layer, all-gather (forward), all-gather (backward), reduce-scatter:
      3 × Σ (Ψ_l padded to a multiple of N), so 1.5x DDP. FSDP2 pads each parameter's first dimension instead: give it
      the sizes from :func:`fsdp2_padded_numel` and it is the same formula;
    * ``zero_redundancy``: torch's ZeroRedundancyOptimizer under DDP: DDP's all-reduce, then
      each rank broadcasts the parameters it stepped: 2Ψ + Ψ = 3Ψ.

    Those counts are elements; ``element_size`` is the bytes of each. With ``grad_bytes`` the
    gradients travel in another dtype than the weights (bf16 weights, fp32 gradients: 2 and
    4): the all-reduce and the reduce-scatters weigh ``grad_bytes`` per element, the
    all-gathers and broadcasts ``element_size`` — and the ratios above change.

    Shown in lesson 08, §4 (folded) and §5.
    """
    _check(stage, world_size, STAGES + ("zero_redundancy",))
    units = [units] if isinstance(units, int) else list(units)
    psi = sum(units)
    padded = sum(world_size * shard_numel(u, world_size) for u in units)
    w = element_size                                       # weights: all-gathers, broadcasts
    g = element_size if grad_bytes is None else grad_bytes  # gradients: reductions
    return {"ddp": 2 * psi * g, "zero1": padded * (g + w), "zero2": padded * (g + w),
            "zero3": padded * (2 * w + g), "zero_redundancy": 2 * psi * g + psi * w}[stage]


def fsdp2_padded_numel(shape, world_size: int) -> int:
    """FSDP2 shards each parameter along its first dimension, padded to a multiple of N: the
    number of elements it all-gathers and reduce-scatters for that parameter.

    Shown in lesson 08, §6.
    """
    shape = tuple(shape)
    rows = shape[0] if shape else 1
    return world_size * shard_numel(rows, world_size) * math.prod(shape[1:])
