"""How lab11's checks read what the learner's tensor-parallel layers did: the column and the row
layer (which dimension was cut, which block each rank holds, whether the storage is the rank's
own, the gradients and the SGD steps) and the MLP built of the two.

Kept apart from :mod:`dpcourse.checks._lab11_diagnose` (the cases every check runs, the f/g
conjugates' diagnosis and the reference SGD steps), which it builds on; the checks that launch
the learner's layers (:mod:`dpcourse.checks._lab11_layers`, :mod:`dpcourse.checks._lab11_mlp`)
call it after each launch.
"""

from __future__ import annotations

import torch
from torch import nn

from . import fail
from ._lab11_diagnose import (D, H, ROWS, _close, _data, _find_slice, _reference_steps,
                              _stepped_failures)


_DIM_NAMES = {"column": "column_weight_dim", "row": "row_weight_dim"}


def _common_layer_failures(outs: list, n: int, name: str, full: nn.Linear, kind: str) -> None:
    __tracebackhide__ = True
    out_f, in_f = full.weight.shape
    per_out, per_in = out_f // n, in_f // n
    for rank, o in enumerate(outs):
        if "build_error" in o:
            fail(f"{name}(linear, {rank}, {n}) raised while being built: {o['build_error']}.")
    shapes = outs[0]["shapes"]
    right = (per_out, in_f) if kind == "column" else (out_f, per_in)
    hidden = out_f if kind == "column" else in_f
    hidden_per = hidden // n
    _wrong_dimension(outs, n, name, full, kind, right)
    if (out_f, in_f) in shapes:
        fail(f"{name} keeps the whole weight {(out_f, in_f)} on every rank, where each rank "
             f"needs only its block of the hidden features ({hidden_per} of {hidden}).")
    if kind == "column" and (out_f,) in shapes and (per_out,) not in shapes:
        fail(f"{name} keeps the whole bias ({out_f},) on every rank: a rank computes only its "
             f"block of the output features, and so needs only their biases.")
    if right not in shapes and right[::-1] not in shapes:
        fail(f"{name}'s parameters are {shapes}, none of them a block of the weight, so this "
             f"rank's block gets no gradient and is never trained.",
             fix="keep this rank's block as an nn.Parameter (a plain tensor gets no gradient).")
    for rank, o in enumerate(outs):
        if "forward_error" in o:
            fail(f"{name}'s forward raised on rank {rank}: {o['forward_error']}.")


def _storage_failures(outs: list, name: str, full: nn.Linear, n: int) -> None:
    """A parameter made from the full layer's tensor without a copy (``nn.Parameter(
    linear.weight[s:e])``) shares its storage: the layer holds the right values, but the whole
    tensor stays alive in it, against the contract's new parameters (the full layer is not
    kept)."""
    __tracebackhide__ = True
    for rank, o in enumerate(outs):
        for shape, whose, held, uses in o.get("shared", ()):
            size = tuple(getattr(full, whose).shape)
            more = (f"all {held} numbers of it stay alive in your layer, of which this "
                    f"parameter uses {uses}" if held > uses else
                    "the full layer's tensor itself stays in your layer")
            fail(f"{name}(linear, {rank}, {n}) keeps a parameter of shape {shape} that shares "
                 f"its storage with the full layer's {whose} {size} (a slice or view of it, not "
                 f"a copy): {more}, so the full layer is kept after all, and the memory tensor "
                 f"parallelism is there to save is not saved.",
                 fix="copy the block (.clone()) before wrapping it in nn.Parameter, so that "
                     "it owns storage of its own.")


def _wrong_dimension(outs: list, n: int, name: str, full: nn.Linear, kind: str,
                     right: tuple) -> None:
    """Both layers cut the hidden dimension (H features) and keep the model's width (D) whole:
    a weight whose H-sized dimension is whole while its D-sized one is cut on some rank was cut
    along the wrong dimension — also when rank 0 seems to keep "the whole weight" because the
    block bounds of H features, applied to the D-sized dimension, run past its end."""
    __tracebackhide__ = True
    out_f, in_f = full.weight.shape
    hidden, width = (out_f, in_f) if kind == "column" else (in_f, out_f)
    weights = [next((s for s in o["shapes"] if len(s) == 2), None) for o in outs]
    cut_wrong = [r for r, s in enumerate(weights)
                 if s is not None and hidden in s and min(s) < width and s != right[::-1]]
    if not cut_wrong:
        return
    which = ("output features (and every input feature)" if kind == "column"
             else "input features (and every output feature)")
    shown = ", ".join(f"rank {r}: {weights[r]}" for r in range(n))
    past_end = any(weights[r] == (out_f, in_f) for r in range(n))
    fail(f"{name} cut the weight along the wrong dimension (from linear.weight of shape "
         f"{(out_f, in_f)}, its shards are {shown}): the shards keep all {hidden} hidden "
         f"features and cut the model's width of {width}, but a {kind}-parallel layer keeps a "
         f"block of its {which}"
         + (f" — the bounds of a block of the {hidden} hidden features, applied to the "
            f"dimension of {width}, give some ranks all of it and others nothing" if past_end
            else "") + ".")


def _cut_dim(shape: tuple, full_shape: tuple, n: int):
    """The dimension of the full weight a rank's 2-D shard cut (stored either way round), or
    None when its shape is neither cut's."""
    out_f, in_f = full_shape
    for dim, cut in ((0, (out_f // n, in_f)), (1, (out_f, in_f // n))):
        if sorted(shape) == sorted(cut) and sorted(cut) != sorted(full_shape):
            return dim
    return None


def _against_dim(outs: list, n: int, name: str, full: nn.Linear, kind: str,
                 declared: int) -> None:
    """Refuse shards that cut another dimension of linear.weight than the learner declared."""
    __tracebackhide__ = True
    shape = tuple(full.weight.shape)
    for rank, o in enumerate(outs):
        weight = next((s for s in o.get("shapes", []) if len(s) == 2), None)
        cut = None if weight is None else _cut_dim(weight, shape, n)
        if cut is not None and cut != declared:
            fail(f"rank {rank}'s weight shard of {name} has shape {weight}, cut along "
                 f"dimension {cut} of linear.weight {shape}, but you declared "
                 f"{_DIM_NAMES[kind]} = {declared} (from the layout you stated): your code does not do what "
                 f"your own decision says.")


def _which_block(weight: torch.Tensor, full_weight: torch.Tensor, dim: int, n: int):
    """The rank whose contiguous block along ``dim`` this shard is, 'strided' or None."""
    per = full_weight.shape[dim] // n
    for s in range(n):
        if torch.equal(weight, full_weight.narrow(dim, s * per, per)):
            return s
    strided = [full_weight.index_select(dim, torch.arange(s, full_weight.shape[dim], n))
               for s in range(n)]
    if any(torch.equal(weight, t) for t in strided):
        return "strided"
    return None


def _block_failures(outs: list, n: int, name: str, full: nn.Linear, dim: int) -> None:
    __tracebackhide__ = True
    per = full.weight.shape[dim] // n
    for rank, o in enumerate(outs):
        shard = next((p for p in o["params"] if p.dim() == 2), None)
        s = _which_block(shard, full.weight.detach(), dim, n)
        if s is None and _which_block(shard.T, full.weight.detach(), dim, n) is not None:
            s = _which_block(shard.T, full.weight.detach(), dim, n)
            o["transposed"] = True     # stored as (in, out) for x @ W: a right variant
        what = "rows" if dim == 0 else "columns"
        if s == "strided":
            fail(f"rank {rank} of {name} took every {n}-th {what[:-1]} (a strided shard), so the "
                 f"next layer's block does not line up with it.",
                 fix=f"keep the contiguous block [rank × {per}, (rank + 1) × {per}), as Megatron does.")
        if isinstance(s, int) and s != rank:
            fail(f"rank {rank} of {name} kept the {what} of rank {s} ([{s * per}, "
                 f"{(s + 1) * per})), the block of another rank.",
                 fix=f"offset the block by the rank: rank r keeps [r × {per}, (r + 1) × {per}).")
        if s is None:
            fail(f"rank {rank}'s weight shard of {name} is not a block of the full layer's "
                 f"{what}.", fix=f"copy linear.weight's {what} [rank × {per}, (rank + 1) × {per}).")


def _weight_grads(o: dict) -> list:
    """The 2-D parameters' gradients, in torch's (out, in) layout."""
    grads = [g for p, g in zip(o["params"], o["grads"]) if p.dim() == 2 and g is not None]
    return [g.T for g in grads] if o.get("transposed") else grads


def _backward_ran(o: dict, rank: int, name: str, what: str) -> None:
    """What both layers' diagnoses check first after the forward: the backward ran, and reached
    the layer's input."""
    __tracebackhide__ = True
    if "backward_error" in o:
        fail(f"the backward through {name} raised on rank {rank}: {o['backward_error']}.")
    if o["x_grad"] is None:
        fail(f"{what} has no gradient after the backward through {name}: the forward cuts it "
             f"off from autograd (a detach, .data, or a backward that returns None).")


def _weight_grad_is(o: dict, rank: int, name: str, want: torch.Tensor, what: str,
                    per: int) -> None:
    """This rank's weight gradient is ``want``, the matching block of the full layer's."""
    __tracebackhide__ = True
    weights = _weight_grads(o)
    if not weights or not _close(weights[0], want):
        fail(f"the weight gradient of {name} on rank {rank} is not the full layer's {what} "
             f"[{rank * per}, {(rank + 1) * per}).")


def _layer_reference(n: int, y_full: torch.Tensor) -> tuple:
    """What both layer diagnoses open with: the hidden features per rank, each rank's block of
    them (a slice), and the full layer's output, detached."""
    per = H // n
    return per, [slice(r * per, (r + 1) * per) for r in range(n)], y_full.detach()


def _diagnose_column(outs: list, n: int, name: str, full, x, grad_full, y_full) -> None:
    __tracebackhide__ = True
    per, blocks, y_whole = _layer_reference(n, y_full)
    for rank, o in enumerate(outs):
        block = blocks[rank]
        if o["y"].shape == y_full.shape:
            fail(f"{name} returns all {H} output features on rank {rank}: each rank returns "
                 f"only its block of {per} (the next, row-parallel layer takes that block) — "
                 f"no all-reduce or all-gather in the column layer's forward.")
        if o["fwd"]:
            fail(f"{name}'s forward makes {o['fwd']} collective call(s) on rank {rank}: the "
                 f"column layer's forward needs none — every rank already holds the same x, "
                 f"and its output stays split by rank (the all-reduce belongs in f's "
                 f"backward).")
        want = y_whole[:, block]
        if not _close(o["y"], want):
            without_bias = want - full.bias.detach()[block]
            if _close(o["y"], without_bias):
                fail(f"{name}'s output on rank {rank} lacks the bias of its output features.")
            fail(f"{name}'s output on rank {rank} is not features [{rank * per}, "
                 f"{(rank + 1) * per}) of the full layer's output.")
        _backward_ran(o, rank, name, "x")
        partial = grad_full[:, block] @ full.weight.detach()[block]
        if _close(o["x_grad"], partial) or o["bwd"] == 0:
            fail(f"no communication in the backward of {name}: dL/dx on rank {rank} is only the "
                 f"part that flows through its own block of output features, and x reaches the "
                 f"loss through every rank's block.")
        if _close(o["x_grad"], x.grad / n):
            fail(f"{name}'s backward averages dL/dx over the ranks: it is the SUM of every "
                 f"block's part — do not divide by the world size.")
        if not _close(o["x_grad"], x.grad):
            summed = sum(grad_full[:, b] for b in blocks)
            if _close(o["x_grad"], summed @ full.weight.detach()[block]):
                fail(f"{name} applies f to its output: its backward then sums the gradient of "
                     f"the output blocks (each rank's is different), where the sum the layer "
                     f"needs is that of dL/dx.")
            fail(f"dL/dx after {name}'s backward on rank {rank} is not the full layer's.")
        _weight_grad_is(o, rank, name, full.weight.grad[block], "rows", per)
        biases = [g for p, g in zip(o["params"], o["grads"]) if p.dim() == 1]
        if not biases or not _close(biases[0], full.bias.grad[block]):
            fail(f"the bias gradient of {name} on rank {rank} is not the full bias's block: the "
                 f"bias does not reach the output as a parameter of this rank's block.",
                 fix="keep the bias block as an nn.Parameter and add it in the forward.")


def _dead_bias(name: str, rank: int, shape: tuple, n: int) -> None:
    """A bias parameter that a rank holds but its forward never uses: its .grad stays None.
    (DDP marks a parameter without a gradient ready only with find_unused_parameters=True:
    torch/nn/parallel/distributed.py, the argument's docstring.)"""
    __tracebackhide__ = True
    fail(f"{name} on rank {rank} holds a bias parameter of shape {shape} whose .grad is still "
         f"None after the backward ({n} ranks): that rank's forward never uses it, so it is a "
         f"dead parameter that never trains — the goal asks every bias a rank holds to get the "
         f"full layer's gradient, and DDP around it would wait for that gradient unless built with "
         f"find_unused_parameters=True.",
         fix="hold the bias only on the ranks whose forward adds it, or add it on every rank "
             "where it counts once.")


def _diagnose_row(outs: list, n: int, name: str, full, h_full, grad_full, y_full) -> None:
    __tracebackhide__ = True
    bias = full.bias.detach()
    per, blocks, want = _layer_reference(n, y_full)
    for rank, o in enumerate(outs):
        if o["fwd"] == 0:
            fail(f"no communication in {name}'s forward: rank {rank}'s output is only its "
                 f"partial product (its block of the hidden features times its block of the "
                 f"weight), one term of the layer's output.")
        if _close(o["y"], want + (n - 1) * bias):
            fail(f"{name} adds the bias on every rank before the all-reduce, so the sum holds it "
                 f"{n} times where the output holds it once.")
        if _close(o["y"], (want - bias) / n + bias) or _close(o["y"], want / n):
            fail(f"{name} averages the partial products (divides by the world size), but they are "
                 f"parts of one matrix product: the output comes out {n} times too small.",
                 fix="sum them, do not divide.")
        if not _close(o["y"], want):
            if _close(o["y"], want - bias):
                fail(f"{name}'s output on rank {rank} lacks the bias: every rank's output is "
                     f"the full layer's, bias included.")
            hs = h_full.detach()
            summed = sum(hs[:, block] for block in blocks)
            w_r = full.weight.detach()[:, blocks[rank]]
            if _close(o["y"], summed @ w_r.T + bias) or _close(o["y"], summed @ w_r.T):
                fail(f"{name} applies g to its input, before the matmul: it sums the ranks' "
                     f"hidden blocks, which are different features, not parts of one sum.")
            fail(f"{name}'s output on rank {rank} is not the full layer's output.")
        _backward_ran(o, rank, name, "the hidden block")
        want_x = h_full.grad[:, blocks[rank]]
        if _close(o["x_grad"], n * want_x) or o["bwd"]:
            fail(f"{name}'s backward all-reduces (it makes {o['bwd']} collective call(s) and "
                 f"dL/dh comes out {n} times too large): every rank already has the same dL/dy "
                 f"(its output is replicated), and the gradient of a sum reaches each partial "
                 f"product unchanged.")
        if not _close(o["x_grad"], want_x):
            fail(f"the gradient of the hidden block after {name}'s backward on rank {rank} is "
                 f"not the full layer's.")
        _weight_grad_is(o, rank, name, full.weight.grad[:, blocks[rank]], "columns", per)
    # the bias: wherever it lives, its gradient is the whole bias's
    holders = []
    for rank, o in enumerate(outs):
        for p, g in zip(o["params"], o["grads"]):
            if p.dim() != 1:
                continue
            if p.shape != bias.shape:          # a block of the bias: its block of the gradient
                start = _find_slice(p, bias, 0)
                if start is None:
                    fail(f"{name} on rank {rank} holds a bias parameter of shape "
                         f"{tuple(p.shape)} that is neither the layer's bias {tuple(bias.shape)} "
                         f"nor a block of it.")
                if g is None:
                    _dead_bias(name, rank, tuple(p.shape), n)
                want_b = full.bias.grad.narrow(0, start, p.shape[0])
                if not _close(g, want_b):
                    fail(f"the gradient of {name}'s bias block [{start}, {start + p.shape[0]}) "
                         f"on rank {rank} is not that block of the full layer's bias gradient.")
                holders.append(rank)
                continue
            if not torch.equal(p, bias) and torch.allclose(p, bias / n):
                fail(f"{name} keeps the bias divided by the world size on every rank: the "
                     f"output adds up right, and each copy even gets the whole dL/db as its "
                     f"gradient — but a step then moves each of the {n} copies by lr·dL/db, so "
                     f"the bias they add up to moves {n} times as far as the full layer's.")
            if g is None:
                _dead_bias(name, rank, tuple(p.shape), n)
            if _close(g, full.bias.grad / n):
                fail(f"{name}'s bias gets 1/{n} of its gradient on rank {rank}: the bias is "
                     f"scaled by 1/N on its way into the output.")
            if not _close(g, full.bias.grad):
                fail(f"the bias gradient of {name} on rank {rank} is not the full layer's.")
            holders.append(rank)
    if not holders:
        fail(f"no rank's bias of {name} got a gradient: the bias never reaches the output as "
             f"a parameter.", fix="keep the bias as an nn.Parameter and add it in the forward.")


def _plain_mlp(hidden: int) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(9)
        return nn.Sequential(nn.Linear(D, hidden), nn.GELU(), nn.Linear(hidden, D))


def _diagnose_mlp(outs: list, n: int, hidden: int, name: str, hint: str = "") -> None:
    __tracebackhide__ = True
    for rank, o in enumerate(outs):
        if "build_error" in o:
            fail(f"{name}(plain, {rank}, {n}) with hidden size {hidden} raised while being "
                 f"built: {o['build_error']}{hint}.")
        if "run_error" in o:
            fail(f"{name} on {n} ranks, hidden size {hidden}, raised on rank {rank}: "
                 f"{o['run_error']}{hint}.")
    plain = _plain_mlp(hidden)
    x = _data(1, ROWS, D, seed=10)[0].clone().requires_grad_(True)
    y = plain(x)
    y.backward(_data(1, ROWS, D, seed=11)[0])
    layers = " — check_column_parallel and check_row_parallel test its layers one by one"
    for rank, o in enumerate(outs):
        if not _close(o["y"], y.detach()):
            fail(f"{name}'s output on rank {rank} ({n} ranks, hidden size {hidden}) differs "
                 f"from the plain MLP's{hint or layers}.")
        if o["x_grad"] is None or not _close(o["x_grad"], x.grad):
            fail(f"dL/dx on rank {rank} ({n} ranks, hidden size {hidden}) differs from the "
                 f"plain MLP's{hint}.")
        if o["fwd"] != ["all_reduce"] or o["bwd"] != ["all_reduce"]:
            fail(f"{name} made {o['fwd'] or 'no collectives'} in the forward and "
                 f"{o['bwd'] or 'no collectives'} in the backward on rank {rank}, although "
                 f"its output and dL/dx are right: what f and g declared in part 2 is one "
                 f"all-reduce per pass, so a collective runs outside them, or twice.",
                 fix="Megatron's MLP needs exactly one all-reduce in each pass (g's forward, "
                     "f's backward): communicate only inside f and g, once each.")
    _mlp_param_grads(outs, n, hidden, name, plain)
    _stepped_failures(outs, n, name, _reference_steps(plain, x, _data(1, ROWS, D, seed=11)[0]),
                      plain[2].bias.grad, "mlp")


_MLP_PARTS = {"w1": "the column layer's weight (plain[0].weight)",
              "b1": "the column layer's bias (plain[0].bias)",
              "w2": "the row layer's weight (plain[2].weight)",
              "b2": "the row layer's bias (plain[2].bias)"}


def _match_param(p: torch.Tensor, plain: nn.Sequential):
    """(part, dim, start, transposed) of the plain MLP's parameter this shard was cut from."""
    w1, b1 = plain[0].weight.detach(), plain[0].bias.detach()
    w2, b2 = plain[2].weight.detach(), plain[2].bias.detach()
    if p.dim() == 1:
        if torch.equal(p, b2):
            return "b2", 0, 0, False
        s = _find_slice(p, b1, 0)
        if s is not None:
            return "b1", 0, s, False
        s = _find_slice(p, b2, 0)          # the row bias kept in blocks, one per rank
        return None if s is None else ("b2", 0, s, False)
    if p.dim() != 2:
        return None
    for cand, transposed in ((p, False), (p.T, True)):
        for part, full, dim in (("w1", w1, 0), ("w2", w2, 1)):
            s = _find_slice(cand, full, dim)
            if s is not None:
                return part, dim, s, transposed
    return None


def _mlp_param_grads(outs: list, n: int, hidden: int, name: str, plain: nn.Sequential) -> None:
    """Each rank's shard's gradient against the same slice of the plain MLP's gradient."""
    __tracebackhide__ = True
    full_grads = {"w1": plain[0].weight.grad, "b1": plain[0].bias.grad,
                  "w2": plain[2].weight.grad, "b2": plain[2].bias.grad}
    b2_holders = []
    for rank, o in enumerate(outs):
        found = set()
        for p, g in zip(o["params"], o["grads"]):
            b2 = plain[2].bias.detach()
            if p.shape == b2.shape and not torch.equal(p, b2) and torch.allclose(p, b2 / n):
                fail(f"{name} keeps {_MLP_PARTS['b2']} divided by the world size on rank {rank}: the "
                     f"output adds up right, and each copy gets the whole dL/db as its gradient, "
                     f"so a step moves the {n} copies' sum {n} times as far as the plain "
                     f"MLP's bias.",
                     fix="keep the whole bias and add it once (after g, or before it on rank 0 only).")
            match = _match_param(p, plain)
            if match is None:
                continue
            part, dim, start, transposed = match
            found.add(part)
            what = _MLP_PARTS[part]
            if g is None and part == "b2":
                _dead_bias(f"{name}'s row layer", rank, tuple(p.shape), n)
            if g is None:
                fail(f"{what} on rank {rank} gets no gradient ({n} ranks, hidden size {hidden}): the "
                     f"forward uses it detached (or through .data).",
                     fix="use the nn.Parameter itself, so that autograd reaches it.")
            if transposed:
                g = g.T
            k = (p.T if transposed else p).shape[dim]
            want = full_grads[part].narrow(dim, start, k)
            if _close(g, want):
                if part == "b2":
                    b2_holders.append(rank)
                continue
            where = ("" if part == "b2" else
                     f" {'rows' if dim == 0 else 'columns'} [{start}, {start + k})")
            if _close(g, want / n):
                fail(f"the gradient of {what} on rank {rank} is 1/{n} of the plain MLP's{where} ({n} "
                     f"ranks, hidden size {hidden}): something divides it by the world size.",
                     fix="keep the whole bias and add it once, and sum (never average) in f and g.")
            if _close(g, want * n):
                fail(f"the gradient of {what} on rank {rank} is {n} times the plain MLP's{where} ({n} "
                     f"ranks, hidden size {hidden}): a gradient is summed over the ranks once too often.",
                     fix="g's backward is the identity.")
            fail(f"the gradient of {what} on rank {rank} differs from the plain MLP's{where} "
                 f"({n} ranks, hidden size {hidden}) although the output and dL/dx are right.")
        for part in ("w1", "b1", "w2"):
            if part not in found:
                fail(f"rank {rank} of {name} ({n} ranks, hidden size {hidden}) has no nn.Parameter "
                     f"that is a block of {_MLP_PARTS[part]}: a plain tensor, or a detached copy, gets no "
                     f"gradient and is never trained.",
                     fix="keep this rank's block as an nn.Parameter.")
    if not b2_holders:
        fail(f"no rank of {name} ({n} ranks, hidden size {hidden}) gives {_MLP_PARTS['b2']} a "
             f"gradient: the bias never reaches the output as a parameter.",
             fix="keep the whole bias as an nn.Parameter (on every rank, or on rank 0), use it "
                 "undetached, and add it once.")
