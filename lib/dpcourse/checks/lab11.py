"""Checks for lab11: tensor parallelism from scratch (Megatron-LM's MLP), and the stretch, a GPipe
stage with its bubble measured.

Every check runs the learner's code on 2 and then 3 gloo ranks (``dpcourse.launch.spawn``, so
classes defined in notebook cells work), records every collective it makes with
``dpcourse.collectives.record_collectives``, and compares values with the plain layer on one
process. The values are chosen so that each classic mistake leaves its own trace:

* ``check_block_of``: the slice rank r keeps of a size (in process): not offset by rank, one
  feature short, the remainder dropped, a size that does not divide neither refused with a
  sentence naming it nor handled;
* ``check_diagnosis``: before any code, the learner declares in which pass f and in which pass
  g communicates (``"forward"``, ``"backward"``, ``"both"`` or ``"neither"``). A wrong answer
  is sent back as a pair, never operation by operation, with what it would make of X, dL/dX, Y
  and dL/dY_r — so that runs cannot sort out the values; a second, different wrong pair in the
  same kernel is named as a search (the earlier pairs listed), and a pass reached after wrong
  pairs says so, with the first. A learner who asks for help (Hint 2) also passes ``held``:
  for X and dL/dX (at f) and Y and dL/dY (at g), whether each rank holds it ``"whole"`` (the
  same on every rank) or ``"partial"`` (a part the ranks must sum) before any collective;
  passes that do not follow from those answers (an operation communicates exactly in the pass
  whose quantity is partial) are then named as that inconsistency first.
  ``check_conjugates`` takes the same declaration
  and refuses code whose collectives disagree with it;
* ``check_conjugates``: ``f`` (copy to the tensor-parallel region: identity forward, all-reduce
  backward) and ``g`` (reduce from it: all-reduce forward, identity backward). Rank-dependent
  inputs and gradients tell apart: an all-reduce in f's forward, none in its backward, an
  average where a sum belongs, an all-reduce in g's backward, none in its forward, f and g
  swapped, a backward that returns nothing;
* ``check_split_decision``: before any code of part 3, the learner states the layout its
  decision rests on, the shape of ``nn.Linear(6, 12).weight`` (checked against the weight torch
  builds: a false layout is refused whatever the dimensions), and which dimension of
  ``linear.weight`` each layer cuts; a wrong dimension gets what it cuts in the learner's own
  layout (never the number, also on the second meeting). Then ``dense_dims``, the same two
  cuts in Keras ``Dense``'s layout (kernel ``(input features, units)``), which the course does
  not show: the torch pair copied there is named as such. The layer checks take the declared
  torch dimension and refuse shards cut along another;
* ``check_column_parallel`` / ``check_row_parallel``: shards cut along the wrong dimension
  (also when the hidden block's bounds, applied to the other dimension, leave rank 0 the whole
  weight and the last rank nothing), the
  whole weight or bias kept, a parameter that shares its storage with the full layer's tensor
  (a slice without a copy keeps the whole weight alive), a block not offset by rank (or strided), an all-reduce in the
  column layer's forward or none in its backward, none in the row layer's forward or one in its
  backward, the row bias added on every rank before the sum, the bias scaled by 1/N, missing on
  some rank, held on a rank whose forward never adds it (its .grad stays None: a dead
  parameter), averaged partial sums; then two SGD steps of each rank's own parameters against
  the full layer trained the same way, which names a bias whose copies add up right at the
  start but each take the whole step (a placeholder of zeros on the other ranks, added before
  the sum: the sum's bias moves t times per step). ``check_row_parallel`` also reveals the
  learner's prediction of what rank 1 of 3's bias gets as its gradient;
* ``check_tp_mlp``: the assembled MLP equals the plain one (outputs, the input's gradient, and
  each rank's weight and bias gradients against the matching slice of the plain MLP's: a
  detached or divided parameter is named) with exactly one all-reduce in the forward and one in
  the backward (a collective outside f and g, or twice, named by its count: cause first); a
  hidden size that the
  world size does not divide (16 on 3 ranks) is refused with a sentence naming both numbers,
  or handled (then it must equal the plain MLP too);
* ``check_normed_mlp``: the MLP with a ``LayerNorm(12)`` between the two layers, an
  arrangement the lesson did not show: the learner decides where the ranks communicate for
  the norm and what that communication's backward is. Refused by cause, with the run's
  numbers: the norm over each rank's own block (its mean and variance beside the row's), a
  backward that sends nothing back (Megatron's gather-with-split: the first weight's gradient
  short by the paths through the statistics), an averaged one, an all-reduce of what every
  rank holds the same, a whole weight kept; then, values right, a norm exchange that sends more
  bytes per rank and pass (counted as a ring sends them, ``ring_bytes``) than the cheapest
  correct one, an all-reduce of two float32 numbers per row (``norm_budget``): the whole hidden
  gradient all-reduced then sliced (2× a reduce-scatter's bytes, n× what a rank keeps) and the
  hidden blocks gathered (grows with h, named first: the forward's gather alone is over) are
  named by their causes; a variance from the sums of x and x² (E[x²] − E[x]²) is refused by
  its cancellation on hidden activations with a large mean (``SHIFT``). Accepted: the mean,
  then the centred squares (or sums shifted by a value every rank shares), all-reduced forward
  and backward; with h = 16 on 3 ranks,
  refused on every rank or the plain values. ``prediction`` (one of ``NORM_CHOICES``): what
  Megatron's gather would break here; ``bytes_prediction``: the fewest bytes the norm's
  forward exchange can send, measured and explained;
* ``count_parameters`` and ``check_parameters_prediction``: the learner predicts how many numbers
  rank 1 of 3 holds in its TPMLP's parameters (58 with the second bias whole on that rank, 52
  without it: its row-bias decision shows), then the count is measured and explained;
* ``count_all_reduces`` and ``check_prediction``: the learner predicts the all-reduces of one
  step of two stacked TP MLPs fed data (3: f's backward runs only where its input needs a
  gradient) and of the same step when the input requires a gradient (4), then both are
  measured and explained (:func:`dpcourse.checks.reveal`);
* ``check_gpipe`` (stretch): one GPipe step of the learner's stage on 2 and 3 stages, 4
  micro-batches, against the unsplit model: gradients not accumulated over the micro-batches
  (only the last one's left), each micro-batch's loss not divided by M, not GPipe's order, a
  received activation that does not require grad, events that time the wait for a message
  (a stage "computing" before its neighbour finished what it sends); and the learner's
  ``bubble(events, stages)`` against :func:`dpcourse.pipeline_parallel.measured_bubble` on
  timelines where the formula and the measurement differ. ``measure_bubble`` refuses the same
  timings, and a measured bubble below (K−1)/(M+K−1).

What each wrong answer looks like, and the sentence that names it, is read by
:mod:`dpcourse.checks._lab11_diagnose` (with the cases every check runs) and, for the stretch,
:mod:`dpcourse.checks._lab11_pipeline`; the three decisions made before any code are judged in
:mod:`dpcourse.checks._lab11_decisions`; part 5's arrangement the lesson did not show (a layer
norm between the two layers) is run and read in :mod:`dpcourse.checks._lab11_norm`; this
module runs the learner's code and calls them.

Every check refuses the library's own reference (``tensor_parallel.shard_bounds``,
``CopyToTensorParallel``, ``ColumnParallelLinear``, ``TensorParallelMLP``,
``pipeline_parallel.measured_bubble`` ...) passed as the learner's answer.

Accepted: ``torch.chunk``, ``narrow``, ``tensor_split`` or index arithmetic; the row layer's
bias added after the all-reduce on every rank, held and added before it on rank 0 only, or cut
in blocks of its output features, one per rank, each added before it;
``x @ W.T`` or ``F.linear``; in-place or cloned all-reduces (Megatron-LM all-reduces in place;
the lab leaves it to the learner); any world size.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from . import check_timeout, fail, has_todo, passed, recorded, refuse_reference, reveal, run_ranks
from ._lab11_decisions import (SP_KEYS, SP_VALUES, _RIGHT_DIM, _declaration, _wrong_passes,
                               check_diagnosis, check_sequence_parallel, check_split_decision)
from ._lab11_diagnose import (D, H, ODD_H, ROWS, _DIM_NAMES, _LR, _NAMES, _STEPS,
                              _against_declaration, _against_dim, _block_failures,
                              _common_layer_failures, _data, _diagnose_column,
                              _diagnose_conjugates, _diagnose_mlp, _diagnose_row, _error,
                              _find_slice, _match_param, _plain_mlp, _reference_steps,
                              _stepped_failures, _storage_failures)
from ._lab11_pipeline import (_BATCH, _BELOW_IDEAL, _CHECK_DELAY_S, _M, _STAGES, _WIDTH,
                              _check_bubble_fn, _computation_only, _diagnose_gpipe,
                              _gpipe_failed, _mse, _pending)
from ._lab11_norm import (NORM_CHOICES, SHIFT, check_normed, norm_budget, normed_worker,
                          ring_bytes)

__all__ = ["check_block_of", "check_diagnosis", "check_conjugates", "check_sequence_parallel",
           "check_split_decision", "SP_KEYS", "SP_VALUES",
           "check_column_parallel", "check_row_parallel",
           "check_tp_mlp", "count_parameters", "check_parameters_prediction",
           "count_all_reduces", "check_prediction", "check_gpipe", "BIAS_GRAD_CHOICES",
           "measure_bubble", "WORLD_SIZES", "DEFAULT_TIMEOUT", "check_normed_mlp", "NORM_CHOICES"]

WORLD_SIZES = (2, 3)
DEFAULT_TIMEOUT = 30.0

_OWN = "the lab asks you to write it, and the library's passes every check by construction"

_HANG = ("every rank must make the same collectives in the same order — an all_reduce that "
         "only some ranks reach (inside `if rank == 0:`, or in a backward that only some ranks "
         "run) leaves the others waiting.")


def _todo(*objs) -> None:
    for obj in objs:
        if has_todo(obj):
            raise NotImplementedError(f"{getattr(obj, '__name__', 'your code')} still raises "
                                      f"NotImplementedError: replace the TODO with your answer.")


def _communicating(log) -> int:
    return sum(1 for c in log if c.op != "barrier")


# --------------------------------------------------------------------------------------------
# block_of (in process)
# --------------------------------------------------------------------------------------------


@recorded
def check_block_of(block_of) -> None:
    """``block_of(size, rank, world_size)`` -> (start, stop): rank r's contiguous block, in rank
    order, covering every feature once; a size the world size does not divide is refused with
    a sentence naming both, or handled by uneven blocks."""
    __tracebackhide__ = True
    from .. import tensor_parallel as tp

    refuse_reference(block_of, "block_of", tp.shard_bounds, why=_OWN)
    _todo(block_of)
    for size, n in ((12, 2), (12, 3), (24, 4), (5, 1)):
        got = []
        for r in range(n):
            try:
                start, stop = (int(v) for v in block_of(size, r, n))
            except Exception as exc:
                fail(f"block_of({size}, {r}, {n}) raised {_error(exc)}, but {n} divides {size}: "
                     f"nothing about this size calls for an error.",
                     fix="return (start, stop), two ints, for every size the world size divides.")
            got.append((start, stop))
        per = size // n
        right = [(r * per, (r + 1) * per) for r in range(n)]
        if got == right:
            continue
        if all(g == got[0] for g in got) and n > 1:
            fail(f"block_of({size}, r, {n}) gives {got[0]} to every rank: every rank keeps the same "
                 f"features, so the other {size - per} are kept by none.",
                 fix=f"offset the block by the rank (rank r's block starts at r × {per}).")
        if all(stop - start == per - 1 for start, stop in got):
            fail(f"block_of({size}, r, {n}) gives blocks of {per - 1}, one feature short: {n} "
                 f"ranks then keep {n * (per - 1)} of the {size} features.",
                 fix="the slice [start:stop) leaves stop out: stop is start plus the block's size.")
        fail(f"block_of({size}, r, {n}) gives {got}, which is not {n} contiguous blocks of "
             f"{per} in rank order.",
             fix=f"rank r's block is [r × {per}, (r + 1) × {per}): {right}.")
    n = 3
    try:
        got = [tuple(int(v) for v in block_of(ODD_H, r, n)) for r in range(n)]
    except Exception as exc:
        if str(ODD_H) in str(exc) and str(n) in str(exc):
            passed(f"block_of: contiguous blocks in rank order, and {ODD_H} features on {n} "
                   f"ranks refused with a sentence naming both")
            return
        fail(f"block_of({ODD_H}, r, {n}) raised {_error(exc)!r}, a sentence that does not name "
             f"both the size ({ODD_H}) and the world size ({n}): the learner who meets it cannot "
             f"tell which number to change.",
             fix="refuse a size the world size does not divide with a ValueError whose sentence "
                 "names both numbers.")
    covered = [i for start, stop in got for i in range(start, stop)]
    if covered == list(range(ODD_H)) and all(stop > start for start, stop in got):
        passed(f"block_of: contiguous blocks in rank order; {ODD_H} features on {n} ranks "
               f"handled with uneven blocks {got}")
        return
    if len(covered) < ODD_H and covered == list(range(len(covered))):
        fail(f"block_of({ODD_H}, r, {n}) gives {got}: feature(s) {len(covered)}..{ODD_H - 1} "
             f"belong to no rank, because {n} does not divide {ODD_H}.",
             fix="refuse such a size (a ValueError naming both numbers) or give the remainder to "
                 "some ranks.")
    fail(f"block_of({ODD_H}, r, {n}) gives {got}, which does not cover the {ODD_H} features "
         f"once each in rank order.",
         fix="refuse a size the world size does not divide, or give uneven blocks that cover it.")


# --------------------------------------------------------------------------------------------
# f and g
# --------------------------------------------------------------------------------------------


def _conjugates_worker(rank: int, world_size: int, copy_cls, reduce_cls) -> dict:
    from ..collectives import record_collectives

    torch.set_num_threads(1)
    xs, gs = _data(world_size, ROWS, D, seed=1), _data(world_size, ROWS, D, seed=2)
    out: dict = {}
    # f: the same x on every rank (what every rank holds before a column layer)
    x = xs[0].clone().requires_grad_(True)
    try:
        with record_collectives() as fwd:
            y = copy_cls.apply(x)
        out["f_y"] = y.detach().clone()
        out["f_fwd"] = _communicating(fwd)
        with record_collectives() as bwd:
            y.backward(gs[rank].clone())   # a copy: an in-place all-reduce is fine
        out["f_bwd"] = _communicating(bwd)
        out["f_grad"] = None if x.grad is None else x.grad.clone()
    except Exception as exc:
        out["f_error"] = _error(exc)
    # g: a different partial result on every rank (what a row layer's matmul gives)
    leaf = xs[rank].clone().requires_grad_(True)
    try:
        partial = leaf * 1.0
        with record_collectives() as fwd:
            z = reduce_cls.apply(partial)
        out["g_z"] = z.detach().clone()
        out["g_fwd"] = _communicating(fwd)
        with record_collectives() as bwd:
            z.backward(gs[rank].clone())
        out["g_bwd"] = _communicating(bwd)
        out["g_grad"] = None if leaf.grad is None else leaf.grad.clone()
    except Exception as exc:
        out["g_error"] = _error(exc)
    return out


@recorded
def check_conjugates(copy_cls, reduce_cls, f_communicates_in=None, g_communicates_in=None,
                     world_sizes=WORLD_SIZES, timeout: float | None = None) -> None:
    """Megatron's two operations, as ``torch.autograd.Function`` classes: ``copy_cls`` (f:
    identity forward, all-reduce backward) and ``reduce_cls`` (g: all-reduce forward, identity
    backward), applied with ``.apply(x)`` on 2 and 3 ranks. ``f_communicates_in`` and
    ``g_communicates_in`` are the learner's own diagnosis (:func:`check_diagnosis`): it must be
    right, and code whose collectives disagree with it is refused first."""
    __tracebackhide__ = True
    from .. import tensor_parallel as tp

    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    refuse_reference(copy_cls, "CopyToTPRegion", tp.CopyToTensorParallel, why=_OWN)
    refuse_reference(reduce_cls, "ReduceFromTPRegion", tp.ReduceFromTensorParallel, why=_OWN)
    for cls in (copy_cls, reduce_cls):
        if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
            fail(f"the check needs your classes themselves, subclasses of "
                 f"torch.autograd.Function, got {cls!r}.")
    declared = _declaration(f_communicates_in, g_communicates_in,
                            "pass them to this check")
    if _wrong_passes(declared):
        fail("your diagnosis (f_communicates_in, g_communicates_in) is not right yet: run "
             "lab11.check_diagnosis and read its sentence before checking the code.")
    _todo(copy_cls, reduce_cls)
    for n in world_sizes:
        outs = run_ranks(_conjugates_worker, n, copy_cls, reduce_cls, timeout=timeout,
                         hang=_HANG)
        _against_declaration(outs, copy_cls.__name__, reduce_cls.__name__, declared)
        _diagnose_conjugates(outs, n, copy_cls.__name__, reduce_cls.__name__)
    shown = " and ".join(map(str, world_sizes))
    passed(f"{copy_cls.__name__} and {reduce_cls.__name__} communicate where you declared, and "
           f"their outputs and gradients are the ones the plain layers need, on {shown} ranks")


# --------------------------------------------------------------------------------------------
# The column- and row-parallel layers
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The MLP
# --------------------------------------------------------------------------------------------


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
    ran = {n: run_ranks(normed_worker, n, mlp_cls, timeout=timeout, hang=_HANG)
           for n in world_sizes}
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


# --------------------------------------------------------------------------------------------
# Stretch: a GPipe stage and its bubble
# --------------------------------------------------------------------------------------------


class _DeviceTime(torch.autograd.Function):
    """Sleep ``s`` in the forward and 2·s in the backward: a stand-in for an accelerator."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        time.sleep(s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.s)
        return grad, None


class _Timed(nn.Module):
    def __init__(self, inner: nn.Module, s: float):
        super().__init__()
        self.inner, self.s = inner, s

    def forward(self, x):
        return _DeviceTime.apply(self.inner(x), self.s)


class _Handle:
    """A point-to-point request as the learner's code sees it, noting whether it was settled:
    waited on, or seen complete through ``is_completed()``."""

    def __init__(self, work, kind: str):
        self._work, self.kind, self.settled = work, kind, False

    def wait(self, *args, **kwargs):
        self.settled = True
        return self._work.wait(*args, **kwargs)

    def is_completed(self):
        done = self._work.is_completed()
        self.settled = self.settled or bool(done)
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


class _TrackP2P:
    """Within the block, every send and receive of a process group (``dist.send``/``recv``,
    ``isend``/``irecv`` and ``batch_isend_irecv`` all go through ``ProcessGroup.send``/``recv``)
    hands back a :class:`_Handle`; the blocking calls wait on theirs at once."""

    def __enter__(self):
        from torch._C._distributed_c10d import ProcessGroup

        self.handles, self._pg = [], ProcessGroup
        self._orig = {name: getattr(ProcessGroup, name) for name in ("send", "recv")}

        def wrap(name):
            orig = self._orig[name]

            def call(group, *args, **kwargs):
                handle = _Handle(orig(group, *args, **kwargs), name)
                self.handles.append(handle)
                return handle
            return call

        for name in self._orig:
            setattr(ProcessGroup, name, wrap(name))
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(self._pg, name, orig)
        return False

    def pending(self) -> dict:
        """How many sends and receives were never settled; waits on them, so that the
        neighbours get their messages and the run ends (the check then names the mistake)."""
        left = [h for h in self.handles if not h.settled]
        for h in left:
            h._work.wait()
        return {kind: sum(h.kind == kind for h in left) for kind in ("send", "recv")}


def _gpipe_worker(rank: int, world_size: int, step_fn, m: int, delay_s: float) -> dict:
    import torch.distributed as dist

    from .. import pipeline_parallel as pp

    torch.set_num_threads(1)
    stage = pp.split_stages(pp.make_mlp(_WIDTH, world_size, seed=12), world_size)[rank]
    module = _Timed(stage, delay_s) if delay_s else stage
    gen = torch.Generator().manual_seed(13)
    x, y = torch.randn(_BATCH, _WIDTH, generator=gen), torch.randn(_BATCH, _WIDTH, generator=gen)
    inputs = list(x.chunk(m)) if rank == 0 else None
    targets = list(y.chunk(m)) if rank == world_size - 1 else None
    stage.zero_grad(set_to_none=True)
    dist.barrier()
    # a rank that raises is not caught here: the launch stops every rank at once (its neighbour
    # would wait for its message forever) and _gpipe_failed names the mistake
    with _TrackP2P() as p2p:
        loss, events = step_fn(module, rank, world_size, m, inputs, targets, _mse,
                               (_BATCH // m, _WIDTH))
        pending = p2p.pending()
    return {"pending": pending, "loss": None if loss is None else float(loss),
            "events": [(str(k), int(i), float(s), float(e)) for k, i, s, e in events],
            "grads": [None if p.grad is None else p.grad.clone() for p in stage.parameters()]}


@recorded
def check_gpipe(step_fn, bubble_fn, stages=_STAGES, timeout: float | None = None) -> None:
    """Stretch: ``step_fn(module, rank, world_size, m, inputs, targets, loss_fn, shape)`` runs one
    GPipe step of this rank's stage (``module``, its part of the model) over send/recv and
    returns ``(loss, events)``; on 2 and 3 stages with 4 micro-batches its gradients must equal
    the unsplit model's on the whole batch, and its events must time the computation only (a
    stage's forward of micro-batch i starts after the previous stage's ended, its backward after
    the next stage's: each forward sleeps ``_CHECK_DELAY_S`` and each backward twice that, so a
    timer around a ``recv`` shows). ``bubble_fn(events, stages)`` must give the measured idle
    share of a timeline ``[(stage, kind, micro-batch, start, end)]``."""
    __tracebackhide__ = True
    from .. import pipeline_parallel as pp

    refuse_reference(step_fn, "gpipe_step", pp.run_stage, why=_OWN)
    refuse_reference(bubble_fn, "bubble", pp.measured_bubble, pp.ideal_bubble, why=_OWN)
    _todo(step_fn, bubble_fn)
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    _check_bubble_fn(bubble_fn)
    for k in stages:
        outs = run_ranks(_gpipe_worker, k, step_fn, _M, _CHECK_DELAY_S, timeout=timeout,
                         failed=_gpipe_failed,
                         hang="a stage waits for a message that never comes: every send needs "
                              "its recv on the neighbour, in the same order (forwards go to "
                              "rank + 1, gradients back to rank - 1).")
        _pending(outs)
        _diagnose_gpipe(outs, k, _M)
        _computation_only(outs, k, _M)
    passed(f"GPipe stage: gradients accumulated over {_M} micro-batches equal the unsplit "
           f"model's on {' and '.join(map(str, stages))} stages, events timing the computation "
           f"only; bubble measured as the idle share of the timeline")


def measure_bubble(step_fn, bubble_fn, stages: int = 2, micro=(1, 2, 4, 8),
                   delay_s: float = 0.01, timeout: float | None = None) -> None:
    """Run the learner's GPipe stage with each number of micro-batches in ``micro`` (each
    forward sleeps ``delay_s`` and each backward twice it, as an accelerator would compute
    without taking a CPU core), and print the bubble their ``bubble_fn`` measures beside
    (K−1)/(M+K−1), one row per M."""
    __tracebackhide__ = True
    from .. import pipeline_parallel as pp

    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    rows = []
    for m in micro:
        outs = run_ranks(_gpipe_worker, stages, step_fn, m, delay_s, timeout=timeout,
                         failed=_gpipe_failed, hang=_HANG)
        _pending(outs)
        _computation_only(outs, stages, m)
        events = [(rank, k, i, s, e) for rank, o in enumerate(outs) for k, i, s, e in o["events"]]
        rows.append((m, float(bubble_fn(events, stages)), pp.ideal_bubble(stages, m)))
    print(f"{'M':>3}  {'measured':>8}  {'(K-1)/(M+K-1)':>13}")
    for m, got, ideal in rows:
        print(f"{m:>3}  {got:>8.3f}  {ideal:>13.3f}")
    for m, got, ideal in rows:
        if got < ideal - _BELOW_IDEAL:
            fail(f"the measured bubble at M = {m} is {got:.3f}, below (K−1)/(M+K−1) = "
                 f"{ideal:.3f}, which no GPipe step with equal stages can beat (each stage idles while "
                 f"the pipeline fills and drains): your events count time that is not computation as "
                 f"busy.", fix="time the computation only.")
    above = sum(got >= ideal - _BELOW_IDEAL for _, got, ideal in rows)
    first, last = rows[0], rows[-1]
    print(f"measured ≥ formula (to {_BELOW_IDEAL}) in {above} of {len(rows)} rows; the measured "
          f"bubble went from {first[1]:.2f} at M = {first[0]} to {last[1]:.2f} at M = {last[0]}")
