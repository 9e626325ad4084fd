"""lab01's checks accept the reference and name each plausible mistake."""

import pytest
import torch

from dpcourse import train
from dpcourse.checks import LabCheckError, lab01


def good_train(model, loader, loss_fn, optimizer, device):
    return train.train_one_epoch(model, loader, loss_fn, optimizer, device)


def no_zero_grad(model, loader, loss_fn, optimizer, device):
    model.train()
    total, n = 0.0, 0
    for X, y in loader:
        loss = loss_fn(model(X), y)
        loss.backward()
        optimizer.step()
        total += loss.item() * len(y)
        n += len(y)
    return total / n


def no_train_mode(model, loader, loss_fn, optimizer, device):
    total, n = 0.0, 0
    for X, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        optimizer.step()
        total += loss.item() * len(y)
        n += len(y)
    return total / n


def no_step(model, loader, loss_fn, optimizer, device):
    model.train()
    total, n = 0.0, 0
    for X, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        total += loss.item() * len(y)
        n += len(y)
    return total / n


def summed_loss_backward(model, loader, loss_fn, optimizer, device):
    model.train()
    total, n = 0.0, 0
    for X, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X), y, reduction="sum")
        loss.backward()
        optimizer.step()
        total += loss.item()
        n += len(y)
    return total / n


def _returning(kind):
    def fn(model, loader, loss_fn, optimizer, device):
        model.train()
        losses, sizes = [], []
        for X, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(X), y)
            loss.backward()
            optimizer.step()
            losses.append(loss)
            sizes.append(len(y))
        if kind == "sum":
            return sum(l.item() for l in losses)
        if kind == "mean_of_means":
            return sum(l.item() for l in losses) / len(losses)
        if kind == "last":
            return losses[-1].item()
        if kind == "tensor":
            return losses[-1]
        raise ValueError(kind)
    return fn


def test_reference_train_passes(capsys):
    lab01.check_train_one_epoch(good_train)
    assert capsys.readouterr().out.startswith("✔")


@pytest.mark.parametrize("fn, phrase", [
    (no_zero_grad, "zero_grad"),
    (no_train_mode, "model.train()"),
    (no_step, "optimizer.step()"),
    (summed_loss_backward, "summed over the batch"),
    (_returning("sum"), "sum of the batch losses"),
    (_returning("mean_of_means"), "averaged the per-batch means"),
    (_returning("last"), "last batch's loss"),
    (_returning("tensor"), "autograd graph"),
])
def test_train_mistakes_are_named(fn, phrase):
    with pytest.raises(LabCheckError, match=None) as err:
        lab01.check_train_one_epoch(fn)
    assert phrase in str(err.value), str(err.value)


def good_eval(model, loader, loss_fn, device):
    return train.evaluate(model, loader, loss_fn, device)


def _eval(mode=True, no_grad=True, acc_kind="fraction", loss_kind="per_sample"):
    def fn(model, loader, loss_fn, device):
        if mode:
            model.eval()
        ctx = torch.no_grad() if no_grad else torch.enable_grad()
        with ctx:
            losses, sizes, hits, accs = [], [], 0, []
            for X, y in loader:
                out = model(X)
                losses.append(loss_fn(out, y).item())
                sizes.append(len(y))
                hits += (out.argmax(1) == y).sum().item()
                accs.append((out.argmax(1) == y).float().mean().item())
        n = sum(sizes)
        loss = {"per_sample": sum(l * s for l, s in zip(losses, sizes)) / n,
                "sum": sum(losses), "mean_of_means": sum(losses) / len(losses)}[loss_kind]
        acc = {"fraction": hits / n, "count": hits, "percent": 100 * hits / n,
               "mean_of_means": sum(accs) / len(accs)}[acc_kind]
        return loss, acc
    return fn


def test_reference_evaluate_passes(capsys):
    lab01.check_evaluate(good_eval)
    assert capsys.readouterr().out.startswith("✔")
    lab01.check_evaluate(_eval())  # the plain version is right too


@pytest.mark.parametrize("fn, phrase", [
    (_eval(mode=False), "model.eval()"),
    (_eval(no_grad=False), "torch.no_grad()"),
    (_eval(acc_kind="count"), "number of correct predictions"),
    (_eval(acc_kind="percent"), "percent"),
    (_eval(acc_kind="mean_of_means"), "per-batch accuracies"),
    (_eval(loss_kind="sum"), "sum of the batch losses"),
    (_eval(loss_kind="mean_of_means"), "averaged the per-batch mean losses"),
])
def test_evaluate_mistakes_are_named(fn, phrase):
    with pytest.raises(LabCheckError) as err:
        lab01.check_evaluate(fn)
    assert phrase in str(err.value), str(err.value)
