"""What every check of lab 01 shares: the tiny models and loaders it runs (two set-ups of
different sizes and seeds, one with a short last batch), the spies and comparisons, and the
refusal of the library's own answer (``dpcourse.train``) passed as the learner's, which lab 02
reuses. The checks are in :mod:`dpcourse.checks.lab01`.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpcourse.checks import fail


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
