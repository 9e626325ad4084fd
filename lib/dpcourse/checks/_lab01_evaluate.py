"""Lab 01 §2: ``check_evaluate`` — the mean loss and accuracy over every sample, with autograd
off, and the model left in the mode the learner's design decision names ("eval" or "as found",
a mixed-mode model included), also when the loader raises or is empty. Re-exported by
:mod:`dpcourse.checks.lab01`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpcourse import train as reference
from dpcourse.checks import fail, passed, recorded
from ._lab01_finetune import check_fine_tuning
from ._lab01_common import (LEAVES, _FROZEN, _SETUPS, _Spy, _as_number, _library, _params,
                            _refuse_library, _same, _setup, library_calls)


@recorded
def check_evaluate(evaluate, leaves: str | None = None, back_to_training=None) -> None:
    """Run your ``evaluate(model, loader, loss_fn, device) -> (loss, accuracy)`` and compare.

    ``leaves`` is the lab's design decision, the mode ``evaluate`` leaves the model in: "eval"
    (evaluation mode, whatever it arrived in) or "as found" (the mode it arrived in). The check
    hands the model over in training mode and in eval mode and holds your function to your
    choice; None checks everything but the mode on return. Then it runs a fine-tuning loop
    that keeps part of the network frozen in eval mode (:mod:`._lab01_finetune`): under "as
    found" evaluate alone must hand the frozen part back; under "eval" your
    ``back_to_training(model, frozen)``, the caller's half of the decision, must.
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
    if leaves is not None:
        check_fine_tuning(evaluate, leaves, back_to_training)
    said = {None: "", "eval": ", and it leaves the model in eval mode as you decided, with "
                              "your back_to_training giving a fine-tuning loop its frozen "
                              "layers back",
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


def _frozen_drift(model, loader) -> float:
    """How far the caller's next training step, with the modes evaluate left, moves model[2]'s
    running mean (0 when it stays frozen)."""
    before = model[2].running_mean.clone()
    X, y = next(iter(loader))
    nn.functional.cross_entropy(model(X), y).backward()
    model.zero_grad(set_to_none=True)
    return float((model[2].running_mean - before).norm())


def _check_mixed_return(model, arrived: dict, leaves: str | None, loader=None) -> None:
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
        drift = ("" if loader is None else
                 f" (the check took that step: its running mean moved by "
                 f"{_frozen_drift(model, loader):.3g})")
        fail(f"you decided that evaluate leaves the model in the mode it found; the check "
             f"handed it a training model whose BatchNorm layer (model[2]) was frozen in eval "
             f"mode, as when fine-tuning (model.train(), then model[2].eval()), and it came "
             f"back with that BatchNorm in training mode: the frozen layer's running statistics "
             f"would move at the caller's next training step{drift}.",
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
        _check_mixed_return(model, arrived_modes, leaves, loader)
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
