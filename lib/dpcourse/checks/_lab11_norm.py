"""Lab 11's arrangement the lesson did not show: a layer norm over the hidden features between
the column- and the row-parallel layer (NormFormer's "FFN LN", Shleifer et al. 2021),
``Sequential(Linear(6, 12), GELU(), LayerNorm(12, elementwise_affine=False), Linear(12, 6))``.

The hidden features are cut over the ranks, and the norm's mean and variance run over all of
them: the learner decides where the ranks communicate for it (the hidden blocks gathered, or
their sums all-reduced) and what that communication's backward is. The answer is not a table:
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
from ._lab11_diagnose import D, H, ROWS, _close, _data, _error, _find_slice

NORM_EPS = 1e-5
# the most collectives the norm may add to a pass (besides g's forward all-reduce and f's
# backward one): one gather, or the statistics as one stacked or two separate all-reduces
_MAX_EXTRA = 2

NORM_CHOICES = ("the output", "dL/dx and the first layer's gradients", "both", "neither")
_RIGHT_CHOICE = NORM_CHOICES[1]


def _plain_normed() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(16)
        return nn.Sequential(nn.Linear(D, H), nn.GELU(),
                             nn.LayerNorm(H, eps=NORM_EPS, elementwise_affine=False),
                             nn.Linear(H, D))


def _normed_case() -> tuple:
    return _plain_normed(), _data(1, ROWS, D, seed=17)[0], _data(1, ROWS, D, seed=18)[0]


def normed_worker(rank: int, world_size: int, mlp_cls) -> dict:
    """Runs on each rank: the learner's module built from the plain normed MLP, one forward
    and one backward, every collective of each pass recorded (op and elements)."""
    from ..collectives import record_collectives

    torch.set_num_threads(1)
    plain, x, upstream = _normed_case()
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
    out["fwd"] = [(c.op, c.numel) for c in fwd if c.op != "barrier"]
    if tuple(y.shape) != tuple(upstream.shape):
        return out
    try:
        with record_collectives(before=keeper("bwd")) as bwd:
            y.backward(upstream.clone())
    except Exception as exc:
        return {**out, "backward_error": _error(exc)}
    out["summed"] = summed
    out["bwd"] = [(c.op, c.numel) for c in bwd if c.op != "barrier"]
    out["x_grad"] = None if x.grad is None else x.grad.clone()
    out["grads"] = [None if p.grad is None else p.grad.clone() for p in mlp.parameters()]
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
    local_y = b2 + sum(F.layer_norm(a[:, blk], (blk.stop - blk.start,), eps=NORM_EPS)
                       @ w2[:, blk].T for blk in _blocks(n))
    per = H // n
    summed = sum(a[:, blk] for blk in _blocks(n))    # the blocks added, feature by feature
    summed_y = b2 + sum(F.layer_norm(summed, (per,), eps=NORM_EPS) @ w2[:, blk].T
                        for blk in _blocks(n))
    return {"plain": plain, "a": a, "y": y_right, "y_own": y_own, "local_y": local_y,
            "summed_y": summed_y,
            "dz": dz_right, "dz_own": dz_own, "x_grad": dz_right @ w1,
            "x_grad_own": dz_own @ w1, "x": x}


def _w1_shard(o: dict, w1: torch.Tensor):
    """(start, gradient) of this rank's block of the first weight, in torch's (out, in)
    layout (a shard stored as (in, out) is turned round), or None."""
    for p, g in zip(o["params"], o["grads"]):
        if p.dim() != 2:
            continue
        for cand, grad, turned in ((p, g, False), (p.T, g, True)):
            start = _find_slice(cand, w1, 0)
            if start is not None and cand.shape[0] < w1.shape[0]:
                return start, cand.shape[0], (None if grad is None else
                                               (grad.T if turned else grad))
    return None


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
        if _close(grad, own):
            missing = want - own
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


def _moved(ops: list) -> int:
    return sum(numel for _, numel in ops)


def check_normed(outs_by_n: dict, name: str, prediction=None) -> None:
    """Diagnose the learner's runs ({world size: outs}) and pass, revealing the prediction."""
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
        _collective_failures(outs, n, name)
    n = max(outs_by_n)
    outs = outs_by_n[n]
    fwd, bwd = outs[0]["fwd"], outs[0]["bwd"]
    passed(f"{name} equals the plain MLP with a LayerNorm({H}) between the layers (output, "
           f"dL/dx and the first weight's gradient) on {' and '.join(map(str, outs_by_n))} "
           f"ranks; on {n} ranks rank 0's forward makes {[op for op, _ in fwd]} "
           f"({_moved(fwd)} elements in) and its backward {[op for op, _ in bwd]} "
           f"({_moved(bwd)} elements in)")
    if prediction is not None:
        reveal_norm_prediction(prediction, n)


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
        f"With the forward's exchange kept and its backward sending nothing, on {n} ranks the "
        f"output matches the plain MLP's (largest difference {out_diff:.1g}: the forward did "
        f"not change), but the gradient of the "
        f"first layer's output is off by {100 * dz:.0f} % and dL/dx by {100 * dx:.0f} % "
        f"(relative norm). Each rank's block of the norm's output depends on every hidden "
        f"feature through the mean and variance, so the gradient for rank r's features has a "
        f"part on every rank. Megatron's gather_from_tensor_model_parallel_region gives its "
        f"all-gather a backward that only keeps this rank's block — right where everything "
        f"after the gather runs the same on every rank, wrong here, where each rank feeds "
        f"only its own block onwards."))
