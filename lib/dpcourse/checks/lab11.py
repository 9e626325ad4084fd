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
:mod:`dpcourse.checks._lab11_diagnose` (with the cases every check runs; the layers' and the
MLP's in :mod:`dpcourse.checks._lab11_layer_diagnosis`) and, for the stretch,
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

import torch

from . import check_timeout, fail, passed, recorded, refuse_reference, run_ranks
from ._lab11_common import DEFAULT_TIMEOUT, WORLD_SIZES, _HANG, _OWN, _communicating, _todo
from ._lab11_decisions import (SP_KEYS, SP_VALUES, _declaration, _wrong_passes, check_diagnosis,
                               check_sequence_parallel, check_split_decision)
from ._lab11_diagnose import (D, ODD_H, ROWS, _against_declaration, _data, _diagnose_conjugates,
                              _error)
from ._lab11_gpipe import check_gpipe, measure_bubble
from ._lab11_layers import BIAS_GRAD_CHOICES, check_column_parallel, check_row_parallel
from ._lab11_mlp import (check_normed_mlp, check_parameters_prediction, check_prediction,
                         check_tp_mlp, count_all_reduces, count_parameters)
from ._lab11_norm import NORM_CHOICES, SHIFT, check_normed, norm_budget, normed_worker, ring_bytes

__all__ = ["check_block_of", "check_diagnosis", "check_conjugates", "check_sequence_parallel",
           "check_split_decision", "SP_KEYS", "SP_VALUES",
           "check_column_parallel", "check_row_parallel",
           "check_tp_mlp", "count_parameters", "check_parameters_prediction",
           "count_all_reduces", "check_prediction", "check_gpipe", "BIAS_GRAD_CHOICES",
           "measure_bubble", "WORLD_SIZES", "DEFAULT_TIMEOUT", "check_normed_mlp", "NORM_CHOICES"]


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
