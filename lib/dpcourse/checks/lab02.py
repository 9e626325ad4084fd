"""Checks for lab02: DataParallel's step by hand (scatter, replicas, gather, summed gradients).

The learner writes ``scatter(X, n_devices)``, ``gather(outputs)`` and
``dp_forward_backward(model, X, y, n_devices)``; each check runs them on small inputs, compares
with the reference (``dpcourse.dp`` and the plain module on the whole batch) and, when the
numbers match a known wrong answer, names it. tests/test_lab02_checks.py proves each one.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time

import torch
import torch.nn.functional as F

from .. import dp as reference
from . import fail, passed, recorded
from .lab01 import is_library_function, library_calls
from ._lab02_state import (HELD_CHOICES, STATE_CASE, check_dp_state, check_held_prediction,
                           held_grad_after_dp, state_after_dp)

__all__ = ["check_scatter", "check_gather", "check_dp_forward_backward",
           "check_threaded_apply", "check_prediction", "copy_share", "CHUNK_SIZES",
           "idle_devices", "idle_batch_sizes", "check_idle_prediction", "COPY_CARRIES", "deepcopy_carries",
           "check_copy_prediction", "SampleCounter", "counted_after_dp", "CALLS_CASE",
           "calls_after_dp", "check_calls_prediction", "STATE_CASE", "state_after_dp",
           "check_dp_state", "HELD_CHOICES", "held_grad_after_dp", "check_held_prediction"]

# The two answers (both accepted) to the choice lab02 §1 leaves to the learner: how scatter
# sizes the chunks when N does not divide B. "like DataParallel": ceil(B/N) per device until the
# batch runs out (torch.chunk's sizes, which the real class uses; 6 on 4 -> 2, 2, 2);
# "balanced": sizes that differ by at most one over min(N, B) devices, the B mod k extra samples
# on the first chunks (6 on 4 -> 2, 2, 1, 1).
CHUNK_SIZES = ("like DataParallel", "balanced")


def _sizes_for(policy: str, b: int, n: int) -> list[int]:
    if policy == "like DataParallel":
        return [len(c) for c in torch.chunk(torch.empty(b), n)]
    k = min(n, b)
    return [b // k + (i < b % k) for i in range(k)]


def _refuse_library(fn, ref, name: str, why: str) -> None:
    __tracebackhide__ = True
    if is_library_function(fn, ref):
        fail(f"{name} is the library's own dpcourse.dp.{ref.__name__}: {why}",
             fix=f"write {name} yourself.")


def _not_yours(name: str, called: list, why: str) -> None:
    __tracebackhide__ = True
    if called:
        fail(f"{name} called the library's dpcourse.dp.{called[0]}: {why}",
             fix=f"do in your own code what dp.{called[0]} did.")


_OWN = ("the lab asks you to write it yourself, so the check would only be comparing the "
        "reference with itself.")


def _tensor_list(result, what: str) -> list[torch.Tensor]:
    __tracebackhide__ = True
    if isinstance(result, torch.Tensor) or not isinstance(result, (list, tuple)):
        fail(f"{what} must return a list or tuple of tensors (one per device), got "
             f"{type(result).__name__}.")
    for r in result:
        if not isinstance(r, torch.Tensor):
            fail(f"{what} must return a list or tuple of tensors, but one item is a "
                 f"{type(r).__name__}.")
    return list(result)


@recorded
def check_scatter(scatter, sizes: str | None = None) -> None:
    """``scatter(X, n_devices)`` must split X along dim 0 into contiguous, non-empty chunks in
    order, as ``nn.DataParallel`` does: at most n chunks, none larger than ceil(B/n), and at
    least as many as ``torch.chunk`` makes (which the real class uses: 6 samples on 4 devices
    are 3 chunks of 2, and the step then runs on 3 devices). A balanced split with n chunks when
    the batch allows it (2, 2, 1, 1: the extra samples on the first chunks) is accepted too;
    an empty chunk or an error is not. A list or a tuple of chunks is accepted. An empty batch
    (no samples) must be refused with a ValueError (a nan loss over 0 samples otherwise), and so
    must zero devices (``n_devices = 0``: no chunk has a device to go to).

    ``sizes`` is the learner's choice of chunk sizes (one of :data:`CHUNK_SIZES`; both are
    accepted); when given, the chunks must have the sizes it names. The library's
    ``dp.scatter`` is refused."""
    __tracebackhide__ = True
    policy = sizes  # (``sizes`` names each split's chunk sizes below)
    if policy is not None and policy not in CHUNK_SIZES:
        fail(f"your choice of chunk sizes must be {CHUNK_SIZES[0]!r} or {CHUNK_SIZES[1]!r} (how "
             f"scatter sizes the chunks), got {policy!r}.")
    _refuse_library(scatter, reference.scatter, "scatter", _OWN)
    # Even and uneven splits, one sample per device, and batches that run out before the
    # devices do (torch.chunk gives fewer chunks than devices: (6, 4), (5, 4), (2, 3)).
    # One device (4, 1): the whole batch is its one chunk.
    for b, n in ((8, 2), (10, 4), (6, 3), (7, 2), (3, 3), (6, 4), (5, 4), (2, 3), (4, 1)):
        X = torch.arange(b * 3, dtype=torch.float32).reshape(b, 3)
        fewest = len(torch.chunk(X, n))   # what nn.DataParallel uses
        most = min(n, b)
        biggest = -(-b // n)
        try:
            with library_calls(reference.scatter) as called:
                chunks = scatter(X.clone(), n)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as one sentence
            if b == n:
                fail(f"scatter refused a batch of {b} samples on {n} devices ({type(exc).__name__}: "
                     f"{exc}), but one sample per device is a valid split.",
                     fix="refuse nothing the contract allows (check < against <=).")
            if fewest < n:
                fail(f"scatter raised {type(exc).__name__} for a batch of {b} on {n} devices "
                     f"({exc}), but nn.DataParallel does not refuse a batch that runs out before "
                     f"the devices do: it returns fewer chunks and the step uses fewer devices.",
                     fix="return fewer chunks when the batch runs out.")
            fail(f"scatter(X, {n}) raised {type(exc).__name__}: {exc}")
        _not_yours("scatter", called, _OWN)
        chunks = _tensor_list(chunks, "scatter")
        if any(c.dim() != 2 for c in chunks):
            fail(f"scatter changed the number of dimensions (got shapes "
                 f"{[tuple(c.shape) for c in chunks]} from {tuple(X.shape)}).",
                 fix="split, do not reshape.")
        if (len(chunks) > 1 and all(c.shape[0] == b for c in chunks)
                and sum(c.shape[1] for c in chunks) == 3):
            fail("scatter split along dim 1 (the features) instead of dim 0 (the batch), so no "
                 "device got a whole sample.", fix="split along dim 0.")
        if any(c.shape[1] != 3 for c in chunks):
            fail(f"scatter returned chunks shaped {[tuple(c.shape) for c in chunks]}, not every "
                 f"feature of their samples (shape (k, 3) here).",
                 fix="cut along dim 0 only.")
        sizes = [c.shape[0] for c in chunks]
        if len(chunks) > n:
            fail(f"scatter(X, {n}) returned {len(chunks)} chunk(s) (sizes {sizes}) for {n} "
                 f"devices, more chunks than devices to run them.",
                 fix="at most one chunk per device.")
        if any(s == 0 for s in sizes):
            fail(f"scatter(X, {n}) gave a device an empty chunk (sizes {sizes}) for a batch of "
                 f"{b}: a replica must not run on no samples.",
                 fix="return only non-empty chunks (nn.DataParallel then uses fewer devices).")
        total = sum(sizes)
        if total < b:
            fail(f"scatter lost {b - total} of {b} samples (chunk sizes {sizes}): the "
                 f"remainder of B / N went to no device.",
                 fix="give the remainder to some device.")
        if total > b:
            fail(f"scatter returned {total} samples from a batch of {b}: a sample was copied to "
                 f"two devices.", fix="let the chunks' bounds meet without overlapping.")
        if len(chunks) < fewest:
            fail(f"scatter(X, {n}) returned {len(chunks)} chunk(s) (sizes {sizes}) for a batch of "
                 f"{b}: it left devices idle that nn.DataParallel would use ({fewest} chunks).",
                 fix="give each device one chunk while the batch lasts.")
        if max(sizes) > biggest:
            fail(f"scatter's chunks are unbalanced (sizes {sizes} for {b} samples on {n} "
                 f"devices): the device with the most samples sets the step's pace, and "
                 f"{max(sizes)} is more than the ceil({b}/{n}) = {biggest} it could be.",
                 fix=f"no chunk may hold more than ceil(B/N) samples.")
        assert fewest <= len(chunks) <= most
        joined = torch.cat(chunks)
        if torch.equal(joined, X):
            if policy is not None and sizes != _sizes_for(policy, b, n):
                if policy == "balanced" and sorted(sizes) == sorted(_sizes_for(policy, b, n)):
                    fail(f"you decided on 'balanced' chunk sizes and scatter(X, {n}) on a batch "
                         f"of {b} gave {sizes}: balanced, but the larger chunks come after "
                         f"smaller ones, where the lab's rule for 'balanced' puts the "
                         f"{b % min(n, b)} extra sample(s) on the first chunks "
                         f"({_sizes_for(policy, b, n)}).",
                         fix="give the B mod k extra samples to the first chunks, one each.")
                fail(f"you decided on {policy!r} chunk sizes, but scatter(X, {n}) on a batch of "
                     f"{b} gave {sizes}, and {policy!r} gives {_sizes_for(policy, b, n)}: your "
                     f"function and your choice disagree.",
                     fix="change the function or the choice, so that they say the same.")
            continue
        k = len(chunks)
        strided = torch.cat([X[i::k] for i in range(k)])
        if torch.equal(joined, strided):
            fail("scatter took every n-th sample (X[i::n]) instead of contiguous slices, so "
                 "gathering the outputs in device order does not put them back in the order "
                 "of y.", fix="give each device one contiguous slice.")
        fail("scatter's chunks, concatenated in device order, are not the original batch.",
             fix="split X along dim 0 into contiguous pieces without reordering them.")
    _check_empty_batch(scatter)
    _check_no_devices(scatter)
    said = f", with {policy!r} sizes as you decided" if policy else ""
    return passed(f"scatter splits the batch along dim 0 into contiguous chunks, at most one per "
                  f"device and none empty, also when the batch runs out before the devices "
                  f"do{said}, and refuses an empty batch and zero devices with a ValueError")


def _check_empty_batch(scatter, n: int = 4) -> None:
    """A batch of no samples: no chunk can be non-empty, and the step's mean loss over 0
    samples would be nan (0/0), so the contract refuses it with a ValueError."""
    __tracebackhide__ = True
    X = torch.empty(0, 3)
    try:
        got = scatter(X, n)
    except NotImplementedError:
        raise
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - reported as one sentence
        fail(f"scatter(X, {n}) on a batch of 0 samples raised {type(exc).__name__} ({exc}): an "
             f"accident of the arithmetic, not the refusal the contract asks for, so a caller "
             f"that handles a bad batch (ValueError) does not catch it and the message does not "
             f"say the batch is empty.",
             fix="test for an empty batch before any arithmetic on B and raise ValueError "
                 "saying the batch is empty.")
    shown = [c.shape[0] for c in got] if isinstance(got, (list, tuple)) and all(
        isinstance(c, torch.Tensor) for c in got) else type(got).__name__
    fail(f"scatter(X, {n}) on a batch of 0 samples returned {shown} instead of refusing it: "
         f"there is no non-empty chunk to give any device, and the step's mean loss over 0 "
         f"samples would be nan (0/0), so the contract refuses an empty batch.",
         fix="raise ValueError, saying the batch is empty, when X has no samples.")


def _check_no_devices(scatter, b: int = 4) -> None:
    """Zero devices (``n_devices = 0``): no chunk has a device to run on, so the contract
    refuses it with a ValueError, as it refuses an empty batch."""
    __tracebackhide__ = True
    X = torch.arange(b * 3, dtype=torch.float32).reshape(b, 3)
    try:
        got = scatter(X, 0)
    except NotImplementedError:
        raise
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - reported as one sentence
        fail(f"scatter(X, 0) on a batch of {b} samples raised {type(exc).__name__} ({exc}): an "
             f"accident of the arithmetic or of a torch call, not the refusal the contract asks "
             f"for, so a caller that handles a bad argument (ValueError) does not catch it and "
             f"the message does not say there are no devices.",
             fix="test for a device count below 1 before using it and raise ValueError saying "
                 "there are no devices.")
    shown = [c.shape[0] for c in got] if isinstance(got, (list, tuple)) and all(
        isinstance(c, torch.Tensor) for c in got) else type(got).__name__
    fail(f"scatter(X, 0) on a batch of {b} samples returned {shown} instead of refusing it: with "
         f"no devices no chunk has a device to run on, so the contract refuses n_devices = 0.",
         fix="raise ValueError, saying there are no devices, when n_devices is below 1.")


@recorded
def check_gather(gather) -> None:
    """``gather(outputs)`` must concatenate the per-device outputs along dim 0, in order."""
    __tracebackhide__ = True
    torch.manual_seed(0)
    outputs = [torch.randn(3, 10) for _ in range(3)]  # equal sizes: a wrong dim still runs
    expected = torch.cat(outputs, dim=0)
    _refuse_library(gather, reference.gather, "gather", _OWN)
    try:
        with library_calls(reference.gather) as called:
            got = gather([o.clone() for o in outputs])
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"gather raised {type(exc).__name__}: {exc}")
    _not_yours("gather", called, _OWN)
    if not isinstance(got, torch.Tensor):
        fail(f"gather must return one tensor, got {type(got).__name__}.")
    if got.dim() == 2 and got.shape[0] == 3:
        fail(f"gather concatenated along dim 1 (shape {tuple(got.shape)}) instead of dim 0: the "
             f"outputs of the devices are more samples, not more features.",
             fix="the result must be shaped (9, 10): join along dim 0.")
    if got.dim() == 3:
        fail(f"gather stacked the outputs into a new dimension (shape {tuple(got.shape)}), "
             f"but the devices' outputs are more rows of one batch.",
             fix="concatenate them along dim 0 into one (9, 10) batch.")
    if got.shape != expected.shape:
        fail(f"gather returned shape {tuple(got.shape)}, not the {tuple(expected.shape)} of "
             f"the devices' outputs one after another.",
             fix="concatenate the outputs along dim 0.")
    if not torch.equal(got, expected):
        if torch.equal(got, torch.cat(outputs[::-1])):
            fail("gather put the outputs in reverse device order, so the rows no longer line "
                 "up with y.", fix="keep device 0's first.")
        fail("gather returned the right shape but not the outputs concatenated in device order.",
             fix="join the outputs along dim 0, device 0's first, without changing their "
                 "values.")
    return passed("gather concatenates the outputs along dim 0 in device order")


def _grads(model) -> list:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _close(a: list, b: list, rtol=1e-4, atol=1e-6) -> bool:
    return all(x is not None and y is not None and x.shape == y.shape
               and torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))


def _forward_spy(model) -> tuple[list, list, list]:
    """Record (module id, batch size), and the thread it ran in, at every forward of ``model``
    and of its deep copies; and the batch size of every forward by a copy that holds
    ``model``'s own parameter tensors (a deep copy given them through its memo).

    A plain function (not a bound method) as the hook: ``copy.deepcopy`` copies a module's hook
    table but keeps functions as they are, so every replica reports into these lists.
    """
    calls: list = []
    threads: list = []
    shares: list = []
    own = {id(p) for p in model.parameters()}

    def hook(module, args):
        x = args[0] if args else None
        calls.append((id(module), x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else None))
        # The Thread object, not its ident: a thread that ended before the next one started
        # (a fast forward under load) may hand its ident on, and the two would look like one.
        threads.append(threading.current_thread())
        if module is not model and any(id(p) in own for p in module.parameters()):
            shares.append(x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else None)

    model.register_forward_pre_hook(hook)
    return calls, threads, shares


@recorded
def check_dp_forward_backward(dp_forward_backward) -> None:
    """After ``dp_forward_backward(model, X, y, n_devices)`` the original model's gradients must
    have grown by the plain model's on the whole batch (mean cross-entropy) — added to what
    ``p.grad`` held, as ``loss.backward()`` adds (None counting as zero) — the returned loss must
    be its loss, and the forward must have run on plain copies, one per chunk.

    Tried with 16 samples on 4 devices (a model with no gradients yet), 10 samples on 3 (chunks
    of 4, 4 and 2) and 6 samples on 4 (torch.chunk gives 3 chunks of 2: fewer chunks than
    devices), the last two on a model that already holds gradients, so an answer tied to one
    device count, to equal chunks, to one copy per device, or that overwrites ``p.grad``
    fails. Copies made by the library's ``dp.replicate`` (or ``dp.data_parallel``) are
    refused: the lab asks for plain copies, one for every chunk, so a forward of ``model``
    itself is refused too; so are the library's ``dp.scatter`` and ``dp.gather``, and copies
    that all ran in one thread (a loop, not DataParallel's threads). Every parameter of these models takes part in the
    loss: a parameter that gets no gradient is outside the lab's contract (it says so).
    """
    __tracebackhide__ = True
    for n_devices, batch, held in ((4, 16, False), (3, 10, True), (4, 6, True)):
        _check_dp_once(dp_forward_backward, n_devices, batch, held)
    _check_dp_buffers(dp_forward_backward)
    passed("DataParallel by hand on 4 and 3 devices (even and uneven chunks, and a batch of 6 "
           "on 4): each plain copy ran on its chunk, the loss is the whole batch's, the "
           "whole batch's gradient was added to what the model held, and BatchNorm's buffers "
           "hold what nn.DataParallel leaves there (part 5 tries a module with state of its own)")


def _bn_net(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(4, 10))


def _bn_state(model) -> list:
    bn = model[1]
    return [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]


def _check_dp_buffers(dp_forward_backward) -> None:
    """A model with BatchNorm, in training mode, 10 samples on 3 devices (chunk 0 holds 4
    samples under either chunk-size choice): afterwards the module's buffers must be what
    nn.DataParallel leaves, whose replica 0 shares them with the module -- one update, from
    chunk 0 alone (torch/nn/parallel/data_parallel.py's class docstring). Each other ending
    that a plausible answer leaves is named."""
    __tracebackhide__ = True
    n, batch = 3, 10
    model = _bn_net()
    model(torch.randn(8, 3, 6, 6) + 1.0)  # running statistics that are not the initial 0 and 1
    torch.manual_seed(1)
    X = torch.randn(batch, 3, 6, 6) * 2.0 + 0.5
    y = torch.randint(0, 10, (batch,))
    before = _bn_state(model)
    c0 = -(-batch // n)  # 4: like DataParallel (4, 4, 2) and balanced (4, 3, 3) alike

    def after_forwards(*parts):
        m = copy.deepcopy(model)
        for part in parts:
            m(part)
        return _bn_state(m)

    want = after_forwards(X[:c0])
    learner = copy.deepcopy(model)
    dp_forward_backward(learner, X.clone(), y.clone(), n)
    got = _bn_state(learner)

    def same(a, b):
        return all(torch.allclose(u.double(), v.double(), rtol=1e-5, atol=1e-6)
                   for u, v in zip(a, b))

    if same(got, want):
        return
    count = int(got[2])
    if same(got, before):
        fail(f"the model's BatchNorm running mean and variance did not move (num_batches_tracked "
             f"still {int(before[2])}) after a training-mode step on {batch} samples over {n} "
             f"devices, where nn.DataParallel(model) leaves them updated once, by chunk 0's "
             f"{c0} samples.",
             fix="every update was made on a copy and thrown away with it, where "
                 "nn.DataParallel keeps one replica's (lesson 02 §2): after the step, the "
                 "model's buffers must hold what the copy that ran chunk 0 holds in its own.")
    if same(got[:2], want[:2]):
        fail(f"the running mean and variance are chunk 0's, but num_batches_tracked is {count}, "
             f"not {int(want[2])}: the module counted a number of updates that nn.DataParallel "
             f"does not (it counts the one update replica 0 made).",
             fix="take every buffer from the copy that ran chunk 0, the count included.")
    sizes = [len(c) for c in torch.chunk(X, n)]
    last = after_forwards(X[batch - sizes[-1]:])
    if same(got[:2], last[:2]) or same(got[:2], after_forwards(X[-3:])[:2]):
        fail("the model's running statistics are those of the last chunk's copy, where "
             f"nn.DataParallel(model) leaves those of chunk 0's (its first {c0} samples).",
             fix="nn.DataParallel keeps the updates of replica 0, the one on the module's own "
                 "device, and loses the others'. Take them from the copy that ran chunk 0.")
    if same(got[:2], after_forwards(X)[:2]):
        fail("the model's running statistics are those of the whole batch, but no device saw "
             "the whole batch: under nn.DataParallel each replica normalises and counts its "
             "own chunk, and the module keeps replica 0's.",
             fix="take them from the copy that ran chunk 0, not from a forward on all of X.")
    parts = [X[a:a + s] for a, s in zip([0, sizes[0], sizes[0] + sizes[1]], sizes)]
    per_copy = [after_forwards(part) for part in parts]
    mean_stats = [sum(st[i] for st in per_copy) / len(per_copy) for i in range(2)]
    if same(got[:2], mean_stats):
        fail("the model's running statistics are the average of the copies', where "
             f"nn.DataParallel(model) leaves those of chunk 0's (its first {c0} samples).",
             fix="nn.DataParallel averages nothing between replicas, it keeps replica 0's (the "
                 "others' updates are lost). Take them from the copy that ran chunk 0 alone.")
    if same(got[:2], after_forwards(*parts)[:2]):
        fail("the model's running statistics took every chunk's update one after another, as "
             "if one module had run the chunks in turn; under nn.DataParallel only replica "
             "0's update reaches the module.", fix="take them from the copy that ran chunk 0 "
                                                   "alone.")
    fail(f"after a training-mode step on {batch} samples over {n} devices, the model's BatchNorm "
         f"running mean differs from what nn.DataParallel leaves (the update of the forward on "
         f"chunk 0, its first {c0} samples, alone) by up to "
         f"{(got[0] - want[0]).abs().max().item():.4f}.",
         fix="take the buffers from the copy that ran chunk 0.")


class SampleCounter(torch.nn.Module):
    """A linear classifier that keeps three records of what its training-mode forwards saw:
    ``seen``, the samples, counted in place in a buffer registered with ``persistent=False``
    (``self.seen += x.shape[0]``); ``peak``, the largest ``|x|``, a buffer given a new tensor by
    each forward (``self.peak = torch.maximum(self.peak, ...)``); ``calls``, the forwards, a
    plain Python int attribute (``self.calls += 1``). Lab 02's part 5 asks which of the three a
    DataParallel step leaves on the module."""

    def __init__(self, features: int = 12, classes: int = 10, seen: int = 0, calls: int = 0,
                 peak: float = 0.0):
        super().__init__()
        self.linear = torch.nn.Linear(features, classes)
        self.register_buffer("seen", torch.tensor(seen), persistent=False)
        self.register_buffer("peak", torch.tensor(float(peak)))
        self.calls = calls

    def forward(self, x):
        if self.training:
            self.seen += x.shape[0]
            self.peak = torch.maximum(self.peak, x.detach().abs().max())
            self.calls += 1
        return self.linear(x.flatten(1))


COUNT_CASE = (10, 4, 7)  # 10 samples on 4 devices, a counter that already holds 7


def counted_after_dp(batch: int = COUNT_CASE[0], n: int = COUNT_CASE[1],
                     start: int = COUNT_CASE[2]) -> tuple[int, list[int]]:
    """One training-mode forward of ``dpcourse.dp.data_parallel`` (whose replica 0 shares the
    module's buffers, as torch's ``replicate`` does) on a :class:`SampleCounter` that holds
    ``start``: (the module's count afterwards, the chunk sizes)."""
    torch.manual_seed(0)
    model = SampleCounter(seen=start)
    X = torch.randn(batch, 3, 2, 2)
    devs = reference.devices_for(n, kind="cpu")
    reference.data_parallel(model, X, devs)
    return int(model.seen), [c.shape[0] for c in reference.scatter(X, devs)]


CALLS_CASE = (10, 4, 5)  # 10 samples on 4 devices, `calls` holding 5


def calls_after_dp(batch: int = CALLS_CASE[0], n: int = CALLS_CASE[1],
                   start: int = CALLS_CASE[2]) -> tuple[int, list[int]]:
    """A :class:`SampleCounter` whose ``calls`` holds ``start``; one replica per chunk made by
    torch's own ``Module._replicate_for_data_parallel`` (how ``torch.nn.parallel.replicate``
    builds every replica, replica 0's included: a new module whose ``__dict__`` is a shallow
    copy of the module's), each run in its thread on its chunk: (the module's ``calls``
    afterwards, the replicas' ``calls``). The replicas' children are the module's own here
    (no GPU to broadcast to); ``calls`` lives on the top module, which is what is measured."""
    torch.manual_seed(0)
    model = SampleCounter(calls=start)
    chunks = list(torch.chunk(torch.randn(batch, 3, 2, 2), n))
    replicas = [model._replicate_for_data_parallel() for _ in chunks]
    reference.parallel_apply(replicas, chunks)
    return model.calls, [r.calls for r in replicas]


def check_calls_prediction(guess) -> None:
    """Compare the learner's predicted ``calls`` with :func:`calls_after_dp`; say why. Never
    raises for a wrong prediction."""
    __tracebackhide__ = True
    from . import reveal

    batch, n, start = CALLS_CASE
    measured, on_replicas = calls_after_dp()
    reveal(guess, measured, close=guess.value == measured, explanation=(
        f"torch's replicate builds each replica with Module._replicate_for_data_parallel "
        f"(torch/nn/modules/module.py): `replica.__dict__ = self.__dict__.copy()`, a dict of "
        f"its own. `self.calls += 1` cannot change an int in place: it reads {start} and binds "
        f"{start + 1} in the replica's own dict (the replicas ended holding {on_replicas}). "
        f"No replica writes into the module's __dict__: every replica's count was dropped "
        f"with its replica, and the module still holds {start}, not {start + 1} "
        f"(replica 0's) nor {start + n} (one per replica)."))


_PLAIN = ("the lab asks for plain copies (copy.deepcopy), whose gradients no autograd link "
          "brings back — getting them onto the model is the part to write.")


_YOURS = ("the lab asks for your own scatter and gather in the step (the check holds the "
          "step to the chunks your scatter makes, and dp's would hide a mistake in yours).")


def _check_dp_once(dp_forward_backward, n: int, batch: int, held: bool) -> None:
    __tracebackhide__ = True
    from ..models import SmallCNN

    torch.manual_seed(n)
    model = SmallCNN(width=4)
    X = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    sizes = [c.shape[0] for c in torch.chunk(X, n)]
    if held:  # gradients left in p.grad by an earlier backward (say, an accumulation)
        F.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.arange(4)).backward()
    before = _grads(model)

    ref_model = copy.deepcopy(model)
    ref_model.zero_grad(set_to_none=True)
    ref_loss = F.cross_entropy(ref_model(X), y)
    ref_loss.backward()
    ref = _grads(ref_model)

    def plus_held(grads):
        return [g if b is None else b + g for g, b in zip(grads, before)]

    learner = copy.deepcopy(model)  # (deepcopy leaves p.grad behind: hand it over)
    for p, b in zip(learner.parameters(), before):
        p.grad = None if b is None else b.clone()
    calls, threads, shared = _forward_spy(learner)
    try:
        with library_calls(reference.replicate, reference.data_parallel, reference.scatter,
                           reference.gather) as called:
            loss = dp_forward_backward(learner, X.clone(), y.clone(), n)
    except NotImplementedError:
        raise
    except TypeError as exc:
        if "NoneType" in str(exc):
            fail(f"dp_forward_backward raised TypeError ({exc}): a p.grad it used as a tensor "
                 f"was None. A parameter's p.grad is None, not zeros, until a backward reaches "
                 f"it: on `model` before its first backward, on a copy until this step's "
                 f"backward has run.",
                 fix="treat None as nothing held yet, and read the copies' gradients after the "
                     "backward.")
        fail(f"dp_forward_backward raised TypeError: {exc}")
    except Exception as exc:  # noqa: BLE001
        if len(sizes) < n:
            fail(f"on a batch of {batch} over {n} devices, where scatter gives {len(sizes)} "
                 f"chunks, dp_forward_backward raised {type(exc).__name__} ({exc}): the "
                 f"copies and the chunks were not paired one to one.",
                 fix="make one copy per chunk, not one per device.")
        fail(f"dp_forward_backward raised {type(exc).__name__}: {exc}")
    _not_yours("dp_forward_backward", [c for c in called if c in ("replicate", "data_parallel")],
               _PLAIN)
    _not_yours("dp_forward_backward", called, _YOURS)

    # Did it do data parallelism at all: one forward per chunk, on different copies, on chunks?
    seen = [b for _, b in calls]
    if batch in seen:
        fail(f"a model ran a forward on the whole batch of {batch} (forward batch sizes "
             f"{seen}), which no device of DataParallel ever sees.", fix="scatter X first and run each copy on its own "
                                            "chunk.")
    if len(calls) not in (len(sizes), min(n, batch)):
        fail(f"{len(calls)} forward pass(es) for {n} devices (batch sizes {seen}): not one "
             f"per chunk.", fix="run each copy once, on its chunk.")
    if len({m for m, _ in calls}) != len(calls):
        fail(f"the {len(calls)} chunks ran through {len({m for m, _ in calls})} model object(s), "
             f"but each device holds its own replica, which is what DataParallel is.",
             fix="make one copy per chunk (copy.deepcopy) and run copy i on chunk i.")
    own = [b for m, b in calls if m == id(learner)]
    if own:
        fail(f"`model` itself ran a forward (on {own[0]} sample(s)) besides its copies: the "
             f"contract gives every chunk, chunk 0 included, a plain copy, so that what "
             f"nn.DataParallel's replica 0 gets by sharing the module's tensors (its buffer "
             f"updates kept, its gradient added to what p.grad held) is left for your code to "
             f"do.",
             fix="run chunk 0 on a deep copy too, then bring onto `model` what that copy's "
                 "forward and backward left.")
    if shared:
        fail(f"a copy that ran a chunk (of {shared[0]} sample(s)) holds `model`'s own "
             f"parameter tensors, not copies of them: the contract gives every chunk a copy "
             f"with no parameter shared with `model`, so that what reaches model's p.grad is "
             f"your code's doing, not autograd's.",
             fix="leave model's parameters out of what the copy shares with it (a memo given "
                 "to copy.deepcopy maps an object to what the copy holds instead).")
    if len(calls) > 1 and len(set(map(id, threads))) == 1:
        where = "your function's own thread" if threads[0] is threading.current_thread() else \
            "one thread"
        fail(f"the {len(calls)} copies ran one after another in {where} (the check saw every "
             f"forward there), so no replica ran beside another: that is a loop over the "
             f"chunks, not DataParallel's step, whose replicas run at the same time, one thread "
             f"each.",
             fix="hand the copies and the chunks to dp.parallel_apply (or to your "
                 "threaded_apply), which runs one thread per copy.")

    got = _grads(learner)
    if all(g is None for g in got):
        fail("the original model has no gradients: the replicas' gradients stayed on the "
             "replicas, and the optimizer steps the original's parameters.",
             fix="put the combined gradient into each p.grad of the original.")
    if any(g is None for g in got):
        fail("some of the original model's parameters have no gradient: those stayed on the "
             "replicas.", fix="every parameter's gradient must reach the original model.")
    for g, r in zip(got, ref):
        if g.shape != r.shape:
            fail(f"a gradient has shape {tuple(g.shape)} but its parameter has shape "
                 f"{tuple(r.shape)}.", fix="combine the replicas' gradients element-wise, "
                                           "parameter by parameter.")
    if _close(got, plus_held(ref)):
        pass
    elif held and _close(got, ref):
        gone = max(b.abs().max().item() for b in before if b is not None)
        fail(f"the model arrived holding gradients (an earlier backward's, up to {gone:.4f}) "
             f"and after your step p.grad holds this batch's gradient alone: what it held is "
             f"gone, where nn.DataParallel(model) leaves what it held plus this batch's "
             f"gradient.",
             fix="nn.DataParallel's backward is a backward like any other: the replicas' "
                 "gradients flow back through the broadcast into the module's parameters, and "
                 "autograd adds them to what p.grad held (so that the caller decides when to "
                 "clear it, as gradient accumulation needs). Add to what p.grad held.")
    else:
        _diagnose_dp_gradients(got, ref, before if held else None, model, X, y, n, batch, sizes,
                               seen)
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            fail(f"dp_forward_backward returned a tensor of shape {tuple(loss.shape)}, not the "
                 f"loss as one number.", fix="return loss.item().")
        held_graph = (f"it still carries its graph (grad_fn {type(loss.grad_fn).__name__}), so "
                      f"a caller that keeps it, as a loop keeping each step's loss does, keeps "
                      f"every copy's activations of that step alive with it"
                      if loss.grad_fn is not None else
                      "detached, it is still a tensor, not a number: a caller that keeps one "
                      "per step keeps tensors (on a GPU, in device memory), and code that "
                      "expects a float (isinstance checks, json.dumps) refuses it")
        fail(f"dp_forward_backward returned a {loss.dim()}-d tensor ({loss.item():.5f}), but "
             f"the contract says the loss as a float: {held_graph}.",
             fix="return the tensor's value as a Python number (Tensor.item()).")
    if not isinstance(loss, (int, float)):
        fail(f"dp_forward_backward returned {type(loss).__name__}, not the loss (a number).",
             fix="return the loss as a float.")
    if abs(loss - ref_loss.item()) > 1e-4 * max(1.0, abs(ref_loss.item())):
        fail(f"the returned loss {loss:.5f} is not the mean loss on the whole batch "
             f"({ref_loss.item():.5f}).", fix="compute it on the gathered outputs.")


def _diagnose_dp_gradients(got, ref, before, model, X, y, n, batch, sizes, seen) -> None:
    """The gradients are wrong: name the mistake they look like (``before``: what the model
    held, added to every candidate as a right answer adds it). ``seen``: the batch sizes the
    learner's forwards ran on, the chunks of the learner's own scatter (in thread order: every
    order of them is tried)."""
    __tracebackhide__ = True

    def held(grads):
        return grads if before is None else [g + b for g, b in zip(grads, before)]

    if before is not None and _close(got, [r - (len(sizes) - 1) * b
                                           for r, b in zip(ref, before)]):
        fail(f"the model arrived holding gradients, and after your step on {len(sizes)} "
             f"copies p.grad is this batch's gradient minus {len(sizes) - 1} times what it "
             f"held, where nn.DataParallel(model) leaves this batch's gradient plus what it "
             f"held, once.",
             fix="you took the held gradient out of the copies' sum as if every copy had "
                 "carried it, but a deep copy of a parameter leaves its .grad behind "
                 "(Parameter.__deepcopy__), so each copy's p.grad holds its share alone. Add "
                 "the copies' sum to what model held.")
    if _close(got, held([r / n for r in ref])):
        fail(f"the gradients are {n} times too small: what your step added to p.grad is "
             f"1/{n} of the plain model's gradient on the whole batch of {batch}, where "
             f"nn.DataParallel(model) adds all of it.",
             fix=f"you averaged the replicas' gradients, but with one mean loss over the "
                 f"gathered batch each replica's gradient is already its share of the whole. "
                 f"Sum the replicas' gradients.")

    # The learner's chunks, in every order their sizes could have come in (at most 4! orders).
    orders = [list(o) for o in dict.fromkeys(itertools.permutations(
        sorted((b for b in seen if b), reverse=True)))] if sum(b or 0 for b in seen) == batch \
        else []
    orders = orders or [sizes]

    def per_chunk(combine, order):
        m = copy.deepcopy(model)
        m.zero_grad(set_to_none=True)
        losses = [F.cross_entropy(m(xc), yc) for xc, yc in zip(torch.split(X, order),
                                                               torch.split(y, order))]
        combine(losses).backward()
        return _grads(m)

    for order in orders:
        if _close(got, held(per_chunk(sum, order))):
            fail(f"the gradients are about {len(order)} times too big: what your step added "
                 f"to p.grad, on chunks of {order}, is about {len(order)} times the plain "
                 f"model's gradient on the whole batch of {batch}, where nn.DataParallel(model) "
                 f"adds it once.",
                 fix=f"a mean loss per chunk, summed over the replicas, counts the batch "
                     f"{len(order)} times. Compute one loss on the gathered outputs.")
    for order in orders:
        if len(set(order)) > 1 and _close(got, held(per_chunk(lambda ls: sum(ls) / len(ls),
                                                              order))):
            fail(f"your gradients weigh the samples of your uneven chunks ({order} samples of "
                 f"{batch}) unequally: a sample of the {min(order)}-sample chunk weighs "
                 f"{max(order) / min(order):g} times as much as one of a {max(order)}-sample "
                 f"chunk, where the whole batch's mean loss (what nn.DataParallel(model) "
                 f"differentiates) weighs every sample alike.",
                 fix=f"these are the gradients of the mean of the chunks' mean losses: "
                     f"averaging the {len(order)} means gives each chunk the same weight. "
                     f"Compute one mean loss on the gathered outputs.")
    # Only replica 0's share: the gradient of chunk 0's part of the global mean loss.
    for order in dict.fromkeys(o[0] for o in orders):
        only0 = copy.deepcopy(model)
        only0.zero_grad(set_to_none=True)
        (F.cross_entropy(only0(X[:order]), y[:order], reduction="sum") / batch).backward()
        if _close(got, held(_grads(only0))):
            fail(f"the gradients are replica 0's alone, the share of its {order} of {batch} "
                 f"samples: the other replicas' shares, {batch - order} samples' worth, never "
                 f"reached the original parameters.", fix="combine every replica's gradient, "
                                                         "not just the first one's.")
    fail(f"the original model's gradients differ from the plain model's on the whole batch "
         f"({batch} samples, {n} devices){' plus what it held' if before else ''}, in none of "
         f"the ways the check knows (the replicas' gradients averaged, or only replica 0's; "
         f"a loss per chunk, summed or averaged).",
         fix="run the plain model on the whole batch yourself (one mean loss, backward) and "
             "compare its p.grad with what your function left, parameter by parameter: whether "
             "they differ by a factor, by one chunk's share or otherwise tells you which step "
             "to look at.")


# --- stretch: the copies' forwards in real threads -----------------------------------------

class _Timed(torch.nn.Module):
    """A stand-in replica: sleeps (releasing the GIL, as torch kernels do), records when it
    ran and in which thread, and returns its input times a factor that identifies it."""

    def __init__(self, factor: float, delay: float, log: list, fail_with: str | None = None,
                 raises: type[BaseException] = ValueError):
        super().__init__()
        self.factor, self.delay, self.log, self.fail_with = factor, delay, log, fail_with
        self.raises = raises
        self.started = 0  # forwards begun (a task a pool cancelled before it ran never begins)
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        self.started += 1
        t0 = time.perf_counter()
        time.sleep(self.delay)
        if self.fail_with:
            raise self.raises(self.fail_with)
        self.log.append((self.factor, threading.get_ident(), t0, time.perf_counter()))
        return x * self.factor * self.w


@recorded
def check_threaded_apply(threaded_apply) -> None:
    """Stretch: ``threaded_apply(replicas, inputs)`` runs ``replicas[i](inputs[i])`` in one
    thread per replica, at the same time, and returns the outputs in replica order, with
    autograd on or off as the caller had it, and any replica's error raised to the caller."""
    __tracebackhide__ = True
    n = 3
    log: list = []
    # Replica 0 is the slowest, so the order the threads finish in is the reverse of the order
    # of the replicas.
    reps = [_Timed(i + 1, 0.15 * (n - i), log) for i in range(n)]
    inputs = [torch.full((2,), 10.0 ** i) for i in range(n)]
    _refuse_library(threaded_apply, reference.parallel_apply, "threaded_apply", _OWN)
    try:
        with library_calls(reference.parallel_apply) as called:
            out = threaded_apply(reps, inputs)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"threaded_apply raised {type(exc).__name__}: {exc}")
    _not_yours("threaded_apply", called, _OWN)
    if not isinstance(out, (list, tuple)) or len(out) != n:
        fail(f"threaded_apply must return a list with one output per replica, got "
             f"{type(out).__name__}" + (f" of length {len(out)}" if hasattr(out, "__len__") else "")
             + ".")
    if any(o is None for o in out):
        fail("some outputs are still None: threaded_apply returned before its threads "
             "finished.", fix="join every thread before reading the results.")
    want = [reps[i].factor * inputs[i] for i in range(n)]
    if not all(isinstance(o, torch.Tensor) and torch.equal(o.detach(), w) for o, w in zip(out, want)):
        if all(isinstance(o, torch.Tensor) and torch.equal(o.detach(), w)
               for o, w in zip(out, want[::-1])):
            fail("the outputs are in the order the threads finished, not in replica order.",
                 fix="store each result at its replica's index.")
        fail("output i is not replicas[i](inputs[i]): the replicas and inputs were not kept "
             "in pairs.", fix="give each thread its own index and keep the pairs together.")
    threads = {tid for _, tid, _, _ in log}
    if threads == {threading.get_ident()}:
        fail("the replicas ran one after another in the caller's thread, so none ran beside "
             "another.", fix="start one thread per replica (threading.Thread, or a "
                             "ThreadPoolExecutor).")
    # Checked before the thread count: a finished thread's id can be reused by the next one.
    spans = sorted((t0, t1) for _, _, t0, t1 in log)
    if not any(spans[i + 1][0] < spans[i][1] for i in range(len(spans) - 1)):
        fail("the replicas each had a thread but never ran at the same time: each thread was "
             "waited for before the next one started.", fix="start every thread (or submit every "
                                                     "task) before waiting for any of them.")
    if len(threads) < n:
        fail(f"the {n} replicas ran in {len(threads)} thread(s), so some waited for others.",
             fix="give each replica a thread of its own.")
    if not all(o.requires_grad for o in out):
        fail("the outputs carry no autograd graph although the caller records one: grad mode "
             "is per thread in torch, and your threads did not run with the caller's.",
             fix="set the caller's grad mode inside each thread (torch.set_grad_enabled).")
    with torch.no_grad():
        quiet = threaded_apply([_Timed(1, 0.0, []) for _ in range(2)],
                               [torch.ones(2), torch.ones(2)])
    if any(o.requires_grad for o in quiet):
        fail("called under torch.no_grad(), the threads still recorded a graph: grad mode is "
             "per thread in torch, and a new thread starts with it on.",
             fix="read torch.is_grad_enabled() in the caller and set it in each thread.")
    broken = [_Timed(1, 0.0, []), _Timed(2, 0.0, [], fail_with="replica 1 broke")]
    try:
        threaded_apply(broken, [torch.ones(2), torch.ones(2)])
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        if not _is_that_error(exc, ValueError, "replica 1 broke"):
            fail(f"when a replica fails, the caller should see its error (replica 1 raised "
                 f"ValueError: replica 1 broke); got {type(exc).__name__}: {exc}",
                 fix="raise the replica's own exception in the caller.")
    else:
        fail("a replica raised an error in its thread and threaded_apply returned as if "
             "nothing happened: an exception ends its thread, not the caller.",
             fix="keep the exception and raise it in the caller after join.")
    _check_several_errors(threaded_apply)
    _check_no_thread_left(threaded_apply)
    _check_system_exit(threaded_apply)
    passed(f"threaded_apply ran {n} replicas at the same time in {n} threads, kept their order, "
           f"the caller's grad mode, and their errors (raised once every thread had ended, the "
           f"lowest replica's first, a SystemExit included)")


def _is_that_error(exc: BaseException, cls: type, text: str) -> bool:
    """Whether the caller got the replica's error itself: its type, its message. One that
    only carries it (raised `from` it, or with it in its message) is refused by its cause."""
    __tracebackhide__ = True
    if type(exc) is cls and text in str(exc):
        return True
    if text in _said(exc):
        fail(f"a replica raised {cls.__name__} ('{text}') and the caller got "
             f"{type(exc).__name__} ({exc}), which carries it but is not it: the contract says "
             f"the caller gets that error, as it would from the loop "
             f"`[replicas[i](inputs[i]) for i in ...]`, so code around the call that catches "
             f"{cls.__name__} (or lets a SystemExit end the program with its code) misses a "
             f"{type(exc).__name__}.",
             fix=f"raise the exception object the replica raised ({cls.__name__} here), not a "
                 f"new one around it.")
    return False


def _said(exc: BaseException) -> str:
    """The messages of ``exc`` and of the exceptions it carries (cause, context)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " ".join(parts)


def _check_system_exit(threaded_apply) -> None:
    """Replica 1 ends with SystemExit (sys.exit() somewhere in its code), a BaseException that
    is no Exception: the caller must get it (not an error carrying it), never a None in place of
    replica 1's output. A thread that SystemExit ends dies silently (threading.excepthook
    ignores it), so a worker that catches only Exception loses it."""
    __tracebackhide__ = True
    broken = [_Timed(1, 0.0, []),
              _Timed(2, 0.0, [], fail_with="replica 1 called sys.exit()", raises=SystemExit)]
    try:
        out = threaded_apply(broken, [torch.ones(2), torch.ones(2)])
    except (NotImplementedError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit is what the check wants back
        if _is_that_error(exc, SystemExit, "replica 1 called sys.exit()"):
            return
        fail(f"replica 1 ended with SystemExit ('replica 1 called sys.exit()') and the caller "
             f"got {type(exc).__name__} ({exc}), which neither is that error nor carries it.",
             fix="keep what ended each thread, BaseException included, and raise that in the "
                 "caller.")
    shown = [None if o is None else type(o).__name__ for o in out] \
        if isinstance(out, (list, tuple)) else out
    fail(f"replica 1 ended with SystemExit, and threaded_apply returned {shown} as if nothing "
         f"had happened: SystemExit is a BaseException, not an Exception, so `except "
         f"Exception` let it end replica 1's thread, which dies silently (threading ignores a "
         f"SystemExit in a thread), and the caller took the None left in its slot for an "
         f"output. (torch's own parallel_apply also catches only Exception, but looks its "
         f"results up in a dict, so its caller gets a KeyError there rather than a None.)",
         fix="catch BaseException in each worker (what ends a thread, not only Exception) and "
             "raise it in the caller after the join.")


def _check_no_thread_left(threaded_apply) -> None:
    """Replica 0 fails at once while replica 1 still sleeps 0.3 s: when the caller gets the
    error, replica 1's thread must have finished (its log entry is written at its end). A
    replica that never ran (a thread pool cancels a task still queued when the caller gets an
    error) leaves no thread behind: it is told apart by waiting, then looking whether replica 1
    began at all."""
    __tracebackhide__ = True
    delay, log = 0.3, []
    broken = [_Timed(1, 0.0, [], fail_with="replica 0 broke"), _Timed(2, delay, log)]
    try:
        threaded_apply(broken, [torch.ones(2), torch.ones(2)])
    except NotImplementedError:
        raise
    except Exception:  # noqa: BLE001 - which error came back is checked elsewhere
        unfinished = not log
        time.sleep(delay + 0.1)  # let the straggler end before the next check starts threads
        if unfinished and broken[1].started:
            fail(f"replica 0 failed at once while replica 1 still had {delay} s of work, and "
                 f"threaded_apply raised replica 0's error while replica 1's thread was still "
                 f"running: the caller went on (to retry, or to the next step) with a thread "
                 f"of the failed call still writing into replica 1's module and its output.",
                 fix="wait for every thread (join them all) before raising the error kept.")
    else:
        fail("replica 0 raised an error in its thread and threaded_apply returned as if nothing "
             "happened: an exception ends its thread, not the caller.",
             fix="keep each thread's exception and raise it in the caller after join.")


def _check_several_errors(threaded_apply) -> None:
    """Replicas 1 and 2 both raise; the caller must get replica 1's error whichever thread
    raised first (tried both ways round), as torch's parallel_apply re-raises in replica order."""
    __tracebackhide__ = True
    for slow in (1, 2):
        broken = [_Timed(1, 0.0, []),
                  _Timed(2, 0.2 if slow == 1 else 0.0, [], fail_with="replica 1 broke"),
                  _Timed(3, 0.2 if slow == 2 else 0.0, [], fail_with="replica 2 broke")]
        try:
            threaded_apply(broken, [torch.ones(2)] * 3)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001
            if type(exc) is ValueError and "replica 1 broke" in str(exc):
                continue
            if "replica 2 broke" in _said(exc):
                order = "the first to fail" if slow == 1 else "the last to fail"
                fail(f"replicas 1 and 2 both raised and the caller got replica 2's error, "
                     f"{order}: which error the caller sees must not depend on which thread "
                     f"ran faster — the contract is the lowest-numbered failing replica's.",
                     fix="keep every thread's exception and, once all are joined, raise the "
                         "one of the lowest-numbered replica that failed.")
            if _is_that_error(exc, ValueError, "replica 1 broke"):
                continue
            fail(f"replicas 1 and 2 both raised, and the caller got neither error but "
                 f"{type(exc).__name__}: {exc}")
        else:
            fail("two replicas raised errors in their threads and threaded_apply returned as if "
                 "nothing happened: an exception ends its thread, not the caller.",
                 fix="keep each thread's exception and raise it in the caller after join.")


# --- predict, then measure: one copy's share of the gradient --------------------------------

def copy_share(n_devices: int = 4, batch: int = 10, seed: int = 0) -> float:
    """DataParallel with plain copies on a batch of ``batch`` identical samples, cut as
    ``torch.chunk`` cuts it (10 on 4: 3, 3, 3, 1), one mean loss over the gathered batch: the
    last copy's gradient as a fraction of the whole batch's (its projection on it, over all
    parameters)."""
    from ..models import SmallCNN

    torch.manual_seed(seed)
    model = SmallCNN(width=8)
    X = torch.randn(1, 3, 32, 32).repeat(batch, 1, 1, 1)
    y = torch.randint(0, 10, (1,)).repeat(batch)
    chunks = list(torch.chunk(X, n_devices))
    copies = [copy.deepcopy(model) for _ in chunks]
    outputs = reference.parallel_apply(copies, chunks)
    F.cross_entropy(torch.cat(outputs), y).backward()
    F.cross_entropy(model(X), y).backward()
    whole = torch.cat([p.grad.flatten() for p in model.parameters()])
    mine = torch.cat([p.grad.flatten() for p in copies[-1].parameters()])
    return float(mine @ whole / (whole @ whole))


def check_prediction(guess, n_devices: int = 4, batch: int = 10) -> None:
    """Measure :func:`copy_share` and compare it with the learner's prediction; say why it is
    the last chunk's size over the batch's. Never raises for a wrong prediction."""
    __tracebackhide__ = True
    from . import reveal

    sizes = [len(c) for c in torch.chunk(torch.empty(batch), n_devices)]
    measured = round(copy_share(n_devices, batch), 2)
    reveal(guess, measured, close=abs(float(guess.value) - measured) <= 0.02, explanation=(
        f"The loss is one mean over all {batch} samples, so each sample's term is divided by "
        f"{batch}, not by its chunk's size, and the last copy's backward differentiates the "
        f"terms of its own chunk ({sizes[-1]} sample(s)) alone. With identical samples every "
        f"term has the same gradient, so the last holds {sizes[-1]}/{batch} of the whole "
        f"batch's gradient."))


# --- predict, then measure: the scatter choice's consequence -------------------------------

IDLE_CASE = (32, 8)  # every batch size from 1 to 32, on 8 devices


def idle_devices(scatter, b: int, n: int = IDLE_CASE[1]) -> tuple[int, list]:
    """Run the learner's ``scatter`` on a batch of ``b`` on ``n`` devices: (devices given no
    sample, the chunk sizes)."""
    X = torch.arange(b, dtype=torch.float32).reshape(b, 1)
    sizes = [c.shape[0] for c in scatter(X, n)]
    return n - len(sizes), sizes


def idle_batch_sizes(scatter, top: int = IDLE_CASE[0], n: int = IDLE_CASE[1]) -> list[int]:
    """The batch sizes 1..``top`` for which the learner's ``scatter`` leaves at least one of
    ``n`` devices without a sample."""
    return [b for b in range(1, top + 1) if idle_devices(scatter, b, n)[0] > 0]


def _runs(values: list[int]) -> str:
    """[1, 2, 3, 9, 10] -> '1-3, 9-10'."""
    out, start = [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v > start else f"{v}")
            start = None
    return ", ".join(out) or "none"


def check_idle_prediction(guess, scatter, sizes: str | None = None) -> None:
    """Compare the predicted count of batch sizes 1..32 that leave a device idle on 8 devices,
    under the learner's own scatter, with the count; say why, and what the choice bought.
    Never raises for a wrong prediction."""
    __tracebackhide__ = True
    from . import reveal

    top, n = IDLE_CASE
    idle = idle_batch_sizes(scatter)
    rule = [b for b in range(1, top + 1) if -(-b // -(-b // n)) < n]  # DataParallel's fill
    why = (f"Your scatter leaves a device idle for {len(idle)} of the {top} batch sizes "
           f"({_runs(idle)}). ")
    if len(idle) > n - 1:
        why += (f"Below {n} samples some device must idle whatever the rule; above it, filling "
                f"each device with ceil(B/{n}) samples in turn uses the batch up early whenever "
                f"the last chunk would be short by a whole chunk: once the chunk size is c, only "
                f"B > {n - 1}c feeds all {n} devices, so the idle stretch after each multiple "
                f"of {n} shrinks by one ({_runs(rule[n - 1:])}). ")
    else:
        why += (f"Only a batch smaller than the {n} devices starves one: a balanced split feeds "
                f"every device once B >= {n}, where DataParallel's rule would idle one for "
                f"{len(rule)} sizes ({_runs(rule)}). ")
    why += ("Either way the busiest device holds ceil(B/8) samples and the step waits for it, so "
            "the step takes as long: the balanced rule spreads the same work over more devices, "
            "DataParallel's leaves the spare ones idle and copies the model to fewer.")
    reveal(guess, len(idle), close=guess.value == len(idle), explanation=why)


# --- predict, then measure: what copy.deepcopy carries along ---------------------------------

COPY_CARRIES = ("both", "gradients only", "running statistics only", "neither")


def deepcopy_carries() -> str:
    """Deep-copy a model that holds gradients (a backward ran) and BatchNorm running statistics
    (a training-mode forward ran): which of the two does the copy hold?"""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    net(torch.randn(8, 3) + 2).sum().backward()
    twin = copy.deepcopy(net)
    grads = all(q.grad is not None for q in twin.parameters())
    stats = torch.equal(twin[1].running_mean, net[1].running_mean) and bool(
        net[1].running_mean.abs().sum() > 0)
    if grads:
        return "both" if stats else "gradients only"
    return "running statistics only" if stats else "neither"


def check_copy_prediction(guess) -> None:
    """Compare the learner's choice with :func:`deepcopy_carries`; say why. Never raises."""
    __tracebackhide__ = True
    from . import reveal

    measured = deepcopy_carries()
    reveal(guess, measured, close=guess.value == measured, explanation=(
        "A module's buffers (BatchNorm's running mean and variance) are tensors in its state "
        "and are copied with it. A parameter is copied by Parameter.__deepcopy__ "
        "(torch/nn/parameter.py), which builds a new Parameter from a clone of the data and "
        "the requires_grad flag alone: the original's .grad is not copied along (a plain "
        "tensor's deep copy would keep it)."))
