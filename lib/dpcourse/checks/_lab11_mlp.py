"""Lab 11 part 4: the tensor-parallel MLP (column then row, one all-reduce each way), its
normed variant, and the two predictions about it: how many all-reduces a training step makes and
how many parameters one rank holds. Re-exported by :mod:`dpcourse.checks.lab11`."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn

from . import check_timeout, fail, passed, recorded, refuse_reference, reveal, run_ranks
from ._lab11_common import DEFAULT_TIMEOUT, WORLD_SIZES, _HANG, _OWN, _todo
from ._lab11_diagnose import D, H, ODD_H, ROWS, _STEPS, _data, _error
from ._lab11_layer_diagnosis import _diagnose_mlp, _match_param, _plain_mlp
from ._lab11_layers import _sgd_outputs
from ._lab11_norm import SHIFT, check_normed, normed_worker


def _mlp_worker(rank: int, world_size: int, mlp_cls, hidden: int) -> dict:
    from ..collectives import record_collectives

    torch.set_num_threads(1)
    x = _data(1, ROWS, D, seed=10)[0].clone().requires_grad_(True)
    upstream = _data(1, ROWS, D, seed=11)[0]
    try:
        mlp = mlp_cls(copy.deepcopy(_plain_mlp(hidden)), rank, world_size)
    except Exception as exc:
        return {"build_error": _error(exc)}
    try:
        with record_collectives() as fwd:
            y = mlp(x)
        if not isinstance(y, torch.Tensor):
            return {"run_error": f"forward returned {type(y).__name__}, not a tensor"}
        with record_collectives() as bwd:
            y.backward(upstream.clone())
    except Exception as exc:
        return {"run_error": _error(exc)}
    out = {"y": y.detach().clone(), "x_grad": None if x.grad is None else x.grad.clone(),
           "fwd": [c.op for c in fwd if c.op != "barrier"],
           "bwd": [c.op for c in bwd if c.op != "barrier"],
           "params": [p.detach().clone() for p in mlp.parameters()],
           "grads": [None if p.grad is None else p.grad.clone() for p in mlp.parameters()]}
    out.update(_sgd_outputs(mlp, x, upstream))
    return out


@recorded
def check_tp_mlp(mlp_cls, world_sizes=WORLD_SIZES, timeout: float | None = None) -> None:
    """``mlp_cls(plain, rank, world_size)`` from a plain ``Sequential(Linear(6, 12), GELU(),
    Linear(12, 6))`` on 2 and 3 ranks: the same output and dL/dx as the plain MLP, with one
    all-reduce forward and one backward, each shard's gradient the plain one's block, and the
    same output after ``_STEPS`` SGD steps of each rank's own parameters; then hidden size 16
    on 3 ranks, refused with a sentence naming both numbers, or handled."""
    __tracebackhide__ = True
    from .. import tensor_parallel as tp

    if not isinstance(mlp_cls, type):
        fail(f"the check needs your class itself, got {type(mlp_cls).__name__}.")
    refuse_reference(mlp_cls, "TPMLP", tp.TensorParallelMLP, why=_OWN)
    _todo(mlp_cls)
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    for n in world_sizes:
        outs = run_ranks(_mlp_worker, n, mlp_cls, H, timeout=timeout, hang=_HANG)
        _diagnose_mlp(outs, n, H, mlp_cls.__name__)
    outs = run_ranks(_mlp_worker, 3, mlp_cls, ODD_H, timeout=timeout, hang=_HANG)
    errors = [o.get("build_error") for o in outs]
    if all(errors):
        if not all(str(ODD_H) in e and "3" in e.replace(str(ODD_H), "") for e in errors):
            fail(f"hidden size {ODD_H} on 3 ranks: your {mlp_cls.__name__} raised {errors[0]!r}, a "
                 f"sentence that does not name both the hidden size ({ODD_H}) and the world size (3).",
                 fix="refuse it with a ValueError whose sentence names the hidden size and the world "
                     "size.")
        how = "refused with a sentence naming both"
    else:
        if any(errors):
            fail(f"hidden size {ODD_H} on 3 ranks: some ranks refused it and some did not "
                 f"({errors}), and the ranks that went on wait for the others' collectives.",
                 fix="refuse it on every rank, or handle it on every rank.")
        _diagnose_mlp(outs, 3, ODD_H, mlp_cls.__name__,
                      hint=f" — {ODD_H} does not split into 3 equal blocks: refuse it with a "
                           f"ValueError naming both numbers, or give uneven blocks that cover "
                           f"every feature")
        how = "handled"
    shown = " and ".join(map(str, world_sizes))
    passed(f"{mlp_cls.__name__} equals the plain MLP (output, dL/dx and every shard's weight and "
           f"bias gradient, and after {_STEPS} SGD steps the output) on {shown} ranks, with "
           f"one all-reduce in each pass; hidden size "
           f"{ODD_H} on 3 ranks {how}")


class _Launched(Mapping):
    """{world size: the ranks' results}, each world size launched on its first reading, in
    the order given."""

    def __init__(self, sizes, launch):
        self._sizes, self._launch, self._outs = tuple(dict.fromkeys(sizes)), launch, {}

    def __getitem__(self, n):
        if n not in self._sizes:
            raise KeyError(n)
        if n not in self._outs:
            self._outs[n] = self._launch(n)
        return self._outs[n]

    def __contains__(self, n):          # without launching
        return n in self._sizes

    def __iter__(self):
        return iter(self._sizes)

    def __len__(self):
        return len(self._sizes)


@recorded
def check_normed_mlp(mlp_cls, world_sizes=WORLD_SIZES, timeout: float | None = None,
                     prediction=None, bytes_prediction=None) -> None:
    """``mlp_cls(plain, rank, world_size)`` from ``Sequential(Linear(6, 12), GELU(),
    LayerNorm(12, elementwise_affine=False), Linear(12, 6))`` on 2 and 3 ranks, then with a
    hidden size of 16 on 3 ranks: the plain network's output, dL/dx, both weights' block
    gradients and its output after ``_STEPS`` SGD steps, each rank holding only its blocks of
    the weights, and the norm's exchange sending no more bytes per rank and pass than the
    cheapest correct one (``norm_budget``: an all-reduce of two float32 numbers per row); then,
    on 2 ranks, the output with the first layer's bias shifted by ``SHIFT`` (hidden activations
    with a large mean, where a variance from E[x²] − E[x]² cancels) within ``LARGE_ATOL``. Each
    wrong placement (none, a backward that sends nothing back, an average, the whole hidden
    gradient all-reduced then sliced, the hidden blocks gathered) is named by its cause
    (:mod:`dpcourse.checks._lab11_norm`); ``prediction`` (one of ``NORM_CHOICES``) and
    ``bytes_prediction`` (bytes) are revealed once it passes."""
    __tracebackhide__ = True
    if not isinstance(mlp_cls, type):
        fail(f"the check needs your class itself, got {type(mlp_cls).__name__}.")
    _todo(mlp_cls)
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    # each world size launched when the diagnosis reaches it: a mistake named on 2 ranks
    # needs no launch on 3
    ran = _Launched(world_sizes, lambda n: run_ranks(normed_worker, n, mlp_cls,
                                                     timeout=timeout, hang=_HANG))
    uneven = None
    if 3 in ran:      # run once the even sizes have passed their diagnoses
        def uneven():
            return run_ranks(normed_worker, 3, mlp_cls, ODD_H, timeout=timeout, hang=_HANG)
    two = min(ran)

    def large():      # run once the small-mean runs have passed their diagnoses
        return two, run_ranks(normed_worker, two, mlp_cls, H, SHIFT, timeout=timeout,
                              hang=_HANG)
    check_normed(ran, mlp_cls.__name__, prediction, uneven, bytes_prediction, large)


def _stacked_worker(rank: int, world_size: int, mlp_cls) -> dict:
    from ..collectives import record_collectives

    torch.set_num_threads(1)
    out = {}
    for case, needs_grad in (("data", False), ("requires_grad", True)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(14)
            plains = [nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))
                      for _ in range(2)]
        model = nn.Sequential(*(mlp_cls(p, rank, world_size) for p in plains))
        x = _data(1, ROWS, D, seed=15)[0].clone().requires_grad_(needs_grad)
        with record_collectives() as calls:
            model(x).square().mean().backward()
        out[case] = [c.op for c in calls if c.op != "barrier"]
    return out


def count_all_reduces(mlp_cls, world_size: int = 2, timeout: float | None = None) -> tuple:
    """The measurement behind lab 11's prediction: two of the learner's ``mlp_cls`` stacked
    (``nn.Sequential``), one forward and one backward on ``world_size`` ranks, first fed data
    (``x`` needs no gradient), then an ``x`` that requires a gradient (as the output of a layer
    below would); returns how many all-reduces rank 0 made in each, ``(data, requires_grad)``
    (every rank makes the same)."""
    __tracebackhide__ = True
    if not isinstance(mlp_cls, type):
        fail(f"the measurement needs your class itself, got {type(mlp_cls).__name__}.")
    _todo(mlp_cls)
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    outs = run_ranks(_stacked_worker, world_size, mlp_cls, timeout=timeout, hang=_HANG)
    return tuple(sum(op == "all_reduce" for op in outs[0][case])
                 for case in ("data", "requires_grad"))


def check_prediction(prediction, measured, prediction_grad=None) -> None:
    """Compare the learner's two predictions of the all-reduces in one step of two stacked TP
    MLPs — ``prediction`` fed data, ``prediction_grad`` with an input that requires a gradient
    — with :func:`count_all_reduces`' pair, and say why each is what it is. Two cases, so that
    the count cannot be guessed between 3 and 4: only the reason gives both."""
    __tracebackhide__ = True
    if not (isinstance(measured, tuple) and len(measured) == 2):
        fail(f"the check needs the pair that lab11.count_all_reduces returned, got "
             f"{measured!r}: pass the value of the count_all_reduces(...) cell.")
    if prediction_grad is None:
        raise NotImplementedError("write your second prediction (the input requires a "
                                  "gradient) and pass it too: "
                                  "check_prediction(guess, measured, guess_grad).")
    for guess, count, explanation in (
            (prediction, measured[0], ""),
            (prediction_grad, measured[1],
             f"In the forward each MLP's g sums its partial products: 2 all-reduces. In the "
             f"backward autograd calls a Function's backward only when one of its inputs needs "
             f"a gradient. Fed data, the second MLP's f (its input comes out of the first MLP) "
             f"all-reduces dL/dx and the first MLP's f does not, since its input is data — "
             f"{measured[0]} in all. When x requires a gradient (it comes out of a layer below, "
             f"or you asked for dL/dx), the first MLP's f all-reduces too — {measured[1]}.")):
        value = getattr(guess, "value", None)
        close = isinstance(value, (int, float)) and value == count
        reveal(guess, count, close=close, explanation=explanation)


PARAMS_RANK, PARAMS_WORLD = 1, 3    # part 4's prediction: rank 1 of 3, plain MLP (D, H)


def count_parameters(mlp_cls, rank: int = PARAMS_RANK, world_size: int = PARAMS_WORLD) -> int:
    """The measurement behind part 4's prediction: the numbers (elements) in the parameters of
    ``mlp_cls(plain, rank, world_size)``, built in this process from the plain
    ``Sequential(Linear(6, 12), GELU(), Linear(12, 6))`` (building a layer communicates
    nothing)."""
    __tracebackhide__ = True
    if not isinstance(mlp_cls, type):
        fail(f"the measurement needs your class itself, got {type(mlp_cls).__name__}.")
    _todo(mlp_cls)
    try:
        mlp = mlp_cls(copy.deepcopy(_plain_mlp(H)), rank, world_size)
    except Exception as exc:
        fail(f"{mlp_cls.__name__}(plain, {rank}, {world_size}) raised while being built: "
             f"{_error(exc)}.")
    return sum(p.numel() for p in mlp.parameters())


def check_parameters_prediction(prediction, measured: int, mlp_cls=None) -> None:
    """Compare the learner's prediction of the numbers rank 1 of 3 holds in its TPMLP's
    parameters with :func:`count_parameters`' count, and explain it part by part (with the
    learner's own row-bias decision when ``mlp_cls`` is given)."""
    __tracebackhide__ = True
    value = getattr(prediction, "value", None)
    close = isinstance(value, (int, float)) and value == measured
    plain = _plain_mlp(H)
    total = sum(p.numel() for p in plain.parameters())
    per = H // PARAMS_WORLD
    blocks = 2 * per * D + per
    b2 = None                           # the numbers of b₂ this rank holds
    if mlp_cls is not None:
        try:
            mlp = mlp_cls(copy.deepcopy(plain), PARAMS_RANK, PARAMS_WORLD)
            b2 = sum(p.numel() for p in mlp.parameters()
                     if (m := _match_param(p.detach(), plain)) is not None and m[0] == "b2")
        except Exception:
            b2 = None
    if b2 is None:
        b2 = measured - blocks if measured - blocks in (0, D, D // PARAMS_WORLD) else 0
    if b2 == D:
        bias = (f"+ the whole second bias ({D}) = {blocks + D}: more than a third of the plain "
                f"MLP's {total}, because b₂ is kept whole on every rank that holds it")
    elif b2:
        bias = (f"+ its block of the second bias ({b2}) = {blocks + b2}: a third of the plain "
                f"MLP's {total}, every part of it cut in blocks")
    else:
        bias = (f"and no second bias (another rank holds it) = {blocks}: a third of the plain "
                f"MLP's weights and first bias")
    reveal(prediction, measured, close=close, explanation=(
        f"Rank {PARAMS_RANK} of {PARAMS_WORLD} keeps a {per} × {D} block of the first weight "
        f"({per * D}), the same {per} entries of the first bias, a {D} × {per} block of the "
        f"second weight ({per * D}) {bias}. The weights shrink by t, what is replicated does "
        f"not; in a transformer the weights are nearly all of it."))
