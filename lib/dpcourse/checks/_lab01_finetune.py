"""Lab 01 §2, the caller's side of the design decision: a fine-tuning loop that keeps part of
the network frozen in eval mode while the rest trains, and calls ``evaluate`` between its
steps. Under "as found" ``evaluate`` itself hands every layer back in the mode it found; under
"eval" the whole model comes back in eval mode, and the caller's ``back_to_training(model,
frozen)`` (the learner's too) must put it back: every layer training except the frozen modules,
which stay in eval mode with everything inside them. The check runs that loop on two models (a
frozen BatchNorm layer; a frozen block holding one) and, where a mode is wrong after the
return, takes the loop's next training step and reports what it did (how far a frozen layer's
running mean moved, which layers trained with dropout off). Re-exported through
:func:`dpcourse.checks.lab01.check_evaluate`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from dpcourse.checks import fail
from ._lab01_common import _setup


def _block_model(seed: int):
    """A model whose first block (a Linear, a BatchNorm, a ReLU) is the part fine-tuning
    freezes, and whose head (dropout, Linear) trains."""
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict(
        flatten=nn.Flatten(),
        block=nn.Sequential(nn.Linear(3 * 8 * 8, 32), nn.BatchNorm1d(32), nn.ReLU()),
        head=nn.Sequential(nn.Dropout(0.5), nn.Linear(32, 10))))


def _scenes():
    """(model, loader, frozen modules, how the caller froze them, in words)."""
    model, loader = _setup(50, 16, 0, batch_norm=True)
    yield model, loader, [model[2]], "model[2] (its BatchNorm1d)"
    _, loader = _setup(37, 8, 3)
    model = _block_model(3)
    yield model, loader, [model.block], ("model.block (a Linear, a BatchNorm1d and a ReLU, "
                                         "the part fine-tuning keeps)")


def _name(model, module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return _where(name)
    return "a module"


def _where(name: str) -> str:
    """model[2], model.block[1]: the name as the learner's code would reach it."""
    if not name:
        return "the model"
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in name.split("."))


def _mode_names(model) -> dict:
    return {name: m.training for name, m in model.named_modules()}


def _label(model, name: str) -> str:
    return f"{_where(name)} ({type(model.get_submodule(name)).__name__})"


def _running_means(model) -> dict:
    return {name: m.running_mean.clone() for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def check_fine_tuning(evaluate, leaves: str, back_to_training) -> None:
    """Run the check's fine-tuning loop with the learner's ``evaluate`` (and, under "eval",
    ``back_to_training``) and fail, with what the loop's next step did, when the modes it
    resumes training with are not those it froze the model in."""
    __tracebackhide__ = True
    if leaves == "eval" and back_to_training is None:
        fail("you decided that evaluate leaves the whole model in eval mode, so a caller that "
             "keeps part of the network frozen while the rest trains gets its modes back only "
             "through back_to_training(model, frozen), and the check got no back_to_training "
             "to run its fine-tuning loop with.",
             fix="write back_to_training (the caller's half of your decision) and pass it: "
                 "lab01.check_evaluate(evaluate, leaves=..., back_to_training=back_to_training).")
    if leaves == "eval" and (not callable(back_to_training) or isinstance(back_to_training, type)):
        fail(f"the check needs your function back_to_training itself, got "
             f"{type(back_to_training).__name__}.")
    for model, loader, frozen, froze in _scenes():
        # fine-tune a little: the frozen layers' running statistics are the pretrained ones
        model.train()
        for m in frozen:
            m.eval()
        want = _mode_names(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        X, y = next(iter(loader))
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
        evaluate(model, loader, nn.CrossEntropyLoss(), "cpu")
        called = ""
        if leaves == "eval":
            listed = "[" + ", ".join(_name(model, m) for m in frozen) + "]"
            back_to_training(model, list(frozen))
            called = f", called back_to_training(model, {listed})"
        got = _mode_names(model)
        if got == want:
            continue
        # the loop's next training step, with the modes the caller now has
        before = _running_means(model)
        seen = []
        hooks = [m.register_forward_pre_hook(
                 lambda module, args, n=n: seen.append((n, module.training)))
                 for n, m in model.named_modules() if isinstance(m, nn.Dropout)]
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
        for h in hooks:
            h.remove()
        moved = {n: float((m - before[n]).norm()) for n, m in _running_means(model).items()
                 if not want[n]}
        unfrozen = [n for n in want if not want[n] and got[n]]
        stopped = [n for n in want if want[n] and not got[n]]
        scene = (f"the check's fine-tuning loop put the model in training mode and froze "
                 f"{froze} in eval mode (model.train(), then .eval() on it), took a training "
                 f"step, called your evaluate{called}, and took its next training step")
        if unfrozen:
            moving = [f"{_label(model, n)}'s running mean moved by {moved[n]:.3g}"
                      for n in unfrozen if n in moved and moved[n] > 0]
            inside = [n for n in unfrozen if not any(m is model.get_submodule(n) for m in frozen)]
            held = [n for n in want if not want[n] and not got[n]]
            where = (f"{_label(model, held[0])} itself was in eval mode, but the "
                     f"{len(inside)} layer(s) inside it ran that step in training mode "
                     f"({', '.join(_label(model, n) for n in inside)})"
                     if held and inside else "")
            fail(f"{scene}: "
                 + (where or f"{len(unfrozen)} frozen layer(s) ran that step in training mode "
                             f"({', '.join(_label(model, n) for n in unfrozen)})")
                 + f"{': ' + '; '.join(moving) if moving else ''}. A frozen layer's statistics "
                 f"must not move while the rest of the network trains.",
                 fix=("setting .training on a module changes that module alone: .eval() (or "
                      ".train(False)) reaches every submodule inside it."
                      if where else
                      "model.train() reaches every submodule, the frozen ones too: after it, "
                      "put each module of `frozen` back in eval mode (the last call that "
                      "reaches a layer sets its mode)."
                      if leaves == "eval" else
                      "remember each submodule's own .training before you switch, and put each "
                      "one back."))
        dropout_off = [n for n, training in seen if want[n] and not training]
        fail(f"{scene}: {len(stopped)} layer(s) the loop trains were in eval mode for that step "
             f"({', '.join(_label(model, n) for n in stopped)})"
             + (f", so {len(dropout_off)} dropout layer(s) were off while the network trained"
                if dropout_off else "") + ".",
             fix=("put the whole model in training mode first (model.train() reaches every "
                  "submodule), then the modules of `frozen` back in eval mode."
                  if leaves == "eval" else
                  "remember each submodule's own .training before you switch, and put each one "
                  "back."))
