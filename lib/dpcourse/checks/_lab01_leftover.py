"""lab01's stretch, its design decision: the micro-batches left over at the end of an epoch.

A loader of m micro-batches with m not a multiple of k ends with fewer than k of them: the
contract leaves what happens to them to the learner, within two rules -- every sample of the
epoch contributes to exactly one step, and each step is plain training's step on the samples it
used (the gradient of their mean loss). Two choices hold (a step of their own; a place in the
last full group's step); the plausible others are refused by what the check measured: the
leftover dropped, its gradients left in p.grad with no step, a step on it with the wrong divisor
(its summed gradient, 1/k per micro-batch, a full group's sample count), or an error raised.
:func:`check_leftover` is called by ``lab01.check_train_accumulated`` once the loaders of whole
groups pass.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpcourse.checks import fail

__all__ = ["LEFTOVER_SETUPS", "check_leftover", "replay_leftover", "CHOSEN"]

# (micro-batch sizes, k, seed): fewer than k micro-batches are left at the end -- two of
# unequal sizes in the first (a full group holds 12 samples, the leftover 6), one in the second.
LEFTOVER_SETUPS = (([4] * 9 + [4, 2], 3, 11), ([5, 3, 6, 5, 2], 2, 13))

# What the pass line says of each accepted choice.
CHOSEN = {"own": "take a step of their own (a smaller group: a noisier step, like §1's short "
                 "batch)",
          "merge": "join the last full group's step (one larger last step)"}


def _data(sizes, seed):
    n = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _loader(X, y, sizes):
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return DataLoader(TensorDataset(X, y),
                      batch_sampler=[list(range(a, b)) for a, b in zip(bounds, bounds[1:])])


def _fresh(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.Tanh(), nn.Linear(16, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.2)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b, tol=1e-5):
    return len(a) == len(b) and all(
        x is not None and y is not None and torch.allclose(x, y, rtol=tol, atol=tol)
        for x, y in zip(a, b))


def replay_leftover(sizes, k, seed, leftover: str, *, loss: bool = False):
    """The weights (and with ``loss``, also the mean loss per sample it saw) after an epoch whose full groups are right and whose leftover is handled
    ``leftover``: "own" (a step on its own samples' mean), "merge" (joined to the last full
    group), "drop" (no step on it), "sum" (a step on its summed gradient, never divided), "k"
    (each micro-batch's mean weighted 1/k) or "full" (divided by a full group's sample count,
    k times the first micro-batch's size)."""
    X, y = _data(sizes, seed)
    model, opt = _fresh(seed)
    model.train()
    opt.zero_grad()
    batches = list(_loader(X, y, sizes))
    whole = len(batches) // k * k
    groups = [batches[g:g + k] for g in range(0, whole, k)]
    rest = batches[whole:]
    if leftover == "merge" and groups:
        groups[-1], rest = groups[-1] + rest, []
    total = 0.0
    for group in groups:
        n = sum(len(b) for _, b in group)
        for Xb, yb in group:
            mean = nn.functional.cross_entropy(model(Xb), yb)
            (mean * len(yb) / n).backward()
            total += mean.item() * len(yb)
        opt.step()
        opt.zero_grad()
    if rest and leftover != "drop":
        n = sum(len(b) for _, b in rest)
        full_n = k * len(batches[0][1])
        for Xb, yb in rest:
            weight = {"own": len(yb) / n, "sum": len(yb), "k": 1 / k,
                      "full": len(yb) / full_n}[leftover]
            mean = nn.functional.cross_entropy(model(Xb), yb)
            (mean * weight).backward()
            total += mean.item() * len(yb)
        opt.step()
        opt.zero_grad()
    return (_params(model), total / sum(sizes)) if loss else _params(model)


def _right_gradient(seed, weights, X, y):
    """The gradient of the mean loss over (X, y) at ``weights``: plain training's on them."""
    model, _ = _fresh(seed)
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    model.train()
    nn.functional.cross_entropy(model(X), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _compare(grad, right):
    """(|grad| / |right|, the cosine between them), over all parameters."""
    dot = sum(float((a.double() * b.double()).sum()) for a, b in zip(grad, right))
    rr = sum(float((b.double() ** 2).sum()) for b in right)
    gg = sum(float((a.double() ** 2).sum()) for a in grad)
    return (gg / max(rr, 1e-300)) ** 0.5, dot / max((gg * rr) ** 0.5, 1e-30)


def _matches(grad, right) -> bool:
    if any(g is None for g in grad):
        return False
    ratio, cos = _compare(grad, right)
    return abs(ratio - 1) < 1e-3 and cos > 1 - 1e-5


def _step_ranges(sizes, k, merged):
    """The micro-batch ranges [a, b) each step takes under the choice its step count shows."""
    whole = len(sizes) // k * k
    ranges = [(g, g + k) for g in range(0, whole, k)]
    if merged and ranges:
        ranges[-1] = (ranges[-1][0], len(sizes))
    elif whole < len(sizes):
        ranges.append((whole, len(sizes)))
    return ranges


def _first_wrong_step(seed, X, y, sizes, k, used, merged):
    """The index of the first step before the last whose gradient is not the mean-loss gradient
    of the micro-batches it should have taken (None if all of them are right)."""
    ranges = _step_ranges(sizes, k, merged)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    for i, ((a, b), (weights, grad)) in enumerate(zip(ranges[:-1], used[:-1])):
        right = _right_gradient(seed, weights, X[bounds[a]:bounds[b]], y[bounds[a]:bounds[b]])
        if not _matches(grad, right):
            return i, (a, b)
    return None


def _fail_on_step(scene, seed, X, y, sizes, used, wrong):
    """Name the step whose samples are wrong, and which consecutive micro-batches its gradient
    does match, if any."""
    __tracebackhide__ = True
    i, (a, b) = wrong
    bounds = [sum(sizes[:j]) for j in range(len(sizes) + 1)]
    weights, grad = used[i]
    right = _right_gradient(seed, weights, X[bounds[a]:bounds[b]], y[bounds[a]:bounds[b]])
    found = None
    if all(g is not None for g in grad):
        ratio, cos = _compare(grad, right)
        seen = f"{ratio:.2f} times as long as theirs, cosine {cos:.4f}"
        for lo in range(len(sizes)):
            for hi in range(lo + 1, len(sizes) + 1):
                other = _right_gradient(seed, weights, X[bounds[lo]:bounds[hi]],
                                        y[bounds[lo]:bounds[hi]])
                if _matches(grad, other):
                    found = (lo, hi)
                    break
            if found:
                break
    else:
        seen = "missing for some parameters (p.grad None)"

    def span(lo, hi):
        return (f"micro-batches {lo + 1} to {hi} (samples {bounds[lo] + 1} to {bounds[hi]})"
                if hi - lo > 1 else f"micro-batch {lo + 1} (samples {bounds[lo] + 1} to "
                                    f"{bounds[hi]})")

    instead = (f"; it is the gradient of {span(*found)} instead" if found else
               "; it matches the mean-loss gradient of no run of consecutive micro-batches")
    fail(f"{scene}; your function took {len(used)} optimizer steps, and step {i + 1} is the "
         f"first whose samples are wrong: it should take {span(a, b)}, the group of k "
         f"consecutive ones in order, but the gradient it used was {seen} (measured at the "
         f"weights it stepped from){instead}. Every step before the leftover is a full "
         f"group's, in order, whatever you decided for the leftover.",
         fix=f"print, for each step, which micro-batches' backwards went into p.grad before "
             f"it: step {i + 1}'s list is not [{', '.join(str(j + 1) for j in range(a, b))}] "
             f"(counting micro-batches from 1).")


def check_leftover(train_accumulated, sizes, k, seed):
    """Run the learner's function on a loader that ends with fewer than k micro-batches; return
    (its choice, "own" or "merge"; what it returned; the mean loss per sample of that epoch,
    the contract's return value) when
    the contract holds, else fail with what was measured (cause first, the mechanism and the
    change with ``fix=``)."""
    __tracebackhide__ = True
    X, y = _data(sizes, seed)
    n = sum(sizes)
    whole = len(sizes) // k * k
    groups, rest_sizes = whole // k, sizes[whole:]
    r, n_rest = len(rest_sizes), sum(rest_sizes)
    full_n = k * sizes[0]
    scene = (f"one of the check's loaders held {len(sizes)} micro-batches of sizes {sizes} with "
             f"k = {k}: {groups} group(s) of {k}, and {r} micro-batch(es) ({n_rest} samples) "
             f"left over at the end")
    model, opt = _fresh(seed)
    used = []  # per step: (the weights it stepped from, the gradient it used)

    def before_step(optimizer, args, kwargs):
        used.append((_params(model), [None if p.grad is None else p.grad.detach().clone()
                                      for p in model.parameters()]))

    opt.register_step_pre_hook(before_step)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        returned = train_accumulated(model, _loader(X, y, sizes), nn.CrossEntropyLoss(), opt, k,
                                     "cpu")
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the learner's function may raise anything
        fail(f"{scene}; your function raised {type(exc).__name__} ({exc}). The contract holds "
             f"for any loader: every sample of the epoch contributes to exactly one step, and "
             f"the function returns the epoch's mean loss.",
             fix="decide what the leftover micro-batches get, within the contract (a step of "
                 "their own, or a place in the last full group's step): an error leaves the "
                 "caller with no epoch at all, for a loader whose length is not a multiple of k.")
    got = _params(model)
    for choice in ("own", "merge"):
        weights, want = replay_leftover(sizes, k, seed, choice, loss=True)
        if _same(got, weights):
            return choice, returned, want
    after = [p.grad for p in model.parameters()]
    if _same(got, replay_leftover(sizes, k, seed, "drop")):
        last = used[-1][1] if used else None
        waiting = (any(g is not None and bool(g.any()) for g in after)
                   and not (last is not None and _same(after, last, tol=1e-7)))
        if waiting:
            norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in after
                                        if g is not None)))
            fail(f"{scene}; your function took {len(used)} optimizer steps, and when it returned "
                 f"p.grad held a gradient (norm {norm:.3g}) that no step had used: the last "
                 f"{n_rest} samples contributed to no step, where the contract says every sample "
                 f"of the epoch contributes to exactly one; and whatever the caller runs next on "
                 f"this model (a gradient-norm log, a clipping, another loop's first step) meets "
                 f"that gradient.",
                 fix=f"give the leftover micro-batches a step (of their own, or within the last "
                     f"full group's), and clear p.grad after it: your loop steps only where a "
                     f"group of {k} closes, the shorter last group never closes, so its "
                     f"backwards added into p.grad and stayed there.")
        ran = len(forwards) == len(sizes)
        how = ("their forward and backward ran, and the gradient was cleared unused"
               if ran else f"your function ran {len(forwards)} forwards for {len(sizes)} "
                           f"micro-batches, never reaching them")
        fail(f"{scene}; your function took {len(used)} optimizer steps, and its weights are "
             f"those the {groups} full group(s) alone give: the last {n_rest} samples "
             f"contributed to no step, where the contract says every sample of the epoch "
             f"contributes to exactly one.",
             fix=f"give the leftover micro-batches a step (of their own, or within the last full "
                 f"group's): {how}. Dropping them, as DataLoader(drop_last=True) drops a short "
                 f"batch, is what the contract rules out.")
    # A step took the leftover, with a gradient that is not its samples' mean loss's.
    if len(used) in (groups, groups + 1) and used:
        merged = len(used) == groups
        first = (whole - k if merged else whole)
        lo = sum(sizes[:first])
        what = (f"the last full group and the leftover ({n - lo} samples)" if merged
                else f"the leftover ({n_rest} samples)")
        wrong = _first_wrong_step(seed, X, y, sizes, k, used, merged)
        if wrong is not None:
            _fail_on_step(scene, seed, X, y, sizes, used, wrong)
        weights, grad = used[-1]
        right = _right_gradient(seed, weights, X[lo:], y[lo:])
        if all(g is not None for g in grad):
            ratio, cos = _compare(grad, right)
            seen = (f"{ratio:.2f} times as long as the gradient of those samples' mean loss"
                    + (f", and pointing elsewhere (cosine {cos:.4f})"
                       if cos < 0.9999 or f"{ratio:.2f}" == "1.00" else ""))
        else:
            seen = "missing for some parameters (p.grad None)"
        fix = ("compare p.grad just before that step with the gradient of one batch holding "
               "its samples (their mean loss, backward): the first parameter where they differ "
               "shows what went wrong.")
        if not merged:
            for variant, why in (
                    ("sum", f"divide the leftover's gradient by the number of samples it holds "
                            f"({n_rest}): its summed gradient was never divided, because your "
                            f"division happens only where a group of {k} closes."),
                    ("k", f"weight each leftover micro-batch by its share of the leftover's "
                          f"samples: you gave each 1/k = 1/{k} of the weight, but the leftover "
                          f"holds {r} micro-batch(es), of sizes {rest_sizes}."),
                    ("full", f"divide by the leftover's own sample count ({n_rest}): you "
                             f"divided by a full group's ({full_n}), samples the step never "
                             f"saw.")):
                if _same(got, replay_leftover(sizes, k, seed, variant)):
                    fix = why
                    break
        fail(f"{scene}; your function took {len(used)} optimizer steps, the last one on "
             f"{what}, but the gradient that step used was {seen} (measured at the weights it "
             f"stepped from): the contract says each step is plain training's step on the "
             f"samples it used, the gradient of their mean loss.", fix=fix)
    fail(f"{scene}; your function took {len(used)} optimizer steps, where {groups} full "
         f"group(s) and the leftover make {groups + 1} (or {groups}, with the leftover in the "
         f"last full group's step), and its weights match no epoch in which every sample "
         f"contributes to exactly one step.",
         fix="count your steps: one where each group of k closes, and the leftover's (or none "
             "for it, if it joins the last full group's step).")
