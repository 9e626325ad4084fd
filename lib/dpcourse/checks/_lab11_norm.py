"""Lab 11's arrangement the lesson did not show: a layer norm over the hidden features between
the column- and the row-parallel layer (NormFormer's "FFN LN", Shleifer et al. 2021),
``Sequential(Linear(6, 12), GELU(), LayerNorm(12, elementwise_affine=False), Linear(12, 6))``.

The hidden features are cut over the ranks, and the norm's mean and variance run over all of
them: the learner decides what the ranks exchange for it, and what that exchange's backward is,
under a byte bound: no more bytes per rank and pass (``ring_bytes``) than the cheapest exact
exchange, an all-reduce of two float32 numbers per row (``norm_budget``). Gathering the hidden
blocks is exact but over the bound (it grows with h); the per-row sums all-reduced forward and
backward are within it — the row's sum, then the squared deviations from its mean summed: a
variance from the sums of x and x² (E[x²] − E[x]²) cancels in float32 when the mean is large,
and the check runs such a case (the first layer's bias shifted by ``SHIFT``). The answer is not a table:
whatever was gathered or summed in the forward, the backward must sum the parts of the
gradient that every rank computed for this rank's features — rank s's block of the norm's
output depends on rank r's features through the statistics. Megatron-LM's own
``gather_from_tensor_model_parallel_region`` (forward all-gather, backward *split*: this
rank's block, no communication) is the wrong backward here, because what follows the gather
does not run identically on every rank (each rank feeds only its block to the row layer).
(Megatron-LM, megatron/core/tensor_parallel/mappings.py: ``_GatherFromModelParallelRegion``'s
forward is ``_gather_along_last_dim``, its backward ``_split_along_last_dim``.)

``check_normed_mlp`` runs the learner's ``NormedTPMLP(plain, rank, world_size)`` on 2 and 3
ranks and names each wrong placement by its cause, with the numbers the run shows: the norm
taken over this rank's block only (its mean and variance beside the whole row's), a backward
that leaves each rank's gradient as it is (the first weight's gradient short of the plain
MLP's by the paths through the statistics), one that averages, the whole weights kept, and
collectives beyond what the norm needs. Every wrong variant's values are simulated here on one
process, so each sentence is measured, not assumed. ``NORM_CHOICES``/``reveal_norm_prediction``
hold the prediction the lab asks before the code.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from . import fail, passed, reveal
from ._lab11_diagnose import (D, H, ODD_H, ROWS, _STEPS, _close, _data, _error,
                              _find_slice)

NORM_EPS = 1e-5
# the large-mean case: the first layer's bias shifted by SHIFT, so every hidden activation is
# about SHIFT with a spread of about 1; float32 holds numbers near 1000 to about 6e-5, so the
# output is compared within LARGE_ATOL (a variance from E[x^2] - E[x]^2 misses it by ~0.1)
SHIFT = 1000.0
LARGE_ATOL = 1e-3
# the most collectives the norm may add to a pass (besides g's forward all-reduce and f's
# backward one): one gather, or the statistics as one stacked or two separate all-reduces
_MAX_EXTRA = 2

NORM_CHOICES = ("the output", "dL/dx and the first layer's gradients", "both", "neither")
_RIGHT_CHOICE = NORM_CHOICES[1]


def _plain_normed(hidden: int = H) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(16)
        return nn.Sequential(nn.Linear(D, hidden), nn.GELU(),
                             nn.LayerNorm(hidden, eps=NORM_EPS, elementwise_affine=False),
                             nn.Linear(hidden, D))


def _normed_case(hidden: int = H, shift: float = 0.0) -> tuple:
    plain = _plain_normed(hidden)
    if shift:
        with torch.no_grad():
            plain[0].bias += shift
    return plain, _data(1, ROWS, D, seed=17)[0], _data(1, ROWS, D, seed=18)[0]


def ring_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for a collective on ``n`` ranks, counted as the bandwidth-optimal
    ring algorithm sends them (Patarasuk & Yuan 2009; NCCL's ring): an all-reduce of a tensor
    of ``nbytes`` sends 2(n − 1)/n of it (a reduce-scatter, then an all-gather), a
    reduce-scatter of a whole input of ``nbytes`` (n − 1)/n of it, an all-gather of a local
    block of ``nbytes`` the block n − 1 times; anything else its whole input."""
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op == "reduce_scatter":
        return (n - 1) / n * nbytes
    if op == "all_gather":
        return (n - 1) * nbytes
    return float(nbytes)


def norm_budget(n: int, rows: int = ROWS) -> float:
    """The bytes per rank and pass of the cheapest correct exchange for the norm: an all-reduce
    of two float32 numbers per row (each rank's sum over its block, then its sum of squared
    deviations from the row's mean, or their gradients: two all-reduces of one number a row).
    It does not grow with the hidden size."""
    return ring_bytes("all_reduce", rows * 2 * 4, n)


def _b(x: float) -> str:
    return f"{x:.0f} B" if abs(x - round(x)) < 1e-9 else f"{x:.1f} B"


def normed_worker(rank: int, world_size: int, mlp_cls, hidden: int = H,
                  shift: float = 0.0) -> dict:
    """Runs on each rank: the learner's module built from the plain normed MLP, one forward
    and one backward, every collective of each pass recorded (op, elements, bytes), then
    ``_STEPS`` SGD steps of this rank's own parameters. With ``shift`` (the first layer's bias
    shifted: hidden activations with a large mean) only the forward."""
    from ..collectives import record_collectives
    from ._lab11_layers import _sgd_outputs

    torch.set_num_threads(1)
    plain, x, upstream = _normed_case(hidden, shift)
    x = x.clone().requires_grad_(True)
    try:
        mlp = mlp_cls(copy.deepcopy(plain), rank, world_size)
    except Exception as exc:
        return {"build_error": _error(exc)}
    out = {"params": [p.detach().clone() for p in mlp.parameters()]}
    summed = {"fwd": [], "bwd": []}          # what each all-reduce of a pass was handed

    def keeper(where):
        def before(call):
            tensor = (call.args or {}).get("tensor")
            if call.op == "all_reduce" and isinstance(tensor, torch.Tensor):
                summed[where].append(tensor.detach().clone())
        return before

    try:
        with record_collectives(before=keeper("fwd")) as fwd:
            y = mlp(x)
    except Exception as exc:
        return {**out, "forward_error": _error(exc)}
    if not isinstance(y, torch.Tensor):
        return {**out, "forward_error": f"forward returned {type(y).__name__}, not a tensor"}
    out["y"] = y.detach().clone()
    if shift:
        return out
    out["fwd"] = [(c.op, c.numel) for c in fwd if c.op != "barrier"]
    out["fwd_bytes"] = [(c.op, c.numel, c.nbytes) for c in fwd if c.op != "barrier"]
    if tuple(y.shape) != tuple(upstream.shape):
        return out
    try:
        with record_collectives(before=keeper("bwd")) as bwd:
            y.backward(upstream.clone())
    except Exception as exc:
        return {**out, "backward_error": _error(exc)}
    out["summed"] = summed
    out["bwd"] = [(c.op, c.numel) for c in bwd if c.op != "barrier"]
    out["bwd_bytes"] = [(c.op, c.numel, c.nbytes) for c in bwd if c.op != "barrier"]
    out["x_grad"] = None if x.grad is None else x.grad.clone()
    out["grads"] = [None if p.grad is None else p.grad.clone() for p in mlp.parameters()]
    out.update(_sgd_outputs(mlp, x, upstream))
    return out


def _blocks(n: int) -> list:
    per = H // n
    return [slice(r * per, (r + 1) * per) for r in range(n)]


def simulate(n: int) -> dict:
    """On one process, the plain normed MLP and the wrong arrangements, as ``n`` ranks would
    compute them: ``y``, ``x_grad`` and ``dz`` (the gradient of the first layer's output,
    ROWS × H, rank r's block in columns r) for the plain MLP (``right``), for a backward that
    leaves each rank's part as it is (``own``: rank r counts only the paths through its own
    block of the norm's output), and the output of a norm over each rank's block alone
    (``local_y``)."""
    plain, x, upstream = _normed_case()
    w1, b1 = plain[0].weight.detach(), plain[0].bias.detach()
    w2, b2 = plain[3].weight.detach(), plain[3].bias.detach()
    z0 = x @ w1.T + b1

    def through(block):
        z = z0.clone().requires_grad_(True)
        normed = F.layer_norm(F.gelu(z), (H,), eps=NORM_EPS)
        cols = slice(None) if block is None else block
        y = normed[:, cols] @ w2[:, cols].T + b2
        y.backward(upstream)
        return y.detach(), z.grad

    y_right, dz_right = through(None)
    dz_own = torch.zeros_like(z0)
    y_own = b2.clone()
    for block in _blocks(n):
        y_r, dz_r = through(block)
        dz_own[:, block] = dz_r[:, block]
        y_own = y_own + (y_r - b2)
    a = F.gelu(z0)
    # the same silence when the statistics are exchanged in two steps (the row's sum, then
    # the squared deviations from its mean summed): rank r's graph sees the other ranks' sums
    # as constants, so the paths through the mean into their deviations are missing too
    dz_own2 = torch.zeros_like(z0)
    for block in _blocks(n):
        others = [b for b in _blocks(n) if b != block]
        z = z0.clone().requires_grad_(True)
        act = F.gelu(z)
        mean = (act[:, block].sum(-1, keepdim=True)
                + sum(a[:, b].sum(-1, keepdim=True) for b in others)) / H
        var = ((act[:, block] - mean).square().sum(-1, keepdim=True)
               + sum((a[:, b] - mean.detach()).square().sum(-1, keepdim=True)
                     for b in others)) / H
        normed = (act[:, block] - mean) / torch.sqrt(var + NORM_EPS)
        (normed @ w2[:, block].T).backward(upstream)
        dz_own2[:, block] = z.grad[:, block]
    local_y = b2 + sum(F.layer_norm(a[:, blk], (blk.stop - blk.start,), eps=NORM_EPS)
                       @ w2[:, blk].T for blk in _blocks(n))
    per = H // n
    summed = sum(a[:, blk] for blk in _blocks(n))    # the blocks added, feature by feature
    summed_y = b2 + sum(F.layer_norm(summed, (per,), eps=NORM_EPS) @ w2[:, blk].T
                        for blk in _blocks(n))
    return {"plain": plain, "a": a, "y": y_right, "y_own": y_own, "local_y": local_y,
            "summed_y": summed_y,
            "dz": dz_right, "dz_own": dz_own, "dz_own2": dz_own2, "x_grad": dz_right @ w1,
            "x_grad_own": dz_own @ w1, "x": x}


def _shard(o: dict, w: torch.Tensor, dim: int):
    """(start, length, gradient) of this rank's block of the weight ``w`` cut along ``dim``,
    in torch's (out, in) layout (a shard stored the other way round is turned), or None."""
    for p, g in zip(o["params"], o["grads"]):
        if p.dim() != 2:
            continue
        for cand, grad, turned in ((p, g, False), (p.T, g, True)):
            start = _find_slice(cand, w, dim)
            if start is not None and cand.shape[dim] < w.shape[dim]:
                return start, cand.shape[dim], (None if grad is None else
                                                 (grad.T if turned else grad))
    return None


def _w1_shard(o: dict, w1: torch.Tensor):
    return _shard(o, w1, 0)


def _reference(hidden: int = H) -> dict:
    """The plain normed MLP after one forward and backward on the check's case, and its
    output after ``_STEPS`` SGD steps trained as each rank trains its part."""
    from ._lab11_diagnose import _reference_steps

    plain, x, upstream = _normed_case(hidden)
    x = x.clone().requires_grad_(True)
    y = plain(x)
    y.backward(upstream)
    return {"plain": plain, "y": y.detach(), "x_grad": x.grad.clone(),
            "w1_grad": plain[0].weight.grad.clone(), "w2_grad": plain[3].weight.grad.clone(),
            "b2_grad": plain[3].bias.grad.clone(),
            "stepped": _reference_steps(plain, x.detach(), upstream)}


def _exact_failures(outs: list, n: int, name: str, hidden: int, blocks: str = "") -> None:
    """Every value the contract names, against the plain network's: the output, dL/dx, each
    rank's blocks of both weights and their gradients, and the output after ``_STEPS`` SGD
    steps of each rank's own parameters (its biases included). The named diagnoses ran
    first; what reaches here gets the numbers."""
    __tracebackhide__ = True
    from ._lab11_diagnose import _stepped_failures

    ref = _reference(hidden)
    w1, w2 = ref["plain"][0].weight.detach(), ref["plain"][3].weight.detach()
    case = f"{n} ranks, h = {hidden}{blocks}"
    for rank, o in enumerate(outs):
        for what in ("forward_error", "backward_error"):
            if what in o:
                fail(f"{name} raised on rank {rank} ({case}): {o[what]}.")
        if not _close(o["y"], ref["y"]):
            fail(f"{name}'s output on rank {rank} ({case}) differs from the plain MLP's by up "
                 f"to {float((o['y'] - ref['y']).abs().max()):.3g}" + (
                     ", where the runs with equal blocks matched it" if blocks else "") + f": "
                 f"with these blocks the norm's statistics do not come out "
                 f"as those of the whole row of {hidden} features.",
                 fix="Normalise by the mean and variance of all the hidden features, "
                     "whatever the blocks' lengths.")
        if o["x_grad"] is None or not _close(o["x_grad"], ref["x_grad"]):
            fail(f"dL/dx on rank {rank} ({case}) is not the plain MLP's, although the output "
                 f"is.", fix="Follow the gradient back through the norm's exchange and f.")
        for label, w, dim, want in (("first", w1, 0, ref["w1_grad"]),
                                    ("second", w2, 1, ref["w2_grad"])):
            shard = _shard(o, w, dim)
            if shard is None:
                fail(f"rank {rank} of {name} ({case}) has no nn.Parameter that is a block of "
                     f"the {label} layer's weight {tuple(w.shape)} cut along its {hidden} "
                     f"hidden features.")
            start, k, grad = shard
            block = want.narrow(dim, start, k)
            if grad is None:
                fail(f"on rank {rank} ({case}) the {label} weight's block of hidden features "
                     f"[{start}, {start + k}) has no gradient where the plain MLP's block has "
                     f"one of norm {_norm(block):.4f}: the forward uses it detached (or through "
                     f".data), so training would never move it.",
                     fix=f"Use the {label} layer's weight block itself in the forward.")
            if not _close(grad, block):
                fail(f"on rank {rank} ({case}) the {label} weight's block of hidden features "
                     f"[{start}, {start + k}) has a gradient of norm {_norm(grad):.4f} where the "
                     f"plain MLP's block has {_norm(block):.4f}, although the output and dL/dx "
                     f"match.", fix="Compare what reaches that block with the plain MLP's "
                                    "backward: a scale or a detach on the way.")
    _stepped_failures(outs, n, name, ref["stepped"], ref["b2_grad"], "mlp")


def _norm(t: torch.Tensor) -> float:
    return float(t.norm())


def _forward_failures(outs: list, n: int, name: str, sim: dict) -> None:
    __tracebackhide__ = True
    want = sim["y"]
    for rank, o in enumerate(outs):
        if _close(o["y"], want):
            continue
        if _close(o["y"], sim["local_y"]):
            blk = _blocks(n)[0]
            row = sim["a"][0]
            part = row[blk]
            fail(f"{name}'s output on rank {rank} is what a norm over each rank's own block of "
                 f"{blk.stop} hidden features gives: rank 0 normalises row 0 by its block's "
                 f"mean {float(part.mean()):.3f} and variance "
                 f"{float(part.var(unbiased=False)):.3f}, where the plain MLP's LayerNorm({H}) "
                 f"uses the whole row's, {float(row.mean()):.3f} and "
                 f"{float(row.var(unbiased=False)):.3f} — the statistics run over all {H} "
                 f"features, and {n - 1} of every {n} live on other ranks.",
                 fix="Before the norm, every rank needs either every rank's hidden block or "
                     "every rank's sums over its block.")
        if _close(o["y"], sim["summed_y"]):
            per = H // n
            fail(f"{name}'s output on rank {rank} is what a norm of the ranks' hidden blocks "
                 f"added together gives: an all-reduce of the blocks adds rank 0's features "
                 f"0–{per - 1} to rank 1's {per}–{2 * per - 1}, different features, not parts "
                 f"of one sum — and the norm then runs over {per} sums where LayerNorm({H}) "
                 f"needs the {H} features themselves.",
                 fix="Before the norm, every rank needs either every rank's hidden block or "
                     "every rank's sums over its block.")
        extra = len(o.get("fwd", [])) - 1
        if extra <= 0:
            fail(f"{name}'s output on rank {rank} differs from the plain MLP's by up to "
                 f"{float((o['y'] - want).abs().max()):.3g}, and its forward makes no collective "
                 f"besides g's all-reduce: the norm on this rank saw only this rank's "
                 f"{H // n} hidden features, but its mean and variance run over all {H}.")
        fail(f"{name}'s output on rank {rank} differs from the plain MLP's by up to "
             f"{float((o['y'] - want).abs().max()):.3g} ({n} ranks; forward collectives "
             f"{[op for op, _ in o['fwd']]}): whatever the norm's collective brought, it is not "
             f"what LayerNorm({H}) of the whole hidden row needs, or the row layer was not fed "
             f"this rank's block of the normed features.")


def _backward_failures(outs: list, n: int, name: str, sim: dict) -> None:
    __tracebackhide__ = True
    w1 = sim["plain"][0].weight.detach()
    x = sim["x"]
    for rank, o in enumerate(outs):
        if "backward_error" in o:
            fail(f"the backward through {name} raised on rank {rank}: {o['backward_error']}.")
        if o["x_grad"] is None:
            fail(f"x has no gradient after the backward through {name} on rank {rank}: the "
                 f"forward cuts it off from autograd (a detach, .data, or a backward that "
                 f"returns None).")
    for rank, o in enumerate(outs):
        shard = _w1_shard(o, w1)
        if shard is None:
            fail(f"rank {rank} of {name} ({n} ranks) has no nn.Parameter that is a block of the "
                 f"first layer's weight (plain[0].weight, {tuple(w1.shape)}): the ranks must "
                 f"hold their blocks, as your TPMLP does.")
        start, k, grad = shard
        rows = slice(start, start + k)
        want = sim["dz"][:, rows].T @ x
        own = sim["dz_own"][:, rows].T @ x
        if grad is None:
            fail(f"the first layer's weight block on rank {rank} gets no gradient: the forward "
                 f"uses it detached (or through .data).")
        if _close(grad, want):
            continue
        own2 = sim["dz_own2"][:, rows].T @ x
        if _close(grad, own) or _close(grad, own2):
            missing = want - (own if _close(grad, own) else own2)
            fail(f"on rank {rank} the gradient of the first weight's rows [{start}, "
                 f"{start + k}) has norm {_norm(grad):.4f} where the plain MLP's has "
                 f"{_norm(want):.4f}: it counts only the paths through this rank's own block "
                 f"of the norm's output. But every block of that output is normalised by the "
                 f"mean and variance of all {H} features, so rank s's block depends on rank "
                 f"{rank}'s features too — and the gradient of those paths (norm "
                 f"{_norm(missing):.4f} here) was computed on rank s, not here. The backward of "
                 f"the norm's communication sent nothing back.",
                 fix="In the backward of what you gathered (or summed) in the forward, sum the "
                     "ranks' gradients before each rank keeps its block.")
        if _close(grad, want / n):
            fail(f"on rank {rank} the gradient of the first weight's rows [{start}, "
                 f"{start + k}) is 1/{n} of the plain MLP's (norm {_norm(grad):.4f} for "
                 f"{_norm(want):.4f}): the backward of the norm's communication averages the "
                 f"ranks' parts, but they are parts of one sum.", fix="Sum, do not divide.")
        if _close(grad, want * n) or _close(grad, own * n):
            fail(f"on rank {rank} the gradient of the first weight's rows [{start}, "
                 f"{start + k}) is {n} times too large (norm {_norm(grad):.4f} for "
                 f"{_norm(want):.4f}): a gradient every rank already holds whole was summed "
                 f"over the ranks.")
        fail(f"on rank {rank} the gradient of the first weight's rows [{start}, {start + k}) "
             f"(norm {_norm(grad):.4f}) is neither the plain MLP's ({_norm(want):.4f}) nor "
             f"the part of it through this rank's own block of the norm ({_norm(own):.4f}).")
    for rank, o in enumerate(outs):
        if not _close(o["x_grad"], sim["x_grad"]):
            fail(f"dL/dx on rank {rank} ({n} ranks) differs from the plain MLP's by up to "
                 f"{float((o['x_grad'] - sim['x_grad']).abs().max()):.3g}, although the first "
                 f"weight's gradient is right: the sum over the ranks of dL/dx (f's backward) "
                 f"is missing or done twice.")


def _parameter_failures(outs: list, n: int, name: str, plain: nn.Sequential) -> None:
    __tracebackhide__ = True
    for rank, o in enumerate(outs):
        for p in o["params"]:
            if p.dim() == 2 and sorted(p.shape) == sorted((D, H)):
                fail(f"{name} on rank {rank} keeps a whole weight of shape {tuple(p.shape)}: "
                     f"each rank holds only its block of the hidden features ({H // n} of "
                     f"{H}) of both weights, and only the activations travel.",
                     fix="Build both layers with your ColumnParallel and RowParallel, and feed "
                         "the row layer this rank's block of the normed features.")


def _collective_failures(outs: list, n: int, name: str) -> None:
    """Values right: refuse an all-reduce of a tensor every rank holds the same (it adds up n
    copies of what each rank has: the plain arithmetic has no such sum), then a count beyond
    what the norm needs."""
    __tracebackhide__ = True
    for where, key in (("forward", "fwd"), ("backward", "bwd")):
        handed = [o["summed"][key] for o in outs]
        for i, tensor in enumerate(handed[0]):
            same = all(len(h) > i and h[i].shape == tensor.shape and torch.equal(h[i], tensor)
                       for h in handed[1:])
            if same and n > 1:
                fail(f"all-reduce no. {i + 1} of {name}'s {where} ({n} ranks) sums a tensor of "
                     f"shape {tuple(tensor.shape)} that every rank holds the same, bit for bit: "
                     f"the sum is {n} copies of what each rank already has (divided back or "
                     f"not), a collective the plain network's arithmetic does not need.",
                     fix="Leave out the all-reduce of what every rank already holds whole.")
    for rank, o in enumerate(outs):
        for where, ops, base in (("forward", o["fwd"], "g's all-reduce"),
                                 ("backward", o["bwd"], "f's all-reduce")):
            extra = len(ops) - 1
            if extra > _MAX_EXTRA:
                fail(f"{name} makes {len(ops)} collectives in the {where} on rank {rank} "
                     f"({[op for op, _ in ops]}), although its values are right: besides "
                     f"{base}, the norm needs one exchange of the hidden features (or of their "
                     f"sums) — {extra} is communication the plain arithmetic does not need.",
                     fix="Exchange the hidden blocks (or their per-row sums) once in each pass.")


def norm_exchange(ops: list, hidden: int = H) -> list:
    """The collectives of one pass that are the norm's: all but one all-reduce of a ROWS × D
    tensor (g's in the forward, f's in the backward, which the MLP without the norm makes)."""
    ops, base = list(ops), ("all_reduce", ROWS * D)
    for i in range(len(ops) - 1, -1, -1):
        if ops[i][:2] == base:
            return ops[:i] + ops[i + 1:]
    return ops


def norm_bytes(ops: list, n: int) -> float:
    return sum(ring_bytes(op, nbytes, n) for op, _, nbytes in norm_exchange(ops))


def _shown(ops: list, n: int) -> str:
    return ", ".join(f"{op} of {numel} numbers: {_b(ring_bytes(op, nbytes, n))}"
                     for op, numel, nbytes in norm_exchange(ops))


def _byte_failures(outs: list, n: int, name: str, hidden: int = H) -> None:
    """Values right: refuse a norm exchange that sends more bytes per rank than the cheapest
    correct one (``norm_budget``), naming the all-reduce of the whole hidden gradient (kept
    1/n of) and the gather of the hidden blocks by their causes."""
    __tracebackhide__ = True
    budget = norm_budget(n)
    fix = ("Exchange what the norm needs of the other ranks' features, not the features: "
           "per-row sums over each rank's block (two numbers a row in all), all-reduced; and "
           "in the backward, the gradients of those sums, all-reduced.")
    for rank, o in enumerate(outs):
        ops = o.get("fwd_bytes", [])
        gathered = [(op, k, b) for op, k, b in norm_exchange(ops) if op == "all_gather"]
        if not gathered:
            continue
        _, k, b = gathered[0]
        alone = ring_bytes("all_gather", b, n)
        if alone > budget + 1e-9:
            fail(f"{name}'s forward on rank {rank} ({n} ranks) all-gathers the hidden blocks "
                 f"for the norm: that all-gather alone sends {_b(alone)} per rank, already "
                 f"{alone / budget:.0f}× the {_b(budget)} the cheapest correct exchange sends "
                 f"in a whole pass — whatever the backward does, a reduce-scatter there "
                 f"included. The all-gather brings every rank the other ranks' "
                 f"{(n - 1) * k // ROWS} hidden features of each of the {ROWS} rows, and it "
                 f"grows with h. LayerNorm needs less of the other ranks' features than the "
                 f"features themselves.", fix=fix)
    for rank, o in enumerate(outs):
        for op, k, b in norm_exchange(o.get("bwd_bytes", [])):
            if op == "all_reduce" and k == ROWS * hidden:
                ar, rs = ring_bytes("all_reduce", b, n), ring_bytes("reduce_scatter", b, n)
                fail(f"{name}'s backward on rank {rank} ({n} ranks) all-reduces the whole "
                     f"{ROWS} × {hidden} gradient of the gathered hidden row: every rank "
                     f"receives all {k} summed numbers to keep its {k // n}, {n}× what it "
                     f"keeps. A ring sends {_b(ar)} per rank for that all-reduce, 2× the "
                     f"{_b(rs)} a reduce-scatter of the same gradient sends (the all-reduce is "
                     f"a reduce-scatter and then an all-gather whose result is thrown away) — "
                     f"and the cheapest correct exchange for the norm sends {_b(budget)} in "
                     f"the whole pass.", fix=fix)
        for where, key in (("forward", "fwd_bytes"), ("backward", "bwd_bytes")):
            ops = o.get(key, [])
            moved = norm_bytes(ops, n)
            if moved <= budget + 1e-9:
                continue
            fail(f"{name}'s {where} on rank {rank} ({n} ranks) sends {_b(moved)} per rank for "
                 f"the norm ({_shown(ops, n)}, counted as a ring sends them), "
                 f"{moved / budget:.1f}× the {_b(budget)} the cheapest correct exchange "
                 f"sends in a pass.", fix=fix)


def one_pass_cancellation(n: int, shift: float = SHIFT) -> dict:
    """The large-mean case on one process, as ``n`` ranks would compute a one-pass variance
    (each rank's per-row sum and sum of squares, all-reduced; var = E[x^2] - E[x]^2) in
    float32: row 0's E[x^2], E[x]^2, their difference, the row's variance by torch, the
    mean and spread of its features, and how far that arithmetic's output is from plain(x)."""
    plain, x, _ = _normed_case(H, shift)
    with torch.no_grad():
        a = F.gelu(x @ plain[0].weight.T + plain[0].bias)
        blocks = _blocks(n)
        mean = sum(a[:, b].sum(-1) for b in blocks) / H
        ex2 = sum(a[:, b].square().sum(-1) for b in blocks) / H
        var = ex2 - mean.square()
        normed = (a - mean[:, None]) * torch.rsqrt(var[:, None] + NORM_EPS)
        w2, b2 = plain[3].weight, plain[3].bias
        y_one = normed @ w2.T + b2
        want = plain(x)
    return {"ex2": float(ex2[0]), "m2": float(mean[0].square()), "var": float(var[0]),
            "true_var": float(a[0].var(unbiased=False)), "mean": float(a[0].mean()),
            "spread": float((a[0] - a[0].mean()).abs().max()), "y": want,
            "one_pass_err": float((y_one - want).abs().max())}


def _digits(a: float, b: float) -> int:
    """How many leading significant digits two close numbers share."""
    import math
    if a == b:
        return 8
    return max(0, int(math.floor(-math.log10(abs(a - b) / max(abs(a), abs(b))))))


def _large_mean_failures(outs: list, n: int, name: str) -> None:
    """The first layer's bias shifted by SHIFT: the output must still be plain(x) within
    LARGE_ATOL on every rank. A variance from the sums of x and x^2 cancels here."""
    __tracebackhide__ = True
    sim = one_pass_cancellation(n)
    for rank, o in enumerate(outs):
        for what in ("build_error", "forward_error"):
            if what in o:
                fail(f"{name} raised on rank {rank} ({n} ranks) with the first layer's bias "
                     f"shifted by {SHIFT:g}: {o[what]}.")
        y = o.get("y")
        if isinstance(y, torch.Tensor) and y.shape == sim["y"].shape and torch.allclose(
                y, sim["y"], rtol=0, atol=LARGE_ATOL):
            continue
        err = (float((y - sim["y"]).abs().nan_to_num(float("inf")).max())
               if isinstance(y, torch.Tensor) and y.shape == sim["y"].shape else float("inf"))
        fail(f"{name}'s output on rank {rank} ({n} ranks) is off torch's LayerNorm MLP by "
             f"{'NaN or inf' if err == float('inf') else f'up to {err:.3g}'} when the hidden "
             f"activations have a large mean — the first layer's bias shifted by {SHIFT:g}, so "
             f"row 0's features lie within ±{sim['spread']:.2f} of {sim['mean']:.2f} — where "
             f"float32 allows {LARGE_ATOL:g}; with a small mean it matched. The variance "
             f"loses it to cancellation if it is E[x²] − E[x]²: in float32, row 0 has "
             f"E[x²] = {sim['ex2']:.4f} and E[x]² = {sim['m2']:.4f}, which agree in their "
             f"first {_digits(sim['ex2'], sim['m2'])} digits, so their difference "
             f"{sim['var']:.4f} is mostly rounding, where the row's variance is "
             f"{sim['true_var']:.4f} (that arithmetic's output is off by up to "
             f"{sim['one_pass_err']:.2g} here).",
             fix="Square deviations from a value every rank shares (the row's mean, once its "
                 "sums are all-reduced) rather than the features themselves: the same bytes, "
                 "one number a row in each of two all-reduces.")


def _uneven_failures(outs: list, name: str) -> str:
    """Hidden size ODD_H on 3 ranks: refused by every rank before any collective (as the
    learner's block_of decides), or the plain values within the byte budget."""
    __tracebackhide__ = True
    errors = [o.get("build_error") for o in outs]
    if all(errors):
        return "refused on every rank"
    if any(errors):
        fail(f"hidden size {ODD_H} on 3 ranks: some ranks refused to build {name} and some did "
             f"not ({errors}), and the ranks that went on wait for the others' collectives.",
             fix="refuse it on every rank, or handle it on every rank.")
    per = [sum(p.numel() for p in o["params"] if p.dim() == 2) // (2 * D) for o in outs]
    if sum(per) != ODD_H:
        fail(f"hidden size {ODD_H} on 3 ranks: {name}'s ranks hold blocks of {per} hidden "
             f"features, {sum(per)} in all — {ODD_H - sum(per)} of the {ODD_H} features belong to "
             f"no rank" if sum(per) < ODD_H else f"hidden size {ODD_H} on 3 ranks: {name}'s "
             f"ranks hold blocks of {per} hidden features, {sum(per)} in all: some feature is "
             f"held twice.", fix="Build both layers from block_of's blocks, which cover every "
                                 "feature once, or refuse the size on every rank.")
    _exact_failures(outs, 3, name, ODD_H, blocks=f", blocks of {per} hidden features")
    _byte_failures(outs, 3, name, ODD_H)
    return f"handled with blocks of {per}"


def check_normed(outs_by_n: dict, name: str, prediction=None, uneven=None,
                 bytes_prediction=None, large=None) -> None:
    """Diagnose the learner's runs ({world size: outs}; ``uneven``: the run with h = ODD_H on
    3 ranks; ``large``: (world size, outs) of the forward with the first layer's bias shifted
    by SHIFT) and pass, revealing the predictions."""
    __tracebackhide__ = True
    for n, outs in outs_by_n.items():
        for rank, o in enumerate(outs):
            if "build_error" in o:
                fail(f"{name}(plain, {rank}, {n}) raised while being built: "
                     f"{o['build_error']}.")
        sim = simulate(n)
        _parameter_failures(outs, n, name, sim["plain"])
        for rank, o in enumerate(outs):
            if "forward_error" in o:
                fail(f"{name}'s forward raised on rank {rank} ({n} ranks): "
                     f"{o['forward_error']}.")
            if tuple(o["y"].shape) != (ROWS, D):
                fail(f"{name}'s output on rank {rank} has shape {tuple(o['y'].shape)}, where "
                     f"the plain MLP's is {(ROWS, D)}.")
        _forward_failures(outs, n, name, sim)
        _backward_failures(outs, n, name, sim)
        _exact_failures(outs, n, name, H)
        _collective_failures(outs, n, name)
        _byte_failures(outs, n, name)
    if callable(large):
        large = large()
    if large is not None:
        _large_mean_failures(large[1], large[0], name)
    if callable(uneven):
        uneven = uneven()
    how = "" if uneven is None else f"; h = {ODD_H} on 3 ranks {_uneven_failures(uneven, name)}"
    two = min(outs_by_n)
    o = outs_by_n[two][0]
    fwd, bwd = norm_bytes(o["fwd_bytes"], two), norm_bytes(o["bwd_bytes"], two)
    passed(f"{name} equals the plain MLP with a LayerNorm({H}) between the layers — the output, "
           f"dL/dx, every rank's gradients of its blocks of both weights, and the output after "
           f"{_STEPS} SGD steps of each rank's own parameters (biases included) — on "
           f"{' and '.join(map(str, outs_by_n))} ranks{how}" + (
               "" if large is None else f"; with the first layer's bias shifted by {SHIFT:g} "
               f"(a large mean) the output within {LARGE_ATOL:g} on {large[0]} ranks") + f"; on {two} ranks the norm's "
           f"exchange sends {_b(fwd)} per rank in the forward and {_b(bwd)} in the backward "
           f"(the budget, the cheapest correct exchange: {_b(norm_budget(two))} per pass)")
    if bytes_prediction is not None:
        reveal_bytes_prediction(bytes_prediction, fwd, two)
    if prediction is not None:
        reveal_norm_prediction(prediction, max(outs_by_n))


def reveal_bytes_prediction(prediction, measured: float, n: int) -> None:
    """The fewest bytes the norm's forward exchange can send per rank (the learner's own
    exchange, measured within the budget), against the gather the lesson's habits suggest."""
    value = getattr(prediction, "value", None)
    close = isinstance(value, (int, float)) and abs(value - measured) < 0.5
    gather = ring_bytes("all_gather", ROWS * (H // n) * 4, n)
    big_h = 4 * 4096
    reveal(prediction, round(measured, 1), close=close, explanation=(
        f"LayerNorm needs of the other ranks' features only two numbers per row — their sum, "
        f"then their squared deviations from the row's mean summed (not the sum of squares: "
        f"E[x²] − E[x]² cancels when the mean is large, as the check's shifted case shows) — "
        f"so {ROWS} rows × 2 float32 numbers = {ROWS * 8} B all-reduced; a ring sends "
        f"2(t − 1)/t of it per rank: {_b(measured)} on {n} ranks. Gathering the hidden blocks instead sends "
        f"{_b(gather)} here, and it grows with h: at h = {big_h} it is "
        f"{_b(ring_bytes('all_gather', ROWS * (big_h // n) * 4, n))} against the same "
        f"{_b(measured)}. The backward is the same exchange, of the sums' gradients."))


def reveal_norm_prediction(prediction, n: int) -> None:
    """What goes wrong when the norm's communication sends nothing back in the backward,
    measured on one process (the simulated arrangement), against the learner's choice."""
    sim = simulate(n)
    out_diff = float((sim["y_own"] - sim["y"]).abs().max())
    out_diff = 0.0 if out_diff < 1e-5 else out_diff
    dx = float((sim["x_grad_own"] - sim["x_grad"]).norm() / sim["x_grad"].norm())
    dz = float((sim["dz_own"] - sim["dz"]).norm() / sim["dz"].norm())
    measured = "the output" if out_diff and not dx else (
        "both" if out_diff and dx else (_RIGHT_CHOICE if dx else "neither"))
    value = getattr(prediction, "value", None)
    reveal(prediction, measured, close=value == measured, explanation=(
        f"With the hidden blocks gathered and the gather's backward sending nothing, on {n} "
        f"ranks the "
        f"output matches the plain MLP's (largest difference {out_diff:.1g}: the forward did "
        f"not change), but the gradient of the "
        f"first layer's output is off by {100 * dz:.0f} % and dL/dx by {100 * dx:.0f} % "
        f"(relative norm). Each rank's block of the norm's output depends on every hidden "
        f"feature through the mean and variance, so the gradient for rank r's features has a "
        f"part on every rank. Megatron's gather_from_tensor_model_parallel_region gives its "
        f"all-gather a backward that only keeps this rank's block — right where everything "
        f"after the gather runs the same on every rank, wrong here, where each rank feeds "
        f"only its own block onwards."))
