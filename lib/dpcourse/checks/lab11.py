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
  g communicates (``"forward"``, ``"backward"``, ``"both"`` or ``"neither"``) and says why in a
  sentence that must speak of the idea (broad word stems, :data:`WHY_WORDS`); a wrong pass is
  sent back with a question, never the answer. ``check_conjugates`` takes the same declaration
  and refuses code whose collectives disagree with it;
* ``check_conjugates``: ``f`` (copy to the tensor-parallel region: identity forward, all-reduce
  backward) and ``g`` (reduce from it: all-reduce forward, identity backward). Rank-dependent
  inputs and gradients tell apart: an all-reduce in f's forward, none in its backward, an
  average where a sum belongs, an all-reduce in g's backward, none in its forward, f and g
  swapped, a backward that returns nothing;
* ``check_split_decision``: before any code of part 3, the learner declares which dimension of
  ``linear.weight`` each layer cuts, with a reason (``why_dims``, :data:`WHY_DIM_WORDS`) that
  is judged before the numbers; a wrong dimension gets what it cuts and a way to find out
  (never the number, also on the second meeting), and a reason sent back with one choice is
  refused when it comes back arguing for the other. The layer checks take the declared
  dimension and refuse shards cut along another;
* ``check_column_parallel`` / ``check_row_parallel``: shards cut along the wrong dimension
  (also when the hidden block's bounds, applied to the other dimension, leave rank 0 the whole
  weight and the last rank nothing), the
  whole weight or bias kept, a block not offset by rank (or strided), an all-reduce in the
  column layer's forward or none in its backward, none in the row layer's forward or one in its
  backward, the row bias added on every rank before the sum, the bias scaled by 1/N, missing on
  some rank, averaged partial sums;
* ``check_tp_mlp``: the assembled MLP equals the plain one (outputs, the input's gradient, and
  each rank's weight and bias gradients against the matching slice of the plain MLP's: a
  detached or divided parameter is named) with exactly one all-reduce in the forward and one in
  the backward; a hidden size that the
  world size does not divide (16 on 3 ranks) is refused with a sentence naming both numbers,
  or handled (then it must equal the plain MLP too);
* ``count_parameters`` and ``check_parameters_prediction``: the learner predicts how many numbers
  rank 1 of 3 holds in its TPMLP's parameters (58 with the second bias whole on that rank, 52
  without it: its row-bias decision shows), then the count is measured and explained;
* ``count_all_reduces`` and ``check_prediction``: the learner predicts the all-reduces of one
  step of two stacked TP MLPs fed data (3: f's backward runs only where its input needs a
  gradient), then the count is measured and explained (:func:`dpcourse.checks.reveal`);
* ``check_gpipe`` (stretch): one GPipe step of the learner's stage on 2 and 3 stages, 4
  micro-batches, against the unsplit model: gradients not accumulated over the micro-batches
  (only the last one's left), each micro-batch's loss not divided by M, not GPipe's order, a
  received activation that does not require grad, events that time the wait for a message
  (a stage "computing" before its neighbour finished what it sends); and the learner's
  ``bubble(events, stages)`` against :func:`dpcourse.pipeline_parallel.measured_bubble` on
  timelines where the formula and the measurement differ. ``measure_bubble`` refuses the same
  timings, and a measured bubble below (K−1)/(M+K−1).

Every check refuses the library's own reference (``tensor_parallel.shard_bounds``,
``CopyToTensorParallel``, ``ColumnParallelLinear``, ``TensorParallelMLP``,
``pipeline_parallel.measured_bubble`` ...) passed as the learner's answer.

Accepted: ``torch.chunk``, ``narrow``, ``tensor_split`` or index arithmetic; the row layer's
bias added after the all-reduce on every rank, or before it on rank 0 only; ``x @ W.T`` or
``F.linear``; in-place or cloned all-reduces (Megatron-LM all-reduces in place; the lab leaves
it to the learner); any world size.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

from . import (check_timeout, fail, has_todo, passed, recorded, refuse_reference, reveal,
               run_ranks)

__all__ = ["check_block_of", "check_diagnosis", "check_conjugates", "check_split_decision", "check_column_parallel", "check_row_parallel",
           "check_tp_mlp", "count_parameters", "check_parameters_prediction",
           "count_all_reduces", "check_prediction", "check_gpipe",
           "measure_bubble", "WORLD_SIZES", "DEFAULT_TIMEOUT"]

WORLD_SIZES = (2, 3)
DEFAULT_TIMEOUT = 30.0
D, H, ROWS = 6, 12, 5            # input width, hidden width (2 and 3 divide it), batch rows
ODD_H = 16                       # a hidden size 3 does not divide
_RTOL, _ATOL = 1e-5, 1e-6

_OWN = "the lab asks you to write it, and the library's passes every check by construction"

_HANG = ("every rank must make the same collectives in the same order — an all_reduce that "
         "only some ranks reach (inside `if rank == 0:`, or in a backward that only some ranks "
         "run) leaves the others waiting.")


def _close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a, b, rtol=_RTOL, atol=_ATOL))


def _todo(*objs) -> None:
    for obj in objs:
        if has_todo(obj):
            raise NotImplementedError(f"{getattr(obj, '__name__', 'your code')} still raises "
                                      f"NotImplementedError: replace the TODO with your answer.")


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _communicating(log) -> int:
    return sum(1 for c in log if c.op != "barrier")


def _data(world_size: int, *shape, seed: int = 0) -> torch.Tensor:
    """world_size different tensors of ``shape``, the same on every rank (a generator, so the
    learner's code sees the global random state untouched)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(world_size, *shape, generator=gen)


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


PASSES = ("forward", "backward", "both", "neither")
# the right declaration (hidden from the lab's text; the check says whether the learner's is)
_RIGHT = {"f": "backward", "g": "forward"}
# what a "why" must speak of: every group needs one of its word stems. Broad on purpose (the
# learner's own words), but not a sentence that says nothing: the idea is that one side of
# each operation is held whole by every rank and the other only as a part that must be added up.
WHY_WORDS = (
    ("sum", "add", "partial", "part ", "parts", "part.", "part,", "piece", "share", "contribut",
     "term", "reduc", "total", "combin", "accumul", "only a", "subset", "fraction", "slice",
     "block", "shard", "+"),
    ("same", "whole", "full", "identical", "replic", "already", "every", "each", "all rank",
     "all the rank", "both rank", "copy", "copies", "local", "own", "everywhere", "duplicat",
     "entire", "complete", "one rank"),
)
# operation -> the question a wrong pass is sent back with (never the answer)
_LOOK_AGAIN = {
    "f": "ask, for each of f's two passes, whether one rank can compute on its own everything "
         "that pass must return: what does each rank hold of the column layer's input, and "
         "what of the gradient of that input?",
    "g": "ask, for each of g's two passes, whether one rank can compute on its own everything "
         "that pass must return: what does each rank hold of the row layer's output before g, "
         "and what of that output's gradient (everything after g runs the same on every rank)?",
}
_NAMES = {"f": "f_communicates_in", "g": "g_communicates_in"}


def _passes(fwd: int, bwd: int) -> str:
    return {(True, True): "both", (True, False): "forward", (False, True): "backward",
            (False, False): "neither"}[(bool(fwd), bool(bwd))]


def _declaration(f_communicates_in, g_communicates_in, where: str) -> dict:
    """The declaration, validated (values only); raises NotImplementedError when unwritten."""
    __tracebackhide__ = True
    declared = {"f": f_communicates_in, "g": g_communicates_in}
    if any(v is None or v is Ellipsis for v in declared.values()):
        raise NotImplementedError(f"write f_communicates_in and g_communicates_in first (part "
                                  f"2's diagnosis), then {where}.")
    for op, value in declared.items():
        if not isinstance(value, str) or value.strip().lower() not in PASSES:
            fail(f"{_NAMES[op]} should be one of {', '.join(map(repr, PASSES))}; got "
                 f"{value!r}.")
    return {op: v.strip().lower() for op, v in declared.items()}


def _wrong_passes(declared: dict) -> list:
    return [op for op in ("f", "g") if declared[op] != _RIGHT[op]]


@recorded
def check_diagnosis(f_communicates_in, g_communicates_in, why) -> None:
    """The learner's own diagnosis of part 2, before any code: in which pass f and in which pass
    g communicates (each ``"forward"``, ``"backward"``, ``"both"`` or ``"neither"``), and
    ``why``, a sentence that must speak of the idea (what each rank holds whole, and what only
    as a part that must be added up). A wrong pass is sent back with a question."""
    __tracebackhide__ = True
    if why is None or why is Ellipsis:
        raise NotImplementedError("write f_communicates_in, g_communicates_in and why first, "
                                  "then run this check.")
    declared = _declaration(f_communicates_in, g_communicates_in, "run this check")
    if not isinstance(why, str) or len(why.split()) < 5:
        fail(f"why should say in a sentence (five words or more) what makes the passes you "
             f"chose communicate; got {why!r}.")
    wrong = _wrong_passes(declared)
    if len(wrong) == 2:
        fail(f"Neither {_NAMES['f']} = {declared['f']!r} nor {_NAMES['g']} = "
             f"{declared['g']!r} is where the operation communicates. To find them, "
             f"{_LOOK_AGAIN['f']} Then the same for g.")
    if wrong:
        op = wrong[0]
        other = "g" if op == "f" else "f"
        fail(f"{_NAMES[other]} is right, but {_NAMES[op]} = {declared[op]!r} is not where {op} "
             f"communicates. To find it, {_LOOK_AGAIN[op]}")
    said = why.lower()
    if not all(any(word in said for word in group) for group in WHY_WORDS):
        fail(f"Both passes are right, but why does not say yet what makes them communicate "
             f"(\"{why.strip()[:80]}\").",
             fix="say what each rank holds whole and what it holds only as a part that the ranks "
                 "must add up, on each side of f and of g.")
    passed("your diagnosis: on each side of f and of g, one pass needs what every rank holds "
           "only as a part — a sum over the ranks — and the other has it whole on every rank "
           "already. Now write the code that does what you declared.")


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


def _against_declaration(outs: list, f_name: str, g_name: str, declared: dict) -> None:
    """Refuse code that does not communicate in the passes the learner declared."""
    __tracebackhide__ = True
    o = outs[-1]
    if any(k in o for k in ("f_error", "g_error")) or o["f_grad"] is None or o["g_grad"] is None:
        return                     # _diagnose_conjugates names the exception or the None
    f_does, g_does = _passes(o["f_fwd"], o["f_bwd"]), _passes(o["g_fwd"], o["g_bwd"])
    if f_does == declared["g"] and g_does == declared["f"] and f_does != g_does:
        fail(f"{f_name} communicates where you declared g does, and {g_name} where you "
             f"declared f does: f and g are swapped.",
             fix="f wraps the column layer's input, g the row layer's product.")
    for op, name, does in (("f", f_name, f_does), ("g", g_name, g_does)):
        if does != declared[op]:
            where = {"both": "in both passes", "neither": "in neither pass",
                     "forward": "in its forward only",
                     "backward": "in its backward only"}[does]
            fail(f"your {name} communicates {where}, but you declared {_NAMES[op]} = "
                 f"{declared[op]!r}: the code does not do what your own diagnosis says.")


def _diagnose_conjugates(outs: list, n: int, f_name: str, g_name: str) -> None:
    __tracebackhide__ = True
    xs, gs = _data(n, ROWS, D, seed=1), _data(n, ROWS, D, seed=2)
    x, g_sum = xs[0], gs.sum(0)
    for rank, o in enumerate(outs):
        if "f_error" in o:
            fail(f"{f_name} raised on rank {rank}: {o['f_error']}.",
                 fix="forward(ctx, x) returns a tensor of x's shape, backward(ctx, grad) returns the "
                     "gradient of x.")
        if "g_error" in o:
            fail(f"{g_name} raised on rank {rank}: {o['g_error']}.",
                 fix="forward(ctx, x) returns a tensor of x's shape, backward(ctx, grad) returns the "
                     "gradient of x.")
    o = outs[n - 1]
    rank = n - 1
    f_like_g = _close(o["f_y"], n * x) and _close(o["f_grad"], gs[rank])
    g_like_f = _close(o["g_z"], xs[rank]) and _close(o["g_grad"], g_sum)
    if f_like_g and g_like_f:
        fail(f"{f_name} and {g_name} are swapped: f wraps an input that every rank already "
             f"holds whole, g an output of which each rank holds only a part — each needs the "
             f"communication that its own position calls for.")
    # f's forward
    if _close(o["f_y"], n * x):
        fail(f"{f_name}'s forward all-reduces x: every rank already holds the same x, so the "
             f"sum is {n}·x where the column layer needs x itself.")
    if not _close(o["f_y"], x):
        fail(f"{f_name}'s forward changes x, but the column layer needs the x every rank "
             f"already holds.", fix="return x itself (the identity).")
    if o["f_fwd"]:
        fail(f"{f_name}'s forward makes {o['f_fwd']} collective call(s) and still returns x "
             f"(an all-reduce divided by the world size?): every rank already holds x, so that "
             f"pass has nothing to exchange.")
    # f's backward
    if o["f_grad"] is None:
        fail(f"x has no gradient after {f_name}'s backward: backward returned None.",
             fix="backward returns the gradient of x.")
    if _close(o["f_grad"], gs[rank]) or o["f_bwd"] == 0:
        fail(f"{f_name}'s backward returns this rank's gradient as it came: it holds only the "
             f"part of dL/dx that flows through this rank's block of the next layer, and x "
             f"reaches the loss through every rank's block.")
    if _close(o["f_grad"], g_sum / n):
        fail(f"{f_name}'s backward averages the gradients (divided by the world size), but dL/dx "
             f"is the SUM of the ranks' parts: it comes out {n} times too small.",
             fix="do not divide.")
    if not _close(o["f_grad"], g_sum):
        fail(f"{f_name}'s backward returns a gradient that is neither this rank's part of "
             f"dL/dx nor the whole of it (the sum of every rank's part).")
    # g's forward
    x_sum = xs.sum(0)
    if _close(o["g_z"], xs[rank]) or o["g_fwd"] == 0:
        fail(f"{g_name}'s forward returns its input unchanged: each rank holds only a partial "
             f"product, and the layer's output is all of them added up.")
    if _close(o["g_z"], x_sum / n):
        fail(f"{g_name}'s forward averages (divides by the world size), but a row-parallel "
             f"layer's partial products add up to the output: it comes out {n} times too small.",
             fix="sum them, do not divide.")
    if not _close(o["g_z"], x_sum):
        fail(f"{g_name}'s forward does not return the sum over the ranks of their inputs.")
    # g's backward
    if o["g_grad"] is None:
        fail(f"the input has no gradient after {g_name}'s backward: backward returned None.",
             fix="backward returns the gradient of its input.")
    if _close(o["g_grad"], g_sum) or o["g_bwd"]:
        fail(f"{g_name}'s backward all-reduces: the gradient of a sum reaches each term "
             f"unchanged, and every rank already holds it (what follows g runs the same on "
             f"every rank) — summing adds the other ranks' copies in.")
    if not _close(o["g_grad"], gs[rank]):
        fail(f"{g_name}'s backward changes the gradient, but the gradient of a sum reaches "
             f"each term unchanged.")


# --------------------------------------------------------------------------------------------
# Part 3's decision: which dimension of linear.weight each layer cuts, with a reason
# --------------------------------------------------------------------------------------------

# the right dimensions (hidden from the lab's text; the check says whether the learner's are)
_RIGHT_DIM = {"column": 0, "row": 1}
_DIM_NAMES = {"column": "column_weight_dim", "row": "row_weight_dim"}
# what a why_dims must speak of: the weight's output features, its input features, and how the
# weight is laid out or used (broad stems: the learner's own words, not an empty sentence)
WHY_DIM_WORDS = (
    ("out_features", "output", "out ", "out,", "(out", "out)", "outs"),
    ("in_features", "input", "(in", " in)", " in,", " in ", "ins "),
    ("shape", "row", "column", "dim", "layout", "index", "store", "transpos", ".t", "@",
     "linear(", "matmul", "multipl", "product", "size"),
)
# a why sent back with a wrong choice, by its words -> the choice it argued for
_whys_sent_back: dict = {}


def _why_key(why: str) -> str:
    return " ".join("".join(c if c.isalnum() else " " for c in why.lower()).split())


def _dim_declaration(column_weight_dim, row_weight_dim, where: str) -> dict:
    """The declared dimensions, validated (values only); NotImplementedError when unwritten."""
    __tracebackhide__ = True
    declared = {"column": column_weight_dim, "row": row_weight_dim}
    if any(v is None or v is Ellipsis for v in declared.values()):
        raise NotImplementedError(f"write column_weight_dim and row_weight_dim first (part 3's "
                                  f"decision), then {where}.")
    for kind, value in declared.items():
        if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, -1, -2):
            fail(f"{_DIM_NAMES[kind]} should be a dimension of the 2-D linear.weight (0 or 1); "
                 f"got {value!r}.")
    return {kind: value % 2 for kind, value in declared.items()}


@recorded
def check_split_decision(column_weight_dim, row_weight_dim, why_dims) -> None:
    """Part 3's decision, before any code: which dimension of ``linear.weight`` (0 or 1) each
    layer cuts, and ``why_dims``, a sentence that must speak of the weight's output features,
    its input features and its layout (:data:`WHY_DIM_WORDS`). The reason is judged first, so
    the dimensions cannot be found by trying; a wrong dimension is sent back with what it cuts
    and a way to find out, never the right number; and a reason sent back with one choice is
    refused when it comes back arguing for another."""
    __tracebackhide__ = True
    if why_dims is None or why_dims is Ellipsis:
        raise NotImplementedError("write column_weight_dim, row_weight_dim and why_dims first, "
                                  "then run this check.")
    declared = _dim_declaration(column_weight_dim, row_weight_dim, "run this check")
    if not isinstance(why_dims, str) or len(why_dims.split()) < 8:
        fail(f"why_dims should say in a sentence (eight words or more) how linear.weight is "
             f"laid out and what that makes each layer cut; got {why_dims!r}.")
    said = why_dims.lower()
    if not all(any(word in said for word in group) for group in WHY_DIM_WORDS):
        fail(f"why_dims (\"{why_dims.strip()[:80]}\") does not yet say how linear.weight holds "
             f"a layer's input and output features; the check judges your dimensions only "
             f"after the reason for them.",
             fix="say which of linear.weight's dimensions runs over out_features and which "
                 "over in_features, and which of them is the hidden size in each layer.")
    key, choice = _why_key(why_dims), (declared["column"], declared["row"])
    if key in _whys_sent_back and _whys_sent_back[key] != choice:
        was = _whys_sent_back[key]
        fail(f"you changed (column_weight_dim, row_weight_dim) from {was} to {choice}, but "
             f"why_dims is the same sentence that argued for {was}: a reason that led to the "
             f"wrong dimension cannot be the reason for another one — trying the other number "
             f"is not a decision.",
             fix="find in which order nn.Linear stores its features (print a layer's "
                 "weight.shape beside its in_features and out_features), then rewrite "
                 "why_dims from what you found.")
    wrong = [kind for kind in ("column", "row") if declared[kind] != _RIGHT_DIM[kind]]
    if wrong:
        _whys_sent_back[key] = choice
        kind = wrong[0]
        width, layer = (f"input features (the model's width, {D})", "Linear(6, 12)") \
            if kind == "column" else (f"output features (the model's width, {D})",
                                      "Linear(12, 6)")
        both = " (and so does row_weight_dim's)" if len(wrong) == 2 else ""
        fail(f"{_DIM_NAMES[kind]} = {declared[kind]} cuts the dimension of the {kind} layer's "
             f"{layer}.weight that runs over its {width}, which every rank keeps whole; only "
             f"the hidden features are split{both}. Your why_dims reasoned about the layout "
             f"of linear.weight, and that reasoning has a step that does not hold.",
             fix="check the step against torch: compare nn.Linear(6, 12).weight.shape with "
                 "in_features and out_features, and see which one F.linear multiplies x by "
                 "(the weight or its transpose); then rewrite why_dims.")
    passed("your decision: each layer cuts the dimension of linear.weight that runs over the "
           "hidden features, and you said why from the weight's layout. Now write the layers "
           "that cut it.")


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


def _layer_worker(rank: int, world_size: int, layer_cls, kind: str) -> dict:
    from ..collectives import record_collectives

    torch.set_num_threads(1)
    out: dict = {}
    full, x, grad_full = _layer_case(kind)
    if kind == "row":                # each rank is fed its block of the hidden features
        per = H // world_size
        x = x[:, rank * per:(rank + 1) * per]
    x = x.clone().requires_grad_(True)
    try:
        layer = layer_cls(copy.deepcopy(full), rank, world_size)
    except Exception as exc:
        return {"build_error": _error(exc)}
    out["shapes"] = _shapes(layer)
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
    return out


def _launch_layer(layer_cls, kind: str, weight_dim, world_sizes, timeout) -> None:
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
    for n in world_sizes:
        outs = run_ranks(_layer_worker, n, layer_cls, kind, timeout=timeout, hang=_HANG)
        full, x, upstream, y = _reference(kind)
        if weight_dim is not None:
            _against_dim(outs, n, layer_cls.__name__, full, kind, weight_dim % 2)
        _common_layer_failures(outs, n, layer_cls.__name__, full, kind)
        _block_failures(outs, n, layer_cls.__name__, full, 0 if kind == "column" else 1)
        diagnose = _diagnose_column if kind == "column" else _diagnose_row
        diagnose(outs, n, layer_cls.__name__, full, x, upstream, y)


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
           f"the matching block of the full layer's, on {shown} ranks")


@recorded
def check_row_parallel(layer_cls, weight_dim=None, world_sizes=WORLD_SIZES,
                       timeout: float | None = None) -> None:
    """``layer_cls(linear, rank, world_size)`` built from a full ``nn.Linear(12, 6)`` on 2 and
    3 ranks, fed each rank's block of the hidden features: every rank's output equals the full
    layer's, with one all-reduce in the forward and none in the backward; the bias counted
    once and given its whole gradient. ``weight_dim`` as in :func:`check_column_parallel`."""
    __tracebackhide__ = True
    _launch_layer(layer_cls, "row", weight_dim, world_sizes, timeout)
    shown = " and ".join(map(str, world_sizes))
    passed(f"{layer_cls.__name__}: every rank's output equals the full layer's, bias included, "
           f"and the input and parameter gradients are the matching blocks of the full "
           f"layer's, on {shown} ranks")


def _common_layer_failures(outs: list, n: int, name: str, full: nn.Linear, kind: str) -> None:
    __tracebackhide__ = True
    out_f, in_f = full.weight.shape
    per_out, per_in = out_f // n, in_f // n
    for rank, o in enumerate(outs):
        if "build_error" in o:
            fail(f"{name}(linear, {rank}, {n}) raised while being built: {o['build_error']}.")
    shapes = outs[0]["shapes"]
    right = (per_out, in_f) if kind == "column" else (out_f, per_in)
    hidden = out_f if kind == "column" else in_f
    hidden_per = hidden // n
    _wrong_dimension(outs, n, name, full, kind, right)
    if (out_f, in_f) in shapes:
        fail(f"{name} keeps the whole weight {(out_f, in_f)} on every rank, where each rank "
             f"needs only its block of the hidden features ({hidden_per} of {hidden}).")
    if kind == "column" and (out_f,) in shapes and (per_out,) not in shapes:
        fail(f"{name} keeps the whole bias ({out_f},) on every rank: a rank computes only its "
             f"block of the output features, and so needs only their biases.")
    if right not in shapes and right[::-1] not in shapes:
        fail(f"{name}'s parameters are {shapes}, none of them a block of the weight, so this "
             f"rank's block gets no gradient and is never trained.",
             fix="keep this rank's block as an nn.Parameter (a plain tensor gets no gradient).")
    for rank, o in enumerate(outs):
        if "forward_error" in o:
            fail(f"{name}'s forward raised on rank {rank}: {o['forward_error']}.")


def _wrong_dimension(outs: list, n: int, name: str, full: nn.Linear, kind: str,
                     right: tuple) -> None:
    """Both layers cut the hidden dimension (H features) and keep the model's width (D) whole:
    a weight whose H-sized dimension is whole while its D-sized one is cut on some rank was cut
    along the wrong dimension — also when rank 0 seems to keep "the whole weight" because the
    block bounds of H features, applied to the D-sized dimension, run past its end."""
    __tracebackhide__ = True
    out_f, in_f = full.weight.shape
    hidden, width = (out_f, in_f) if kind == "column" else (in_f, out_f)
    weights = [next((s for s in o["shapes"] if len(s) == 2), None) for o in outs]
    cut_wrong = [r for r, s in enumerate(weights)
                 if s is not None and hidden in s and min(s) < width and s != right[::-1]]
    if not cut_wrong:
        return
    which = ("output features (and every input feature)" if kind == "column"
             else "input features (and every output feature)")
    shown = ", ".join(f"rank {r}: {weights[r]}" for r in range(n))
    past_end = any(weights[r] == (out_f, in_f) for r in range(n))
    fail(f"{name} cut the weight along the wrong dimension (from linear.weight of shape "
         f"{(out_f, in_f)}, its shards are {shown}): the shards keep all {hidden} hidden "
         f"features and cut the model's width of {width}, but a {kind}-parallel layer keeps a "
         f"block of its {which}"
         + (f" — the bounds of a block of the {hidden} hidden features, applied to the "
            f"dimension of {width}, give some ranks all of it and others nothing" if past_end
            else "") + ".")


def _cut_dim(shape: tuple, full_shape: tuple, n: int):
    """The dimension of the full weight a rank's 2-D shard cut (stored either way round), or
    None when its shape is neither cut's."""
    out_f, in_f = full_shape
    for dim, cut in ((0, (out_f // n, in_f)), (1, (out_f, in_f // n))):
        if sorted(shape) == sorted(cut) and sorted(cut) != sorted(full_shape):
            return dim
    return None


def _against_dim(outs: list, n: int, name: str, full: nn.Linear, kind: str,
                 declared: int) -> None:
    """Refuse shards that cut another dimension of linear.weight than the learner declared."""
    __tracebackhide__ = True
    shape = tuple(full.weight.shape)
    for rank, o in enumerate(outs):
        weight = next((s for s in o.get("shapes", []) if len(s) == 2), None)
        cut = None if weight is None else _cut_dim(weight, shape, n)
        if cut is not None and cut != declared:
            fail(f"rank {rank}'s weight shard of {name} has shape {weight}, cut along "
                 f"dimension {cut} of linear.weight {shape}, but you declared "
                 f"{_DIM_NAMES[kind]} = {declared} (and said why): your code does not do what "
                 f"your own decision says.")


def _which_block(weight: torch.Tensor, full_weight: torch.Tensor, dim: int, n: int):
    """The rank whose contiguous block along ``dim`` this shard is, 'strided' or None."""
    per = full_weight.shape[dim] // n
    for s in range(n):
        if torch.equal(weight, full_weight.narrow(dim, s * per, per)):
            return s
    strided = [full_weight.index_select(dim, torch.arange(s, full_weight.shape[dim], n))
               for s in range(n)]
    if any(torch.equal(weight, t) for t in strided):
        return "strided"
    return None


def _block_failures(outs: list, n: int, name: str, full: nn.Linear, dim: int) -> None:
    __tracebackhide__ = True
    per = full.weight.shape[dim] // n
    for rank, o in enumerate(outs):
        shard = next((p for p in o["params"] if p.dim() == 2), None)
        s = _which_block(shard, full.weight.detach(), dim, n)
        if s is None and _which_block(shard.T, full.weight.detach(), dim, n) is not None:
            s = _which_block(shard.T, full.weight.detach(), dim, n)
            o["transposed"] = True     # stored as (in, out) for x @ W: a right variant
        what = "rows" if dim == 0 else "columns"
        if s == "strided":
            fail(f"rank {rank} of {name} took every {n}-th {what[:-1]} (a strided shard), so the "
                 f"next layer's block does not line up with it.",
                 fix=f"keep the contiguous block [rank × {per}, (rank + 1) × {per}), as Megatron does.")
        if isinstance(s, int) and s != rank:
            fail(f"rank {rank} of {name} kept the {what} of rank {s} ([{s * per}, "
                 f"{(s + 1) * per})), the block of another rank.",
                 fix=f"offset the block by the rank: rank r keeps [r × {per}, (r + 1) × {per}).")
        if s is None:
            fail(f"rank {rank}'s weight shard of {name} is not a block of the full layer's "
                 f"{what}.", fix=f"copy linear.weight's {what} [rank × {per}, (rank + 1) × {per}).")


def _weight_grads(o: dict) -> list:
    """The 2-D parameters' gradients, in torch's (out, in) layout."""
    grads = [g for p, g in zip(o["params"], o["grads"]) if p.dim() == 2 and g is not None]
    return [g.T for g in grads] if o.get("transposed") else grads


def _backward_ran(o: dict, rank: int, name: str, what: str) -> None:
    """What both layers' diagnoses check first after the forward: the backward ran, and reached
    the layer's input."""
    __tracebackhide__ = True
    if "backward_error" in o:
        fail(f"the backward through {name} raised on rank {rank}: {o['backward_error']}.")
    if o["x_grad"] is None:
        fail(f"{what} has no gradient after the backward through {name}: the forward cuts it "
             f"off from autograd (a detach, .data, or a backward that returns None).")


def _weight_grad_is(o: dict, rank: int, name: str, want: torch.Tensor, what: str,
                    per: int) -> None:
    """This rank's weight gradient is ``want``, the matching block of the full layer's."""
    __tracebackhide__ = True
    weights = _weight_grads(o)
    if not weights or not _close(weights[0], want):
        fail(f"the weight gradient of {name} on rank {rank} is not the full layer's {what} "
             f"[{rank * per}, {(rank + 1) * per}).")


def _diagnose_column(outs: list, n: int, name: str, full, x, grad_full, y_full) -> None:
    __tracebackhide__ = True
    per = H // n
    for rank, o in enumerate(outs):
        block = slice(rank * per, (rank + 1) * per)
        if o["y"].shape == y_full.shape:
            fail(f"{name} returns all {H} output features on rank {rank}: each rank returns "
                 f"only its block of {per} (the next, row-parallel layer takes that block) — "
                 f"no all-reduce or all-gather in the column layer's forward.")
        if o["fwd"]:
            fail(f"{name}'s forward makes {o['fwd']} collective call(s) on rank {rank}: the "
                 f"column layer's forward needs none — every rank already holds the same x, "
                 f"and its output stays split by rank (the all-reduce belongs in f's "
                 f"backward).")
        want = y_full.detach()[:, block]
        if not _close(o["y"], want):
            without_bias = want - full.bias.detach()[block]
            if _close(o["y"], without_bias):
                fail(f"{name}'s output on rank {rank} lacks the bias of its output features.")
            fail(f"{name}'s output on rank {rank} is not features [{rank * per}, "
                 f"{(rank + 1) * per}) of the full layer's output.")
        _backward_ran(o, rank, name, "x")
        partial = grad_full[:, block] @ full.weight.detach()[block]
        if _close(o["x_grad"], partial) or o["bwd"] == 0:
            fail(f"no communication in the backward of {name}: dL/dx on rank {rank} is only the "
                 f"part that flows through its own block of output features, and x reaches the "
                 f"loss through every rank's block.")
        if _close(o["x_grad"], x.grad / n):
            fail(f"{name}'s backward averages dL/dx over the ranks: it is the SUM of every "
                 f"block's part — do not divide by the world size.")
        if not _close(o["x_grad"], x.grad):
            summed = sum(grad_full[:, s * per:(s + 1) * per] for s in range(n))
            if _close(o["x_grad"], summed @ full.weight.detach()[block]):
                fail(f"{name} applies f to its output: its backward then sums the gradient of "
                     f"the output blocks (each rank's is different), where the sum the layer "
                     f"needs is that of dL/dx.")
            fail(f"dL/dx after {name}'s backward on rank {rank} is not the full layer's.")
        _weight_grad_is(o, rank, name, full.weight.grad[block], "rows", per)
        biases = [g for p, g in zip(o["params"], o["grads"]) if p.dim() == 1]
        if not biases or not _close(biases[0], full.bias.grad[block]):
            fail(f"the bias gradient of {name} on rank {rank} is not the full bias's block: the "
                 f"bias does not reach the output as a parameter of this rank's block.",
                 fix="keep the bias block as an nn.Parameter and add it in the forward.")


def _diagnose_row(outs: list, n: int, name: str, full, h_full, grad_full, y_full) -> None:
    __tracebackhide__ = True
    bias = full.bias.detach()
    per = H // n
    want = y_full.detach()
    for rank, o in enumerate(outs):
        if o["fwd"] == 0:
            fail(f"no communication in {name}'s forward: rank {rank}'s output is only its "
                 f"partial product (its block of the hidden features times its block of the "
                 f"weight), one term of the layer's output.")
        if _close(o["y"], want + (n - 1) * bias):
            fail(f"{name} adds the bias on every rank before the all-reduce, so the sum holds it "
                 f"{n} times where the output holds it once.")
        if _close(o["y"], (want - bias) / n + bias) or _close(o["y"], want / n):
            fail(f"{name} averages the partial products (divides by the world size), but they are "
                 f"parts of one matrix product: the output comes out {n} times too small.",
                 fix="sum them, do not divide.")
        if not _close(o["y"], want):
            if _close(o["y"], want - bias):
                fail(f"{name}'s output on rank {rank} lacks the bias: every rank's output is "
                     f"the full layer's, bias included.")
            hs = h_full.detach()
            summed = sum(hs[:, s * per:(s + 1) * per] for s in range(n))
            w_r = full.weight.detach()[:, rank * per:(rank + 1) * per]
            if _close(o["y"], summed @ w_r.T + bias) or _close(o["y"], summed @ w_r.T):
                fail(f"{name} applies g to its input, before the matmul: it sums the ranks' "
                     f"hidden blocks, which are different features, not parts of one sum.")
            fail(f"{name}'s output on rank {rank} is not the full layer's output.")
        _backward_ran(o, rank, name, "the hidden block")
        want_x = h_full.grad[:, rank * per:(rank + 1) * per]
        if _close(o["x_grad"], n * want_x) or o["bwd"]:
            fail(f"{name}'s backward all-reduces (it makes {o['bwd']} collective call(s) and "
                 f"dL/dh comes out {n} times too large): every rank already has the same dL/dy "
                 f"(its output is replicated), and the gradient of a sum reaches each partial "
                 f"product unchanged.")
        if not _close(o["x_grad"], want_x):
            fail(f"the gradient of the hidden block after {name}'s backward on rank {rank} is "
                 f"not the full layer's.")
        _weight_grad_is(o, rank, name, full.weight.grad[:, rank * per:(rank + 1) * per],
                        "columns", per)
    # the bias: wherever it lives, its gradient is the whole bias's
    holders = []
    for rank, o in enumerate(outs):
        for p, g in zip(o["params"], o["grads"]):
            if p.dim() != 1:
                continue
            if not torch.equal(p, bias) and torch.allclose(p, bias / n):
                fail(f"{name} keeps the bias divided by the world size on every rank: the "
                     f"output adds up right, but each copy gets 1/{n} of its gradient, so no "
                     f"rank's bias trains like the full layer's.")
            if g is None:
                continue
            if _close(g, full.bias.grad / n):
                fail(f"{name}'s bias gets 1/{n} of its gradient on rank {rank}: the bias is "
                     f"scaled by 1/N on its way into the output.")
            if not _close(g, full.bias.grad):
                fail(f"the bias gradient of {name} on rank {rank} is not the full layer's.")
            holders.append(rank)
    if not holders:
        fail(f"no rank's bias of {name} got a gradient: the bias never reaches the output as "
             f"a parameter.", fix="keep the bias as an nn.Parameter and add it in the forward.")


# --------------------------------------------------------------------------------------------
# The MLP
# --------------------------------------------------------------------------------------------


def _plain_mlp(hidden: int) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(9)
        return nn.Sequential(nn.Linear(D, hidden), nn.GELU(), nn.Linear(hidden, D))


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
    return {"y": y.detach().clone(), "x_grad": None if x.grad is None else x.grad.clone(),
            "fwd": [c.op for c in fwd if c.op != "barrier"],
            "bwd": [c.op for c in bwd if c.op != "barrier"],
            "params": [p.detach().clone() for p in mlp.parameters()],
            "grads": [None if p.grad is None else p.grad.clone() for p in mlp.parameters()]}


@recorded
def check_tp_mlp(mlp_cls, world_sizes=WORLD_SIZES, timeout: float | None = None) -> None:
    """``mlp_cls(plain, rank, world_size)`` from a plain ``Sequential(Linear(6, 12), GELU(),
    Linear(12, 6))`` on 2 and 3 ranks: the same output and dL/dx as the plain MLP, with one
    all-reduce forward and one backward; then hidden size 16 on 3 ranks, refused with a
    sentence naming both numbers, or handled."""
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
           f"bias gradient) on {shown} ranks, with one all-reduce in each pass; hidden size "
           f"{ODD_H} on 3 ranks {how}")


def _diagnose_mlp(outs: list, n: int, hidden: int, name: str, hint: str = "") -> None:
    __tracebackhide__ = True
    for rank, o in enumerate(outs):
        if "build_error" in o:
            fail(f"{name}(plain, {rank}, {n}) with hidden size {hidden} raised while being "
                 f"built: {o['build_error']}{hint}.")
        if "run_error" in o:
            fail(f"{name} on {n} ranks, hidden size {hidden}, raised on rank {rank}: "
                 f"{o['run_error']}{hint}.")
    plain = _plain_mlp(hidden)
    x = _data(1, ROWS, D, seed=10)[0].clone().requires_grad_(True)
    y = plain(x)
    y.backward(_data(1, ROWS, D, seed=11)[0])
    layers = " — check_column_parallel and check_row_parallel test its layers one by one"
    for rank, o in enumerate(outs):
        if not _close(o["y"], y.detach()):
            fail(f"{name}'s output on rank {rank} ({n} ranks, hidden size {hidden}) differs "
                 f"from the plain MLP's{hint or layers}.")
        if o["x_grad"] is None or not _close(o["x_grad"], x.grad):
            fail(f"dL/dx on rank {rank} ({n} ranks, hidden size {hidden}) differs from the "
                 f"plain MLP's{hint}.")
        if o["fwd"] != ["all_reduce"] or o["bwd"] != ["all_reduce"]:
            fail(f"{name} made {o['fwd'] or 'no collectives'} in the forward and "
                 f"{o['bwd'] or 'no collectives'} in the backward on rank {rank}: Megatron's MLP "
                 f"needs exactly one all-reduce in each (g's forward, f's backward).")
    _mlp_param_grads(outs, n, hidden, name, plain)


def _stacked_worker(rank: int, world_size: int, mlp_cls) -> dict:
    from ..collectives import record_collectives

    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(14)
        plains = [nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)) for _ in range(2)]
    model = nn.Sequential(*(mlp_cls(p, rank, world_size) for p in plains))
    x = _data(1, ROWS, D, seed=15)[0]            # data: it needs no gradient
    with record_collectives() as calls:
        model(x).square().mean().backward()
    return {"ops": [c.op for c in calls if c.op != "barrier"]}


def count_all_reduces(mlp_cls, world_size: int = 2, timeout: float | None = None) -> int:
    """The measurement behind lab 11's prediction: two of the learner's ``mlp_cls`` stacked
    (``nn.Sequential``), fed data that needs no gradient, one forward and one backward on
    ``world_size`` ranks; returns how many all-reduces rank 0 made (every rank makes the same)."""
    __tracebackhide__ = True
    if not isinstance(mlp_cls, type):
        fail(f"the measurement needs your class itself, got {type(mlp_cls).__name__}.")
    _todo(mlp_cls)
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    outs = run_ranks(_stacked_worker, world_size, mlp_cls, timeout=timeout, hang=_HANG)
    return sum(op == "all_reduce" for op in outs[0]["ops"])


def check_prediction(prediction, measured: int) -> None:
    """Compare the learner's prediction of the all-reduces in one step of two stacked TP MLPs
    fed data with :func:`count_all_reduces`' count, and say why it is what it is."""
    __tracebackhide__ = True
    value = getattr(prediction, "value", None)
    close = isinstance(value, (int, float)) and value == measured
    reveal(prediction, measured, close=close, explanation=(
        "In the forward each MLP's g sums its partial products: 2 all-reduces. In the backward "
        "autograd calls a Function's backward only when one of its inputs needs a gradient: "
        "the second MLP's f (its input comes out of the first MLP) all-reduces dL/dx; the "
        "first MLP's f does not, since its input is data — 3 in all. Put a layer with "
        "parameters below the first MLP and its f all-reduces too: 4."))


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
    b2 = None
    if mlp_cls is not None:
        try:
            mlp = mlp_cls(copy.deepcopy(plain), PARAMS_RANK, PARAMS_WORLD)
            held = [_match_param(p.detach(), plain) for p in mlp.parameters()]
            b2 = any(m is not None and m[0] == "b2" for m in held)
        except Exception:
            b2 = None
    if b2 is None:
        b2 = measured - blocks == D
    if b2:
        bias = (f"+ the whole second bias ({D}) = {blocks + D}: more than a third of the plain "
                f"MLP's {total}, because b₂ is kept whole on every rank that holds it")
    else:
        bias = (f"and no second bias (another rank holds it) = {blocks}: a third of the plain "
                f"MLP's weights and first bias")
    reveal(prediction, measured, close=close, explanation=(
        f"Rank {PARAMS_RANK} of {PARAMS_WORLD} keeps a {per} × {D} block of the first weight "
        f"({per * D}), the same {per} entries of the first bias, a {D} × {per} block of the "
        f"second weight ({per * D}) {bias}. The weights shrink by t, what is replicated does "
        f"not; in a transformer the weights are nearly all of it."))


_MLP_PARTS = {"w1": "the column layer's weight (plain[0].weight)",
              "b1": "the column layer's bias (plain[0].bias)",
              "w2": "the row layer's weight (plain[2].weight)",
              "b2": "the row layer's bias (plain[2].bias)"}


def _find_slice(p: torch.Tensor, full: torch.Tensor, dim: int):
    """The start of the contiguous block of ``full`` along ``dim`` equal to ``p``, or None."""
    if p.dim() != full.dim() or any(a != b for d, (a, b) in enumerate(zip(p.shape, full.shape))
                                    if d != dim):
        return None
    k = p.shape[dim]
    for s in range(full.shape[dim] - k + 1):
        if torch.equal(full.narrow(dim, s, k), p):
            return s
    return None


def _match_param(p: torch.Tensor, plain: nn.Sequential):
    """(part, dim, start, transposed) of the plain MLP's parameter this shard was cut from."""
    w1, b1 = plain[0].weight.detach(), plain[0].bias.detach()
    w2, b2 = plain[2].weight.detach(), plain[2].bias.detach()
    if p.dim() == 1:
        if torch.equal(p, b2):
            return "b2", 0, 0, False
        s = _find_slice(p, b1, 0)
        return None if s is None else ("b1", 0, s, False)
    if p.dim() != 2:
        return None
    for cand, transposed in ((p, False), (p.T, True)):
        for part, full, dim in (("w1", w1, 0), ("w2", w2, 1)):
            s = _find_slice(cand, full, dim)
            if s is not None:
                return part, dim, s, transposed
    return None


def _mlp_param_grads(outs: list, n: int, hidden: int, name: str, plain: nn.Sequential) -> None:
    """Each rank's shard's gradient against the same slice of the plain MLP's gradient."""
    __tracebackhide__ = True
    full_grads = {"w1": plain[0].weight.grad, "b1": plain[0].bias.grad,
                  "w2": plain[2].weight.grad, "b2": plain[2].bias.grad}
    b2_holders = []
    for rank, o in enumerate(outs):
        found = set()
        for p, g in zip(o["params"], o["grads"]):
            b2 = plain[2].bias.detach()
            if p.shape == b2.shape and not torch.equal(p, b2) and torch.allclose(p, b2 / n):
                fail(f"{name} keeps {_MLP_PARTS['b2']} divided by the world size on rank {rank}: the "
                     f"output adds up right, but each copy gets 1/{n} of its gradient.",
                     fix="keep the whole bias and add it once (after g, or before it on rank 0 only).")
            match = _match_param(p, plain)
            if match is None:
                continue
            part, dim, start, transposed = match
            found.add(part)
            what = _MLP_PARTS[part]
            if g is None and part == "b2":
                continue           # the bias added on rank 0 only: the others' copy is unused
            if g is None:
                fail(f"{what} on rank {rank} gets no gradient ({n} ranks, hidden size {hidden}): the "
                     f"forward uses it detached (or through .data).",
                     fix="use the nn.Parameter itself, so that autograd reaches it.")
            if transposed:
                g = g.T
            k = (p.T if transposed else p).shape[dim]
            want = full_grads[part].narrow(dim, start, k)
            if _close(g, want):
                if part == "b2":
                    b2_holders.append(rank)
                continue
            where = ("" if part == "b2" else
                     f" {'rows' if dim == 0 else 'columns'} [{start}, {start + k})")
            if _close(g, want / n):
                fail(f"the gradient of {what} on rank {rank} is 1/{n} of the plain MLP's{where} ({n} "
                     f"ranks, hidden size {hidden}): something divides it by the world size.",
                     fix="keep the whole bias and add it once, and sum (never average) in f and g.")
            if _close(g, want * n):
                fail(f"the gradient of {what} on rank {rank} is {n} times the plain MLP's{where} ({n} "
                     f"ranks, hidden size {hidden}): a gradient is summed over the ranks once too often.",
                     fix="g's backward is the identity.")
            fail(f"the gradient of {what} on rank {rank} differs from the plain MLP's{where} "
                 f"({n} ranks, hidden size {hidden}) although the output and dL/dx are right.")
        for part in ("w1", "b1", "w2"):
            if part not in found:
                fail(f"rank {rank} of {name} ({n} ranks, hidden size {hidden}) has no nn.Parameter "
                     f"that is a block of {_MLP_PARTS[part]}: a plain tensor, or a detached copy, gets no "
                     f"gradient and is never trained.",
                     fix="keep this rank's block as an nn.Parameter.")
    if not b2_holders:
        fail(f"no rank of {name} ({n} ranks, hidden size {hidden}) gives {_MLP_PARTS['b2']} a "
             f"gradient: the bias never reaches the output as a parameter.",
             fix="keep the whole bias as an nn.Parameter (on every rank, or on rank 0), use it "
                 "undetached, and add it once.")


# --------------------------------------------------------------------------------------------
# Stretch: a GPipe stage and its bubble
# --------------------------------------------------------------------------------------------

_STAGES = (2, 3)
_M = 4
_WIDTH, _BATCH = 8, 8
_CHECK_DELAY_S = 0.015   # "device time" of a forward in check_gpipe (a backward: twice)
_CLOCK_SLACK_S = 1e-4    # perf_counter is one clock for every process of the machine
_BELOW_IDEAL = 0.05      # how far a measured bubble may dip below (K−1)/(M+K−1) (uneven stages)


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


def _mse(out, target):
    return ((out - target) ** 2).mean()


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


def _micro_grads(world_size: int, m: int) -> tuple:
    """The reference gradients (whole batch), and each micro-batch's own loss's gradients."""
    from .. import pipeline_parallel as pp

    model = pp.make_mlp(_WIDTH, world_size, seed=12)
    gen = torch.Generator().manual_seed(13)
    x, y = torch.randn(_BATCH, _WIDTH, generator=gen), torch.randn(_BATCH, _WIDTH, generator=gen)
    loss, ref = pp.reference_step(model, x, y, _mse)
    each = [pp.reference_step(model, xm, ym, _mse)[1] for xm, ym in zip(x.chunk(m), y.chunk(m))]
    return loss, ref, each


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


def _pending(outs: list) -> None:
    """A stage that returns with a non-blocking send (or receive) never waited on: its message
    may not have left (or arrived) yet — the neighbour waits for it after this process has gone
    on, which shows as a deadlock (the worker settles them, so the check can name the cause)."""
    __tracebackhide__ = True
    for rank, o in enumerate(outs):
        sends, recvs = o["pending"]["send"], o["pending"]["recv"]
        if sends:
            fail(f"stage {rank} returned from gpipe_step with {sends} non-blocking send(s) still "
                 f"pending (an isend whose handle was never waited on): until its wait() returns, the "
                 f"message may not have left, and a process that goes on or ends leaves its neighbour "
                 f"waiting.", fix="wait on every send's handle before gpipe_step returns.")
        if recvs:
            fail(f"stage {rank} returned from gpipe_step with {recvs} non-blocking receive(s) "
                 f"never waited on (an irecv whose handle was never waited on): until its wait() "
                 f"returns, the tensor may not hold the message yet.",
                 fix="wait on a receive's handle before using what it receives.")


def _computation_only(outs: list, k: int, m: int) -> None:
    """A stage cannot start computing micro-batch i before its neighbour has finished computing
    what it sends (its activation forward, its gradient backward): an event that starts earlier
    timed the wait for the message (or the neighbour's timed its send)."""
    __tracebackhide__ = True
    at = {(s, kind, i): (a, b) for s, o in enumerate(outs) for kind, i, a, b in o["events"]}
    t0 = min(a for a, _ in at.values())
    for kind, neighbour, what in (("F", -1, "forward"), ("B", +1, "backward")):
        for s in range(k):
            if not 0 <= s + neighbour < k:
                continue
            for i in range(m):
                start, ready = at[(s, kind, i)][0], at[(s + neighbour, kind, i)][1]
                if start < ready - _CLOCK_SLACK_S:
                    needs = "activation" if kind == "F" else "gradient"
                    fail(f"stage {s}'s {what} of micro-batch {i} starts at "
                         f"{1e3 * (start - t0):.1f} ms, {1e3 * (ready - start):.1f} ms before "
                         f"stage {s + neighbour} finished computing the {needs} it needs "
                         f"({1e3 * (ready - t0):.1f} ms): the events time waiting for (or "
                         f"sending) a message, not only the computation.",
                         fix="take each start after the recv returns and each end before the send.")


def _check_bubble_fn(bubble_fn) -> None:
    __tracebackhide__ = True
    from .. import pipeline_parallel as pp

    cases = [pp.simulate_timeline(2, 4, "gpipe", 1.0, 2.0),
             pp.simulate_timeline(3, 2, "gpipe", 1.0, 3.0)]
    # a measured-looking one: stage 1's forwards are slow, and there are gaps
    slow = [(s, k, i, a * 1.3 + 0.1 * s, b * 1.3 + 0.1 * s + (0.4 if s == 1 else 0.0))
            for s, k, i, a, b in pp.simulate_timeline(2, 3, "gpipe", 1.0, 2.0)]
    cases.append(slow)
    for events in cases:
        k = len({e[0] for e in events})
        m = sum(1 for e in events if e[0] == 0 and e[1] == "F")
        want = pp.measured_bubble(events)
        try:
            got = float(bubble_fn(events, k))
        except Exception as exc:
            fail(f"bubble(events, {k}) raised {_error(exc)}.")
        if abs(got - want) <= 1e-9:
            continue
        if abs(got - pp.ideal_bubble(k, m)) <= 1e-9:
            fail(f"bubble() returns (K−1)/(M+K−1) = {got:.3f} whatever the timeline; this timeline "
                 f"idles {want:.3f} of the time.",
                 fix="measure it: 1 − (time spent computing, all stages) / (stages × the step's span).")
        busy = sum(e[4] - e[3] for e in events)
        span = max(e[4] for e in events) - min(e[3] for e in events)
        if abs(got - busy / (k * span)) <= 1e-9:
            fail(f"bubble() returns the busy share {got:.3f}, where the bubble is the idle share "
                 f"({want:.3f}).", fix="1 − the busy share.")
        own = sum(1 - sum(e[4] - e[3] for e in events if e[0] == s)
                  / (max(e[4] for e in events if e[0] == s)
                     - min(e[3] for e in events if e[0] == s)) for s in range(k)) / k
        if abs(got - own) <= 1e-9:
            fail(f"bubble() measures each stage against its own first and last action, but a stage "
                 f"idles from the step's start until its first input arrives, and after its last "
                 f"backward until the step ends: {got:.3f} where the idle share is {want:.3f}.",
                 fix="use the step's span (earliest start to latest end over all stages).")
        fail(f"bubble() gives {got:.4f} on a timeline whose idle share is {want:.4f}.",
             fix="1 − (time spent computing, summed over stages) / (stages × the step's span).")


def _gpipe_failed(exc) -> None:
    __tracebackhide__ = True
    if "NoneType" in exc.summary or "None" in exc.summary and "grad" in exc.summary:
        fail(f"stage {exc.rank} raised {exc.summary!r}: the tensor it received has no gradient "
             f"after the backward, so there is nothing to send back.",
             fix="call requires_grad_() on it after recv, so that the backward computes the gradient "
                 "to send back.")
    fail(f"stage {exc.rank} raised: {exc.summary}.")


def _diagnose_gpipe(outs: list, k: int, m: int) -> None:
    __tracebackhide__ = True
    loss, ref, each = _micro_grads(k, m)
    last = outs[-1]
    for rank, o in enumerate(outs):
        kinds = [e[0] for e in o["events"]]
        if sorted(kinds) != ["B"] * m + ["F"] * m or len(o["events"]) != 2 * m:
            fail(f"stage {rank} reported {len(o['events'])} events ({kinds}): one ('F', i, "
                 f"start, end) and one ('B', i, start, end) per micro-batch.")
        if kinds != ["F"] * m + ["B"] * m:
            fail(f"stage {rank} ran {kinds}: GPipe runs every forward first, then every "
                 f"backward (interleaving them is 1F1B — a fine schedule, but not this one).")
        if any(s > e for _, _, s, e in o["events"]):
            fail(f"stage {rank}'s events end before they start: (kind, micro-batch, start, end).")
        timed = sorted(o["events"], key=lambda ev: ev[2])
        if any(b[2] < a[3] for a, b in zip(timed, timed[1:])):
            fail(f"stage {rank}'s events overlap, but a stage computes one action at a time.",
                 fix="take start right before each computation and end right after it.")
    grads = [g for o in outs for g in o["grads"]]
    if any(g is None for g in grads):
        fail("a stage's parameters have no gradient after the step: a backward did not run "
             "through them.", fix="run the backward of every micro-batch (the last stage from its "
             "loss, the others from the gradient they receive).")
    if all(_close(g, r) for g, r in zip(grads, ref)):
        if last["loss"] is None or abs(last["loss"] - loss) > 1e-5 * max(1.0, abs(loss)):
            fail(f"the last stage returned loss {last['loss']}, but the batch's loss is "
                 f"{loss:.6f}.", fix="return the sum of the micro-batches' losses, each divided by M.")
        return
    if all(_close(g, m * r) for g, r in zip(grads, ref)):
        fail(f"the gradients are {m} times too large: the {m} micro-batches' losses were "
             f"summed, but the batch's loss is their mean.",
             fix=f"divide each micro-batch's loss by M = {m}.")
    for scale in (1.0 / m, 1.0):
        for i in (m - 1, 0):
            if all(_close(g, scale * r) for g, r in zip(grads, each[i])):
                fail(f"only micro-batch {i}'s gradient is left: the gradients were not "
                     f"accumulated over the micro-batches.",
                     fix="do not zero them (or replace .grad) between micro-batches; autograd adds each "
                         "backward into .grad.")
    fail("the stages' gradients differ from the unsplit model's on the whole batch: each "
         "micro-batch's loss divided by M, every backward adding into .grad.")


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
