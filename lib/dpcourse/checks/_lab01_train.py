"""Lab 01 §1: ``check_train_one_epoch`` — the learner's epoch against ``dpcourse.train``'s on two
set-ups, the usual mistakes replayed to name theirs, then a batch spoiled three ways (a NaN
pixel; labels all ignore_index; a huge finite image under label smoothing) and the contract a
caller relies on when the loss is not finite. Re-exported by :mod:`dpcourse.checks.lab01`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpcourse import train as reference
from dpcourse.checks import fail, passed, recorded
from ._lab01_common import (_SETUPS, _Spy, _as_number, _library, _params, _refuse_library, _same,
                            _setup, library_calls)


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
