"""Checks for lab01 (lesson 01_single_device): your ``train_one_epoch`` and ``evaluate``.

Each check runs your function on a tiny model (with dropout, so train/eval mode matters) and a
loader whose last batch is short (so "mean of batch means" differs from "mean per sample"),
then compares with the reference in ``dpcourse.train``. When the numbers differ, it replays
the usual mistakes with the reference and tells you which one yours matches.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpcourse import train as reference
from dpcourse.checks import fail, passed

__all__ = ["check_train_one_epoch", "check_evaluate"]

_N, _BATCH = 50, 16  # 16 + 16 + 16 + 2: the last batch is short on purpose


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(_N, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (_N,), generator=g)
    loader = DataLoader(TensorDataset(X, y), batch_size=_BATCH, shuffle=False)
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


def _run(fn_variant, **kw):
    model, loader = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    fn_variant(model, loader, nn.CrossEntropyLoss(), opt, **kw)
    return _params(model)


def check_train_one_epoch(train_one_epoch) -> str:
    """Run your ``train_one_epoch(model, loader, loss_fn, optimizer, device)`` and compare."""
    __tracebackhide__ = True
    model, loader = _setup()
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
    if len(spy.training) != math.ceil(_N / _BATCH):
        fail(f"train_one_epoch called the model {len(spy.training)} times for "
             f"{math.ceil(_N / _BATCH)} batches: one forward pass per batch.")
    got_params = _params(model)

    ref_model, ref_loader = _setup()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    torch.manual_seed(1)
    want = reference.train_one_epoch(ref_model, ref_loader, nn.CrossEntropyLoss(), ref_opt, "cpu")
    if not _same(got_params, _params(ref_model)):
        if _same(got_params, start):
            fail("the weights did not change: call optimizer.step() after loss.backward() "
                 "(and zero the gradients before backward, not between backward and step).")
        if _same(got_params, _run(_train_variant, zero_grad=False)):
            fail("gradients from earlier batches leaked into each step: call "
                 "optimizer.zero_grad() once per batch, before loss.backward().")
        if _same(got_params, _run(_train_variant, reduction="sum")):
            fail("the loss you backpropagate is summed over the batch, so the step grows with "
                 "the batch size: use the mean (CrossEntropyLoss's default reduction).")
        fail("after one epoch your weights differ from the reference: one zero_grad, forward, "
             "loss, backward and step per batch, in that order.")

    got = _as_number(got, "train_one_epoch")
    if math.isclose(got, want, rel_tol=1e-5):
        return passed("train_one_epoch matches the reference: same weights, same mean loss.")
    ref_model, ref_loader = _setup()
    torch.manual_seed(1)
    losses, sizes = _train_variant(ref_model, ref_loader, nn.CrossEntropyLoss(),
                                   torch.optim.SGD(ref_model.parameters(), lr=0.1))
    if math.isclose(got, sum(losses), rel_tol=1e-5):
        fail("you returned the sum of the batch losses: return the mean loss per sample.")
    if math.isclose(got, sum(losses) / len(losses), rel_tol=1e-5):
        fail("you averaged the per-batch means, but the last batch is smaller: weight each "
             "batch's loss by its size (loss.item() * len(y)) and divide by the sample count.")
    if math.isclose(got, sum(l * s for l, s in zip(losses, sizes)), rel_tol=1e-5):
        fail("you returned the total loss over all samples: divide it by the number of samples.")
    if math.isclose(got, losses[-1], rel_tol=1e-5):
        fail("you returned only the last batch's loss: return the mean over the whole epoch.")
    fail(f"train_one_epoch returned {got:.4f}, the mean loss per sample is {want:.4f}.")


def check_evaluate(evaluate) -> str:
    """Run your ``evaluate(model, loader, loss_fn, device) -> (loss, accuracy)`` and compare."""
    __tracebackhide__ = True
    model, loader = _setup()
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
    want_loss = sum(l * s for l, s in zip(per_batch, sizes)) / _N
    correct = sum((o.argmax(1) == y).sum().item() for o, y in logits)
    want_acc = correct / _N

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
        fail(f"evaluate's accuracy is {acc:.4f}; counting argmax hits over all samples gives "
             f"{want_acc:.4f}.")
    if not math.isclose(loss, want_loss, rel_tol=1e-5):
        if math.isclose(loss, sum(per_batch), rel_tol=1e-5):
            fail("the loss is the sum of the batch losses: return the mean loss per sample.")
        if math.isclose(loss, sum(per_batch) / len(per_batch), rel_tol=1e-5):
            fail("you averaged the per-batch mean losses, but the last batch is smaller: weight "
                 "each by its size and divide by the sample count.")
        fail(f"evaluate's loss is {loss:.4f}, the mean loss per sample is {want_loss:.4f}.")
    return passed("evaluate matches the reference: eval mode, no graph, per-sample mean loss "
                  "and accuracy.")
