"""Checks for lab01 (lesson 01_single_device): your ``train_one_epoch`` and ``evaluate``, and
the stretch exercise ``train_accumulated`` (gradient accumulation).

Each check runs your function on a tiny model (with dropout, so train/eval mode matters) and a
loader whose last batch is short (so "mean of batch means" differs from "mean per sample"), in
two set-ups with different sizes and seeds (so a number that only fits one of them, such as a
hard-coded sample count, is caught), then compares with the reference in ``dpcourse.train``.
When the numbers differ, it replays the usual mistakes with the reference and tells you which
one yours matches.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpcourse import train as reference
from dpcourse.checks import fail, passed, recorded

__all__ = ["check_train_one_epoch", "check_evaluate", "check_train_accumulated"]

# (samples, batch size, seed): 16+16+16+2 and 8+8+8+8+5 -- the last batch is short in both, and
# the two differ in every number an answer could hard-code.
_SETUPS = ((50, 16, 0), (37, 8, 3))


def _setup(n: int = 50, batch: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    loader = DataLoader(TensorDataset(X, y), batch_size=batch, shuffle=False)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Dropout(0.5),
                          nn.Linear(32, 10))
    return model, loader


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
    __tracebackhide__ = True
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            fail(f"{what} returned a tensor of shape {tuple(value.shape)}; return one number.")
        if value.requires_grad:
            fail(f"{what} returned a tensor that still carries its autograd graph: return "
                 f"loss.item() (a Python float), or every batch's graph stays in memory.")
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        fail(f"{what} returned {type(value).__name__}; return a number.")
    return float(value)


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
    for setup in _SETUPS:
        _check_train_once(train_one_epoch, setup)
    passed("train_one_epoch matches the reference: same weights, same mean loss.")


def _check_train_once(train_one_epoch, setup) -> None:
    __tracebackhide__ = True
    n, batch, _ = setup
    model, loader = _setup(*setup)
    start = _params(model)
    spy = _Spy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.eval()  # a correct answer switches to training mode itself
    torch.manual_seed(1)  # the dropout masks
    got = train_one_epoch(model, loader, nn.CrossEntropyLoss(), opt, "cpu")

    if not spy.training:
        fail("train_one_epoch never called the model: loop over the loader and run model(X).")
    if not all(spy.training):
        fail("train_one_epoch ran the model in eval mode: call model.train() first (the model "
             "may come straight from evaluate, which switched to eval mode).")
    if len(spy.training) != math.ceil(n / batch):
        fail(f"train_one_epoch called the model {len(spy.training)} times for "
             f"{math.ceil(n / batch)} batches: one forward pass per batch.")
    got_params = _params(model)

    ref_model, ref_loader = _setup(*setup)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    torch.manual_seed(1)
    want = reference.train_one_epoch(ref_model, ref_loader, nn.CrossEntropyLoss(), ref_opt, "cpu")
    if not _same(got_params, _params(ref_model)):
        if _same(got_params, start):
            fail("the weights did not change: call optimizer.step() after loss.backward() "
                 "(and zero the gradients before backward, not between backward and step).")
        if _same(got_params, _run(_train_variant, setup, zero_grad=False)):
            fail("gradients from earlier batches leaked into each step: call "
                 "optimizer.zero_grad() once per batch, before loss.backward().")
        if _same(got_params, _run(_train_variant, setup, reduction="sum")):
            fail("the loss you backpropagate is summed over the batch, so the step grows with "
                 "the batch size: use the mean (CrossEntropyLoss's default reduction).")
        fail("after one epoch your weights differ from the reference: one zero_grad, forward, "
             "loss, backward and step per batch, in that order.")

    got = _as_number(got, "train_one_epoch")
    if math.isclose(got, want, rel_tol=1e-5):
        return
    ref_model, ref_loader = _setup(*setup)
    torch.manual_seed(1)
    losses, sizes = _train_variant(ref_model, ref_loader, nn.CrossEntropyLoss(),
                                   torch.optim.SGD(ref_model.parameters(), lr=0.1))
    total = sum(l * s for l, s in zip(losses, sizes))
    if math.isclose(got, sum(losses), rel_tol=1e-5):
        fail("you returned the sum of the batch losses: return the mean loss per sample.")
    if math.isclose(got, sum(losses) / len(losses), rel_tol=1e-5):
        fail("you averaged the per-batch means, but the last batch is smaller: weight each "
             "batch's loss by its size (loss.item() * len(y)) and divide by the sample count.")
    if math.isclose(got, total, rel_tol=1e-5):
        fail("you returned the total loss over all samples: divide it by the number of samples.")
    if math.isclose(got, total / (len(losses) * batch), rel_tol=1e-5):
        fail("you divided by (number of batches × batch size), but the last batch is short: "
             "divide by the number of samples you actually saw (count len(y) per batch).")
    if math.isclose(got, losses[-1], rel_tol=1e-5):
        fail("you returned only the last batch's loss: return the mean over the whole epoch.")
    fail(f"train_one_epoch returned {got:.4f} on {n} samples in batches of {batch}; the mean "
         f"loss per sample is {want:.4f} (does your answer use a number that fits only another "
         f"data set, such as a fixed sample count?)")


@recorded
def check_evaluate(evaluate) -> None:
    """Run your ``evaluate(model, loader, loss_fn, device) -> (loss, accuracy)`` and compare."""
    __tracebackhide__ = True
    for setup in _SETUPS:
        _check_evaluate_once(evaluate, setup)
    passed("evaluate matches the reference: eval mode, no graph, per-sample mean loss "
           "and accuracy.")


def _check_evaluate_once(evaluate, setup) -> None:
    __tracebackhide__ = True
    n, batch, _ = setup
    model, loader = _setup(*setup)
    # train a little so that accuracy is not a coin toss and dropout visibly matters
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(30):
        for X, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            opt.step()
    before = _params(model)
    spy = _Spy(model)
    model.train()  # a correct answer switches to eval mode itself
    torch.manual_seed(2)
    result = evaluate(model, loader, nn.CrossEntropyLoss(), "cpu")

    if not spy.training:
        fail("evaluate never called the model: loop over the loader and run model(X).")
    if any(spy.training):
        fail("evaluate ran the model in training mode, so dropout was still on: call "
             "model.eval() first.")
    if any(spy.grad):
        fail("evaluate let autograd record a graph it never uses: wrap the loop in "
             "torch.no_grad() (or decorate the function with @torch.no_grad()).")
    if not _same(_params(model), before):
        fail("evaluate changed the weights: evaluation must never step the optimizer.")
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        fail(f"evaluate returned {type(result).__name__}; return a pair (mean_loss, accuracy).")
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
            fail("accuracy is the number of correct predictions: divide by the number of "
                 "samples to get a fraction in [0, 1].")
        if math.isclose(acc, 100 * want_acc, rel_tol=1e-6):
            fail("accuracy is in percent: return a fraction in [0, 1].")
        batch_acc = [(o.argmax(1) == y).float().mean().item() for o, y in logits]
        if math.isclose(acc, sum(batch_acc) / len(batch_acc), rel_tol=1e-6):
            fail("you averaged per-batch accuracies, but the last batch is smaller: count "
                 "correct predictions over all samples and divide once.")
        if math.isclose(acc, correct / (len(sizes) * batch), rel_tol=1e-6):
            fail("you divided the correct count by (number of batches × batch size), but the "
                 "last batch is short: divide by the number of samples.")
        fail(f"evaluate's accuracy is {acc:.4f} on {n} samples; counting argmax hits over all "
             f"samples gives {want_acc:.4f}.")
    if not math.isclose(loss, want_loss, rel_tol=1e-5):
        if math.isclose(loss, sum(per_batch), rel_tol=1e-5):
            fail("the loss is the sum of the batch losses: return the mean loss per sample.")
        if math.isclose(loss, sum(per_batch) / len(per_batch), rel_tol=1e-5):
            fail("you averaged the per-batch mean losses, but the last batch is smaller: weight "
                 "each by its size and divide by the sample count.")
        fail(f"evaluate's loss is {loss:.4f} on {n} samples, the mean loss per sample is "
             f"{want_loss:.4f}.")


# --- stretch: gradient accumulation -------------------------------------------------------

def _accumulate_variant(model, loader, optimizer, k, divide=True, step_every=False,
                        zero_every=False, zero_after_step=True, zero_first=True):
    """Accumulation as written right (the defaults) or with one of the usual mistakes."""
    __tracebackhide__ = True
    model.train()
    if zero_first:
        optimizer.zero_grad()
    for i, (X, y) in enumerate(loader):
        if zero_every:
            optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(X), y)
        (loss / k if divide else loss).backward()
        if step_every or (i + 1) % k == 0:
            optimizer.step()
            if zero_after_step:
                optimizer.zero_grad()


@recorded
def check_train_accumulated(train_accumulated) -> None:
    """Stretch: ``train_accumulated(model, loader, loss_fn, optimizer, k, device)`` must take
    the same steps as plain training on batches k times larger (one step per k batches)."""
    __tracebackhide__ = True
    # (samples, micro-batch, k, seed): every group of k micro-batches is full, so each group is
    # exactly one big batch of k * micro-batch samples.
    for n, micro, k, seed in ((48, 4, 3, 0), (64, 8, 2, 5), (40, 5, 4, 7)):
        g = torch.Generator().manual_seed(seed)
        X = torch.randn(n, 3, 8, 8, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)

        def fresh():
            torch.manual_seed(seed)
            # no dropout here: the big batch and the micro-batches would draw different masks
            model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.Tanh(),
                                  nn.Linear(16, 10))
            # The model arrives with gradients left in p.grad (say, from an unfinished group
            # of the previous epoch): an answer must start from zero.
            nn.functional.cross_entropy(model(X[:micro]), y[:micro]).backward()
            return model, torch.optim.SGD(model.parameters(), lr=0.2)

        def micro_loader():
            return DataLoader(TensorDataset(X, y), batch_size=micro, shuffle=False)

        model, opt = fresh()
        start = _params(model)
        spy = _Spy(model)
        model.eval()
        train_accumulated(model, micro_loader(), nn.CrossEntropyLoss(), opt, k, "cpu")
        got = _params(model)
        if len(spy.training) != n // micro:
            fail(f"train_accumulated ran {len(spy.training)} forward passes for {n // micro} "
                 f"micro-batches: one forward (and backward) per micro-batch — accumulation "
                 f"saves memory by never running the big batch at once.")
        if not all(spy.training):
            fail("train_accumulated ran the model in eval mode: call model.train() first.")

        big, big_opt = fresh()
        for Xb, yb in DataLoader(TensorDataset(X, y), batch_size=micro * k, shuffle=False):
            big_opt.zero_grad()
            nn.functional.cross_entropy(big(Xb), yb).backward()
            big_opt.step()
        if _same(got, _params(big), tol=1e-5):
            continue
        if _same(got, start):
            fail("the weights did not change: call optimizer.step() once every k micro-batches.")

        def replay(**kw):
            m, o = fresh()
            _accumulate_variant(m, micro_loader(), o, k, **kw)
            return _params(m)

        if _same(got, replay(divide=False), tol=1e-5):
            fail(f"each step is {k} times too big: the gradients of k mean losses add up, so "
                 f"divide each micro-batch's loss by k (here {k}) before backward.")
        if _same(got, replay(step_every=True), tol=1e-5) or _same(
                got, replay(step_every=True, divide=False), tol=1e-5):
            fail("you stepped after every micro-batch: step (and zero) only when k micro-"
                 "batches have been accumulated, e.g. when (i + 1) % k == 0.")
        if _same(got, replay(zero_every=True), tol=1e-5) or _same(
                got, replay(zero_every=True, divide=False), tol=1e-5):
            fail("you zeroed the gradients before every micro-batch, so each step saw only the "
                 "last micro-batch: zero them only after a step.")
        if _same(got, replay(zero_first=False), tol=1e-5):
            fail("the first step carried gradients that were in p.grad before the loop: zero "
                 "them once before the first micro-batch (the model may come from an unfinished "
                 "group of the previous epoch).")
        if _same(got, replay(zero_after_step=False), tol=1e-5):
            fail("the gradients were never zeroed after a step, so each group's gradient "
                 "carried all earlier groups': call optimizer.zero_grad() after each step.")
        fail(f"with micro-batches of {micro} and k={k} your weights differ from plain training "
             f"with batches of {micro * k}: accumulate k gradients of loss / k, then step and "
             f"zero.")
    passed("train_accumulated takes the same steps as training on k-times larger batches.")
