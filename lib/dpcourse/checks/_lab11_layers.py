"""Lab 11 parts 2-3: the column- and row-parallel layers, run on 2 and 3 ranks against one full
``nn.Linear`` (outputs, gradients, one SGD step, what each rank stores), and the prediction of
the gradient a row layer's bias gets on each rank. The diagnosis of a wrong layer is in
:mod:`dpcourse.checks._lab11_layer_diagnosis`; re-exported by :mod:`dpcourse.checks.lab11`."""

from __future__ import annotations

import copy

import torch
from torch import nn

from . import check_timeout, fail, passed, recorded, refuse_reference, reveal, run_ranks
from ._lab11_common import DEFAULT_TIMEOUT, WORLD_SIZES, _HANG, _OWN, _communicating, _todo
from ._lab11_decisions import _RIGHT_DIM
from ._lab11_diagnose import (D, H, ROWS, _LR, _STEPS, _data, _error, _find_slice,
                              _reference_steps, _stepped_failures)
from ._lab11_layer_diagnosis import (_DIM_NAMES, _against_dim, _block_failures,
                                     _common_layer_failures, _diagnose_column, _diagnose_row,
                                     _storage_failures)


def _full_linear(fan_in: int, fan_out: int, seed: int) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(fan_in, fan_out)


def _shapes(module) -> list:
    return [tuple(p.shape) for p in module.parameters()]


def _layer_case(kind: str) -> tuple:
    """The full layer a check cuts, its whole input and the gradient of its whole output: the
    column layer is ``Linear(D, H)``, the row layer ``Linear(H, D)`` (the same on every rank and
    in the diagnosis)."""
    if kind == "column":
        return (_full_linear(D, H, seed=3), _data(1, ROWS, D, seed=4)[0],
                _data(1, ROWS, H, seed=5)[0])
    return _full_linear(H, D, seed=6), _data(1, ROWS, H, seed=7)[0], _data(1, ROWS, D, seed=8)[0]


def _reference(kind: str) -> tuple:
    """(full layer, its input, the upstream gradient, its output) after one forward and backward
    of the full layer on one process: what every rank's block is compared with."""
    full, x, upstream = _layer_case(kind)
    x = x.clone().requires_grad_(True)
    y = full(x)
    y.backward(upstream)
    return full, x, upstream, y.detach()


def _shared_storage(layer: nn.Module, full: nn.Linear) -> list:
    """(parameter's shape, "weight" or "bias", numbers in the storage, numbers in the
    parameter) for every parameter of ``layer`` whose storage is one of ``full``'s tensors'
    (a slice or view of it, not a copy)."""
    storages = {name: t.untyped_storage() for name, t in
                (("weight", full.weight), ("bias", full.bias)) if t is not None}
    shared = []
    for p in layer.parameters():
        ptr = p.untyped_storage().data_ptr()
        for name, st in storages.items():
            if ptr and ptr == st.data_ptr():
                shared.append((tuple(p.shape), name, st.nbytes() // p.element_size(), p.numel()))
    return shared


def _layer_worker(rank: int, world_size: int, layer_cls, kind: str) -> dict:
    from ..collectives import record_collectives

    torch.set_num_threads(1)
    out: dict = {}
    full, x, grad_full = _layer_case(kind)
    if kind == "row":                # each rank is fed its block of the hidden features
        per = H // world_size
        x = x[:, rank * per:(rank + 1) * per]
    x = x.clone().requires_grad_(True)
    given = copy.deepcopy(full)
    try:
        layer = layer_cls(given, rank, world_size)
    except Exception as exc:
        return {"build_error": _error(exc)}
    out["shapes"] = _shapes(layer)
    out["shared"] = _shared_storage(layer, given)
    out["params"] = [p.detach().clone() for p in layer.parameters()]
    try:
        with record_collectives() as fwd:
            y = layer(x)
    except Exception as exc:
        return {**out, "forward_error": _error(exc)}
    if not isinstance(y, torch.Tensor):
        return {**out, "forward_error": f"forward returned {type(y).__name__}, not a tensor"}
    out["y"] = y.detach().clone()
    out["fwd"] = _communicating(fwd)
    if kind == "column":
        per = H // world_size
        upstream = grad_full[:, rank * per:(rank + 1) * per]
        if tuple(y.shape) != tuple(upstream.shape):
            return out
    else:
        upstream = grad_full
        if tuple(y.shape) != tuple(upstream.shape):
            return out
    try:
        with record_collectives() as bwd:
            y.backward(upstream.clone())
    except Exception as exc:
        return {**out, "backward_error": _error(exc)}
    out["bwd"] = _communicating(bwd)
    out["x_grad"] = None if x.grad is None else x.grad.clone()
    out["grads"] = [None if p.grad is None else p.grad.clone() for p in layer.parameters()]
    out.update(_sgd_outputs(layer, x, upstream))
    return out


def _sgd_outputs(module: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    """After the first forward and backward (its gradients still in ``.grad``): ``_STEPS``
    plain SGD steps of this rank's own parameters, each followed by a forward (recorded) and a
    backward on the same input and upstream gradient — what training does to the layer. A
    mistake that one forward and backward cannot show (a bias whose copies add up right at
    the start but each take the whole step) shows here."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return {"stepped": []}
    opt = torch.optim.SGD(params, lr=_LR)
    stepped = []
    try:
        for _ in range(_STEPS):
            opt.step()
            opt.zero_grad(set_to_none=True)
            y = module(x)
            stepped.append(y.detach().clone())
            y.backward(upstream.clone())
    except Exception as exc:
        return {"stepped": stepped, "step_error": _error(exc)}
    return {"stepped": stepped}


def _launch_layer(layer_cls, kind: str, weight_dim, world_sizes, timeout) -> dict:
    """Run and diagnose the layer on each world size; returns {n: (outs, full layer)}."""
    __tracebackhide__ = True
    from .. import tensor_parallel as tp

    if not isinstance(layer_cls, type):
        fail(f"the check needs your class itself, got {type(layer_cls).__name__}.")
    refuse_reference(layer_cls, "ColumnParallel" if kind == "column" else "RowParallel",
                     tp.ColumnParallelLinear, tp.RowParallelLinear, why=_OWN)
    if weight_dim is not None:
        if isinstance(weight_dim, bool) or weight_dim not in (0, 1, -1, -2):
            fail(f"{_DIM_NAMES[kind]} should be a dimension of the 2-D linear.weight (0 or 1); "
                 f"got {weight_dim!r}.")
        if weight_dim % 2 != _RIGHT_DIM[kind]:
            fail(f"your decision ({_DIM_NAMES[kind]} = {weight_dim}) is not right yet: run "
                 f"lab11.check_split_decision and read its sentence before checking the code.")
    _todo(layer_cls)
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    ran = {}
    for n in world_sizes:
        outs = run_ranks(_layer_worker, n, layer_cls, kind, timeout=timeout, hang=_HANG)
        full, x, upstream, y = _reference(kind)
        if weight_dim is not None:
            _against_dim(outs, n, layer_cls.__name__, full, kind, weight_dim % 2)
        _common_layer_failures(outs, n, layer_cls.__name__, full, kind)
        _block_failures(outs, n, layer_cls.__name__, full, 0 if kind == "column" else 1)
        _storage_failures(outs, layer_cls.__name__, full, n)
        diagnose = _diagnose_column if kind == "column" else _diagnose_row
        diagnose(outs, n, layer_cls.__name__, full, x, upstream, y)
        _stepped_failures(outs, n, layer_cls.__name__, _reference_steps(full, x, upstream),
                          full.bias.grad, kind)
        ran[n] = (outs, full)
    return ran


@recorded
def check_column_parallel(layer_cls, weight_dim=None, world_sizes=WORLD_SIZES,
                          timeout: float | None = None) -> None:
    """``layer_cls(linear, rank, world_size)`` built from a full ``nn.Linear(6, 12)`` on 2 and
    3 ranks: each rank's output is its block of the full layer's output features, with no
    communication in the forward and one all-reduce of dL/dx in the backward. ``weight_dim``
    is the learner's part-3 decision (:func:`check_split_decision`): it must be right, and
    shards cut along another dimension are refused first."""
    __tracebackhide__ = True
    _launch_layer(layer_cls, "column", weight_dim, world_sizes, timeout)
    shown = " and ".join(map(str, world_sizes))
    passed(f"{layer_cls.__name__}: each rank's output, dL/dx and weight and bias gradients equal "
           f"the matching block of the full layer's, on {shown} ranks, and still do after "
           f"{_STEPS} SGD steps of each rank's own parameters")


# part 3's prediction: what rank 1 of 3's row bias gets as its gradient, with the learner's own
# row-bias decision (dL/db: the full layer's bias gradient after the same backward)
BIAS_RANK, BIAS_WORLD = 1, 3
BIAS_GRAD_CHOICES = ("the whole of dL/db", "its block of dL/db", "dL/db divided by 3",
                     "3 × dL/db", "nothing: rank 1 holds no row bias")


def _bias_gradient_on(outs: list, full: nn.Linear, rank: int) -> tuple:
    """(choice, what rank ``rank`` holds of the row bias) from a run that passed the check."""
    bias = full.bias.detach()
    for p, g in zip(outs[rank]["params"], outs[rank]["grads"]):
        if p.dim() != 1 or g is None:
            continue
        if p.shape == bias.shape:
            return BIAS_GRAD_CHOICES[0], None
        start = _find_slice(p, bias, 0)
        if start is not None:
            return BIAS_GRAD_CHOICES[1], (start, start + p.shape[0])
    return BIAS_GRAD_CHOICES[4], None


def _reveal_bias_gradient(prediction, outs: list, full: nn.Linear) -> None:
    __tracebackhide__ = True
    got, block = _bias_gradient_on(outs, full, BIAS_RANK)
    value = getattr(prediction, "value", None)
    same = ("g's backward hands dL/dY to every partial product unchanged, so a bias added "
            "before g gets the gradient it would get after it")
    if got == BIAS_GRAD_CHOICES[0]:
        why = ("Every rank adds its whole copy of b after g, to the Y that every rank holds: "
               "dL/db is dL/dY summed over the tokens, the same on every rank, so each copy gets "
               "the whole of it and takes the same step — the copies stay equal because every "
               "rank computes the same thing, not because anything keeps them in sync.")
    elif got == BIAS_GRAD_CHOICES[1]:
        why = (f"Rank {BIAS_RANK} holds features [{block[0]}, {block[1]}) of b and adds them to "
               f"its partial product before g. {same[0].upper() + same[1:]}: rank {BIAS_RANK}'s "
               f"block gets that block of dL/db, and the blocks together get all of it, once.")
    else:
        why = (f"Rank {BIAS_RANK} holds no row bias: the rank that holds it adds it to its "
               f"partial product before g. {same[0].upper() + same[1:]}: that rank's bias gets "
               f"the whole dL/db, and rank {BIAS_RANK} has nothing to train.")
    reveal(prediction, got, close=value == got, explanation=why)


@recorded
def check_row_parallel(layer_cls, weight_dim=None, world_sizes=WORLD_SIZES,
                       timeout: float | None = None, bias_prediction=None) -> None:
    """``layer_cls(linear, rank, world_size)`` built from a full ``nn.Linear(12, 6)`` on 2 and
    3 ranks, fed each rank's block of the hidden features: every rank's output equals the full
    layer's, with one all-reduce in the forward and none in the backward; the bias counted
    once and given its whole gradient (or each block its block), and the layer still equal to
    the full one after ``_STEPS`` SGD steps of each rank's own parameters. ``weight_dim`` as in
    :func:`check_column_parallel`. ``bias_prediction``, the learner's
    :func:`~dpcourse.checks.predict` of what rank 1 of 3's bias gets as its gradient (one of
    ``BIAS_GRAD_CHOICES``), is compared with the measurement once the layer passes."""
    __tracebackhide__ = True
    if bias_prediction is not None and BIAS_WORLD not in world_sizes:
        raise ValueError(f"the bias prediction is about {BIAS_WORLD} ranks: world_sizes must "
                         f"include {BIAS_WORLD}")
    ran = _launch_layer(layer_cls, "row", weight_dim, world_sizes, timeout)
    shown = " and ".join(map(str, world_sizes))
    passed(f"{layer_cls.__name__}: every rank's output equals the full layer's, bias included, "
           f"and the input and parameter gradients are the matching blocks of the full "
           f"layer's, on {shown} ranks; after {_STEPS} SGD steps of each rank's own parameters "
           f"it still equals the full layer trained the same way")
    if bias_prediction is not None:
        _reveal_bias_gradient(bias_prediction, *ran[BIAS_WORLD])
