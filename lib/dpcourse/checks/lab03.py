"""Checks for lab03: ``average_gradients(model)``, a DDP-free data-parallel step,
``average_gradients_weighted(model, n_local)`` (shards of unequal sizes), and the stretch
``average_gradients_flat(model)`` (one all_reduce for the whole model).

They run the learner's functions (defined in notebook cells; ``dpcourse.launch`` ships them to
the ranks with cloudpickle) on 2 and then 3 gloo ranks, and compare with ``dpcourse.ddp``'s
reference. A wrong answer is matched against simulations of the plausible mistakes:

* summing without dividing (gradients ``world_size`` times too big);
* dividing by a fixed 2 instead of the world size (right on 2 ranks only: hence 3 ranks too);
* dividing into a new tensor bound to a name or a list slot (``g = g / world_size``): ``p.grad``
  keeps the sum — numerically the same as never dividing, so the learner's source is read to
  tell the two apart;
* reducing a copy (``p.grad.clone()``): ``p.grad`` is still the rank's own gradient;
* calling ``all_reduce`` on rank 0 only: rank 0 waits forever; the launch's timeout (20 s by
  default, ``timeout=`` or ``DPCOURSE_CHECK_TIMEOUT`` for more) ends it. When another rank had
  already returned, the wait can only be a deadlock and the message says so (and nothing about
  slowness); when no rank returned, it may be slowness on a crowded server and says which
  ``timeout=`` to pass;
* averaging the loss instead of the gradients: each rank steps with its own gradients and the
  ranks' weights drift apart;
* averaging the weights instead of the gradients (each rank steps with its own gradients, then
  the parameters are all-reduced and divided): equal to the global step for plain SGD (linear
  in the gradient), so the step is also run with Adam, and a spy on the collectives' tensors
  names the cause;
* no ``None`` guard: the averaging worker's model has a parameter the forward never uses;
* the step returning a tensor, or its own shard's loss, where the contract asks for the global
  batch's loss as a Python float;
* the library's own ``dpcourse.ddp.average_gradients`` passed as the answer: refused (the lab
  asks for the learner's);
* the stretch's flat buffer leaving out a ``None`` gradient: right while every rank used every
  parameter, wrong on part 1's two-head model, where even and odd ranks leave out different
  heads and the same offset of their buffers holds different parameters (the check runs it);
* part 4 on part 1's two-head model (unequal shards and a head unused on some ranks): a
  weighted loop that skips a ``None`` gradient pairs the heads, as in part 1; dividing a head's
  weighted sum by the samples of the ranks that used it gives the mean over those samples, not
  the global batch's mean loss the contract asks for;
* part 4's count tensor made without ``device=`` (``torch.tensor([n_local])``): it follows the
  default device, the CPU, wherever the gradients are, which gloo accepts and NCCL refuses. A
  ``TorchFunctionMode`` notes the tensors a factory function made without a device (and what
  is computed from them alone), and a spy refuses them before the collective, on every rank.

* a parameter that requires a gradient and that NO rank used (part 1's ``never``, 0.5 each)
  given zeros (parts 1, 4 and the stretch): one process on the global batch, and DDP with
  ``find_unused_parameters=True`` (its reducer all-reduces a map of the locally used
  parameters, ``local_used_map_``; with the defaults DDP fails at the next step), leave its
  p.grad None, and an optimizer steps every parameter whose p.grad is not None; the sentence
  computes one SGD step with weight decay on it. No rank can see alone whether another rank used
  it, so the ranks must exchange something; a tensor made for that without ``device=`` is
  refused in part 1 too (the same watch as part 4's count);
* the converse: p.grad set to None because the averaged gradient is all zeros (a parameter
  every rank used with a derivative of exactly 0 keeps zeros, as one process keeps them);
* the stretch making more than one collective call of any kind (an all_gather of the flags
  beside the all_reduce counts).

``p.grad = p.grad / world_size`` (a new tensor bound to ``p.grad`` itself) is right: the lab's
contract is the values every ``p.grad`` holds afterwards, and the optimizer reads ``p.grad`` at
each step. The success line says whether the gradients were averaged in place or rebound.

:func:`count_all_reduces` and :func:`check_prediction` are the lab's predict-then-measure part:
how many collective calls one ``average_gradients`` makes on the lab's model, and what each
carried.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
import torch.nn.functional as F

from . import check_timeout, fail, passed, recorded, refuse_reference
# The checks of the other parts live in modules of their own; their names are this module's too.
from ._lab03_common import (DEFAULT_TIMEOUT, ROUTED_HEADS, WORLD_SIZES, _all_close, _close,
                            _hang, _launch, _none_guard, _part1_model_after_backward,
                            _refuse_frozen_grad, _refuse_never_grad, part1_model)
from ._lab03_placement import _DeviceWatch, _refuse_unplaced
from ._lab03_predict import (BYTES_CHOICES, check_bytes_prediction, check_prediction,
                             count_all_reduces)
from ._lab03_step import check_data_parallel_step
from ._lab03_weighted import SHARD_SIZES, check_average_gradients_weighted

__all__ = ["check_average_gradients", "check_average_gradients_flat",
           "check_average_gradients_weighted", "check_data_parallel_step", "count_all_reduces",
           "check_prediction", "check_bytes_prediction", "part1_model", "BYTES_CHOICES",
           "DEFAULT_TIMEOUT", "SHARD_SIZES", "WORLD_SIZES"]


def _avg_worker(rank: int, world_size: int, fn, unused: bool = True,
                routed: bool = False) -> dict:
    __tracebackhide__ = True
    from .. import ddp
    from ..models import SmallCNN

    dev = ddp.setup_rank()

    def model_after_backward(extra: bool):
        torch.manual_seed(0)
        model = SmallCNN(width=4).to(dev)
        if extra:  # a parameter the forward never uses: its p.grad stays None after backward;
            # and one every rank uses with a derivative of exactly zero: p.grad holds zeros
            model.register_parameter("unused", torch.nn.Parameter(torch.zeros(3, device=dev)))
            model.register_parameter("dead", torch.nn.Parameter(torch.ones(3, device=dev)))
        g = torch.Generator().manual_seed(1000 + rank)  # different data on each rank
        X = torch.randn(4, 3, 32, 32, generator=g).to(dev)
        y = torch.randint(0, 10, (4,), generator=g).to(dev)
        loss = F.cross_entropy(model(X), y)
        (loss + 0.0 * model.dead.sum() if extra else loss).backward()
        return model

    watch = _DeviceWatch(dev)
    model = model_after_backward(False)
    local = [p.grad.detach().cpu().clone() for p in model.parameters()]
    before = [p.grad for p in model.parameters()]  # the tensors themselves: rebound or not?
    # Count the collective calls (the stretch asks for exactly one) and their bytes.
    calls = watch.run(fn, model)
    after = [None if p.grad is None else p.grad.detach().cpu().clone()
             for p in model.parameters()]
    out = {"local": local, "after": after,
           "in_place": all(p.grad is b for p, b in zip(model.parameters(), before)),
           "all_reduce_calls": calls.count_by_op().get("all_reduce", 0),
           "all_reduce_bytes": calls.bytes_by_op().get("all_reduce", 0),
           "calls_by_op": calls.count_by_op(),
           "n_params": sum(p.numel() for p in model.parameters()),
           "n_tensors": len(before), "none_error": None}
    if watch.seen:
        return dict(out, unplaced=watch.seen[0])
    if unused:  # the contract's "each p.grad that is not None": one parameter without a grad
        extra = model_after_backward(True)
        try:
            watch.run(fn, extra)
        except (AttributeError, TypeError, RuntimeError, ValueError) as e:
            if "None" not in str(e):
                raise
            out["none_error"] = f"{type(e).__name__}: {e}"
            return out  # every rank stopped at the same parameter: no rank waits in a call
        out["dead_after"] = None if extra.dead.grad is None else extra.dead.grad.cpu().clone()
    if routed:  # part 1's case the lesson did not show: ranks that used different parameters
        model = _part1_model_after_backward(rank, dev)
        local = {n: None if p.grad is None else p.grad.detach().cpu().clone()
                 for n, p in model.named_parameters()}
        watch.run(fn, model)
        out["routed_local"] = local
        out["routed_after"] = {n: None if p.grad is None else p.grad.detach().cpu().clone()
                               for n, p in model.named_parameters()}
    if watch.seen:
        out["unplaced"] = watch.seen[0]
    return out


def _rebinds_division(fn) -> bool | None:
    """Does ``fn`` assign a division (or multiplication) to a plain name or a list slot, like
    ``g = g / world_size`` or ``grads[i] = grads[i] / n``? None if the source is unavailable."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.BinOp)
                and isinstance(node.value.op, (ast.Div, ast.Mult, ast.FloorDiv))
                and all(isinstance(t, (ast.Name, ast.Subscript)) for t in node.targets)):
            return True
    return False


@recorded
def check_average_gradients(average_gradients, world_sizes=WORLD_SIZES,
                            timeout: float | None = None) -> None:
    """Run ``average_gradients(model)`` on 2 and on 3 ranks after a backward on different
    data; every rank's ``p.grad`` must then be the mean of the ranks' gradients."""
    __tracebackhide__ = True
    from .. import ddp

    refuse_reference(average_gradients, "average_gradients", ddp.average_gradients,
                     why="define it in the cell above, under the same name, and pass that")
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    in_place, every, runs = True, [], []
    for world_size in world_sizes:
        results = _check_average(average_gradients, world_size, timeout, "average_gradients",
                                 routed=True)
        in_place = in_place and all(r["in_place"] for r in results)
        every += results
        runs.append(results)
    _none_guard(every, "average_gradients")
    _refuse_dead_none(every, "average_gradients")
    for results in runs:
        _diagnose_routed(results, len(results), "average_gradients")
    how = ("in place (each p.grad is still the tensor the backward filled)" if in_place else
           "in new tensors bound to p.grad (right here: the optimizer reads p.grad at each "
           "step; where gradients are views of a bucket, as in lesson 07, only writing into "
           "them would do)")
    passed(f"average_gradients on {' and '.join(map(str, world_sizes))} ranks: every p.grad is "
           f"the mean over the ranks, {how}; a head used on some ranks only got the same mean "
           f"on every rank, never (used by no rank) and the frozen parameter no gradient")


@recorded
def check_average_gradients_flat(average_gradients_flat, world_sizes=WORLD_SIZES,
                                 timeout: float | None = None) -> None:
    """Stretch: the same average, with exactly one ``dist.all_reduce`` call for the whole model
    (one flat buffer holding every gradient)."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    every, runs = [], []
    for world_size in world_sizes:
        results = _check_average(average_gradients_flat, world_size, timeout,
                                 "average_gradients_flat", flat=True, routed=True)
        every += results
        runs.append(results)
    _none_guard(every, "average_gradients_flat")
    _refuse_dead_none(every, "average_gradients_flat")
    for results in runs:
        _diagnose_routed(results, len(results), "average_gradients_flat", flat=True)
    passed(f"average_gradients_flat: one all_reduce for the whole model, every p.grad the mean "
           f"over the ranks (on {' and '.join(map(str, world_sizes))} ranks), part 1's heads "
           f"too: every rank's buffer had the same layout; never kept no gradient")


def _refuse_dead_none(results: list, name: str) -> None:
    """A parameter every rank used with a derivative of exactly zero holds zeros in p.grad
    after the backward: a gradient all the same, which must stay (one process keeps it)."""
    __tracebackhide__ = True
    for rank, r in enumerate(results):
        if "dead_after" in r and r["dead_after"] is None:
            fail(f"on rank {rank} a parameter that every rank's backward gave a gradient of "
                 f"exactly zero (its term in the loss is multiplied by 0) has p.grad None after "
                 f"{name}: a gradient of zeros is still a gradient — one process keeps it, and "
                 f"its optimizer steps the parameter (weight decay moves it). Only a "
                 f"parameter that got no gradient on any rank keeps None, and a gradient's "
                 f"values cannot tell a parameter no rank used from one whose gradient is 0.",
                 fix="decide from whether each rank's p.grad was None before the averaging, "
                     "not from the averaged values.")


def _diagnose_routed(results: list, world_size: int, name: str, flat: bool = False) -> None:
    """Part 1's routed model: rank r used only ROUTED_HEADS[r % 2]. The contract: on every rank
    each head holds the sum over the ranks of that head's gradient, a rank that did not use it
    counting zeros, divided by the number of ranks; the frozen parameter keeps p.grad None."""
    __tracebackhide__ = True
    used = [ROUTED_HEADS[rank % 2] for rank in range(world_size)]
    zero = torch.zeros_like(results[0]["routed_local"][used[0]])
    local = {h: [r["routed_local"][h] for r in results] for h in ROUTED_HEADS}
    want = {h: sum((g if g is not None else zero) for g in local[h]) / world_size
            for h in ROUTED_HEADS}
    users = {h: [g for g in local[h] if g is not None] for h in ROUTED_HEADS}
    # what a loop that skips a None gradient computes: each rank's call on the head it used
    # meets the other ranks' calls on the heads THEY used (same shape, same place in the order)
    paired = sum(results[rank]["routed_local"][used[rank]] for rank in range(world_size))
    paired = paired / world_size

    close = _close
    _refuse_frozen_grad(results, name, "")
    for rank, r in enumerate(results):
        mine = used[rank]
        for h in ROUTED_HEADS:
            got = r["routed_after"][h]
            if close(got, want[h]):
                continue
            if close(r["routed_after"][mine], paired) and not close(paired, want[mine]) and flat:
                fail(f"on {world_size} ranks, rank {rank}'s {mine}.grad ends holding the "
                     f"even ranks' head_a gradients and the odd ranks' head_b gradients added "
                     f"together and divided by {world_size} (the values match that mix): "
                     f"each rank left out of its flat buffer the head whose p.grad was None — "
                     f"head_b on even ranks, head_a on odd ones — so the same offset in the "
                     f"ranks' buffers held a different parameter, and the element-wise sum "
                     f"added head_a's gradient to head_b's (the same size, so the buffers "
                     f"were as long and nothing complained). An all_reduce matches positions, "
                     f"not names.",
                     fix="give every rank's buffer the same layout: the same parameters in the "
                         "same order, with zeros for a parameter that requires a gradient but "
                         "got none on this rank (its p.grad must then hold the mean too).")
            if close(r["routed_after"][mine], paired) and not close(paired, want[mine]):
                fail(f"on {world_size} ranks, rank {rank}'s {mine}.grad ends holding the "
                     f"even ranks' head_a gradients and the odd ranks' head_b gradients added "
                     f"together and divided by {world_size} (the values match that mix): "
                     f"the model routes even ranks through "
                     f"head_a and odd ranks through head_b, so each rank skipped a different "
                     f"parameter whose p.grad was None, and the ranks' all_reduce calls — "
                     f"matched by their order, not by parameter — paired different parameters "
                     f"(the same shape, so nothing complained).",
                     fix="make every rank call the collective on the same parameters in the "
                         "same order: a parameter that requires a gradient but got none on "
                         "this rank contributes zeros to the sum (its p.grad must then hold "
                         "the mean too).")
            if got is None:
                fail(f"on {world_size} ranks, rank {rank}'s {h}.grad is still None after "
                     f"{name}, though {len(users[h])} other rank(s) computed a "
                     f"gradient for it: the global batch's loss depends on {h}, so every rank "
                     f"must end holding the same mean gradient for it, this rank's share being "
                     f"zero.",
                     fix="when this rank has no gradient for a parameter that requires one, "
                         "reduce zeros for it and store the result in p.grad.")
            if users[h] and close(got, sum(users[h]) / len(users[h])) and \
                    len(users[h]) != world_size:
                fail(f"on {world_size} ranks, {h}'s gradient is the sum over the "
                     f"{len(users[h])} rank(s) that used it divided by {len(users[h])}, not by "
                     f"{world_size}: the global loss is the mean over all {world_size} ranks' "
                     f"shards, and a rank whose batch did not go through {h} adds a zero "
                     f"gradient to that mean — it still counts.",
                     fix=f"divide every parameter's sum by the number of ranks "
                         f"({world_size} here), used or not.")
            fail(f"on {world_size} ranks, rank {rank}'s {h}.grad is not the mean over the "
                 f"ranks of {h}'s gradient (the ranks that did not use {h} counting zero), "
                 f"though the parameters every rank used were averaged right.",
                 fix="treat a missing gradient on a rank as zeros, sum over the ranks, divide "
                     "by the world size, and leave the result in p.grad on every rank.")
    _refuse_never_grad(results, name, f"on {world_size} ranks, ")


def _check_average(fn, world_size: int, timeout: float, name: str, flat: bool = False,
                   routed: bool = False) -> list:
    __tracebackhide__ = True
    if not callable(fn):
        fail(f"the check needs your function, got {type(fn).__name__}.")
    results = _launch(_avg_worker, world_size, timeout, fn, True, routed, name=name)
    _refuse_unplaced(results)
    locals_ = [r["local"] for r in results]
    n_params = len(locals_[0])
    total = [sum(loc[i] for loc in locals_) for i in range(n_params)]
    mean = [t / world_size for t in total]
    for rank, r in enumerate(results):
        after = r["after"]
        if any(a is None for a in after):
            fail(f"on rank {rank} some p.grad that the backward had filled is None after "
                 f"{name}: the optimizer would skip that parameter.",
                 fix="leave each average in p.grad; never delete a gradient.")
        for a, m in zip(after, mean):
            if a.shape != m.shape:
                fail(f"on rank {rank} a gradient has shape {tuple(a.shape)} instead of its "
                     f"parameter's {tuple(m.shape)}: the optimizer needs p.grad in its "
                     f"parameter's shape.",
                     fix=("copy each slice of the flat buffer back in its parameter's shape "
                          "(.view_as(p.grad))." if flat else "average element-wise; do not "
                          "reduce or reshape the tensor."))
        if _all_close(after, mean):
            continue
        if _all_close(after, total):
            if _rebinds_division(fn):
                fail(f"the gradients hold the sum over the ranks, {world_size} times the mean: "
                     f"you divided into a new tensor bound to a name or list slot "
                     f"(g = g / world_size), which leaves p.grad untouched.",
                     fix="divide p.grad in place (p.grad /= world_size or "
                         "p.grad.div_(world_size)).")
            fail(f"the gradients hold the sum over the ranks, {world_size} times the mean: "
                 f"all_reduce with SUM adds the ranks' tensors and nothing divided the result.",
                 fix="after all_reduce(SUM), divide by the world size.")
        for k in sorted({2, 3, 4} - {world_size}):
            if _all_close(after, [t / k for t in total]):
                fail(f"on {world_size} ranks the gradients are the sum divided by {k}, not by "
                     f"{world_size}: a fixed {k} is the mean only on {k} ranks.",
                     fix="divide by the world size (dist.get_world_size()), not by a fixed "
                         "number.")
        if _all_close(after, r["local"]):
            if flat:
                fail(f"on rank {rank} p.grad is still that rank's own gradient: the flat buffer "
                     f"is a copy (torch.cat copies), and its averaged values never travelled "
                     f"back into the gradients.",
                     fix="after reducing and dividing the buffer, copy each slice back into "
                         "its p.grad (p.grad.copy_(...)).")
            fail(f"on rank {rank} p.grad is still that rank's own gradient: nothing was reduced "
                 f"into it — all_reduce writes its result into the tensor it is given, and "
                 f"that tensor was a copy (p.grad.clone(), p.grad / world_size, "
                 f"torch.tensor(...)), not p.grad.",
                 fix="all_reduce p.grad itself.")
        if _all_close(after, [loc / world_size for loc in r["local"]]):
            fail(f"on rank {rank} p.grad is the rank's own gradient divided by {world_size}: the "
                 f"division happened but the all_reduce did not reach p.grad.",
                 fix="all_reduce p.grad itself, before or after the division.")
        fail(f"on rank {rank} the gradients are not the mean over the ranks (nor their sum, nor "
             f"the rank's own, nor the sum over a fixed count).",
             fix="every p.grad must end holding the sum over the ranks divided by the world "
                 "size.")
    if flat:
        by_op = results[0]["calls_by_op"]
        calls = sum(by_op.values())
        if calls == 0:
            fail("the averages are right but the check saw no collective call: it counts the "
                 "calls made through torch.distributed.",
                 fix="call it as dist.all_reduce(flat).")
        if calls > 1:
            ops = ", ".join(f"{n} {op}" for op, n in sorted(by_op.items()))
            fail(f"{name} made {calls} collective calls ({ops})"
                 + (f", one per parameter ({n_params})"
                    if by_op.get("all_reduce") == n_params else "")
                 + ": each call pays the collective's start-up cost again, and the contract "
                   "allows one.",
                 fix="put everything the ranks must add up into one flat tensor (torch.cat "
                     "of the flattened pieces), reduce it once, and copy the slices back.")
    return results
