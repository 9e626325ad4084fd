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
  given zeros (parts 1, 4 and the stretch): one process on the global batch, and DDP (its
  reducer all-reduces a map of the locally used parameters, ``local_used_map_``), leave its
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

from . import (check_timeout, fail, has_todo, passed, recorded, refuse_reference, reveal,
               run_ranks)

__all__ = ["check_average_gradients", "check_average_gradients_flat",
           "check_average_gradients_weighted", "check_data_parallel_step", "count_all_reduces",
           "check_prediction", "check_bytes_prediction", "part1_model", "BYTES_CHOICES",
           "DEFAULT_TIMEOUT", "SHARD_SIZES", "WORLD_SIZES"]

DEFAULT_TIMEOUT = 20.0  # seconds; a correct answer takes 1-8 s, a deadlock is cut off here


ROUTED_HEADS = ("head_a", "head_b")  # even ranks add head_a to the logits, odd ranks head_b
NEVER_VALUE = 0.5   # part 1's ``never``: not zero, so an optimizer's step on it shows


def part1_model(device=None) -> torch.nn.Module:
    """Part 1's model: ``SmallCNN(width=4)`` with four more parameters of 10 values each —
    ``head_a`` and ``head_b`` (zeros; a router sends even ranks' batches through ``head_a``, odd
    ranks' through ``head_b``, as a mixture-of-experts layer sends each token to an expert),
    ``never`` (0.5 each; requires a gradient, used by no rank) and ``frozen`` (zeros,
    ``requires_grad=False``)."""
    from ..models import SmallCNN

    torch.manual_seed(0)
    model = SmallCNN(width=4).to(device)
    for name in ROUTED_HEADS:
        model.register_parameter(name, torch.nn.Parameter(torch.zeros(10, device=device)))
    model.register_parameter("never", torch.nn.Parameter(torch.full((10,), NEVER_VALUE,
                                                                    device=device)))
    model.register_parameter("frozen", torch.nn.Parameter(torch.zeros(10, device=device),
                                                          requires_grad=False))
    return model


def _part1_model_after_backward(rank: int, dev, n: int = 4, seed: int = 3000,
                                routed: bool = True) -> torch.nn.Module:
    """Part 1's model after rank ``rank``'s backward on the mean loss over its ``n`` samples: a
    head's p.grad is None on the ranks that did not use it, ``never``'s and ``frozen``'s on
    every rank. ``routed=False``: every rank used both heads (only ``never`` and ``frozen``
    lack a gradient, on every rank alike: a function that fails on a None fails at the same
    place on every rank, and no rank is left waiting in a collective)."""
    model = part1_model(dev)
    g = torch.Generator().manual_seed(seed + rank)
    X = torch.randn(n, 3, 32, 32, generator=g).to(dev)
    y = torch.randint(0, 10, (n,), generator=g).to(dev)
    heads = [getattr(model, ROUTED_HEADS[rank % 2])] if routed else \
        [getattr(model, h) for h in ROUTED_HEADS]
    F.cross_entropy(model(X) + sum(heads) + model.frozen, y).backward()
    return model


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


def _all_close(a: list, b: list) -> bool:
    return all(torch.allclose(x, y, rtol=1e-4, atol=1e-7) for x, y in zip(a, b))


_HANG = ("all_reduce is a collective that every rank must call, in the same order, so calling "
         "it on some ranks only (e.g. `if rank == 0:`) leaves them waiting forever for the "
         "others.")


def _hang(name: str, timeout: float):
    """The timeout's sentence. When a rank had already returned from the learner's function
    while another still waited, the wait is a deadlock for certain: say so and nothing else (a
    longer timeout would not end it). Otherwise run_ranks adds that it may be slowness."""

    def sentence(exc) -> str:
        __tracebackhide__ = True
        pending = list(getattr(exc, "pending", []))
        finished = list(getattr(exc, "finished", []))
        waiting = ", ".join(map(str, pending)) or "some rank"
        if pending and finished:
            fail(f"deadlock: rank(s) {', '.join(map(str, finished))} returned from {name} while "
                 f"rank(s) {waiting} still waited in a collective after {timeout:g} s — a rank "
                 f"that has returned will never join that call. {_HANG} A longer timeout would "
                 f"not end it.", fix="make every rank make the same collective calls, in the "
                                     "same order.")
        return f"rank(s) {waiting} never finished within {timeout:g} s — a deadlock: {_HANG}"

    return sentence


def _launch(worker, world_size: int, timeout: float, *args, name: str = "your function"):
    __tracebackhide__ = True
    from .. import devices

    # An unfilled TODO stops here, like any other lab, without starting ranks.
    for fn in args:
        if callable(fn) and has_todo(fn):
            raise NotImplementedError(f"{getattr(fn, '__name__', 'your function')} still raises "
                                      f"NotImplementedError: replace the TODO with your answer.")

    return run_ranks(worker, world_size, *args, backend=devices.backend_for(world_size),
                     timeout=timeout, hang=_hang(name, timeout))


WORLD_SIZES = (2, 3)  # two sizes: an answer that divides by 2 instead of the world size fails


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


def _none_guard(results: list, name: str) -> None:
    """After the means are right on every world size: the run on a model with a parameter
    that gets no gradient must not have failed on it."""
    __tracebackhide__ = True
    for r in results:
        if r["none_error"]:
            error = " ".join(r["none_error"].split())
            error = error if len(error) <= 110 else error[:107] + "..."
            fail(f"{name} failed on a parameter whose p.grad is None ({error}): a parameter the "
                 f"forward did not use, or a frozen one, gets no gradient: p.grad is None "
                 f"there, not a tensor.",
                 fix="look at p.grad before using it, and decide what a missing gradient "
                     "means for the contract.")


def _close(a, b) -> bool:
    """Equal up to the order of float additions; a gradient that is None is never close."""
    return a is not None and torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def _refuse_frozen_grad(results: list, name: str, where: str) -> None:
    """The routed model's ``frozen`` parameter must keep p.grad None on every rank after the
    learner's ``name``: the backward gave it none, and an optimizer steps every parameter whose
    p.grad is not None."""
    __tracebackhide__ = True
    for rank, r in enumerate(results):
        frozen = r["routed_after"].get("frozen")
        if frozen is not None:
            fail(f"{where}on rank {rank} the frozen parameter (requires_grad=False) ends with a "
                 f"p.grad of {frozen.numel()} values after {name}, where the backward gave it "
                 f"none on any rank: an optimizer steps every parameter whose p.grad is not "
                 f"None (weight decay or momentum alone would then move a frozen weight).",
                 fix="give zeros only to a parameter that requires a gradient and got none on "
                     "this rank; leave p.grad None where p.requires_grad is False.")


_DECAY = {"lr": 0.1, "weight_decay": 0.01}   # the SGD step the never sentence computes


def _one_sgd_step(value: float, grad) -> float:
    """``never``'s first value after one ``torch.optim.SGD(lr=0.1, weight_decay=0.01)`` step
    with ``grad`` (None: the optimizer skips the parameter)."""
    p = torch.nn.Parameter(torch.full((1,), value))
    p.grad = None if grad is None else torch.full((1,), float(grad))
    torch.optim.SGD([p], **_DECAY).step()
    return p.item()


def _refuse_never_grad(results: list, name: str, where: str) -> None:
    """The routed model's ``never`` (requires a gradient, used by no rank) must keep p.grad
    None on every rank, as one process on the global batch and DDP leave it: an optimizer
    steps every parameter whose p.grad is not None, zeros included."""
    __tracebackhide__ = True
    for rank, r in enumerate(results):
        never = r["routed_after"].get("never")
        if never is None:
            continue
        zeros = not torch.any(never)
        held = f"{never.numel()} zeros" if zeros else f"{never.numel()} values (not all zero)"
        first = float(never.reshape(-1)[0])
        moved, kept = _one_sgd_step(NEVER_VALUE, first), _one_sgd_step(NEVER_VALUE, None)
        fail(f"{where}`never`, which no rank's batch went through, ends with a p.grad of {held} "
             f"on rank {rank} after {name}: one process on the global batch leaves its p.grad "
             f"None (so does DDP), and an optimizer steps every parameter whose p.grad is not "
             f"None — one SGD step with lr {_DECAY['lr']} and weight_decay "
             f"{_DECAY['weight_decay']} takes never from {NEVER_VALUE} to {moved:.6g} with "
             f"that gradient, where one process leaves it at {kept:.6g} (momentum and Adam's "
             f"weight decay move it too). No rank can tell from what it holds alone whether "
             f"another rank used a parameter.",
             fix="let the ranks find out together which parameters got a gradient on some "
                 "rank; keep p.grad None on every rank for one that got none on any rank, and "
                 "give zeros only where some other rank got a gradient.")


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


# --------------------------------------------------------------------------------------------
# Predict, then measure: the all_reduce calls of one average_gradients
# --------------------------------------------------------------------------------------------


def _count_worker(rank: int, world_size: int, fn) -> dict:
    __tracebackhide__ = True
    from .. import ddp

    model = _part1_model_after_backward(rank, ddp.setup_rank())
    named = list(model.named_parameters())
    had = [n for n, p in named if p.grad is not None]
    handed = []   # (op, the first tensor handed over): kept alive until matched below

    def spy(call):
        tensors = [t for v in (call.args or {}).values()
                   for t in (v if isinstance(v, (list, tuple)) else [v])
                   if isinstance(t, torch.Tensor)]
        owner = next((n for n, p in named for t in tensors[:1]
                      if p.grad is not None and t.data_ptr() == p.grad.data_ptr()
                      and t.numel() == p.numel()), None)
        handed.append((call.op, tensors[0] if tensors else None, owner))

    watch = _DeviceWatch(None)
    calls = watch.run(fn, model, before=spy)
    carried = []  # what each call carried: a parameter's gradient (by name) or another tensor
    for op, t, owner in handed:
        if owner is None and t is not None:   # a tensor that became p.grad afterwards
            owner = next((n for n, p in named if p.grad is not None and t.numel() == p.numel()
                          and t.data_ptr() == p.grad.data_ptr()), None)
        carried.append({"op": op, "grad_of": owner,
                        "numel": 0 if t is None else t.numel(),
                        "dtype": None if t is None else str(t.dtype).replace("torch.", "")})
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"calls": len(calls), "bytes": sum(c.nbytes for c in calls),
            "tensors": len(named), "trainable": len(trainable),
            "parameters": sum(p.numel() for p in trainable), "carried": carried,
            "had": had, "nbytes": {n: p.numel() * p.element_size() for n, p in named}}


def count_all_reduces(average_gradients, world_size: int = 2,
                      timeout: float | None = None) -> dict:
    """Run ``average_gradients(model)`` once on ``world_size`` ranks, on part 1's model
    (:func:`part1_model`) after each rank's backward, and return what rank 0 handed to the
    collectives (``dist.all_reduce`` or any other): ``{"calls", "bytes", "tensors", "trainable",
    "parameters", "carried", "used", "used_bytes"}`` (``tensors``: the model's parameter
    tensors, ``trainable``: those that require a gradient, ``parameters``: their elements,
    ``carried``: per call, its op, the parameter whose gradient it carried (None: another
    tensor), its size and dtype; ``used``: the parameters some rank's backward gave a gradient,
    ``used_bytes``: their gradients' bytes)."""
    __tracebackhide__ = True
    if not callable(average_gradients):
        fail(f"count_all_reduces needs your function, got {type(average_gradients).__name__}.")
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    results = _launch(_count_worker, world_size, timeout, average_gradients,
                      name=getattr(average_gradients, "__name__", "your function"))
    out = dict(results[0])
    used = [n for n in out.pop("nbytes") if any(n in r["had"] for r in results)]
    sizes = results[0]["nbytes"]
    out.pop("had")
    return dict(out, used=used, used_bytes=sum(sizes[n] for n in used))


def _describe_calls(measured: dict) -> str:
    """What rank 0's calls carried, grouped: SmallCNN's gradients, each extra parameter's by
    name (with why it matters), and the tensors that were no parameter's gradient."""
    carried = measured.get("carried", [])
    grads = [c["grad_of"] for c in carried if c["grad_of"]]
    cnn = [n for n in grads if n not in ROUTED_HEADS + ("never", "frozen")]
    parts = []
    if cnn:
        parts.append(f"{len(cnn)} on SmallCNN's gradients (a weight and a bias in each of its "
                     f"5 layers)" if len(cnn) == 10 else f"{len(cnn)} on SmallCNN's gradients")
    why = {"head_a": "the head rank 0's batch went through",
           "head_b": "the head only rank 1's batch went through — rank 0's call pairs with "
                     "rank 1's",
           "never": "which no rank used",
           "frozen": "which requires no gradient"}
    for n in ROUTED_HEADS + ("never", "frozen"):
        k = grads.count(n)
        if k:
            parts.append(f"{k} on {n}'s ({why[n]})")
    others = [c for c in carried if not c["grad_of"]]
    if others:
        shown = ", ".join(f"{c['op']} of {c['numel']:,} {c['dtype']} value(s)"
                          for c in others[:4]) + (", ..." if len(others) > 4 else "")
        parts.append(f"{len(others)} on tensors that are no parameter's gradient ({shown})")
    return "; ".join(parts) if parts else "none"


def check_prediction(guess, measured: dict) -> None:
    """Compare the learner's prediction of the number of collective calls one
    ``average_gradients`` makes on rank 0 with :func:`count_all_reduces`'s measurement, and say
    what each call carried and what the calls cost. Never raises for a wrong prediction."""
    __tracebackhide__ = True
    if not isinstance(measured, dict) or "calls" not in measured:
        fail("check_prediction needs what count_all_reduces(...) returned (a dict), got "
             f"{type(measured).__name__}.")
    calls = measured["calls"]
    used = measured.get("used")
    n_used = len(used) if used is not None else measured.get("trainable", measured["tensors"])
    why = (f"On rank 0 your function made {calls} collective call(s): "
           f"{_describe_calls(measured)}. Each call pays the collective's fixed start-up cost "
           f"(lesson 06's α) whatever it carries — one flag or 4,000 gradients — so this "
           f"average pays {calls} times α in every step, on top of what the calls carry. Part 1's "
           f"contract needs a gradient call for each of the {n_used} parameters some rank "
           f"used (a rank without that gradient still makes the call, or the calls pair the "
           f"wrong tensors), none for frozen or for never, and the ranks must first learn "
           f"together which parameters those are: one more call if all the flags travel in "
           f"one tensor, {n_used + 1} in all.")
    reveal(guess, calls, close=bool(guess.value == calls) if hasattr(guess, "value") else False,
           explanation=why)


BYTES_CHOICES = ("fewer", "the same", "more")


def check_bytes_prediction(guess, flat: dict, per_parameter: dict) -> None:
    """Stretch: compare the learner's prediction ("fewer", "the same" or "more" bytes handed to
    the collective by ``average_gradients_flat`` than the gradients of the parameters some rank
    used weigh) with :func:`count_all_reduces`'s measurements, and say why; part 1's
    ``average_gradients`` (``per_parameter``) is shown beside it. Never raises for a wrong
    prediction."""
    __tracebackhide__ = True
    for what, m in (("flat", flat), ("per_parameter", per_parameter)):
        if not isinstance(m, dict) or "bytes" not in m or "used_bytes" not in m:
            fail(f"check_bytes_prediction needs what count_all_reduces(...) returned for "
                 f"{what} (a dict), got {type(m).__name__}.")
    a, used, b = flat["bytes"], flat["used_bytes"], per_parameter["bytes"]
    measured = "fewer" if a < used else "more" if a > used else "the same"
    n_used = len(flat.get("used", ()))
    versus = (f"Part 1's average_gradients handed over {b:,} bytes in {per_parameter['calls']} "
              f"call(s): α paid {per_parameter['calls']} times against once.")
    if measured == "more":
        why = (f"Your one call carried {a:,} bytes; the gradients of the {n_used} parameters "
               f"some rank used weigh {used:,}. The {a - used:,} bytes more are the price of "
               f"one call: it is made before any rank has heard from the others, so every "
               f"rank's buffer needs a slot for every parameter that might have a gradient "
               f"somewhere — never's zeros included, though no rank used it — and room for "
               f"what tells the ranks who used what. A per-parameter loop can learn that first "
               f"and skip never. {versus}")
    elif measured == "the same":
        why = (f"Your one call carried exactly the {used:,} bytes of the gradients of the "
               f"{n_used} parameters some rank used — nothing for never and nothing to tell "
               f"the ranks who used what. {versus}")
    else:
        why = (f"Your one call carried {a:,} bytes, fewer than the {used:,} bytes the "
               f"gradients of the parameters some rank used weigh in their own dtype: it sent "
               f"them in a smaller type (lesson 07's fp16 hook does that on purpose). {versus}")
    reveal(guess, measured, close=getattr(guess, "value", None) == measured, explanation=why)


# --------------------------------------------------------------------------------------------
# Unequal shards: the gradient of the mean loss over every rank's samples
# --------------------------------------------------------------------------------------------

SHARD_SIZES = (3, 5, 8)  # rank r holds SHARD_SIZES[r] samples


class _Unplaced(Exception):
    """Raised on every rank, before the collective, when a tensor handed to it follows the
    default device rather than the gradients' (the same call on every rank: no rank waits)."""


def _placement_mode():
    """A TorchFunctionMode that remembers the tensors a factory function (``torch.tensor``,
    ``torch.zeros``, ... — the ones ``torch.set_default_device`` redirects) made without a
    ``device=``, and what is computed from such tensors alone. They live on the default device,
    the CPU, wherever the gradients are: under gloo on the CPU nothing shows, under NCCL the
    collective refuses them. Naming a device afterwards (``.to(dev)``, ``.to(p.grad)``,
    ``.cuda()``, ``.type_as(p.grad)``) places the result; ``*_like`` and ``new_*`` follow their
    input tensor's device, so they never count as unplaced."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors
    from torch.utils._pytree import tree_leaves

    constructors = _device_constructors()
    moves = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type_as}

    class Placement(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.unplaced = []          # kept alive: identity is what is compared

        def is_unplaced(self, t) -> bool:
            return any(t is u for u in self.unplaced)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            named = kwargs.get("device") is not None or (func in moves and (
                func is not torch.Tensor.to
                or any(isinstance(a, (torch.device, str, int, torch.Tensor)) for a in args[1:])))
            if func in constructors:
                if not named:
                    self.unplaced.extend(outs)
            elif named:
                self.unplaced = [u for u in self.unplaced if not any(u is o for o in outs)]
            else:
                ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                if ins and all(self.is_unplaced(t) for t in ins):
                    self.unplaced.extend(o for o in outs if not self.is_unplaced(o))
            return out

    return Placement()


class _DeviceWatch:
    """Run the learner's function under :func:`_placement_mode` with a spy on its collectives:
    the first tensor handed to a collective that a factory function made without a device (and
    what was computed from it alone) is noted in ``seen`` — never raised there, since a rank
    that stopped in the spy would leave the others waiting in the call. Parts 1, 4 and the
    stretch share it; :func:`_refuse_unplaced` turns a note into the sentence."""

    def __init__(self, dev):
        self.placement = _placement_mode()
        self.grad_device = str(torch.device(dev) if dev is not None else torch.device("cpu"))
        self.seen: list = []

    def spy(self, call) -> None:
        for v in (call.args or {}).values():
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor) and self.placement.is_unplaced(t) \
                        and not self.seen:
                    self.seen.append({"op": call.op, "shape": str(tuple(t.shape)),
                                      "device": str(t.device), "grad_device": self.grad_device})

    def run(self, fn, *args, before=None):
        """``fn(*args)`` watched; returns the collectives' log. ``before``: another spy."""
        from ..collectives import record_collectives

        def both(call):
            self.spy(call)
            if before is not None:
                before(call)

        try:
            with record_collectives(before=both) as calls, self.placement:
                fn(*args)
        finally:
            self.placement.unplaced.clear()
        return calls


def _refuse_unplaced(results: list, where: str = "") -> None:
    """A tensor handed to a collective followed the default device on some rank: refused with
    the cause (gloo accepts it, NCCL on GPUs does not)."""
    __tracebackhide__ = True
    for rank, r in enumerate(results):
        if r.get("unplaced"):
            u = r["unplaced"]
            fail(f"{where}on rank {rank} the tensor of shape {u['shape']} handed to "
                 f"dist.{u['op']} was made by a factory function (torch.tensor, torch.zeros, "
                 f"...) without a device=, so it lives on the default device ({u['device']}) "
                 f"whatever device the gradients are on ({u['grad_device']} here): gloo on the "
                 f"CPU accepts it, but on GPUs, where the gradients live on cuda:<rank>, NCCL "
                 f"refuses a CPU tensor — the contract asks for every tensor you hand to a "
                 f"collective to live on the gradients' device.",
                 fix="create it on the gradients' device: pass device=p.grad.device (or "
                     "build it with p.grad.new_tensor(...) / torch.full_like(...)).")


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


# --------------------------------------------------------------------------------------------
# The data-parallel step
# --------------------------------------------------------------------------------------------

_STEPS = 3


def _cfg():
    from ..ddp import StepConfig

    # 24 samples split evenly over both world sizes tried (2 and 3 ranks)
    return StepConfig(global_batch=24, steps=_STEPS, lr=0.1, width=4, n_train=96)


def _optimizer(name: str, params, cfg):
    if name == "adam":   # not linear in the gradient: averaging the weights differs from it
        return torch.optim.Adam(params, lr=ADAM_LR)
    return torch.optim.SGD(params, lr=cfg.lr)


ADAM_LR = 0.01


def _step_worker(rank: int, world_size: int, step_fn, opt_name: str = "sgd") -> dict:
    __tracebackhide__ = True
    from .. import ddp
    from ..collectives import record_collectives

    cfg = _cfg()
    dev = ddp.setup_rank()
    model = ddp.make_model(cfg).to(dev)
    opt = _optimizer(opt_name, model.parameters(), cfg)
    weights = {p.data_ptr() for p in model.parameters()}
    touched = []   # did a collective receive a parameter itself (not its gradient)?

    def spy(call):
        for v in (call.args or {}).values():
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor) and t.data_ptr() in weights:
                    touched.append(call.op)

    returned, expected = [], []
    for step in range(cfg.steps):
        X, y = ddp.shard_of(*ddp.global_batch_for_step(cfg, step), rank, world_size)
        X, y = X.to(dev), y.to(dev)
        with torch.no_grad():  # this rank's loss before the step
            expected.append(F.cross_entropy(model(X), y).item())
        with record_collectives(before=spy):
            out = step_fn(model, opt, X, y)
        if out is None or isinstance(out, float):
            returned.append(out)
        elif isinstance(out, torch.Tensor):
            returned.append(f"a torch.Tensor ({out.detach().cpu().float().reshape(-1)[0]:.4f})"
                            if out.numel() else "an empty torch.Tensor")
        else:
            returned.append(f"a {type(out).__name__}")
    return {"params": ddp.flat_params(model), "returned": returned, "expected": expected,
            "weights_reduced": bool(touched)}


def _simulate(world_size: int, rank: int | None, scale: float = 1.0,
              zero_grad: bool = True, opt_name: str = "sgd") -> torch.Tensor:
    """Final weights of a single process that trains on rank ``rank``'s shard only (None: the
    whole global batch), with gradients multiplied by ``scale``, with or without zero_grad.
    (Its ``world_size`` only picks the shard.)"""
    from .. import ddp

    cfg = _cfg()
    model = ddp.make_model(cfg)
    opt = _optimizer(opt_name, model.parameters(), cfg)
    for step in range(cfg.steps):
        X, y = ddp.global_batch_for_step(cfg, step)
        if rank is not None:
            X, y = ddp.shard_of(X, y, rank, world_size)
        if zero_grad:
            opt.zero_grad(set_to_none=True)
        (F.cross_entropy(model(X), y) * scale).backward()
        opt.step()
    return ddp.flat_params(model)


_WEIGHTS = ("the ranks all-reduced the weights themselves, after each rank stepped with its own "
            "gradients, instead of the gradients before the step: that matches one process on "
            "the global batch only while the update is linear in the gradient, as plain SGD's "
            "is — with Adam the mean of the ranks' updates is not the update of the mean "
            "gradient.")
_WEIGHTS_FIX = ("average the gradients between backward and the optimizer step; nobody sends "
                "weights after the start (lesson 03).")


@recorded
def check_data_parallel_step(data_parallel_step, world_sizes=WORLD_SIZES,
                             timeout: float | None = None) -> None:
    """Run ``data_parallel_step(model, optimizer, X, y)`` for 3 steps on 2 and on 3 ranks, each
    on its shard of the global batch; the final weights must be equal on every rank and equal
    to one process trained on the whole global batch."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    if not callable(data_parallel_step):
        fail(f"check_data_parallel_step needs your function, got "
             f"{type(data_parallel_step).__name__}.")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the simulations are tiny: extra threads only add contention
    try:
        # A step 1/world_size too small on 2 ranks is also 1/4, a fixed 4: only every world
        # size together shows a division by the world size done twice.
        doubled = []
        for world_size in world_sizes:
            results = _launch(_step_worker, world_size, timeout, data_parallel_step,
                              name="data_parallel_step")
            args = ([r["params"] for r in results], world_size, _returned_loss_problem(results),
                    any(r["weights_reduced"] for r in results))
            if world_size > 1 and all(
                    torch.allclose(p, _simulate(world_size, None, scale=1.0 / world_size),
                                   rtol=1e-4, atol=1e-6) for p in args[0]):
                doubled.append(args)
                continue
            _diagnose_step(*args)
        if doubled and len(doubled) == len(world_sizes):
            sizes = " and ".join(f"{a[1]} ({a[1]} x {a[1]} = {a[1] ** 2})" for a in doubled)
            fail(f"on {sizes} ranks the gradients were divided by the world size squared: the "
                 f"world size was divided out twice, e.g. the loss averaged over the ranks "
                 f"before backward (which divides this rank's gradients by the world size) AND "
                 f"the gradients averaged after it.",
                 fix="divide by the world size once: backward this rank's own mean loss, then "
                     "average the gradients; all-reduce a detached copy of the loss only to "
                     "report it.")
        for args in doubled:
            _diagnose_step(*args)
        # The same step with Adam, whose update is not linear in the gradient.
        world_size = min(world_sizes)
        results = _launch(_step_worker, world_size, timeout, data_parallel_step, "adam",
                          name="data_parallel_step")
        reference = _simulate(world_size, None, opt_name="adam")
        if not all(torch.allclose(r["params"], reference, rtol=1e-4, atol=1e-6)
                   for r in results):
            if any(r["weights_reduced"] for r in results):
                fail(_WEIGHTS, fix=_WEIGHTS_FIX)
            fail(f"with plain SGD the weights matched one process on the global batch, but with "
                 f"Adam (lr {ADAM_LR}) they do not: Adam's update is not linear in the "
                 f"gradient, so whatever the step averages after the optimizer does not average "
                 f"the gradients it was fed.",
                 fix="give every rank the averaged gradients before the optimizer step.")
    finally:
        torch.set_num_threads(threads)
    passed(f"data-parallel step on {' and '.join(map(str, world_sizes))} ranks == one process "
           f"on the global batch (with SGD, and with Adam on {min(world_sizes)} ranks), weights "
           f"equal on every rank, the global batch's loss returned")


_LOSS_FIX = ("return a Python float: the global batch's loss before the step, from a detached "
             "copy of this rank's loss summed over the ranks and divided by their number.")


def _returned_loss_problem(results: list) -> tuple[str, str] | None:
    """None if every call returned the global batch's loss as a float, else (the cause, the
    fix)."""
    world_size = len(results)
    for step in range(len(results[0]["expected"])):
        own = [r["expected"][step] for r in results]
        want = sum(own) / world_size          # equal shards: the mean of the shards' means
        for rank, r in enumerate(results):
            got = r["returned"][step]
            if got is None:
                return ("data_parallel_step returned nothing: the contract asks for the global "
                        "batch's loss as a Python float.", _LOSS_FIX)
            if isinstance(got, str):
                return (f"data_parallel_step returned {got}, not a Python float: the contract "
                        f"asks for a float, which a caller can log or compare without keeping "
                        f"a tensor (its autograd graph, its device) alive.",
                        "return the tensor's number: .item() (or float(...)) of the global "
                        "loss.")

            def near(a, b):
                return abs(a - b) <= 1e-4 * max(1.0, abs(b))

            if near(got, want):
                continue
            if near(got, own[rank]) and not near(own[rank], want):
                return (f"data_parallel_step returned {got:.4f} on rank {rank}, that rank's own "
                        f"shard's loss, where the global batch's loss was {want:.4f}: the "
                        f"contract asks for the loss of the whole global batch, the same number "
                        f"on every rank, and no rank's loss is that without the others'.",
                        _LOSS_FIX)
            if near(got, sum(own)):
                return (f"data_parallel_step returned {got:.4f}, the sum of the ranks' shard "
                        f"losses, {world_size} times the global batch's loss ({want:.4f}).",
                        "divide the sum of the ranks' losses by the number of ranks.")
            return (f"data_parallel_step returned {got:.4f} on rank {rank} where the global "
                    f"batch's loss before this step was {want:.4f}: neither this rank's shard "
                    f"loss nor the sum over the ranks, so a loss computed at another moment "
                    f"(after the optimizer step?) or over other samples.",
                    "return the loss computed before the step, over every rank's shard.")
    return None


def _diagnose_step(params: list, world_size: int, loss_problem: tuple | None = None,
                   weights_reduced: bool = False) -> None:
    __tracebackhide__ = True
    from .. import ddp

    reference = _simulate(world_size, None)
    start = ddp.flat_params(ddp.make_model(_cfg()))

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-4, atol=1e-6)

    if all(close(p, reference) for p in params):
        if loss_problem:
            fail(loss_problem[0], fix=loss_problem[1])
        return
    if all(torch.equal(p, start) for p in params):
        fail("the weights never changed in 3 steps: the averaged gradients never reached an "
             "optimizer step.", fix="call optimizer.step() after averaging the gradients.")
    own = [[_simulate(world_size, r, scale) for r in range(world_size)]
           for scale in (1.0, 1.0 / world_size)]
    for sims in own:
        if all(close(p, s) for p, s in zip(params, sims)):
            fail("each rank stepped with its own gradients and the ranks' weights drifted apart: "
                 "averaging the loss (or not averaging at all) does not average the gradients, "
                 "since each rank's backward still differentiates its own shard's loss.",
                 fix="call average_gradients(model) between loss.backward() and "
                     "optimizer.step().")
    if all(close(p, _simulate(world_size, None, zero_grad=False)) for p in params):
        fail("the gradients piled up from step to step: backward adds into p.grad, so each "
             "step also applied the previous steps' gradients.",
             fix="call optimizer.zero_grad() before each backward.")
    for k in sorted({2, 3, 4} - {world_size}):
        if all(close(p, _simulate(world_size, None, scale=world_size / k)) for p in params):
            fail(f"on {world_size} ranks the steps are {world_size}/{k} of the right size: the "
                 f"gradients were divided by {k}, not by the world size.",
                 fix="divide by dist.get_world_size(), not a fixed number.")
    if weights_reduced:
        fail(_WEIGHTS, fix=_WEIGHTS_FIX)
    if not all(close(p, params[0]) for p in params):
        fail("after 3 steps the ranks hold different weights: they did not all apply the same "
             "averaged gradients.", fix="average the gradients on every rank before its step.")
    fail("the weights are equal on every rank but differ from one process trained on the global "
         "batch.", fix="use the mean loss on the rank's shard, backward, average_gradients, "
                       "step.")
