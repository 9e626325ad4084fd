"""lab02's checks: the reference passes; each plausible mistake fails with a sentence naming it."""

import copy

import pytest
import torch
import torch.nn.functional as F

from dpcourse import dp
from dpcourse.checks import LabCheckError, lab02


def good_scatter(X, n):
    return list(torch.chunk(X, n))


def good_gather(outputs):
    return torch.cat(outputs)


def make_step(combine="sum", loss_per_chunk=False):
    def step(model, X, y, n):
        chunks = good_scatter(X, n)
        reps = [copy.deepcopy(model) for _ in range(n)]
        outs = dp.parallel_apply(reps, chunks)
        if loss_per_chunk:
            loss = sum(F.cross_entropy(o, yc) for o, yc in zip(outs, good_scatter(y, n)))
        else:
            loss = F.cross_entropy(good_gather(outs), y)
        loss.backward()
        for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps)):
            gs = [c.grad for c in cs]
            if combine == "sum":
                p.grad = sum(gs)
            elif combine == "mean":
                p.grad = sum(gs) / n
            elif combine == "first":
                p.grad = gs[0].clone()
            elif combine == "flat":
                p.grad = sum(gs).reshape(-1)[:1].clone() if p.dim() == 1 else sum(gs)
        return loss.item()
    return step


def test_reference_answers_pass(capsys):
    lab02.check_scatter(good_scatter)
    lab02.check_gather(good_gather)
    lab02.check_dp_forward_backward(make_step())
    out = capsys.readouterr().out.splitlines()
    assert [line[:1] for line in out] == ["✔"] * 3, out  # one line each, printed once
    assert "scatter" in out[0] and "gather" in out[1] and "DataParallel by hand" in out[2]


@pytest.mark.parametrize("wrong, phrase", [
    (lambda X, n: list(torch.chunk(X, n, dim=1)), "split along dim 1"),
    (lambda X, n: [X[i::n] for i in range(n)], "every n-th sample"),
    (lambda X, n: list(torch.split(X, X.shape[0] // n))[:n], "lost 2 of 10 samples"),
    (lambda X, n: list(torch.chunk(X, n))[:-1], r"chunk\(s\) for 2 devices"),
    (lambda X, n: list(torch.chunk(X, n))[::-1], "not the original batch"),
    (lambda X, n: X, "list of tensors"),
    (lambda X, n: [c.reshape(-1) for c in torch.chunk(X, n)], "changed the number of dimensions"),
])
def test_wrong_scatter(wrong, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab02.check_scatter(wrong)


@pytest.mark.parametrize("wrong, phrase", [
    (lambda o: torch.cat(o, dim=1), "along dim 1"),
    (lambda o: torch.stack(o), "stacked"),
    (lambda o: torch.cat(o[::-1]), "reverse device order"),
    (lambda o: torch.cat(o[:2]), "returned shape"),
])
def test_wrong_gather(wrong, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab02.check_gather(wrong)


@pytest.mark.parametrize("step, phrase", [
    (make_step("mean"), "averaged the replicas' gradients"),
    (make_step("first"), "replica 0's alone"),
    (make_step("none"), "no gradients"),
    (make_step(loss_per_chunk=True), "counts the batch 4 times"),
])
def test_wrong_dp_step(step, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab02.check_dp_forward_backward(step)


def test_wrong_loss_value_is_named():
    def step(model, X, y, n):
        make_step()(model, X, y, n)
        return 123.0
    with pytest.raises(LabCheckError, match="not the mean loss on the whole batch"):
        lab02.check_dp_forward_backward(step)


def test_unfinished_lab_propagates_not_implemented():
    def todo(X, n):
        raise NotImplementedError("TODO")
    with pytest.raises(NotImplementedError):
        lab02.check_scatter(todo)


def scatter_refusing_one_per_device(X, n_devices):
    if X.shape[0] <= n_devices:  # off by one: a batch of exactly n_devices is fine
        raise ValueError("batch too small")
    return list(torch.chunk(X, n_devices, dim=0))


def test_scatter_that_refuses_one_sample_per_device_is_named():
    with pytest.raises(LabCheckError, match=r"one sample per device is a valid split"):
        lab02.check_scatter(scatter_refusing_one_per_device)

