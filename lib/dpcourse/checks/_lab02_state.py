"""Lab 02, part 5 (the lab's design decision): what of the copies' state comes back to the
model, and from which copy — and §3's prediction of what ``p.grad`` holds after a
DataParallel step on a model that arrived holding gradients.

The reference for the state is torch's own ``torch.nn.parallel.replicate``
(torch/nn/parallel/replicate.py) run on the CPU: only its device copy,
``comm.broadcast_coalesced``, is stood in for, by one that gives the first device the input
tensors themselves and the others clones — what torch's C++ ``broadcast_coalesced``
(torch/csrc/cuda/comm.cpp: ``outputs[0] = tensors.vec()``) does, which is how replica 0 comes
to share the module's tensors. Every replica module is then built by torch's
``Module._replicate_for_data_parallel``, as on a GPU box. Re-exported by
:mod:`dpcourse.checks.lab02`.
"""

from __future__ import annotations

import copy
import importlib
from unittest import mock

import torch
import torch.nn.functional as F

from .. import dp as reference
from . import fail, passed, recorded

__all__ = ["STATE_CASE", "state_after_dp", "check_dp_state", "HELD_CHOICES",
           "held_grad_after_dp", "check_held_prediction", "PEAK_CHOICES",
           "state_predictions_measured", "check_state_predictions"]

# 10 samples on 4 devices (chunk 0 holds 3 under either chunk-size choice of §1); the
# counter's `seen` starts at 7, `calls` at 5, `peak` at 0.5.
STATE_CASE = (10, 4, 7, 5, 0.5)


def _first_device_keeps_its_tensors(tensors, devices, buffer_size=None):
    """CPU stand-in for ``comm.broadcast_coalesced``: device 0's outputs are the inputs
    themselves (as torch's C++ broadcast_coalesced returns them), every other device's a clone."""
    return [list(tensors)] + [[t.detach().clone() for t in tensors] for _ in devices[1:]]


def _torch_replicate(module, n: int) -> list:
    """``n`` replicas of ``module`` made by torch's own ``replicate`` on the CPU."""
    replicate_module = importlib.import_module("torch.nn.parallel.replicate")
    comm = importlib.import_module("torch.nn.parallel.comm")
    with mock.patch.object(comm, "broadcast_coalesced", _first_device_keeps_its_tensors):
        # detach=True: parameters go through the same stand-in (torch's Broadcast refuses CPU
        # tensors); buffers that need no gradient take this path under nn.DataParallel too.
        return replicate_module.replicate(module, list(range(n)), detach=True)


def _state(model) -> dict:
    """Every buffer (persistent or not) and the plain ``calls`` attribute, by name."""
    state = {name: b.detach().clone() for name, b in model.named_buffers()}
    state["calls"] = getattr(model, "calls", None)
    return state


def state_after_dp(model, X: torch.Tensor, n: int) -> dict:
    """One training-mode forward of ``model`` as nn.DataParallel runs it on ``n`` devices —
    chunks as ``torch.chunk`` cuts them, replicas from torch's own ``replicate`` (see the module
    docstring), one thread per replica — then the module's state (:func:`_state`). The
    forward's outputs are dropped: the backward leaves the buffers as they are."""
    chunks = list(torch.chunk(X, n))
    replicas = _torch_replicate(model, len(chunks))
    with torch.no_grad():
        reference.parallel_apply(replicas, chunks)
    return _state(model)


class _Counter(torch.nn.Module):
    """The counter's state without its forward: ``seen`` (a buffer, persistent=False), ``peak``
    (a buffer) and ``calls`` (a plain int), as :class:`~dpcourse.checks.lab02.SampleCounter`
    holds them. The modules below differ from it only in how their forwards write them."""

    def __init__(self, seen: int, calls: int, peak: float, features: int = 12,
                 classes: int = 10):
        super().__init__()
        self.linear = torch.nn.Linear(features, classes)
        self.register_buffer("seen", torch.tensor(seen), persistent=False)
        self.register_buffer("peak", torch.tensor(peak))
        self.calls = calls


class _Swapped(_Counter):
    """The counter's two buffers with their roles swapped: ``peak`` written in place, ``seen``
    given a new tensor each forward. A rule tied to the buffers' names fails here."""

    def forward(self, x):
        if self.training:
            self.seen = self.seen + x.shape[0]
            self.peak.copy_(torch.maximum(self.peak, x.detach().abs().max()))
            self.calls += 1
        return self.linear(x.flatten(1))


def _case(cls):
    from .lab02 import SampleCounter

    batch, n, seen, calls, peak = STATE_CASE
    torch.manual_seed(3)
    if cls is SampleCounter:
        model = SampleCounter(seen=seen, calls=calls, peak=peak)
    else:
        model = cls(seen=seen, calls=calls, peak=peak)
    X = torch.randn(batch, 3, 2, 2)
    X[7] *= 3.0  # the batch's largest |x| lies in chunk 2, not in chunk 0
    y = torch.randint(0, 10, (batch,))
    return model, X, y


def _show(v) -> str:
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=1e-6)
    return a == b


class _InPlaceThenRebound(_Counter):
    """The counter with ``seen`` written both ways in one forward: added to in place, then a
    new tensor (a clamp that does not bind) bound to the name. Under nn.DataParallel the
    in-place addition stays on the module although replica 0 ends holding another tensor: a
    rule that brings a buffer back only while copy 0 still holds the tensor it started with
    fails here."""

    def forward(self, x):
        if self.training:
            self.seen += x.shape[0]
            self.seen = torch.clamp(self.seen, max=10 ** 6)
            self.peak = torch.maximum(self.peak, x.detach().abs().max())
            self.calls += 1
        return self.linear(x.flatten(1))


# --- part 5's predictions, before its contract: what one DataParallel forward leaves --------

PEAK_CHOICES = ("0.5, as before", "chunk 0's largest |x|", "the batch's largest |x|")
def _peak_label(value, before, r0, whole) -> str:
    for label, ref in zip(PEAK_CHOICES, (before, r0, whole)):
        if _same(value, ref):
            return label
    raise RuntimeError(f"peak {value} is none of {PEAK_CHOICES}")


def state_predictions_measured() -> tuple[int, str, int]:
    """What nn.DataParallel (torch's own ``replicate``, :func:`state_after_dp`) leaves after one
    training-mode forward of :data:`STATE_CASE`: the SampleCounter's ``seen``, which of
    :data:`PEAK_CHOICES` its ``peak`` holds, and the ``seen`` of :class:`_InPlaceThenRebound`
    (``self.seen += n`` then ``self.seen = torch.clamp(self.seen, ...)``)."""
    from .lab02 import SampleCounter

    batch, n, *_ = STATE_CASE
    model, X, _ = _case(SampleCounter)
    before = _state(model)["peak"]
    chunk0, whole = copy.deepcopy(model), copy.deepcopy(model)
    chunk0(X[:-(-batch // n)])
    whole(X)
    want = state_after_dp(copy.deepcopy(model), X.clone(), n)
    rebound, X2, _ = _case(_InPlaceThenRebound)
    other = state_after_dp(rebound, X2.clone(), n)
    return (int(want["seen"]), _peak_label(want["peak"], before, chunk0.peak, whole.peak),
            int(other["seen"]))


def check_state_predictions(seen_guess, peak_guess, rebound_guess) -> None:
    """Compare part 5's three predictions with :func:`state_predictions_measured`: right or
    wrong and the measured value, then a question to take into the contract. Why they are what
    they are waits for :func:`check_dp_state`'s pass line (:data:`WHY_STATE`): it is the
    contract's answer. Never raises for a wrong prediction."""
    __tracebackhide__ = True
    from . import reveal

    seen, peak, rebound = state_predictions_measured()
    reveal(seen_guess, seen, close=seen_guess.value == seen, explanation="")
    reveal(peak_guess, peak, close=peak_guess.value == peak, explanation="")
    reveal(rebound_guess, rebound, close=rebound_guess.value == rebound, explanation=(
        "A question to take into the contract: replica 0 ran `self.seen += 3` and "
        "`self.peak = torch.maximum(...)` on chunk 0. What did each line do to the tensor "
        "replica 0 was handed under that name, and where was its result kept? (The why comes "
        "with part 5's pass line.)"))


# Why part 5's state is what it is: the explanation of the predictions, held back until the
# contract has been met (their feedback says only what was measured).
_B, _N, _SEEN, _CALLS, _PEAK = STATE_CASE
_C0 = -(-_B // _N)  # chunk 0's samples under either chunk-size choice of part 1
WHY_STATE = (
    f"Why, from your predictions: torch's replicate hands replica 0 the module's own tensors "
    f"(the first device's broadcast returns its inputs themselves) but a _buffers dict and a "
    f"__dict__ of its own (Module._replicate_for_data_parallel copies both). `self.seen += "
    f"{_C0}` writes into the tensor it was handed, the module's: {_SEEN} + {_C0} = "
    f"{_SEEN + _C0}, chunk 0's samples alone (the other replicas wrote into copies). "
    f"`self.peak = torch.maximum(...)` and `self.calls += 1` bind new objects in replica 0's "
    f"own dicts, dropped with it: peak stays {_PEAK}, calls {_CALLS}. Binding a new tensor "
    f"after an in-place write does not undo the write: the counter that adds then rebinds ends "
    f"at {_SEEN + _C0} too. So nothing needs detecting: what comes back is whatever replica 0 "
    f"wrote into the tensors it started with.")


def _still_part_4s(dp_forward_backward) -> None:
    """Part 5 holds the step to part 4's contract too: part 4's check, run silently first (a
    step changed for part 5 that now averages the gradients, or runs the copies one after
    another, is refused here with part 4's sentence)."""
    __tracebackhide__ = True
    import contextlib
    import io

    from . import LabCheckError
    from ._lab02_step import check_dp_forward_backward

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check_dp_forward_backward(dp_forward_backward)
    except LabCheckError as exc:
        fail(f"your step no longer passes part 4's check, which part 5 runs first: "
             f"{exc.message}")


@recorded
def check_dp_state(dp_forward_backward) -> None:
    """First part 4's check (:func:`_still_part_4s`: the gradients, the threads, BatchNorm).
    Then, after ``dp_forward_backward(model, X, y, 4)`` on a :class:`~dpcourse.checks.lab02.
    SampleCounter` (10 samples, ``seen`` 7, ``calls`` 5, ``peak`` 0.5), every buffer and the
    ``calls`` attribute must hold what nn.DataParallel leaves (:func:`state_after_dp`: torch's
    own replicate): ``seen`` 10 (replica 0 adds its 3 into the module's own tensor), ``peak``
    0.5 (replica 0 binds a new tensor in a ``_buffers`` dict of its own), ``calls`` 5. Then the
    same on a module with the two buffers' roles swapped, so that a rule tied to the names
    fails, and on one whose forward writes ``seen`` in place and then rebinds it, so that a
    rule that asks whether copy 0 still holds its first tensor fails. The first meeting says
    what differs, with the numbers; the mechanism and the fix come with the second."""
    __tracebackhide__ = True
    from .lab02 import SampleCounter

    _still_part_4s(dp_forward_backward)
    batch, n, *_ = STATE_CASE
    shown = None
    for cls in (SampleCounter, _Swapped, _InPlaceThenRebound):
        model, X, y = _case(cls)
        want = state_after_dp(copy.deepcopy(model), X.clone(), n)
        before = _state(model)
        chunk0 = copy.deepcopy(model)
        chunk0(X[:-(-batch // n)])
        r0 = _state(chunk0)
        whole = copy.deepcopy(model)
        whole(X)
        learner = copy.deepcopy(model)
        held = dict(learner.named_buffers())  # the tensor objects, to see if any is replaced
        try:
            dp_forward_backward(learner, X.clone(), y.clone(), n)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as one sentence
            fail(f"dp_forward_backward raised {type(exc).__name__} on lab02.{cls.__name__} "
                 f"({batch} samples on {n} devices): {exc}")
        got = _state(learner)
        wrong = [k for k in want if not _same(got[k], want[k])]
        shown = shown or want
        if wrong:
            _diagnose(cls, wrong, got, want, before, r0, _state(whole), batch, n)
        _check_same_tensors(held, learner, cls, batch, n)
    passed(f"your step leaves lab02.SampleCounter as nn.DataParallel does (torch's own "
           f"replicate on {n} devices: seen {_show(shown['seen'])}, peak {_show(shown['peak'])}, "
           f"calls {shown['calls']}), also with its buffers' roles swapped and with a buffer "
           f"written in place then rebound in one forward; part 4's check still passes. "
           f"{WHY_STATE}")


def _check_same_tensors(held: dict, learner, cls, batch: int, n: int) -> None:
    """The values are right; the module must also still hold its own buffer tensors. Under
    nn.DataParallel nothing binds a new tensor in the module's ``_buffers`` (every replica,
    replica 0's included, gets a dict of its own), so whatever holds a reference to a buffer (a
    hook, an EMA, a second module sharing it) sees the step's update."""
    __tracebackhide__ = True
    replaced = [name for name, b in learner.named_buffers() if b is not held.get(name)]
    if replaced:
        fail(f"After your step on {batch} samples over {n} devices, on lab02.{cls.__name__}: "
             f"the values are right, but model's {' and '.join(replaced)} "
             f"{'is another tensor' if len(replaced) == 1 else 'are other tensors'} than the "
             f"one{'s' if len(replaced) > 1 else ''} model held before the step. "
             f"nn.DataParallel never binds a new tensor in the module's buffers (each replica "
             f"binds names in a dict of its own), so anything that holds the module's buffer "
             f"(a hook, a running average, another module sharing it) would keep the old value.",
             fix="write the values into the buffer tensors model already holds (Tensor.copy_) "
                 "instead of binding new tensors to their names.")


def _whose(value, before, r0, whole, key) -> str:
    if _same(value, r0[key]) and not _same(value, before[key]):
        return "chunk 0's copy's value"
    if _same(value, before[key]):
        return "what the model held before the step"
    if _same(value, whole[key]):
        return "the value of one forward over the whole batch"
    return "none of the replicas' values"


def _diagnose(cls, wrong, got, want, before, r0, whole, batch, n) -> None:
    __tracebackhide__ = True
    shown = "; ".join(
        f"{k} holds {_show(got[k])}, {_whose(got[k], before, r0, whole, k)}, where "
        f"nn.DataParallel(model) leaves {_show(want[k])} "
        f"({_whose(want[k], before, r0, whole, k)})" for k in wrong)
    module = {
        _Swapped: "a counter whose forward writes `peak` in place and binds a new tensor to "
                  "`seen` (the roles of lab02.SampleCounter's two buffers swapped)",
        _InPlaceThenRebound: "a counter whose forward adds to `seen` in place and then binds "
                             "a new tensor to `seen` (torch.clamp of it, which changes no "
                             "value)",
    }.get(cls, "lab02.SampleCounter")
    message = f"After your step on {batch} samples over {n} devices, on {module}: {shown}."
    if cls is _Swapped:  # (reached only when the same rule passed lab02.SampleCounter)
        fail(message, fix=(
            "your rule passes lab02.SampleCounter but not this module, whose buffers have the "
            "same names and dtypes: it decides by something other than what the forward did. "
            "Under nn.DataParallel what comes back is what replica 0 wrote into the tensors it "
            "was handed, and nothing it bound to a name: keep the tensors copy 0 starts with and "
            "bring back their values afterwards, for every buffer alike; nothing needs telling "
            "apart."))
    if cls is _InPlaceThenRebound:  # (reached only when the rule passed the other two)
        fail(message, fix=(
            "replica 0 wrote into the module's own `seen` tensor first, and that write stays on "
            "the module, although replica 0 ends holding another tensor under the name: "
            "whether copy 0 still holds the tensor it started with does not tell whether it "
            "wrote into it. Bring back what was written into the tensors copy 0 started with "
            "(keep them before the forward), whatever it holds at the end (or give copy 0 the "
            "model's own buffer tensors, as replica 0 has them)."))
    rebound, in_place = "peak", "seen"
    if "calls" in wrong and _same(got["calls"], r0["calls"]):
        fail(message, fix=(
            "calls is a plain attribute, not a tensor: each replica's `self.calls += 1` binds a "
            "new int in that replica's own __dict__ (Module._replicate_for_data_parallel copies "
            "the dict), so under nn.DataParallel no replica's count reaches the module. Leave "
            "the model's plain attributes as they were."))
    if rebound in wrong and _same(got[rebound], r0[rebound]):
        dropped = (f" and {in_place} is not back at all: it is registered with "
                   f"persistent=False, which state_dict() leaves out"
                   if in_place in wrong and _same(got[in_place], before[in_place]) else "")
        fail(message, fix=(
            f"the forward binds a new tensor to {rebound} instead of writing into the one it "
            f"has. torch's replicate hands replica 0 the module's own tensors but a _buffers "
            f"dict of its own (Module._replicate_for_data_parallel), so the new tensor lands "
            f"in replica 0's dict and is dropped with it, while a write into a tensor it was "
            f"handed ({in_place}'s) lands in the module{dropped}. Bring back what copy 0 wrote "
            f"into the buffers it started with, not the tensors its buffers hold at the end "
            f"(or give copy 0 the model's own buffer tensors, as replica 0 has them)."))
    if in_place in wrong and _same(got[in_place], before[in_place]):
        fail(message, fix=(
            f"replica 0 writes into the module's own {in_place} tensor, so nn.DataParallel "
            f"keeps its update; a buffer registered with persistent=False is a buffer all the "
            f"same (model.named_buffers() lists it; state_dict() does not). Bring back what "
            f"copy 0 wrote into each buffer it started with."))
    fail(message, fix=(
        "under nn.DataParallel the module keeps exactly what replica 0 wrote into the tensors "
        "it was handed (the module's own); the other replicas' writes, and any tensor or value "
        "a replica binds to a name, are dropped with the replicas. Bring back that, from copy 0 "
        "alone."))


# --- §3's second prediction: what p.grad holds after a step on a model that held G ---------

HELD_CHOICES = ("g", "G + g", "G + g/4", "4G + g")


def held_grad_after_dp(n: int = 4, batch: int = 12, seed: int = 0) -> str:
    """A model whose every ``p.grad`` holds G (random); g, the plain model's gradient on one
    batch alone. After the forward and backward of the lesson's ``dp.data_parallel`` on ``n``
    CPU devices (the course's own ``dp.Broadcast``, not torch's, which refuses CPU tensors;
    replica 0 sharing the module's storage as in torch's),
    which of :data:`HELD_CHOICES` does ``p.grad`` hold (every parameter, to 1e-5)?"""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 10))
    X, y = torch.randn(batch, 12), torch.randint(0, 10, (batch,))
    plain = copy.deepcopy(model)
    F.cross_entropy(plain(X), y).backward()
    g = [p.grad.clone() for p in plain.parameters()]
    G = [torch.randn_like(p) for p in model.parameters()]
    for p, held in zip(model.parameters(), G):
        p.grad = held.clone()
    F.cross_entropy(reference.data_parallel(model, X, reference.devices_for(n, kind="cpu")),
                    y).backward()
    candidates = {"g": g, "G + g": [a + b for a, b in zip(G, g)],
                  "G + g/4": [a + b / n for a, b in zip(G, g)],
                  "4G + g": [n * a + b for a, b in zip(G, g)]}
    for label, want in candidates.items():
        if all(torch.allclose(p.grad, w, atol=1e-5) for p, w in zip(model.parameters(), want)):
            return label
    raise RuntimeError("p.grad after the DataParallel step is none of the choices")


def check_held_prediction(guess) -> None:
    """Compare the learner's choice with :func:`held_grad_after_dp`: right or wrong, the
    measured choice and a question to take into part 4. Why (AccumulateGrad at the module's
    parameters) waits for part 4's pass line (``_lab02_step.WHY_RULE``): how plain copies get
    there is part 4's to work out. Never raises for a wrong prediction."""
    __tracebackhide__ = True
    from . import reveal

    measured = held_grad_after_dp()
    reveal(guess, measured, close=guess.value == measured, explanation=(
        "A question to take into part 4: what in a backward kept G in p.grad, and does the "
        "backward of your plain copies reach `model`'s p.grad at all?"))
