"""Lab 02 §3-§4: ``check_dp_forward_backward`` — the learner's DataParallel step against the
plain module on the whole batch (outputs, summed gradients, what the model held before, the
BatchNorm buffers) with each known wrong rule named — and the ``calls`` prediction's
``SampleCounter``. Re-exported by :mod:`dpcourse.checks.lab02`.
"""

from __future__ import annotations

import copy
import itertools
import threading

import torch
import torch.nn.functional as F

from . import fail, passed, recorded
from .. import dp as reference
from ._lab02_common import _not_yours
from .lab01 import library_calls


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
           "hold what nn.DataParallel leaves there (part 5 tries a module with state of its "
           f"own). {WHY_RULE}")


# Why part 4's rule is what it is: the explanation of part 3's two measurements, held back
# until the rule has been worked out from them (their feedback says only what was measured).
WHY_RULE = (
    "Why, from part 3's two measurements: the loss is one mean over the whole batch, so each "
    "sample's term is divided by the batch's size, not by its chunk's; a copy's backward "
    "differentiates its own chunk's terms alone, so its gradient is its chunk's share of the "
    "whole batch's (the 1-sample copy held 1/10), and the copies' shares add up to it. And at a "
    "leaf autograd adds what arrives into what .grad already held (AccumulateGrad): under "
    "nn.DataParallel the module's parameters are the leaves the broadcast's backward reaches, "
    "so what the model held stays, once, and the batch's gradient joins it, once. Your plain "
    "copies are leaves of their own, which is why your code does that last step.")


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
             f"devices, where nn.DataParallel(model) leaves them updated once, by one chunk's "
             f"{c0} samples.",
             fix="every update was made on a copy and thrown away with it, where "
                 "nn.DataParallel keeps one replica's (lesson 02 §2): which replica's, and "
                 "how do its updates reach the model?")
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
