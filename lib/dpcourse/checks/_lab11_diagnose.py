"""How lab11's checks tell one wrong answer from another: the cases they run (the model's
width, the hidden size, the data), the diagnosis of the f/g conjugates (part 1), and the
reference SGD steps every layer and MLP is judged against. The layers' and the MLP's own
diagnoses build on these in :mod:`dpcourse.checks._lab11_layer_diagnosis`.

:mod:`dpcourse.checks.lab11` holds the public checks and the workers that run the learner's
code; it calls these after each launch. Kept apart so that each file holds one idea: running
the learner's code, and reading what it did.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from . import fail

D, H, ROWS = 6, 12, 5            # input width, hidden width (2 and 3 divide it), batch rows


ODD_H = 16                       # a hidden size 3 does not divide


_RTOL, _ATOL = 1e-5, 1e-6


def _close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a, b, rtol=_RTOL, atol=_ATOL))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _data(world_size: int, *shape, seed: int = 0) -> torch.Tensor:
    """world_size different tensors of ``shape``, the same on every rank (a generator, so the
    learner's code sees the global random state untouched)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(world_size, *shape, generator=gen)


_NAMES = {"f": "f_communicates_in", "g": "g_communicates_in"}


def _passes(fwd: int, bwd: int) -> str:
    return {(True, True): "both", (True, False): "forward", (False, True): "backward",
            (False, False): "neither"}[(bool(fwd), bool(bwd))]


def _against_declaration(outs: list, f_name: str, g_name: str, declared: dict) -> None:
    """Refuse code that does not communicate in the passes the learner declared."""
    __tracebackhide__ = True
    o = outs[-1]
    if any(k in o for k in ("f_error", "g_error")) or o["f_grad"] is None or o["g_grad"] is None:
        return                     # _diagnose_conjugates names the exception or the None
    f_does, g_does = _passes(o["f_fwd"], o["f_bwd"]), _passes(o["g_fwd"], o["g_bwd"])
    if f_does == declared["g"] and g_does == declared["f"] and f_does != g_does:
        fail(f"{f_name} communicates where you declared g does, and {g_name} where you "
             f"declared f does: f and g are swapped.",
             fix="f wraps the column layer's input, g the row layer's product.")
    for op, name, does in (("f", f_name, f_does), ("g", g_name, g_does)):
        if does != declared[op]:
            where = {"both": "in both passes", "neither": "in neither pass",
                     "forward": "in its forward only",
                     "backward": "in its backward only"}[does]
            fail(f"your {name} communicates {where}, but you declared {_NAMES[op]} = "
                 f"{declared[op]!r}: the code does not do what your own diagnosis says.")


def _diagnose_conjugates(outs: list, n: int, f_name: str, g_name: str) -> None:
    __tracebackhide__ = True
    xs, gs = _data(n, ROWS, D, seed=1), _data(n, ROWS, D, seed=2)
    x, g_sum = xs[0], gs.sum(0)
    for rank, o in enumerate(outs):
        if "f_error" in o:
            fail(f"{f_name} raised on rank {rank}: {o['f_error']}.",
                 fix="forward(ctx, x) returns a tensor of x's shape, backward(ctx, grad) returns the "
                     "gradient of x.")
        if "g_error" in o:
            fail(f"{g_name} raised on rank {rank}: {o['g_error']}.",
                 fix="forward(ctx, x) returns a tensor of x's shape, backward(ctx, grad) returns the "
                     "gradient of x.")
    o = outs[n - 1]
    rank = n - 1
    f_like_g = _close(o["f_y"], n * x) and _close(o["f_grad"], gs[rank])
    g_like_f = _close(o["g_z"], xs[rank]) and _close(o["g_grad"], g_sum)
    if f_like_g and g_like_f:
        fail(f"{f_name} and {g_name} are swapped: f wraps an input that every rank already "
             f"holds whole, g an output of which each rank holds only a part — each needs the "
             f"communication that its own position calls for.")
    # f's forward
    if _close(o["f_y"], n * x):
        fail(f"{f_name}'s forward all-reduces x: every rank already holds the same x, so the "
             f"sum is {n}·x where the column layer needs x itself.")
    if not _close(o["f_y"], x):
        fail(f"{f_name}'s forward changes x, but the column layer needs the x every rank "
             f"already holds.", fix="return x itself (the identity).")
    if o["f_fwd"]:
        fail(f"{f_name}'s forward makes {o['f_fwd']} collective call(s) and still returns x "
             f"(an all-reduce divided by the world size?): every rank already holds x, so that "
             f"pass has nothing to exchange.")
    # f's backward
    if o["f_grad"] is None:
        fail(f"x has no gradient after {f_name}'s backward: backward returned None.",
             fix="backward returns the gradient of x.")
    if _close(o["f_grad"], gs[rank]) or o["f_bwd"] == 0:
        fail(f"{f_name}'s backward returns this rank's gradient as it came: it holds only the "
             f"part of dL/dx that flows through this rank's block of the next layer, and x "
             f"reaches the loss through every rank's block.")
    if _close(o["f_grad"], g_sum / n):
        fail(f"{f_name}'s backward averages the gradients (divided by the world size), but dL/dx "
             f"is the SUM of the ranks' parts: it comes out {n} times too small.",
             fix="do not divide.")
    if not _close(o["f_grad"], g_sum):
        fail(f"{f_name}'s backward returns a gradient that is neither this rank's part of "
             f"dL/dx nor the whole of it (the sum of every rank's part).")
    # g's forward
    x_sum = xs.sum(0)
    if _close(o["g_z"], xs[rank]) or o["g_fwd"] == 0:
        fail(f"{g_name}'s forward returns its input unchanged: each rank holds only a partial "
             f"product, and the layer's output is all of them added up.")
    if _close(o["g_z"], x_sum / n):
        fail(f"{g_name}'s forward averages (divides by the world size), but a row-parallel "
             f"layer's partial products add up to the output: it comes out {n} times too small.",
             fix="sum them, do not divide.")
    if not _close(o["g_z"], x_sum):
        fail(f"{g_name}'s forward does not return the sum over the ranks of their inputs.")
    # g's backward
    if o["g_grad"] is None:
        fail(f"the input has no gradient after {g_name}'s backward: backward returned None.",
             fix="backward returns the gradient of its input.")
    if _close(o["g_grad"], g_sum) or o["g_bwd"]:
        fail(f"{g_name}'s backward all-reduces: the gradient of a sum reaches each term "
             f"unchanged, and every rank already holds it (what follows g runs the same on "
             f"every rank) — summing adds the other ranks' copies in.")
    if not _close(o["g_grad"], gs[rank]):
        fail(f"{g_name}'s backward changes the gradient, but the gradient of a sum reaches "
             f"each term unchanged.")


_STEPS, _LR = 2, 0.1            # the SGD steps every layer and MLP check trains for, and their lr


def _reference_steps(full: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> list:
    """The plain layer (or MLP) on one process, trained as :func:`_sgd_outputs` trains each
    rank's part: its output after each SGD step. ``full`` has had one backward already."""
    grads = [None if p.grad is None else p.grad.clone() for p in full.parameters()]
    full = copy.deepcopy(full)                 # a Parameter's deepcopy leaves its .grad behind
    for p, g in zip(full.parameters(), grads):
        p.grad = g
    x = x.detach().clone().requires_grad_(True)
    opt = torch.optim.SGD(full.parameters(), lr=_LR)
    stepped = []
    for _ in range(_STEPS):
        opt.step()
        opt.zero_grad(set_to_none=True)
        y = full(x)
        stepped.append(y.detach().clone())
        y.backward(upstream.clone())
    return stepped


def _stepped_close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a, b, rtol=1e-4, atol=1e-5))


def _bias_taken_times(diff: torch.Tensor, bias_grad: torch.Tensor):
    """How many times the bias's SGD step is in the output after one step, when the output's
    error ``diff`` is (k − 1) times that step on every row (k ≥ 2); None otherwise."""
    if bias_grad is None or diff.dim() != 2 or diff.shape[-1] != bias_grad.shape[0]:
        return None
    step = -_LR * bias_grad
    c = float((diff * step).sum() / (diff.shape[0] * step.square().sum()))
    k = round(c)
    if k >= 1 and _stepped_close(diff, k * step.expand_as(diff)):
        return k + 1
    return None


def _stepped_failures(outs: list, n: int, name: str, reference: list, bias_grad, kind: str) -> None:
    """Each rank's output after each of ``_STEPS`` SGD steps (lr ``_LR``) of its own parameters
    against the plain layer's (or MLP's), trained the same way on one process. Run after the
    one-step diagnoses passed: what fails here is a layer that computes right but trains
    wrong."""
    __tracebackhide__ = True
    thing = "MLP" if kind == "mlp" else "layer"
    for rank, o in enumerate(outs):
        if "step_error" in o:
            fail(f"an SGD step (lr {_LR}) of rank {rank}'s parameters, then a forward and backward "
                 f"of {name}, raised: {o['step_error']}.")
    for k, want in enumerate(reference):
        for rank, o in enumerate(outs):
            got = o["stepped"][k] if k < len(o.get("stepped", ())) else None
            if kind == "column" and got is not None:
                per = want.shape[1] // n
                want_r = want[:, rank * per:(rank + 1) * per]
            else:
                want_r = want
            if _stepped_close(got, want_r):
                continue
            times = (_bias_taken_times(got - want_r, bias_grad)
                     if k == 0 and kind != "column" and got is not None
                     and got.shape == want_r.shape else None)
            if times is not None:
                held = [r for r, q in enumerate(outs)
                        if any(p.dim() == 1 and p.shape[0] == D for p in q["params"])]
                zeros = [r for r in held if any(p.dim() == 1 and p.shape[0] == D
                                                and not p.any() for p in outs[r]["params"])]
                who = (f"rank {zeros[0]} holds" if len(zeros) == 1 else
                       f"ranks {', '.join(map(str, zeros))} hold")
                start = (f"{who} a bias of zeros, so the copies added up to the bias at the "
                         f"start" if zeros else "the copies added up to the bias at the start")
                fail(f"after one SGD step (lr {_LR}) of each rank's own parameters, {name}'s "
                     f"output on rank {rank} holds the bias's step {times} times, where the "
                     f"full {thing}'s holds it once: {times} ranks add a bias of {D} numbers "
                     f"to their partial products before the sum ({start}), and each of them "
                     f"gets the whole dL/db, since g's backward hands dL/dY to every partial "
                     f"product unchanged — so each copy takes the full step and the sum takes "
                     f"it {times} times. One forward and backward cannot show it; training "
                     f"drifts further with every step.",
                     fix="hold the row bias's numbers once over the ranks (whole on one rank and "
                         "added before g, whole on every rank and added after g, or one block "
                         "per rank), so that one step moves the sum's bias once.")
            fail(f"after {k + 1} SGD step(s) (lr {_LR}) of each rank's own parameters, "
                 f"{name}'s output on rank {rank} differs from the full {thing}'s trained the "
                 f"same way, although one forward and backward matched it: some parameter's "
                 f"step does not move the {thing} the way the full {thing}'s step moves it.")


def _find_slice(p: torch.Tensor, full: torch.Tensor, dim: int):
    """The start of the contiguous block of ``full`` along ``dim`` equal to ``p``, or None."""
    if p.dim() != full.dim() or any(a != b for d, (a, b) in enumerate(zip(p.shape, full.shape))
                                    if d != dim):
        return None
    k = p.shape[dim]
    for s in range(full.shape[dim] - k + 1):
        if torch.equal(full.narrow(dim, s, k), p):
            return s
    return None
