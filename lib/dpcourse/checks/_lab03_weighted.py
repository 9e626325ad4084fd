"""Lab 03 part 4: ``average_gradients_weighted(model, n_local)`` on shards of unequal sizes,
whose result must be the gradient of the mean loss over every rank's samples. Re-exported by
:mod:`dpcourse.checks.lab03`, whose docstring lists the mistakes named here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import check_timeout, fail, passed, recorded
from ._lab03_common import (DEFAULT_TIMEOUT, ROUTED_HEADS, WORLD_SIZES, _all_close, _close,
                            _launch, _none_guard, _part1_model_after_backward,
                            _refuse_frozen_grad, _refuse_never_grad)
from ._lab03_placement import _DeviceWatch, _refuse_unplaced

SHARD_SIZES = (3, 5, 8)  # rank r holds SHARD_SIZES[r] samples


def _weighted_worker(rank: int, world_size: int, fn, sizes: tuple) -> dict:
    __tracebackhide__ = True
    from .. import ddp
    from ..models import SmallCNN

    dev = ddp.setup_rank()
    torch.manual_seed(0)
    model = SmallCNN(width=4).to(dev)
    g = torch.Generator().manual_seed(2000 + rank)  # different data on each rank
    n_local = sizes[rank]
    X = torch.randn(n_local, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n_local,), generator=g)
    F.cross_entropy(model(X.to(dev)), y.to(dev)).backward()   # the mean over this rank's shard
    local = [p.grad.detach().cpu().clone() for p in model.parameters()]
    watch = _DeviceWatch(dev)
    seen = watch.seen   # the first tensor handed to a collective that follows the default device

    def run(m):
        watch.run(fn, m, n_local)

    def grads(m, named=False):
        out = [(n, None if p.grad is None else p.grad.detach().cpu().clone())
               for n, p in m.named_parameters()]
        return dict(out) if named else [g for _, g in out]

    run(model)
    out = {"local": local, "after": grads(model), "n_local": n_local, "none_error": None}
    if seen:
        return dict(out, unplaced=seen[0])
    # Part 1's model, on this rank's n_local samples: first with both heads used on every rank
    # (a function that fails on a None gradient fails on every rank alike), then routed.
    try:
        run(_part1_model_after_backward(rank, dev, n_local, seed=4000, routed=False))
    except (AttributeError, TypeError, RuntimeError, ValueError) as e:
        if "None" not in str(e):
            raise
        return dict(out, none_error=f"{type(e).__name__}: {e}")
    model = _part1_model_after_backward(rank, dev, n_local, seed=4000)
    out["routed_local"] = grads(model, named=True)
    run(model)
    out["routed_after"] = grads(model, named=True)
    if seen:
        out["unplaced"] = seen[0]
    return out


@recorded
def check_average_gradients_weighted(average_gradients_weighted, world_sizes=WORLD_SIZES,
                                     timeout: float | None = None,
                                     sizes: tuple = SHARD_SIZES) -> None:
    """Ranks hold shards of different sizes (3, 5 and 8 samples); after each rank's backward
    on the mean loss over its own shard, ``average_gradients_weighted(model, n_local)`` must
    leave in every ``p.grad`` the gradient of the mean loss over all the ranks' samples
    together: sum over r of n_r * g_r, divided by the sum of the n_r. Run on SmallCNN, then on
    part 1's two-head model (a rank without a head's gradient contributes zeros, the divisor
    stays every sample's count; the frozen parameter keeps None)."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    if not callable(average_gradients_weighted):
        fail(f"the check needs your function, got {type(average_gradients_weighted).__name__}.")
    for world_size in world_sizes:
        results = _launch(_weighted_worker, world_size, timeout, average_gradients_weighted,
                          tuple(sizes[:world_size]), name="average_gradients_weighted")
        _diagnose_weighted(results, world_size)
    passed(f"average_gradients_weighted: every p.grad is the gradient of the mean loss over all "
           f"the ranks' samples, shards of {', '.join(map(str, sizes[:max(world_sizes)]))} "
           f"(on {' and '.join(map(str, world_sizes))} ranks); on part 1's model each head's "
           f"gradient too, a rank that did not use it counting its samples with zeros; never "
           f"(used by no rank) and the frozen parameter no gradient")


def _diagnose_weighted(results: list, world_size: int) -> None:
    __tracebackhide__ = True
    _diagnose_weighted_smallcnn(results, world_size)
    _none_guard(results, "average_gradients_weighted")
    _diagnose_weighted_routed(results, world_size)


def _diagnose_weighted_smallcnn(results: list, world_size: int) -> None:
    __tracebackhide__ = True
    _refuse_unplaced(results)
    ns = [r["n_local"] for r in results]
    total_n = sum(ns)
    n_params = len(results[0]["local"])

    def combine(weights, divisor):
        return [sum(w * r["local"][i] for w, r in zip(weights, results)) / divisor
                for i in range(n_params)]

    want = combine(ns, total_n)
    for rank, r in enumerate(results):
        after = r["after"]
        if any(a is None for a in after):
            fail(f"on rank {rank} some p.grad is None after average_gradients_weighted: the "
                 f"optimizer would skip that parameter.",
                 fix="leave each result in p.grad; never delete a gradient.")
        if any(a.shape != w.shape for a, w in zip(after, want)):
            fail(f"on rank {rank} a gradient changed shape: the optimizer needs p.grad in its "
                 f"parameter's shape.",
                 fix="combine the gradients element-wise, in p.grad's own shape.")
        if _all_close(after, want):
            continue
        if _all_close(after, r["local"]):
            fail(f"on rank {rank} p.grad is still that rank's own gradient: nothing was reduced "
                 f"into it.",
                 fix="all_reduce p.grad itself (or write the result back into it).")
        if _all_close(after, combine([1] * world_size, world_size)):
            fail(f"the gradients are the plain mean over the ranks, which weighs a rank with "
                 f"{min(ns)} samples as much as one with {max(ns)}, so one of its samples "
                 f"counts {max(ns)}/{min(ns)} times as much as one of the other's.",
                 fix="weight each rank's gradient by its number of samples before the sum.")
        if _all_close(after, combine([1] * world_size, 1)):
            fail("the gradients are the plain sum over the ranks: a sum of means is no mean "
                 "of anything, and it grows with the number of ranks.",
                 fix="weight each rank's gradient by its number of samples, and divide by the "
                     "total number of samples.")
        if _all_close(after, combine([1] * world_size, total_n)):
            fail(f"the gradients are the plain sum over the ranks divided by the total count "
                 f"({total_n}): each rank's gradient was not multiplied by its own n_local "
                 f"before the sum, so a rank's mean gradient stood in for the sum over its "
                 f"samples and every rank weighed the same.",
                 fix="multiply each rank's gradient by its own n_local before the sum.")
        if _all_close(after, combine([r["n_local"]] * world_size, total_n)):
            fail(f"on rank {rank} the sum over the ranks was multiplied by this rank's own "
                 f"n_local ({r['n_local']}) after the all_reduce: each rank's gradient must be "
                 f"weighted by its own count before the sum, where the other ranks' counts "
                 f"still apply.", fix="scale by n_local before the all_reduce, not after.")
        if _all_close(after, combine(ns, 1)):
            fail(f"the gradients are the sample-weighted sum, not yet divided: {total_n} times "
                 f"the gradient of the mean loss.",
                 fix=f"divide by the total number of samples over all ranks ({total_n} here).")
        if _all_close(after, combine(ns, world_size)):
            fail(f"the sample-weighted sum was divided by the world size ({world_size}), which "
                 f"counts ranks, where the mean over samples divides by {total_n} samples.",
                 fix="divide by the total number of samples over all ranks instead.")
        if _all_close(after, combine(ns, r["n_local"] * world_size)):
            fail(f"on rank {rank} the weighted sum was divided by n_local × world_size "
                 f"({r['n_local']} × {world_size}), as if every rank had this rank's number "
                 f"of samples: no rank knows the total, and the others' counts differ.",
                 fix="all_reduce the sample count too, and divide by that total.")
        if _all_close(after, combine(ns, r["n_local"])):
            fail(f"on rank {rank} the weighted sum was divided by this rank's own n_local "
                 f"({r['n_local']}), not by the {total_n} samples of all the ranks.",
                 fix="all_reduce the sample count too, and divide by that total.")
        fail(f"on rank {rank} the gradients are not the gradient of the mean loss over all "
             f"{total_n} samples (nor a plain mean or sum): each rank's gradient is a mean over "
             f"its own n_local samples; the global mean counts every sample once.",
             fix="weight each rank's gradient by its count, sum over the ranks, divide by the "
                 "total count.")


def _diagnose_weighted_routed(results: list, world_size: int) -> None:
    """Part 1's model on unequal shards: rank r (n_r samples) used only ROUTED_HEADS[r % 2].
    The contract: each head's p.grad is the gradient of the global batch's mean loss, the sum
    over the ranks of n_r times that rank's gradient (zeros where it has none) divided by the
    total count of all the samples — a sample that did not go through a head still counts."""
    __tracebackhide__ = True
    name = "average_gradients_weighted"
    ns = [r["n_local"] for r in results]
    total_n = sum(ns)
    used = [ROUTED_HEADS[rank % 2] for rank in range(world_size)]
    zero = torch.zeros_like(results[0]["routed_local"][used[0]])

    def weighted(h, r):
        g = r["routed_local"][h]
        return zero if g is None else r["n_local"] * g

    want = {h: sum(weighted(h, r) for r in results) / total_n for h in ROUTED_HEADS}
    users = {h: [rank for rank in range(world_size) if used[rank] == h] for h in ROUTED_HEADS}
    # a loop that skips a None gradient: each rank's call on the head it used meets the other
    # ranks' calls on the heads THEY used
    paired = sum(weighted(used[rank], r) for rank, r in enumerate(results)) / total_n

    close = _close
    _refuse_frozen_grad(results, name, "on part 1's model, ")
    for rank, r in enumerate(results):
        mine = used[rank]
        for h in ROUTED_HEADS:
            got = r["routed_after"][h]
            if close(got, want[h]):
                continue
            if close(r["routed_after"][mine], paired) and not close(paired, want[mine]):
                fail(f"on part 1's model with shards of {', '.join(map(str, ns))} samples, "
                     f"rank {rank}'s {mine}.grad ends holding the even ranks' head_a gradients "
                     f"and the odd ranks' head_b gradients, each times its rank's n_local, "
                     f"added together and divided by {total_n} (the values match that mix): "
                     f"each rank skipped the head whose p.grad was None — head_b on even "
                     f"ranks, head_a on odd ones — so the ranks' all_reduce calls, matched by "
                     f"their order and not by parameter, paired different parameters (the "
                     f"same shape, so nothing complained).",
                     fix="make every rank call the collective on the same parameters in the "
                         "same order: for a parameter that requires a gradient but got none "
                         "on this rank, this rank's samples contribute zeros to the weighted "
                         "sum, which is still divided by the total count of all the samples "
                         "(and its p.grad must then hold the result too).")
            if got is None:
                fail(f"on part 1's model, rank {rank}'s {h}.grad is still None after {name}, "
                     f"though rank(s) {', '.join(map(str, users[h]))} computed a gradient for "
                     f"it: the global batch's mean loss depends on {h}, so every rank must end "
                     f"holding the same gradient for it, this rank's samples contributing "
                     f"zero.",
                     fix="when this rank has no gradient for a parameter that requires one, "
                         "reduce zeros for it and store the result in p.grad.")
            n_users = sum(ns[u] for u in users[h])
            if n_users != total_n and close(got, want[h] * total_n / n_users):
                fail(f"on part 1's model, {h}'s weighted sum was divided by the "
                     f"{' + '.join(str(ns[u]) for u in users[h])} = {n_users} samples of the "
                     f"rank(s) whose batch went through {h}, not by all {total_n}: that is the "
                     f"mean loss over the samples that used {h}, but the contract asks for the "
                     f"gradient of the mean loss over every sample of the global batch, and a "
                     f"sample that did not go through {h} still counts in that mean (its "
                     f"derivative for {h} is zero, its 1/{total_n} share is not).",
                     fix=f"divide every parameter's weighted sum by the total count of all the "
                         f"ranks' samples ({total_n} here), whether or not a rank used it.")
            fail(f"on part 1's model with shards of {', '.join(map(str, ns))} samples, rank "
                 f"{rank}'s {h}.grad is not the gradient of the global batch's mean loss, "
                 f"though SmallCNN's gradients were right.",
                 fix="treat a missing gradient on a rank as zeros, weight it by that rank's "
                     "count like any other, sum over the ranks, divide by the total count, and "
                     "leave the result in p.grad on every rank.")
    _refuse_never_grad(results, name, "on part 1's model, ")
