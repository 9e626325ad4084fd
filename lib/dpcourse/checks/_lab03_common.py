"""What every check of lab 03 shares: part 1's two-head model, the launch that turns a hang
into a sentence, and the refusals more than one part makes (a ``None`` guard missing, a frozen
parameter given a gradient, a parameter no rank used given zeros). The checks themselves are in
:mod:`dpcourse.checks.lab03`, whose docstring lists every mistake they name."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fail, has_todo, run_ranks

DEFAULT_TIMEOUT = 20.0  # seconds; a correct answer takes 1-8 s, a deadlock is cut off here


ROUTED_HEADS = ("head_a", "head_b")  # even ranks add head_a to the logits, odd ranks head_b


NEVER_VALUE = 0.5   # part 1's ``never``: not zero, so an optimizer's step on it shows


WORLD_SIZES = (2, 3)  # two sizes: an answer that divides by 2 instead of the world size fails


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
