"""Checks for lab01 (lesson 01_single_device): your ``train_one_epoch`` and ``evaluate``, and
the stretch exercise ``train_accumulated`` (gradient accumulation).

Each check runs your function on a tiny model (with dropout, so train/eval mode matters) and a
loader whose last batch is short (so "mean of batch means" differs from "mean per sample"), in
two set-ups with different sizes and seeds (so a number that only fits one of them, such as a
hard-coded sample count, is caught), then compares with the reference in ``dpcourse.train``.
When the numbers differ, it replays the usual mistakes with the reference and tells you which
one yours matches. ``check_train_one_epoch`` then spoils one batch of its loader in three ways
(an image with a NaN pixel; finite images whose labels are all ignore_index, a NaN loss with a
zero gradient; a huge finite image under label smoothing, an inf loss with finite gradients) and
holds the function to its contract: a loss that is not finite raises FloatingPointError, and the
caller finds the weights, Adam's state and every p.grad as the last sound step left them.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpcourse import train as reference
from dpcourse.checks import _lab01_leftover as _leftover
from dpcourse.checks import fail, passed, recorded

__all__ = ["check_train_one_epoch", "check_evaluate", "check_train_accumulated",
           "check_prediction", "LEAVES", "PREDICTION_QUESTION", "PREDICTION_CHOICES",
           "STEP_QUESTION", "STEP_CHOICES", "short_batch_step", "check_step_prediction"]

# The two answers to lab01's design decision: the mode evaluate leaves the model in.
LEAVES = ("eval", "as found")

# (samples, batch size, seed): 16+16+16+2 and 8+8+8+8+5 -- the last batch is short in both, and
# the two differ in every number an answer could hard-code.
_SETUPS = ((50, 16, 0), (37, 8, 3))


def _setup(n: int = 50, batch: int = 16, seed: int = 0, batch_norm: bool = False):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    loader = DataLoader(TensorDataset(X, y), batch_size=batch, shuffle=False)
    torch.manual_seed(seed)
    if batch_norm:  # index 2 is the BatchNorm layer that _FROZEN freezes
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.BatchNorm1d(32),
                              nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))
    else:
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(),
                              nn.Dropout(0.5), nn.Linear(32, 10))
    return model, loader


# The mixed-mode arrival: a model in training mode whose BatchNorm layer (index 2) was frozen
# in eval mode, as when fine-tuning: model.train(), then model[2].eval().
_FROZEN = "mixed"


class _Spy:
    """Records, at every forward call, whether the model was in training mode and whether
    autograd was recording."""

    def __init__(self, model: nn.Module):
        self.training, self.grad = [], []
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.training.append(module.training)
        self.grad.append(torch.is_grad_enabled())


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b, tol=1e-6):
    return all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b))


def _as_number(value, what: str) -> float:
    """``value`` as a float, or the sentence for what the contract's Python float is not."""
    __tracebackhide__ = True
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            fail(f"{what} returned a tensor of shape {tuple(value.shape)}, not one number.",
                 fix="return one number, a Python float.")
        if value.requires_grad:
            fail(f"{what} returned a tensor that still carries its autograd graph, so every "
                 f"batch's graph it was built from stays in memory.",
                 fix="return a Python float (.item()).")
        try:  # what the caller's logging meets: measured here, not assumed
            json.dumps(value)
            refused = "json.dumps takes it"
        except TypeError as exc:
            refused = f"json.dumps refuses it ({exc})"
        fail(f"{what} returned {value!r}, a tensor, where the contract asks for a Python float. "
             f"It prints like a number, but to the caller's code it is not one: "
             f"arithmetic with it gives tensors again ({value!r} + 1.0 is {value + 1.0!r}), "
             f"{refused}, and on a GPU it stays in device memory, so each later use of its "
             f"value (a print, an `if`) makes the CPU wait for the GPU.",
             fix="turn the tensor into a Python float (.item()) once, where you return it.")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        fail(f"{what} returned {type(value).__name__}, not a number.",
             fix="return a Python float.")
    return float(value)


# --- the library's own answer is not the learner's -----------------------------------------

def _library(name: str, fn) -> str:
    return (f"{name} is the library's own dpcourse.train.{name} (passed directly or called by "
            f"your function): the lab asks for your own loop, so the check would only be "
            f"comparing the reference with itself.")


def is_library_function(fn, ref) -> bool:
    """True if ``fn`` is ``ref`` itself, or a decorated copy of it (same code object).

    Shared with lab02's checks, which refuse ``dp.scatter`` and its neighbours the same way."""
    target = inspect.unwrap(ref)
    try:
        unwrapped = inspect.unwrap(fn)
    except ValueError:  # a cycle of __wrapped__
        return False
    return unwrapped is target or getattr(unwrapped, "__code__", None) is target.__code__


def _refuse_library(fn, ref, name: str) -> None:
    """Refuse ``ref`` itself (or a decorated copy of it) as the learner's answer."""
    __tracebackhide__ = True
    if not callable(fn) or isinstance(fn, type):
        fail(f"the check needs your function itself ({name}), got {type(fn).__name__}.")
    if is_library_function(fn, ref):
        fail(_library(name, fn), fix="write the body yourself.")


@contextlib.contextmanager
def library_calls(*refs):
    """Within the block, the name of every call of one of ``refs`` (under any name it was
    imported as, through any wrapper) is appended to the yielded list: the learner's code may
    not hand the work to the library's own answer. A profile hook on this thread, so a
    reference called from another thread (parallel_apply's) is not seen."""
    codes = {inspect.unwrap(r).__code__: r.__name__ for r in refs}
    called: list = []
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            called.append(codes[frame.f_code])
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(profile)
    try:
        yield called
    finally:
        sys.setprofile(previous)


# --- the usual mistakes, replayed with the reference --------------------------------------

def _train_variant(model, loader, loss_fn, optimizer, zero_grad=True, reduction="mean"):
    __tracebackhide__ = True
    model.train()
    batch_losses, sizes = [], []
    for X, y in loader:
        if zero_grad:
            optimizer.zero_grad()
        out = model(X)
        loss = loss_fn(out, y) if reduction == "mean" else nn.functional.cross_entropy(
            out, y, reduction="sum")
        loss.backward()
        optimizer.step()
        batch_losses.append(loss.item() if reduction == "mean" else loss.item() / len(y))
        sizes.append(len(y))
    return batch_losses, sizes


def _run(fn_variant, setup, **kw):
    __tracebackhide__ = True
    model, loader = _setup(*setup)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    fn_variant(model, loader, nn.CrossEntropyLoss(), opt, **kw)
    return _params(model)


@recorded
def check_train_one_epoch(train_one_epoch) -> None:
    """Run your ``train_one_epoch(model, loader, loss_fn, optimizer, device)`` and compare."""
    __tracebackhide__ = True
    _refuse_library(train_one_epoch, reference.train_one_epoch, "train_one_epoch")
    for setup in _SETUPS:
        _check_train_once(train_one_epoch, setup)
    _check_train_nan(train_one_epoch)
    passed("train_one_epoch matches the reference: same weights, same mean loss; and a batch "
           "whose loss is not finite (NaN from a bad image or from labels alone, inf from a "
           "huge finite input) stops the epoch with a FloatingPointError before it touches the "
           "weights, Adam's state or p.grad, which still holds the last sound step's gradient.")


def _check_train_once(train_one_epoch, setup) -> None:
    __tracebackhide__ = True
    n, batch, _ = setup
    model, loader = _setup(*setup)
    start = _params(model)
    spy = _Spy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.eval()  # a correct answer switches to training mode itself
    torch.manual_seed(1)  # the dropout masks
    with library_calls(reference.train_one_epoch) as called:
        got = train_one_epoch(model, loader, nn.CrossEntropyLoss(), opt, "cpu")
    if called:
        fail(_library("train_one_epoch", train_one_epoch), fix="write the body yourself.")

    if not spy.training:
        fail("train_one_epoch never called the model, so nothing was trained.",
             fix="loop over the loader and run model(X) on each batch.")
    if not all(spy.training):
        off = len(spy.training) - sum(spy.training)
        fail(f"the check handed train_one_epoch a model in eval mode (as a caller's model is "
             f"straight after an evaluation), and {off} of your epoch's {len(spy.training)} "
             f"forward passes ran the model in eval mode, dropout off: the contract trains the "
             f"model it is given, whatever mode it arrives in.",
             fix="put the model in training mode at the start of the function: a training "
                 "function cannot rely on the mode its caller left.")
    if len(spy.training) != math.ceil(n / batch):
        fail(f"train_one_epoch called the model {len(spy.training)} times for "
             f"{math.ceil(n / batch)} batches, so its steps and the batches do not match one "
             f"to one.", fix="one forward pass per batch.")
    got_params = _params(model)

    ref_model, ref_loader = _setup(*setup)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    torch.manual_seed(1)
    want = reference.train_one_epoch(ref_model, ref_loader, nn.CrossEntropyLoss(), ref_opt, "cpu")
    if not _same(got_params, _params(ref_model)):
        if _same(got_params, start):
            fail(f"the weights did not change: after an epoch of {math.ceil(n / batch)} "
                 f"batches they were exactly those the model started with, so no batch trained "
                 f"it.",
                 fix="call optimizer.step() after each backward: backward only fills p.grad; "
                     "the weights move when the optimizer steps with it.")
        if _same(got_params, _run(_train_variant, setup, zero_grad=False)):
            fail(f"gradients from earlier batches leaked into each step: your weights match "
                 f"steps that each used the gradients of every batch so far added up (the step "
                 f"on batch {math.ceil(n / batch)}: batches 1 to {math.ceil(n / batch)}), where "
                 f"the contract's step on a batch uses that batch's mean loss alone.",
                 fix="clear the gradients (optimizer.zero_grad()) before each backward: "
                     "backward adds into p.grad, and nothing cleared what the previous batch "
                     "left there.")
        if _same(got_params, _run(_train_variant, setup, reduction="sum")):
            fail(f"your steps grow with the batch size: your weights match steps {batch} times "
                 f"those of the batch's mean loss on a batch of {batch}, and {n % batch or batch} "
                 f"times on the last, where the contract's step is on the batch's mean loss.",
                 fix="backpropagate the mean (CrossEntropyLoss's default reduction): the loss "
                     "you backpropagate is summed over the batch.")
        fail("after one epoch your weights differ from the reference's, in none of the ways "
             "the check knows (a missing zero_grad or step, a summed loss).",
             fix="each batch's step must use the gradient of that batch's mean loss alone, one "
                 "step per batch.")

    got = _as_number(got, "train_one_epoch")
    if math.isclose(got, want, rel_tol=1e-5):
        return
    ref_model, ref_loader = _setup(*setup)
    torch.manual_seed(1)
    losses, sizes = _train_variant(ref_model, ref_loader, nn.CrossEntropyLoss(),
                                   torch.optim.SGD(ref_model.parameters(), lr=0.1))
    total = sum(l * s for l, s in zip(losses, sizes))
    if math.isclose(got, sum(losses), rel_tol=1e-5):
        fail(f"you returned the sum of the batch losses ({got:.4f}; the mean loss per sample "
             f"is {want:.4f}), a number that grows with the number of batches.",
             fix="return the mean loss per sample.")
    if math.isclose(got, sum(losses) / len(losses), rel_tol=1e-5):
        fail(f"you returned {got:.4f}, the mean of the {len(losses)} batches' mean losses; the "
             f"mean loss per sample is {want:.4f}: the last batch holds {sizes[-1]} of the {n} "
             f"samples but counted for 1/{len(losses)} of your number, and a mean per sample "
             f"counts every sample once.",
             fix="weight each batch's loss by its number of samples: you averaged the per-batch "
                 "means.")
    if math.isclose(got, total, rel_tol=1e-5):
        fail("you returned the total loss over all samples, not the mean per sample.",
             fix="divide by the number of samples the epoch saw.")
    if math.isclose(got, total / (len(losses) * batch), rel_tol=1e-5):
        fail("you divided by (number of batches × batch size), but the last batch is short: "
             "that count includes samples the epoch never saw.",
             fix="count the samples as the batches come.")
    if math.isclose(got, losses[-1], rel_tol=1e-5):
        fail("you returned only the last batch's loss, which says nothing of the epoch's other "
             "batches.", fix="return the mean loss per sample over the whole epoch.")
    fail(f"train_one_epoch returned {got:.4f} on {n} samples in batches of {batch}; the mean "
         f"loss per sample is {want:.4f} (does your answer use a number that fits only another "
         f"data set, such as a fixed sample count?)")


# --- a batch whose loss is not finite: the case the lesson did not show ---------------------

_BAD = 2  # the index of the batch the check spoils: the third of four
# How the check spoils it: one image with a NaN pixel (a corrupt file); finite images whose
# every label is CrossEntropyLoss's ignore_index, -100 (a batch of padding): its mean loss is
# 0/0 = NaN while its gradient is all zeros, so a guard on the images or on the gradients
# misses it; or one image whose every pixel is a huge but finite 1e38 (a bad normalisation),
# trained with label smoothing 0.1: in float32 the loss is inf, not NaN, while the logits and
# the gradients stay finite -- and Adam's running mean of squared gradients overflows to inf.
_SPOILED = {
    "pixel": "batch 3 of 4 held one image with a NaN pixel (a corrupt file), so that batch's "
             "mean loss was NaN",
    "ignored": "batch 3 of 4 had finite images, but every one of its labels was -100, "
               "CrossEntropyLoss's ignore_index (a batch of padding), so its mean loss was "
               "0/0 = NaN while its gradient was all zeros",
    "huge": "batch 3 of 4 held one image whose pixels were all 1e38, large but finite (a bad "
            "normalisation), and the loss was CrossEntropyLoss(label_smoothing=0.1): that "
            "batch's loss was inf in float32, not NaN, while its logits and gradients were "
            "finite",
}
_HUGE = 1e38
_LR = 0.01  # Adam's: the contract's optimizer state is Adam's running moments


def _spoiled(setup, how: str):
    """The set-up's model and a loader whose batch ``_BAD`` is spoiled ``how``, and the loss
    function the caller trains with."""
    n, batch, _ = setup
    model, loader = _setup(*setup)
    X, y = (t.clone() for t in loader.dataset.tensors)
    lo, hi = _BAD * batch, (_BAD + 1) * batch
    loss_fn = nn.CrossEntropyLoss()
    if how == "pixel":
        X[lo + 5, 0, 0, 0] = float("nan")
    elif how == "ignored":
        y[lo:hi] = -100
    else:
        X[lo + 5] = _HUGE
        loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    return model, DataLoader(TensorDataset(X, y), batch_size=batch, shuffle=False), X, y, loss_fn


def _state(optimizer) -> list:
    """The optimizer's state tensors (Adam: step, exp_avg, exp_avg_sq per parameter)."""
    return [v.detach().clone() for st in optimizer.state.values() for v in st.values()
            if torch.is_tensor(v)]


def _not_finite(tensors) -> int:
    return sum(not bool(torch.isfinite(t).all()) for t in tensors)


def _check_train_nan(train_one_epoch, setup=_SETUPS[0]) -> None:
    """The contract's case the lesson did not show: a batch whose loss is not finite never
    reaches the weights, the optimizer's state or p.grad; the function raises
    FloatingPointError, and the caller finds the weights, the optimizer's state and every
    p.grad as the batches before it left them (p.grad: the gradient the last sound step
    used)."""
    __tracebackhide__ = True
    n, batch, _ = setup
    stopped = []  # the spoilings the learner's function stopped on
    for how, what in _SPOILED.items():
        model, loader, X, y, loss_fn = _spoiled(setup, how)
        start = _params(model)
        opt = torch.optim.Adam(model.parameters(), lr=_LR)
        torch.manual_seed(1)
        backwards = []  # one entry per backward that reached the first layer's weight
        hook = next(model.parameters()).register_hook(lambda g: backwards.append(1))
        raised = None
        try:
            got = train_one_epoch(model, loader, loss_fn, opt, "cpu")
        except Exception as exc:  # noqa: BLE001 - the learner's function may raise anything
            raised = exc
        finally:
            hook.remove()
        weights = _params(model)
        broken = sum(bool(torch.isnan(p).any()) for p in weights)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        bad_grads = _not_finite(grads)
        state = _state(opt)
        bad_state = _not_finite(state)
        ref, _ = _setup(*setup)
        torch.manual_seed(1)
        head = DataLoader(TensorDataset(X[:_BAD * batch], y[:_BAD * batch]), batch_size=batch)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=_LR)
        _train_variant(ref, head, loss_fn, ref_opt)
        harm = (f" The step on it made {broken} of the model's {len(weights)} parameter tensors "
                f"NaN, so batch 4 trained a broken model." if broken else "")
        if bad_state and not broken:
            harm = (f" The weights stayed finite, but the step on it left {bad_state} of Adam's "
                    f"{len(state)} state tensors inf or NaN (the running mean of squared "
                    f"gradients overflows), so every later step of those weights is lost.")
        guard = "look at each batch's loss before it reaches backward and the step"
        if raised is None:
            shown = f"{got:.4f}" if isinstance(got, float) else repr(got)
            if how == "huge" and stopped:
                fail(f"{what}. Your function stopped on the check's NaN batches, but here it "
                     f"trained on and returned {shown}.{harm} The contract's rule is a loss "
                     f"that is not finite.",
                     fix="test the loss with torch.isfinite (or math.isfinite of its float), "
                         "before backward: a test for NaN alone (isnan, x != x) lets inf "
                         "through.")
            if how == "ignored" and "pixel" in stopped:
                fail(f"{what}. Your function stopped on the NaN image of the check's first "
                     f"spoiled epoch, but here it trained on and returned {shown}, while "
                     f"loss_fn's mean loss on that batch was NaN. The contract is about that "
                     f"loss.",
                     fix=guard + ": what your function tests was clean here (the images, the "
                                 "gradients, or a loss of your own in place of loss_fn's).")
            if isinstance(got, float) and math.isfinite(got):
                fail(f"{what}; your function returned {got:.4f} and no error: the batch was "
                     f"left out without a word, so the caller logs an ordinary epoch over a data "
                     f"set that holds a spoiled batch. The contract asks for a "
                     f"FloatingPointError the caller can see.",
                     fix="raise FloatingPointError instead of skipping the batch quietly.")
            fail(f"{what}; your function trained on through it and returned {shown}.{harm} The "
                 f"contract says a loss that is not finite never reaches the weights, and the "
                 f"caller hears of it as a FloatingPointError.",
                 fix=guard + ", and raise FloatingPointError when it is not finite.")
        if not isinstance(raised, FloatingPointError):
            extra = (" (and an assert statement is removed when Python runs with -O, so there "
                     "it would not even raise)" if isinstance(raised, AssertionError) else "")
            fail(f"{what}; your function raised {type(raised).__name__} ({raised}){extra}. The "
                 f"contract's error is FloatingPointError, the one a caller catches for a "
                 f"numeric failure (to skip a spoiled shard and go on): yours would pass "
                 f"through such a handler.",
                 fix="raise FloatingPointError for a loss that is not finite.")
        stepped = ("; the optimizer step on the spoiled batch had already run when your test "
                   "raised.")
        if broken:
            fail(f"{what}; your function raised FloatingPointError, but {broken} of the model's "
                 f"{len(weights)} parameter tensors already held NaN when it did, so the caller "
                 f"who catches your error holds a broken model, where the contract promises the "
                 f"weights as the batches before left them.", fix=guard + stepped)
        if bad_state:
            fail(f"{what}; your function raised FloatingPointError with finite weights, but "
                 f"{bad_state} of Adam's {len(state)} state tensors already held inf or NaN "
                 f"when it did, so every later step of the caller's training inherits them, "
                 f"where the contract promises the optimizer's state as the batches before left "
                 f"it.", fix=guard + stepped)
        if bad_grads:
            fail(f"{what}; your function raised FloatingPointError with the weights and Adam's "
                 f"state intact, but {bad_grads} of the model's {len(grads)} gradients (p.grad) "
                 f"held NaN or inf when it did. The contract says each p.grad holds the last "
                 f"sound step's gradient, and a caller who steps, clips or logs gradient norms "
                 f"before your next zero_grad meets these.",
                 fix=guard + " (which number does the NaN show in before backward?): "
                             "backward() on the spoiled batch had already run when your test "
                             "raised.")
        if _same(weights, _params(ref)):
            if not all(_same([a], [b]) for a, b in zip(state, _state(ref_opt))) \
                    or len(state) != len(_state(ref_opt)):
                fail(f"{what}; your function raised FloatingPointError with the weights of the "
                     f"batches before it, but Adam's state is not the one those batches give "
                     f"(its step counts or moments moved): the next step of the caller's "
                     f"training would not be the one it would have been.", fix=guard + ".")
            _check_grads_kept(model, ref, what, backward_ran=len(backwards) > _BAD)
            stopped.append(how)
            _check_caller_goes_on(train_one_epoch, model, opt, ref, ref_opt, head, what)
            continue
        if _same(weights, start):
            fail(f"{what}; your function raised FloatingPointError, but the weights it left are "
                 f"those from before the epoch: the steps on batches 1 and 2 were sound "
                 f"training, and the contract keeps them (the weights as they were before the "
                 f"spoiled batch).", fix="leave the steps already taken as they are.")
        fail(f"{what}; your function raised FloatingPointError, but the weights it left differ "
             f"from those the steps on batches 1 and 2 give: the contract's weights are those "
             f"from before the spoiled batch.", fix=guard + ".")


def _check_grads_kept(model, ref, what: str, backward_ran: bool) -> None:
    """The contract's p.grad: when the function raises, every p.grad holds the gradient the
    last sound step used (``ref``'s, after the batches before the spoiled one), as the batches
    before it left them: a guard that a zero_grad or a backward has already run before is
    refused by what it left there."""
    __tracebackhide__ = True
    got = [p.grad for p in model.parameters()]
    want = [p.grad for p in ref.parameters()]
    if all(g is not None for g in got) and _same(got, want):
        return
    n = len(got)
    if all(g is None for g in got):
        found = f"all {n} of the model's p.grad were None when it raised"
        cause = ("a zero_grad() ran (its default, set_to_none=True, sets p.grad to None), "
                 "whether you wrote it at the end of a step or at the start of the next")
    elif all(g is not None and not bool(g.any()) for g in got):
        found = f"all {n} of the model's p.grad held only zeros when it raised"
        cause = ("the gradients were zeroed in place (zero_grad(set_to_none=False), or "
                 "p.grad.zero_()), which clears them as surely as None does")
    else:
        diff = max(float((a - b).abs().max()) if a is not None and b is not None else math.inf
                   for a, b in zip(got, want))
        found = (f"p.grad was not the gradient the step on batch 2 used when it raised "
                 f"(largest difference {diff:.3g})")
        cause = "something wrote into p.grad"
    if backward_ran:
        cause = ("backward() on the spoiled batch ran (after a clearing, or adding into what "
                 "was there)")
    fail(f"{what}; your function raised FloatingPointError with the weights and Adam's state "
         f"of the batches before it, but {found}. The contract says the caller finds the "
         f"gradients as the batches before left them, each p.grad holding the last sound "
         f"step's gradient (batch 2's): what a caller inspects (its norm, its largest entries) "
         f"beside the spoiled batch to see what went wrong.",
         fix=f"test the loss before anything clears or writes p.grad, and clear the gradients "
             f"after the test, just before backward: between the step on batch 2 and your test "
             f"of batch 3's loss, {cause}, so the gradient that step used was gone.")


def _check_caller_goes_on(train_one_epoch, model, opt, ref, ref_opt, clean, what) -> None:
    """After the FloatingPointError, the caller goes on: it trains another epoch, on clean
    batches, with the same model and optimizer. "That loss never reaches the weights" holds for
    the later steps too: nothing of the spoiled batch may reach them."""
    __tracebackhide__ = True
    torch.manual_seed(3)
    try:
        train_one_epoch(model, clean, nn.CrossEntropyLoss(), opt, "cpu")
        ended = "after it"
    except FloatingPointError:  # the learner's own guard, meeting what its first step did
        ended = "it raised FloatingPointError on a clean batch, and by then"
    torch.manual_seed(3)
    _train_variant(ref, clean, nn.CrossEntropyLoss(), ref_opt)
    weights = _params(model)
    broken = sum(bool(torch.isnan(p).any()) for p in weights)
    if broken and not _same(weights, _params(ref)):
        fail(f"{what}; your function raised FloatingPointError with the weights intact, and the "
             f"check, as a caller would, caught it and trained the next epoch on clean batches "
             f"with the same model and optimizer: {ended} {broken} of the model's "
             f"{len(weights)} parameter tensors were NaN: the NaN loss reached the weights one "
             f"epoch late.",
             fix="raise before backward, or clear the gradients before each backward rather "
                 "than after each step: the spoiled batch's gradient was still in p.grad when "
                 "your raise left the function, and the next epoch's first step added it in.")


@recorded
def check_evaluate(evaluate, leaves: str | None = None) -> None:
    """Run your ``evaluate(model, loader, loss_fn, device) -> (loss, accuracy)`` and compare.

    ``leaves`` is the lab's design decision, the mode ``evaluate`` leaves the model in: "eval"
    (evaluation mode, whatever it arrived in) or "as found" (the mode it arrived in). The check
    hands the model over in training mode and in eval mode and holds your function to your
    choice; None checks everything but the mode on return.
    """
    __tracebackhide__ = True
    if leaves is not None and leaves not in LEAVES:
        fail(f"your design decision must be one of {LEAVES[0]!r} or {LEAVES[1]!r} (the mode "
             f"evaluate leaves the model in), got {leaves!r}.")
    _refuse_library(evaluate, reference.evaluate, "evaluate")
    for setup in _SETUPS:
        for arrives_training in (True, False):
            _check_evaluate_once(evaluate, setup, arrives_training, leaves)
    _check_evaluate_once(evaluate, _SETUPS[0], _FROZEN, leaves)
    _check_evaluate_raising(evaluate, _SETUPS[1], leaves)
    _check_evaluate_empty(evaluate, leaves)
    said = {None: "", "eval": ", and it leaves the model in eval mode as you decided",
            "as found": ", and it leaves each layer in the mode it found (a frozen BatchNorm "
                        "included), as you decided"}[leaves]
    passed(f"evaluate matches the reference: eval mode, no graph, per-sample mean loss "
           f"and accuracy{said}; a loader that fails midway reaches the caller with the "
           f"model's mode and autograd as the contract says, and an empty loader is a "
           f"ValueError.")


class LoaderFailed(RuntimeError):
    """What the check's failing loader raises (a corrupt file, a data worker that died)."""


class _FailingLoader:
    """A loader that yields its first ``good`` batches, then raises :class:`LoaderFailed`."""

    def __init__(self, loader, good: int):
        self.loader, self.good = loader, good
        self.dataset, self.batch_size = loader.dataset, loader.batch_size
        self.served = 0

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i == self.good:
                raise LoaderFailed(f"the check's loader failed on batch {i + 1} (as a corrupt "
                                   f"file or a dead data worker would)")
            self.served += 1
            yield batch


def _raised_ours(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LoaderFailed):
            return True
        seen.add(id(exc))
        # `raise X from None` hides the context: the caller's traceback no longer shows it
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return False


def _check_evaluate_raising(evaluate, setup, leaves: str | None) -> None:
    """The contract's other half: a loader that fails midway. The error must reach the caller,
    and the caller must find autograd recording as before and the model in the mode the
    learner's decision says (for "as found": the mode it arrived in)."""
    __tracebackhide__ = True
    good = 2
    model, loader = _setup(*setup)
    failing = _FailingLoader(loader, good)
    model.train()
    grad_before = torch.is_grad_enabled()
    try:
        result = evaluate(model, failing, nn.CrossEntropyLoss(), "cpu")
    except Exception as exc:  # noqa: BLE001 - the learner's function may raise anything
        if not _raised_ours(exc):
            fail(f"the check's loader raised LoaderFailed on batch {good + 1}, and evaluate "
                 f"raised {type(exc).__name__} ({exc}) in its place, with the loader's error "
                 f"lost from the chain: the caller cannot tell what failed.",
                 fix="let the loader's exception through unchanged (clean up in a finally "
                     "block, or re-raise with `raise ... from`).")
    else:
        fail(f"the check's loader raised LoaderFailed on batch {good + 1} of "
             f"{len(loader)}, and evaluate returned {result!r} anyway: the error was "
             f"swallowed, so the caller got numbers measured on {good} batches as if on all of "
             f"them.", fix="let the exception reach the caller: clean up in a finally block, "
                           "never catch it and return.")
    grad_after = torch.is_grad_enabled()
    torch.set_grad_enabled(grad_before)  # the rest of the learner's notebook is not ours to break
    if grad_after != grad_before:
        fail(f"when the loader failed on batch {good + 1}, evaluate left autograd switched off "
             f"for its caller (torch.is_grad_enabled() was True before, False after): the next "
             f"training step would record no graph.",
             fix="turn autograd off with a block that restores it however the block ends: "
                 "`with torch.no_grad():` (or the decorator); the line that switches it back on "
                 "never ran.")
    after = _modes(model)
    if leaves == "as found" and after != {True}:
        fail(f"you decided that evaluate leaves the model in the mode it found, and it does when "
             f"the loop ends; but when the loader failed on batch {good + 1}, a model handed "
             f"over in training mode reached the caller in eval mode.",
             fix="restore the mode in a block that runs whether the loop ends or raises "
                 "(try/finally): the line that restores the mode comes after the loop, and an "
                 "exception skips it.")
    if leaves == "eval" and after != {False}:
        fail("you decided that evaluate leaves the model in eval mode, but when the loader "
             f"failed on batch {good + 1} a model handed over in training mode reached the "
             f"caller in training mode.",
             fix="switch to eval mode before the loop, so that the mode holds however the loop "
                 "ends.")


def _check_evaluate_empty(evaluate, leaves: str | None) -> None:
    """A loader with no sample at all: the contract says evaluate raises ValueError (a clear
    error), with autograd and the model's mode as after any other ending."""
    __tracebackhide__ = True
    model, loader = _setup(*_SETUPS[0])
    X, y = loader.dataset.tensors
    empty = DataLoader(TensorDataset(X[:0], y[:0]), batch_size=loader.batch_size)
    model.train()
    grad_before = torch.is_grad_enabled()
    try:
        result = evaluate(model, empty, nn.CrossEntropyLoss(), "cpu")
    except ValueError:
        pass
    except ZeroDivisionError as exc:
        torch.set_grad_enabled(grad_before)
        fail(f"given a loader with no sample (an empty test split, a filter that kept "
             f"nothing), evaluate raised ZeroDivisionError ({exc}): the caller reads a "
             f"division by zero somewhere in evaluate's arithmetic, not that the loader was "
             f"empty, and the contract asks for a ValueError that says so.",
             fix="when the loop saw no sample, raise ValueError saying the loader was empty.")
    except Exception as exc:  # noqa: BLE001 - the learner's function may raise anything
        torch.set_grad_enabled(grad_before)
        fail(f"given a loader with no sample, evaluate raised {type(exc).__name__} ({exc}); "
             f"the contract asks for a ValueError that says the loader was empty.",
             fix="when the loop saw no sample, raise ValueError saying so.")
    else:
        torch.set_grad_enabled(grad_before)
        fail(f"given a loader with no sample, evaluate returned {result!r}: a loss and an "
             f"accuracy measured on nothing look like a measurement to the caller (a test "
             f"accuracy of {result!r} logged for an empty split), and the contract asks for a "
             f"ValueError.", fix="when the loop saw no sample, raise ValueError saying the "
                                 "loader was empty.")
    grad_after = torch.is_grad_enabled()
    torch.set_grad_enabled(grad_before)
    if grad_after != grad_before:
        fail("given a loader with no sample, evaluate raised, and left autograd switched off "
             "for its caller (torch.is_grad_enabled() was True before, False after).",
             fix="turn autograd off with a block that restores it however the block ends: "
                 "`with torch.no_grad():` (or the decorator); the line that switches it back on "
                 "never ran.")
    after = _modes(model)
    if leaves == "as found" and after != {True}:
        fail("given a loader with no sample, evaluate raised its ValueError, but a model "
             "handed over in training mode reached the caller in eval mode: you decided that "
             "evaluate leaves the model in the mode it found, however it ends.",
             fix="raise after the mode is restored, or restore it in a block that runs "
                 "however the function ends (try/finally).")
    if len(after) > 1:  # (under "eval", refusing bad input before switching is fine)
        fail("given a loader with no sample, evaluate raised its ValueError and left the "
             "model with some layers in training mode and others in eval mode.",
             fix="set or restore the mode of every layer before the error leaves evaluate.")


def _modes(model) -> set:
    return {m.training for m in model.modules()}


def _mode_map(model) -> dict:
    """Each submodule's own mode, by its name in the model ("" is the model itself)."""
    return {name: m.training for name, m in model.named_modules()}


def _check_mixed_return(model, arrived: dict, leaves: str | None) -> None:
    """The mode on return for a model that arrived in training mode with its BatchNorm frozen
    in eval mode: "eval" leaves every submodule in eval mode; "as found" leaves each submodule
    in its own arriving mode."""
    __tracebackhide__ = True
    after = _mode_map(model)
    if leaves == "eval" and any(after.values()):
        fail("you decided that evaluate leaves the model in eval mode, but a training model "
             "whose BatchNorm layer was frozen in eval mode came back with layers in training "
             "mode: your function and your decision disagree — change one of them.")
    if leaves != "as found" or after == arrived:
        return
    wrong = [name for name in arrived if after[name] != arrived[name]]
    said = ", ".join(f"{name or 'the model'} ({type(model.get_submodule(name)).__name__}) "
                     f"{'training' if after[name] else 'eval'} instead of "
                     f"{'training' if arrived[name] else 'eval'}" for name in wrong)
    if set(after.values()) == {True}:
        fail(f"you decided that evaluate leaves the model in the mode it found; the check "
             f"handed it a training model whose BatchNorm layer (model[2]) was frozen in eval "
             f"mode, as when fine-tuning (model.train(), then model[2].eval()), and it came "
             f"back with that BatchNorm in training mode: the frozen layer's running statistics "
             f"would move at the caller's next training step.",
             fix="remember each submodule's own .training (model.modules()) before you switch, "
                 "and put each one back: one flag, model.training, cannot say the mode of every "
                 "layer, and model.train(flag) sets every submodule to that flag.")
    fail(f"you decided that evaluate leaves the model in the mode it found; a training model "
         f"whose BatchNorm layer (model[2]) was frozen in eval mode came back with {said}.",
         fix="remember each submodule's own .training before you switch, and put each one "
             "back.")


def _check_evaluate_once(evaluate, setup, arrives_training: bool | str = True,
                         leaves: str | None = None) -> None:
    """``arrives_training``: True or False (the whole model in one mode), or _FROZEN (a model
    in training mode whose BatchNorm layer is frozen in eval mode)."""
    __tracebackhide__ = True
    n, batch, _ = setup
    mixed = arrives_training == _FROZEN
    model, loader = _setup(*setup, batch_norm=mixed)
    # train a little so that accuracy is not a coin toss and dropout visibly matters
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(30):
        for X, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            opt.step()
    before = _params(model)
    spy = _Spy(model)
    if mixed:
        model.train()
        model[2].eval()  # frozen: its running statistics must not move while the rest trains
    else:
        model.train(arrives_training)  # a correct answer switches to eval mode itself
    arrived_modes = _mode_map(model)
    torch.manual_seed(2)
    grad_before = torch.is_grad_enabled()
    with library_calls(reference.evaluate) as called:
        result = evaluate(model, loader, nn.CrossEntropyLoss(), "cpu")
    grad_after = torch.is_grad_enabled()
    torch.set_grad_enabled(grad_before)
    if called:
        fail(_library("evaluate", evaluate), fix="write the body yourself.")
    after = _modes(model)

    if not spy.training:
        fail("evaluate never called the model, so it measured nothing.",
             fix="loop over the loader and run model(X) on each batch.")
    if any(spy.training):
        fail("evaluate ran the model in training mode, so dropout was still on while it "
             "measured: a test-time measurement needs the test-time behaviour of every layer.",
             fix="switch the model to eval mode before the first forward.")
    if any(spy.grad):
        fail("evaluate let autograd record a graph that nothing ever backpropagates through: "
             "memory and time spent on every forward for nothing.",
             fix="run the loop under torch.no_grad().")
    if grad_after != grad_before:
        fail("evaluate returned with autograd switched off for its caller "
             "(torch.is_grad_enabled() was True before the call, False after): the next "
             "training step would record no graph and learn nothing.",
             fix="turn autograd off only inside evaluate, with a block that restores it: "
                 "`with torch.no_grad():` (or the decorator).")
    if not _same(_params(model), before):
        fail("evaluate changed the weights, but a measurement must leave the model as it "
             "found it.", fix="no backward and no optimizer step in evaluate.")
    if mixed:
        _check_mixed_return(model, arrived_modes, leaves)
    arrived = "training" if arrives_training else "eval"
    if not mixed and len(after) > 1:
        fail("evaluate left the model with some layers in training mode and others in eval "
             "mode.", fix="set the mode of the whole model (model.train(...) / model.eval() "
                         "reach every submodule).")
    if not mixed and leaves == "eval" and after != {False}:
        fail(f"you decided that evaluate leaves the model in eval mode, but a model handed over "
             f"in {arrived} mode came back in training mode: your function and your decision "
             f"disagree — change one of them.")
    if not mixed and leaves == "as found" and after != {arrives_training}:
        came = "training" if True in after else "eval"
        fail(f"you decided that evaluate leaves the model in the mode it found, but a model "
             f"handed over in {arrived} mode came back in {came} mode: the mode it arrived in "
             f"was lost on the way.",
             fix="read model.training before you change the mode, and restore it before "
                 "returning.")
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        fail(f"evaluate returned {type(result).__name__}, not a pair.",
             fix="return a pair (mean_loss, accuracy).")
    loss = _as_number(result[0], "evaluate's loss")
    acc = _as_number(result[1], "evaluate's accuracy")

    model.eval()
    with torch.no_grad():
        logits = [(model(X), y) for X, y in loader]
    per_batch = [nn.functional.cross_entropy(o, y).item() for o, y in logits]
    sizes = [len(y) for _, y in logits]
    want_loss = sum(l * s for l, s in zip(per_batch, sizes)) / n
    correct = sum((o.argmax(1) == y).sum().item() for o, y in logits)
    want_acc = correct / n

    if not math.isclose(acc, want_acc, rel_tol=1e-6):
        if acc == correct:
            fail("accuracy is the number of correct predictions, not the fraction of samples "
                 "predicted right (a float in [0, 1]).",
                 fix="divide the count by the number of samples.")
        if math.isclose(acc, 100 * want_acc, rel_tol=1e-6):
            fail(f"accuracy is in percent ({acc:.2f}), but the contract asks for a fraction "
                 f"in [0, 1].", fix="drop the factor 100.")
        batch_acc = [(o.argmax(1) == y).float().mean().item() for o, y in logits]
        if math.isclose(acc, sum(batch_acc) / len(batch_acc), rel_tol=1e-6):
            fail("you averaged per-batch accuracies, but the last batch is smaller, so each of "
                 "its samples counted for more than the others.",
                 fix="count hits over all samples and divide once.")
        if math.isclose(acc, correct / (len(sizes) * batch), rel_tol=1e-6):
            fail("you divided the correct count by (number of batches × batch size), but the "
                 "last batch is short: that count includes samples that were never there.",
                 fix="count the samples as the batches come.")
        fail(f"evaluate's accuracy is {acc:.4f} on {n} samples; counting argmax hits over all "
             f"samples gives {want_acc:.4f}.")
    if not math.isclose(loss, want_loss, rel_tol=1e-5):
        if math.isclose(loss, sum(per_batch), rel_tol=1e-5):
            fail("the loss is the sum of the batch losses, a number that grows with the number "
                 "of batches.", fix="return the mean loss per sample.")
        if math.isclose(loss, sum(per_batch) / len(per_batch), rel_tol=1e-5):
            fail("you averaged the per-batch mean losses, but the last batch is smaller, so "
                 "each of its samples counted for more than a sample of a full batch.",
                 fix="weight each batch's loss by its number of samples.")
        fail(f"evaluate's loss is {loss:.4f} on {n} samples, the mean loss per sample is "
             f"{want_loss:.4f}.")


# --- stretch: gradient accumulation -------------------------------------------------------

def _groups(loader, k):
    """The loader's micro-batches, k at a time."""
    batches = list(loader)
    return [batches[g:g + k] for g in range(0, len(batches), k)]


def _accumulate_variant(model, loader, optimizer, k, weight="share", step_every=False,
                        zero_every=False, zero_after_step=True, zero_first=True):
    """Accumulation as written right (the defaults) or with one of the usual mistakes.

    ``weight`` is what each micro-batch's mean loss is multiplied by before backward: "share"
    (its samples' share of the group's: right), "k" (1/k, right only when every micro-batch of
    the group has the same size) or "none"."""
    __tracebackhide__ = True
    model.train()
    if zero_first:
        optimizer.zero_grad()
    total, count = 0.0, 0
    for group in _groups(loader, k):
        group_n = sum(len(y) for _, y in group)
        for i, (X, y) in enumerate(group):
            if zero_every:
                optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(X), y)
            scale = {"share": len(y) / group_n, "k": 1 / k, "none": 1.0}[weight]
            (loss * scale).backward()
            if step_every or i == len(group) - 1:
                optimizer.step()
                if zero_after_step:
                    optimizer.zero_grad()
            total += loss.item() * len(y)
            count += len(y)
    return total / count


def _sizes_loader(X, y, sizes):
    """A loader whose micro-batches hold ``sizes`` samples, in order."""
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return DataLoader(TensorDataset(X, y),
                      batch_sampler=[list(range(a, b)) for a, b in zip(bounds, bounds[1:])])


# (micro-batch sizes, k, seed): every loader holds a whole number of groups of k micro-batches,
# and in each set-up some group holds micro-batches of different sizes -- a short last
# micro-batch as a DataLoader gives it (4 x 11 + 2, 8 x 7 + 2), or sizes that vary throughout --
# so weighting every micro-batch alike (1/k) takes other steps than plain training.
_ACCUM_SETUPS = (([4] * 11 + [2], 3, 0), ([8] * 7 + [2], 2, 5),
                 ([5, 3, 7, 5, 2, 6, 4, 4], 4, 7))


@recorded
def check_train_accumulated(train_accumulated) -> None:
    """Stretch: ``train_accumulated(model, loader, loss_fn, optimizer, k, device)`` must take,
    for each group of k micro-batches, the same step as plain training on the group's samples
    (one batch of them all, its mean loss), and return the mean loss per sample over the
    epoch, as ``train_one_epoch`` does. The micro-batches of a group need not be the same size."""
    __tracebackhide__ = True
    if not callable(train_accumulated) or isinstance(train_accumulated, type):
        fail(f"the check needs your function itself (train_accumulated), got "
             f"{type(train_accumulated).__name__}.")
    for sizes, k, seed in _ACCUM_SETUPS:
        n = sum(sizes)
        g = torch.Generator().manual_seed(seed)
        X = torch.randn(n, 3, 8, 8, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)

        def fresh(stale=True):
            torch.manual_seed(seed)
            # no dropout here: the big batch and the micro-batches would draw different masks
            model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.Tanh(),
                                  nn.Linear(16, 10))
            # The model arrives with gradients left in p.grad (say, from an unfinished group
            # of the previous epoch): an answer must start from zero.
            if stale:
                nn.functional.cross_entropy(model(X[:4]), y[:4]).backward()
            return model, torch.optim.SGD(model.parameters(), lr=0.2)

        def micro_loader():
            return _sizes_loader(X, y, sizes)

        model, opt = fresh()
        start = _params(model)
        spy = _Spy(model)
        steps = []
        opt.register_step_post_hook(lambda optimizer, args, kwargs: steps.append(1))
        model.eval()
        returned = train_accumulated(model, micro_loader(), nn.CrossEntropyLoss(), opt, k, "cpu")
        got = _params(model)
        if len(spy.training) != len(sizes):
            fail(f"train_accumulated ran {len(spy.training)} forward passes for {len(sizes)} "
                 f"micro-batches, but accumulation saves memory by never running more than one "
                 f"micro-batch at once.", fix="one forward (and backward) per micro-batch.")
        if not all(spy.training):
            fail("train_accumulated ran the model in eval mode, so dropout would be off while "
                 "it trains: the model may arrive in eval mode, straight after an evaluation.",
                 fix="put the model in training mode at the start.")

        big, big_opt = fresh()
        group_sizes = [sum(sizes[i:i + k]) for i in range(0, len(sizes), k)]
        for Xb, yb in _sizes_loader(X, y, group_sizes):
            big_opt.zero_grad()
            nn.functional.cross_entropy(big(Xb), yb).backward()
            big_opt.step()
        if _same(got, _params(big), tol=1e-5):
            m, o = fresh()
            _check_accumulated_loss(returned, _accumulate_variant(m, micro_loader(), o, k), k,
                                    n)
            continue
        if _same(got, start):
            fail("the weights did not change: the accumulated gradients never reached the "
                 "weights through an optimizer step.",
                 fix="step the optimizer at the end of each group.")

        def replay(**kw):
            m, o = fresh()
            _accumulate_variant(m, micro_loader(), o, k, **kw)
            return _params(m)

        def replays(**kw):  # the mistake, with either weighting of the micro-batches
            return any(_same(got, replay(weight=w, **kw), tol=1e-5) for w in ("share", "k"))

        groups = len(group_sizes)
        if _same(got, replay(weight="k"), tol=1e-5):
            fail(f"your steps match plain training's on a group's samples only where its "
                 f"micro-batches hold the same number of samples; where the micro-batches of a "
                 f"group differ in size (here {sizes}), a sample in a short micro-batch counted "
                 f"for more than one in a full micro-batch: the group's mean loss counts each of "
                 f"its samples once.",
                 fix=f"weight each micro-batch by its share of the group's samples: you gave "
                     f"each micro-batch 1/{k} of the group's weight, whatever it held.")
        if _same(got, replay(weight="none"), tol=1e-5):
            fail(f"each step was about {k} times too big: your weights match steps on {k} times "
                 f"the gradient of each group's mean loss.",
                 fix=f"scale each micro-batch's loss by its share of the group's samples: "
                     f"backward adds each micro-batch's gradient into p.grad, so the group's "
                     f"gradient was the sum of {k} mean-loss gradients.")
        if replays(step_every=True) or _same(got, replay(step_every=True, weight="none"),
                                             tol=1e-5):
            fail(f"your function took {len(steps)} optimizer steps for {len(sizes)} "
                 f"micro-batches in {groups} groups of k = {k}, where the contract takes one "
                 f"step per group, on the gradient of the whole group's samples.",
                 fix="step once per group, after its last micro-batch: you stepped after every "
                     "micro-batch, so each step used one micro-batch's gradient.")
        if replays(zero_every=True) or _same(got, replay(zero_every=True, weight="none"),
                                             tol=1e-5):
            fail(f"your function took {len(steps)} steps for {groups} groups, but each step "
                 f"moved the weights as if its group held only its last micro-batch: the other "
                 f"samples of the group contributed to no step.",
                 fix="clear the gradients only after a step: you zeroed them before every "
                     "micro-batch, so each step saw only the last micro-batch of its group.")
        if replays(zero_after_step=False):
            fail(f"your first step matches plain training's on its group, but each later step "
                 f"carried the gradients of all earlier groups too (the step on group {groups}: "
                 f"groups 1 to {groups}).",
                 fix="clear the gradients after every step: backward adds into p.grad, and "
                     "nothing cleared what the previous group left there.")
        # Run the learner's function again on the same model with p.grad empty: if the weights
        # change, what p.grad held before the call reached the steps.
        clean, clean_opt = fresh(stale=False)
        train_accumulated(clean, micro_loader(), nn.CrossEntropyLoss(), clean_opt, k, "cpu")
        if not _same(got, _params(clean), tol=1e-5):
            rest = (" With p.grad empty at the start, your steps are exactly plain training's."
                    if _same(_params(clean), _params(big), tol=1e-5) else "")
            fail(f"your weights depend on what p.grad held before the call: the check ran your "
                 f"function twice on the same model and micro-batches of sizes {sizes}, once "
                 f"with p.grad holding an earlier backward's gradients (as after an unfinished "
                 f"group of a previous epoch) and once with p.grad empty, and the two runs "
                 f"ended with different weights, but the contract says the result must not "
                 f"depend on what p.grad held.{rest}",
                 fix="clear the gradients once before the first micro-batch: the gradients "
                     "p.grad held were added into your first group's gradient.")
        fail(f"with micro-batches of sizes {sizes} and k={k} your weights differ from plain "
             f"training on each group's samples (groups of {group_sizes}), in none of the ways "
             f"the check knows (each micro-batch weighted 1/k or not at all, a step per "
             f"micro-batch, gradients zeroed too often or never, leftover gradients).",
             fix="for one group, compare p.grad just before your step with the gradient of "
                 "one batch holding the group's samples (its mean loss, backward): the first "
                 "parameter where they differ shows which part of the group went wrong.")
    chosen = set()
    for sizes, k, seed in _leftover.LEFTOVER_SETUPS:
        choice, returned, want = _leftover.check_leftover(train_accumulated, sizes, k, seed)
        chosen.add(choice)
        _check_accumulated_loss(returned, want, k, sum(sizes),
                                leftover=sum(sizes[len(sizes) // k * k:]))
    said = " or ".join(_leftover.CHOSEN[c] for c in sorted(chosen))
    passed(f"train_accumulated takes the same steps as plain training on each group's samples, "
           f"whatever the micro-batches' sizes, and returns the mean loss per sample; the "
           f"micro-batches left over at the end {said}, as you decided.")


def _check_accumulated_loss(returned, want: float, k: int, n: int, leftover: int = 0) -> None:
    """The stretch's return value: the mean loss per sample of the epoch, unscaled; with
    ``leftover`` samples at the end, they count too."""
    __tracebackhide__ = True
    if returned is None:
        fail("train_accumulated returned None; its contract is train_one_epoch's: the mean "
             "loss per sample over the epoch.", fix="return that mean as a float.")
    got = _as_number(returned, "train_accumulated")
    if math.isclose(got, want, rel_tol=1e-5):
        return
    if math.isclose(got, want / k, rel_tol=1e-5):
        fail(f"train_accumulated returned {got:.4f}, {k} times less than the mean loss per "
             f"sample ({want:.4f}): the loss to report is the model's loss on its samples.",
             fix="add the unscaled loss (times the micro-batch's size) to your total: you "
                 "reported the scaled loss you backpropagated.")
    if math.isclose(got, want * n, rel_tol=1e-5):
        fail("train_accumulated returned the total loss over all samples, not the mean per "
             "sample.", fix="divide by the number of samples the epoch saw.")
    also = (f", the {leftover} left over at the end included," if leftover else "")
    fail(f"train_accumulated returned {got:.4f}; the mean loss per sample over the epoch's {n} "
         f"samples{also} is {want:.4f}.")


# --- predict, then measure: the epoch's returned loss against the trained model's ----------

PREDICTION_QUESTION = ("after epoch 1, whose loss on the training set is larger: "
                       "train_one_epoch's return value or evaluate's")
PREDICTION_CHOICES = ("train_one_epoch's", "evaluate's", "about the same")


def check_prediction(guess, epoch_loss: float, eval_loss: float) -> None:
    """Compare the learner's prediction of which is larger after the first epoch, the mean loss
    ``train_one_epoch`` returned (``epoch_loss``) or the one ``evaluate`` measures on the same
    training set right after (``eval_loss``), and say why. Never raises for a wrong
    prediction."""
    __tracebackhide__ = True
    from dpcourse.checks import reveal

    epoch_loss, eval_loss = float(epoch_loss), float(eval_loss)
    if epoch_loss > 1.1 * eval_loss:
        measured = PREDICTION_CHOICES[0]
    elif eval_loss > 1.1 * epoch_loss:
        measured = PREDICTION_CHOICES[1]
    else:
        measured = PREDICTION_CHOICES[2]
    reveal(guess, measured, close=guess.value == measured, explanation=(
        f"On the same training samples, train_one_epoch returned {epoch_loss:.3f} and evaluate "
        f"measured {eval_loss:.3f} right after the epoch (the larger is "
        f"{max(epoch_loss, eval_loss) / min(epoch_loss, eval_loss):.2f} times the smaller; "
        f"within 10% counts as about the same). "
        "Same samples, two different models: train_one_epoch's mean adds up each batch's loss "
        "at the moment it was trained on, so its first batches are those of a network that "
        "still guesses; evaluate measures only the model the epoch ended with. The lab's "
        "SmallCNN has no batch norm and its dropout is 0, so the two modes compute the same "
        "function here: the whole gap is the network changing during the epoch (with dropout "
        "on, training mode would widen it). The returned number is a running summary of the "
        "epoch, not a measurement of the model you now hold."))


# --- predict, then measure: the step a short last batch takes --------------------------------

STEP_QUESTION = ("the step on the epoch's short last batch (2 samples) against a full batch's "
                 "(16 samples)")
STEP_CHOICES = ("smaller", "about the same", "larger")


def short_batch_step(train_one_epoch, setup=_SETUPS[0]) -> tuple[float, list]:
    """Run the learner's ``train_one_epoch`` on 50 samples in batches of 16 (16, 16, 16, 2)
    with plain SGD, and measure how far each optimizer step moved the weights (the norm of the
    change): (the last step over the mean of the full batches' steps, every step's norm)."""
    model, loader = _setup(*setup)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms: list = []
    last = [_params(model)]

    def moved(optimizer, args, kwargs):
        now = _params(model)
        norms.append(float(torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(now, last[0])))))
        last[0] = now

    opt.register_step_post_hook(moved)
    torch.manual_seed(1)
    train_one_epoch(model, loader, nn.CrossEntropyLoss(), opt, "cpu")
    if len(norms) < 2:
        fail(f"the check counted {len(norms)} optimizer step(s) in an epoch of "
             f"{len(loader)} batches: it needs one per batch to compare them.")
    return norms[-1] / (sum(norms[:-1]) / len(norms[:-1])), norms


def check_step_prediction(guess, train_one_epoch) -> None:
    """Measure :func:`short_batch_step` with the learner's own ``train_one_epoch`` and compare
    the learner's prediction: is the step on the 2-sample last batch smaller than a full
    batch's, about the same (within 50%), or larger? Say why. Never raises for a wrong
    prediction."""
    __tracebackhide__ = True
    from dpcourse.checks import reveal

    ratio, norms = short_batch_step(train_one_epoch)
    measured = ("smaller" if ratio < 0.5 else "larger" if ratio > 1.5 else "about the same")
    n, batch, _ = _SETUPS[0]
    short = n % batch
    reveal(guess, measured, close=guess.value == measured, explanation=(
        f"Your steps moved the weights by {', '.join(f'{x:.3f}' for x in norms)}: the last, on "
        f"{short} samples, {ratio:.1f} times the full batches' mean. Each batch's loss is its "
        f"own mean, so the {short}-sample batch's gradient is an average like the others', "
        f"not {short}/{batch} of one, and its step has a full step's scale; and an average of "
        f"{short} samples' gradients cancels less of their disagreement than one of {batch} "
        f"(the check's labels are random, so they disagree a lot; the more a batch's samples "
        f"agree, the less an average of many cancels, and the closer the two steps come). Each of those {short} "
        f"samples moved the weights about {ratio * batch / short:.0f} times as much as a "
        f"sample of a full batch. The number your function returns counts every sample "
        f"once; the steps do not. DataLoader(drop_last=True) skips such a batch."))
