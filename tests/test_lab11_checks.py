"""lab11's checks: every wrong answer fails with the sentence that names its mistake; every right
variant passes (other world sizes, torch.chunk / narrow / tensor_split, F.linear or x @ W.T, the
row bias after the all-reduce on every rank, before it on rank 0 only, or in blocks one per rank
before it, in-place all-reduces,
uneven blocks for a hidden size the world size does not divide).
"""

import functools
import re
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse import pipeline_parallel, tensor_parallel
from dpcourse.checks import LabCheckError, lab11, predict

from conftest import answers_in_one_launch, distinct_run, launches_replayed

cloudpickle.register_pickle_by_value(sys.modules[__name__])

T = 60  # generous: a loaded 2-core machine


# --- one launch per distinct run, replayed for the tests that repeat it -------------------------
# (as tests/test_lab06_checks.py does) A mistake met twice (the cause, then the fix on the second
# meeting), a prediction revealed on a run another test already made, the same right answer
# checked again with another argument of the check: each distinct run (worker, world size, its
# arguments: the learner's function or class itself, and the backend) is launched for real the
# first time, and a repeat gets what the ranks returned then (a copy), or the same
# RankFailedError. Everything after the launch — the check's judgement, its memory of the
# learner's mistakes, its sentence — runs again each time. A launch that timed out is never
# replayed, and answers built inside a test (new objects each time) always launch
# (conftest.launches_replayed, conftest.distinct_run).
@pytest.fixture(autouse=True, scope="module")
def _launch_each_run_once():
    with launches_replayed(distinct_run):
        yield


# --- each class's source read once -----------------------------------------------------------
# Every check looks for an unfilled TODO in the learner's class before it starts a rank
# (checks.has_todo, inspect.getsource). For a class, Python 3.11's inspect parses the whole file
# that defines it to find the class: in a notebook, a cell; here, this 2,000-line module, again at
# every check (about a tenth of a second each, 130 times). The source of this module's classes
# does not change while it runs, so each class's source is read once and reused (the same
# string); functions, and anything inspect cannot read, go to inspect as before.
@pytest.fixture(autouse=True, scope="module")
def _class_sources_read_once():
    import inspect

    read, sources = inspect.getsource, {}

    def getsource(obj):
        if not (isinstance(obj, type) and obj.__module__ == __name__):
            return read(obj)
        if obj not in sources:
            sources[obj] = read(obj)
        return sources[obj]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inspect, "getsource", getsource)
        yield


# --- several answers judged in one launch -------------------------------------------------------
# A launch is most of a test's cost here, and the answers are stateless: the groups in ONE_LAUNCH
# (at the end of this file) each run in one launch, and the check gets each answer's results
# (conftest.answers_in_one_launch says what still launches alone).
@pytest.fixture(autouse=True, scope="module")
def _answers_in_one_launch(_launch_each_run_once):
    with answers_in_one_launch(ONE_LAUNCH):
        yield


def fails(check, *args, match, **kwargs):
    with pytest.raises(LabCheckError, match=match) as info:
        check(*args, **kwargs)
    assert "\n" not in info.value.message.strip()
    return info.value.message


# --------------------------------------------------------------------------------------------
# block_of
# --------------------------------------------------------------------------------------------


def block_refuse(size, rank, world_size):
    if size % world_size:
        raise ValueError(f"{size} features do not split over {world_size} ranks")
    per = size // world_size
    return rank * per, (rank + 1) * per


def block_tensor_split(size, rank, world_size):
    # uneven blocks: the first size % world_size ranks get one more
    parts = torch.arange(size).tensor_split(world_size)
    return int(parts[rank][0]), int(parts[rank][-1]) + 1


def block_chunk(size, rank, world_size):
    parts = torch.arange(size).chunk(world_size)          # 16 on 3: 6, 6, 4
    return int(parts[rank][0]), int(parts[rank][-1]) + 1


@pytest.mark.parametrize("fn", [block_refuse, block_tensor_split, block_chunk])
def test_right_block_of_pass(fn, capsys):
    lab11.check_block_of(fn)
    assert capsys.readouterr().out.count("✔") == 1


def block_no_offset(size, rank, world_size):
    return 0, size // world_size


def block_one_short(size, rank, world_size):
    per = size // world_size
    return rank * per, rank * per + per - 1


def block_drops_remainder(size, rank, world_size):
    per = size // world_size
    return rank * per, (rank + 1) * per


def block_vague(size, rank, world_size):
    if size % world_size:
        raise ValueError("uneven split")
    per = size // world_size
    return rank * per, (rank + 1) * per


@pytest.mark.parametrize("fn,match", [
    (block_no_offset, r"gives \(0, 6\) to every rank: every rank keeps the same features"),
    (block_one_short, "one feature short"),
    (block_drops_remainder, "belong to no rank"),
    (block_vague, r"does not name both the size \(16\) and the world size \(3\)"),
])
def test_wrong_block_of_named(fn, match):
    message = fails(lab11.check_block_of, fn, match=match)
    assert "Run the check again" in message        # the first meeting: the cause only


def test_the_same_block_of_mistake_met_twice_adds_what_to_change():
    first = fails(lab11.check_block_of, block_no_offset, match="to every rank")
    assert "offset the block by the rank" not in first
    second = fails(lab11.check_block_of, block_no_offset, match="to every rank")
    assert "offset the block by the rank" in second


@pytest.mark.parametrize("check,answer", [
    (lab11.check_block_of, tensor_parallel.shard_bounds),
    (lab11.check_tp_mlp, tensor_parallel.TensorParallelMLP),
    (lab11.check_column_parallel, tensor_parallel.ColumnParallelLinear),
    (lab11.check_row_parallel, tensor_parallel.RowParallelLinear),
])
def test_the_librarys_own_answer_refused(check, answer):
    # refused before any rank starts, with why: the lab asks for the learner's own
    message = fails(check, answer, match="library's own reference answer")
    assert "lab asks you to write it" in message


def test_the_librarys_own_conjugates_and_bubble_refused():
    fails(lab11.check_conjugates, tensor_parallel.CopyToTensorParallel,
          tensor_parallel.ReduceFromTensorParallel, *DECLARED,
          match="library's own reference answer")
    fails(lab11.check_gpipe, gpipe, pipeline_parallel.measured_bubble,
          match="library's own reference answer")


# --------------------------------------------------------------------------------------------
# f and g
# --------------------------------------------------------------------------------------------


DECLARED = ("backward", "forward")   # the right diagnosis: f_communicates_in, g_communicates_in


def allsum(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def conj(name, forward, backward):
    """An autograd Function from two plain functions of a tensor."""
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(lambda ctx, x: forward(x)),
        "backward": staticmethod(lambda ctx, g: backward(g)),
    })


def ident(t):
    return t.clone()


def allmean(t):
    return allsum(t) / dist.get_world_size()


def inplace_sum(t):           # Megatron's way: all-reduce the tensor it was given
    dist.all_reduce(t)
    return t


Copy = conj("Copy", ident, allsum)
Reduce = conj("Reduce", allsum, ident)


class CopyViewAs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return inplace_sum(grad.contiguous())


class ReduceInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return inplace_sum(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


class ReduceInPlaceNoClone(torch.autograd.Function):
    """Megatron's _reduce: the partial product itself all-reduced and returned (the lab leaves
    the copy to the learner: nothing else holds the partial product)."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


RIGHT_CONJUGATES = [(Copy, Reduce), (CopyViewAs, ReduceInPlace), (CopyViewAs, ReduceInPlaceNoClone)]


@pytest.mark.parametrize("f,g", RIGHT_CONJUGATES)
def test_right_conjugates_pass(f, g, capsys):
    lab11.check_conjugates(f, g, *DECLARED, timeout=T)
    out = capsys.readouterr().out
    assert out.count("✔") == 1
    # the success line says what was verified, not which pass communicates
    assert "identity" not in out and "all-reduce" not in out


def test_right_conjugates_pass_on_four_ranks(capsys):
    lab11.check_conjugates(Copy, Reduce, "Backward", " forward", world_sizes=(4,), timeout=T)
    assert "✔" in capsys.readouterr().out


WRONG_CONJUGATES = [
    (conj("F", allsum, allsum), Reduce, "communicates in both passes, but you declared "
                                         "f_communicates_in = 'backward'"),
    (conj("F", allmean, allsum), Reduce, "communicates in both passes"),
    (conj("F", ident, ident), Reduce, "communicates in neither pass, but you declared "
                                      "f_communicates_in"),
    (conj("F", ident, allmean), Reduce, "backward averages"),
    (conj("F", ident, lambda g: None), Reduce, "no gradient"),
    (Copy, conj("G", ident, ident), "communicates in neither pass, but you declared "
                                    "g_communicates_in = 'forward'"),
    (Copy, conj("G", allmean, ident), "forward averages"),
    (Copy, conj("G", allsum, allsum), "communicates in both passes, but you declared "
                                      "g_communicates_in"),
    (conj("F", allsum, ident), Reduce, "in its forward only, but you declared"),
    (Reduce, Copy, "swapped"),
]


@pytest.mark.parametrize("f,g,match", WRONG_CONJUGATES)
def test_wrong_conjugates_named(f, g, match):
    fails(lab11.check_conjugates, f, g, *DECLARED, match=match, timeout=T)


# --- the learner's own diagnosis of f and g, before the code ---------------------------------

RIGHT_HELD = {"X": "whole", "dL/dX": "partial", "Y": "partial", "dL/dY": "whole"}


def held_for(f, g):
    """The whole/partial answers from which the pair (f, g) follows: partial in every pass
    that communicates."""
    talks = {"forward": {"forward"}, "backward": {"backward"}, "both": {"forward", "backward"},
             "neither": set()}
    return {"X": "partial" if "forward" in talks[f] else "whole",
            "dL/dX": "partial" if "backward" in talks[f] else "whole",
            "Y": "partial" if "forward" in talks[g] else "whole",
            "dL/dY": "partial" if "backward" in talks[g] else "whole"}


def test_a_right_diagnosis_passes(capsys):
    lab11.check_diagnosis("backward", "Forward",
                          {"X": "Whole", "dL/dX": "partial ", "Y": "PARTIAL", "dL/dY": "whole"})
    out = capsys.readouterr().out
    assert out.startswith("✔ your diagnosis") and out.count("✔") == 1


def test_the_learners_false_sentence_as_a_structured_answer_is_refused():
    # "X is partial on each rank so f sums it up" passed the keyword check of the last round;
    # as answers it is X partial with f in the forward: consistent, and wrong
    held = dict(RIGHT_HELD, X="partial")
    fails(lab11.check_diagnosis, "both", "forward", held, match=r"The pair .* is not right")
    # the same false answer with the right passes is named as the inconsistency it is
    message = fails(lab11.check_diagnosis, "backward", "forward", held,
                    match="Your passes do not follow from your own whole/partial answers: you "
                          "say X, the input f receives in the forward, is partial")
    assert "f_communicates_in = 'backward' makes no collective in the forward" in message


@pytest.mark.parametrize("key, f, g, phrase", [
    ("dL/dX", "neither", "forward", "you say dL/dX, the gradient f receives in the backward, "
                                    "is partial"),
    ("Y", "backward", "neither", "you say Y, the row layer's product g receives in the "
                                 "forward, is partial"),
    ("dL/dY", "backward", "forward", "you say dL/dY, the gradient g receives in the backward, "
                                     "is partial"),
])
def test_passes_that_contradict_the_learners_own_answers_are_named(key, f, g, phrase):
    held = dict(RIGHT_HELD, **{key: "partial"}) if key == "dL/dY" else RIGHT_HELD
    message = fails(lab11.check_diagnosis, f, g, held, match="do not follow from your own")
    assert phrase in message
    # the sentence restates the learner's own answer, never which value is right
    assert "is right" not in message and "should be" not in message


def test_a_whole_quantity_that_a_pass_all_reduces_is_named():
    message = fails(lab11.check_diagnosis, "both", "forward", RIGHT_HELD,
                    match="do not follow from your own")
    assert ("you say X, the input f receives in the forward, is whole — the same on every rank "
            "— yet f_communicates_in = 'both' all-reduces it in the forward") in message


def test_an_inconsistency_met_twice_adds_what_to_change():
    fails(lab11.check_diagnosis, "both", "forward", RIGHT_HELD, match="do not follow")
    message = fails(lab11.check_diagnosis, "both", "forward", RIGHT_HELD, match="do not follow")
    assert "communicates exactly in the pass whose quantity is partial" in message


WRONG_PAIRS = [("forward", "forward"), ("both", "forward"), ("backward", "backward"),
               ("backward", "neither"), ("forward", "backward"), ("neither", "neither")]


@pytest.mark.parametrize("f, g", WRONG_PAIRS)
def test_a_wrong_pair_is_sent_back_as_a_pair_with_what_it_implies(f, g):
    message = fails(lab11.check_diagnosis, f, g, held_for(f, g),
                    match=rf"The pair \(f_communicates_in = '{f}', g_communicates_in = '{g}'\) "
                          r"is not right")
    # what the pair would make of dL/dX (and X, Y), judged by the learner, never which one of
    # the two operations is wrong nor the right value
    assert "dL/dX" in message and "which of your whole/partial answers" in message
    assert message.rstrip().endswith(
        "(Run the check again after your change: if this same mistake comes back, the check "
        "will say what to change.)")
    tail = message.split(") is not right.")[1]
    for verdict in ("is right", "is not where", "'backward'", "'forward'", "f_communicates_in",
                    "g_communicates_in", "'whole'", "'partial'"):
        assert verdict not in tail


def test_a_wrong_pair_names_what_its_f_would_make_of_dl_dx():
    # f silent in the backward: dL/dX is only this rank's term; f in the forward: X combined
    message = fails(lab11.check_diagnosis, "forward", "forward", held_for("forward", "forward"),
                    match="is not right")
    assert "X would be combined over the ranks" in message
    assert "dL/dX on rank r would be its own term" in message
    message = fails(lab11.check_diagnosis, "both", "both", held_for("both", "both"),
                    match="is not right")
    assert "dL/dX would be the sum over the ranks" in message
    assert "dL/dY_r would be combined over the ranks" in message


def test_trying_the_values_learns_the_same_form_of_sentence_for_every_wrong_pair():
    # one right half and one wrong half read like two wrong halves: runs cannot sort out
    # which operation (or which answer) is right
    forms = set()
    for f, g in WRONG_PAIRS:
        message = fails(lab11.check_diagnosis, f, g, held_for(f, g), match="is not right")
        forms.add(message.split(") is not right.")[1].split(":")[0])
    assert len(forms) == 1


def test_an_inconsistency_is_named_before_a_wrong_pair():
    # wrong passes, and answers they do not follow from: the learner's own contradiction first
    fails(lab11.check_diagnosis, "forward", "backward", RIGHT_HELD,
          match="do not follow from your own whole/partial answers")


def test_a_wrong_pair_met_twice_adds_what_to_change():
    fails(lab11.check_diagnosis, "forward", "forward", held_for("forward", "forward"),
          match="is not right")
    message = fails(lab11.check_diagnosis, "neither", "both", held_for("neither", "both"),
                    match="is not right")
    assert "write ∂L/∂X and Y of the plain MLP as sums" in message


def test_a_second_wrong_pair_is_named_as_a_search():
    first = fails(lab11.check_diagnosis, "forward", "forward", held_for("forward", "forward"),
                  match="is not right")
    assert "diagnosis no." not in first
    # the same pair again is no search (the same mistake met twice)
    again = fails(lab11.check_diagnosis, "forward", "forward", held_for("forward", "forward"),
                  match="is not right")
    assert "diagnosis no." not in again
    message = fails(lab11.check_diagnosis, "both", "both", held_for("both", "both"),
                    match="is not right")
    assert ("This is your diagnosis no. 2; before it, (f 'forward', g 'forward') came back too: "
            "a new pair without a new reason is a search") in message


def test_a_right_diagnosis_after_wrong_pairs_says_how_it_was_reached(capsys):
    fails(lab11.check_diagnosis, "both", "both", held_for("both", "both"), match="is not right")
    fails(lab11.check_diagnosis, "neither", "forward", held_for("neither", "forward"),
          match="is not right")
    capsys.readouterr()
    lab11.check_diagnosis("backward", "forward", RIGHT_HELD)
    out = capsys.readouterr().out
    assert out.startswith("✔ your diagnosis")
    assert "(reached after 2 wrong pairs, the first (f 'both', g 'both'): say to yourself " \
           "which tensor that diagnosis took for whole on every rank, or for a part to sum" in out


def test_a_right_first_diagnosis_says_nothing_of_a_search(capsys):
    lab11.check_diagnosis("backward", "forward", RIGHT_HELD)
    assert "reached after" not in capsys.readouterr().out


RIGHT_SP = {"f forward": "all-gather", "f backward": "reduce-scatter",
            "g forward": "reduce-scatter", "g backward": "all-gather"}


def test_the_right_sequence_parallel_collectives_pass(capsys):
    lab11.check_sequence_parallel({k: v.upper() + " " for k, v in RIGHT_SP.items()})
    out = capsys.readouterr().out
    assert out.startswith("✔ sequence parallelism") and "reached after" not in out


@pytest.mark.parametrize("wrong, phrase", [
    # the first diagnosis's answer carried over unchanged (the recall answer)
    ({"f forward": "nothing", "f backward": "all-reduce", "g forward": "all-reduce",
      "g backward": "nothing"},
     "the column layer would multiply only this rank's share of the tokens; dL/dX would be the "
     "sum over the ranks of their terms, for every token; Y would be the sum of the ranks' "
     "partial products, for every token, on every rank; dL/dY_r would be the gradient of this "
     "rank's tokens only"),
    # the forwards right, the backwards copied from them (not turned around)
    (dict(RIGHT_SP, **{"f backward": "all-gather", "g backward": "reduce-scatter"}),
     "dL/dX would be the ranks' own terms stacked one after another"),
    # f and g swapped
    (dict(RIGHT_SP, **{"f forward": "reduce-scatter", "g forward": "all-gather"}),
     "the column layer would multiply a t-th of the ranks' token shares added together"),
])
def test_wrong_sequence_parallel_collectives_come_back_whole(wrong, phrase):
    message = fails(lab11.check_sequence_parallel, wrong, match="not all right")
    assert phrase in message
    # all four implications, right ones included, in the same form: never which is wrong
    assert message.count(" would ") == 4 and "Run the check again" in message
    for verdict in ("is right", "is wrong", "should be", "'all-gather'", "'reduce-scatter'"):
        assert verdict not in message
    second = fails(lab11.check_sequence_parallel, wrong, match="not all right")
    assert "the collective is what turns the one into the other" in second
    assert "answer no." not in second           # the same answer twice is no search


def test_a_changed_wrong_sequence_parallel_set_is_named_as_a_search(capsys):
    first = dict(RIGHT_SP, **{"f forward": "nothing"})
    fails(lab11.check_sequence_parallel, first, match="not all right")
    message = fails(lab11.check_sequence_parallel, dict(RIGHT_SP, **{"f forward": "all-reduce"}),
                    match="not all right")
    assert "This is your answer no. 2; 1 other set came back before it: a new set without a " \
           "new reason is a search" in message
    capsys.readouterr()
    lab11.check_sequence_parallel(RIGHT_SP)
    assert "(reached after 2 wrong sets)" in capsys.readouterr().out


@pytest.mark.parametrize("answer, phrase", [
    ("all-gather then reduce-scatter", "sp_collectives should be a dict with exactly the keys"),
    (dict(RIGHT_SP, **{"f forward": "gather"}),
     r"sp_collectives\['f forward'\] should be one of 'nothing', 'all-reduce'"),
    ({k: v for k, v in RIGHT_SP.items() if k != "g backward"}, "exactly the keys"),
])
def test_sequence_parallel_answers_that_are_not_four_collectives_are_refused(answer, phrase):
    fails(lab11.check_sequence_parallel, answer, match=phrase)


def test_unwritten_sequence_parallel_answers_are_a_todo():
    with pytest.raises(NotImplementedError, match="write sp_collectives first"):
        lab11.check_sequence_parallel(None)
    with pytest.raises(NotImplementedError, match=r"write sp_collectives\['g forward'\]"):
        lab11.check_sequence_parallel(dict(RIGHT_SP, **{"g forward": ...}))


@pytest.mark.parametrize("f, g, held, phrase", [
    ("up", "forward", RIGHT_HELD, "should be one of 'forward', 'backward', 'both', 'neither'"),
    ("backward", 1, RIGHT_HELD, "g_communicates_in should be one of"),
    ("backward", "forward", "x is whole and its gradient partial",
     "held should be a dict with exactly the keys 'X', 'dL/dX', 'Y', 'dL/dY'"),
    ("backward", "forward", {"X": "whole", "dX": "partial", "Y": "partial", "dY": "whole"},
     "held should be a dict with exactly the keys"),
    ("backward", "forward", dict(RIGHT_HELD, Y="summed"),
     "held\\['Y'\\] should be 'whole' \\(the same on every rank\\) or 'partial'"),
    ("backward", "forward", dict(RIGHT_HELD, X=True), "held\\['X'\\] should be 'whole'"),
])
def test_a_diagnosis_that_is_not_passes_and_answers_is_refused(f, g, held, phrase):
    fails(lab11.check_diagnosis, f, g, held, match=phrase)


def test_the_passes_alone_are_the_diagnosis_and_held_is_help_on_request(capsys):
    """Part 2 asks for the passes first; the whole/partial vocabulary is Hint 2's help. Without
    held a right pair passes, and a wrong one asks which tensor is only a part on each rank —
    never mentioning answers the learner did not give."""
    lab11.check_diagnosis("backward", "forward")
    assert "✔" in capsys.readouterr().out
    message = fails(lab11.check_diagnosis, "both", "both", match=r"The pair .* is not right")
    assert "which tensor does a rank hold only as a part the ranks must sum?" in message
    assert "whole/partial answers" not in message
    again = fails(lab11.check_diagnosis, "forward", "forward", match="is not right")
    assert "This is your diagnosis no. 2; before it, (f 'both', g 'both') came back too" in again
    with pytest.raises(NotImplementedError, match="write held\\['X'\\]"):
        lab11.check_diagnosis("backward", "forward", dict(RIGHT_HELD, X=None))


def test_an_unwritten_diagnosis_is_a_todo():
    with pytest.raises(NotImplementedError, match="write f_communicates_in"):
        lab11.check_diagnosis(None, "forward", RIGHT_HELD)
    with pytest.raises(NotImplementedError, match=r"write held\['Y'\]"):
        lab11.check_diagnosis("backward", "forward", dict(RIGHT_HELD, Y=...))
    with pytest.raises(NotImplementedError, match="write f_communicates_in and "
                                                  "g_communicates_in first"):
        lab11.check_conjugates(Copy, Reduce, timeout=T)


def test_the_code_check_refuses_a_wrong_diagnosis_before_running_the_code():
    # even right code: the learner's own diagnosis must be right first
    fails(lab11.check_conjugates, Copy, Reduce, "both", "forward",
          match="your diagnosis .* is not right yet: run lab11.check_diagnosis")


# --------------------------------------------------------------------------------------------
# The column-parallel layer
# --------------------------------------------------------------------------------------------


class Column(nn.Module):
    """Right: rows [r·per, (r+1)·per) of the weight and of the bias; f, then F.linear."""

    def __init__(self, linear, rank, world_size):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        w, b = self.shard(linear.weight.detach(), linear.bias.detach(), rank, world_size)
        self.weight, self.bias = nn.Parameter(w.clone()), nn.Parameter(b.clone())

    def shard(self, w, b, rank, n):
        per = w.shape[0] // n
        return w.narrow(0, rank * per, per), b.narrow(0, rank * per, per)

    def forward(self, x):
        return F.linear(Copy.apply(x), self.weight, self.bias)


class ColumnChunk(Column):
    def shard(self, w, b, rank, n):
        return w.chunk(n, dim=0)[rank], b.chunk(n)[rank]


class ColumnMatmul(Column):
    def forward(self, x):
        return Copy.apply(x) @ self.weight.t() + self.bias


class ColumnTransposed(nn.Module):
    """Right: the block stored as (in, out) for x @ W; the conjugates Megatron's way."""

    def __init__(self, linear, rank, world_size):
        super().__init__()
        per = linear.out_features // world_size
        self.w = nn.Parameter(linear.weight.detach().t()[:, rank * per:(rank + 1) * per].clone())
        self.b = nn.Parameter(linear.bias.detach()[rank * per:(rank + 1) * per].clone())

    def forward(self, x):
        return CopyViewAs.apply(x) @ self.w + self.b


class ColumnInnerLinear(nn.Module):
    """Right: an nn.Linear of the block inside, its parameters copied in."""

    def __init__(self, linear, rank, world_size):
        super().__init__()
        per = linear.out_features // world_size
        self.inner = nn.Linear(linear.in_features, per)
        with torch.no_grad():
            self.inner.weight.copy_(linear.weight[rank * per:(rank + 1) * per])
            self.inner.bias.copy_(linear.bias[rank * per:(rank + 1) * per])

    def forward(self, x):
        return self.inner(Copy.apply(x))


RIGHT_COLUMNS = [Column, ColumnChunk, ColumnMatmul, ColumnTransposed,
                 ColumnInnerLinear]


@pytest.mark.parametrize("cls", RIGHT_COLUMNS)
def test_right_column_pass(cls, capsys):
    # the other variants on 3 ranks only: a launch is the cost of these tests
    sizes = lab11.WORLD_SIZES if cls is Column else (3,)
    lab11.check_column_parallel(cls, world_sizes=sizes, timeout=T)
    assert capsys.readouterr().out.count("✔") == 1


class ColumnAllReduceForward(Column):
    def forward(self, x):
        return allsum(F.linear(Copy.apply(x), self.weight, self.bias))


class ColumnNoF(Column):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class ColumnWrongDim(Column):
    def shard(self, w, b, rank, n):
        per = w.shape[1] // n
        return w[:, rank * per:(rank + 1) * per], b


class ColumnWrongDimBounds(Column):
    # the bounds of the output features' block, on the input features' dimension: rank 0
    # keeps (12, 6), the whole weight, and rank 1 (12, 0)
    def shard(self, w, b, rank, n):
        per = w.shape[0] // n
        return w[:, rank * per:(rank + 1) * per], b[rank * per:(rank + 1) * per]


class ColumnNoOffset(Column):
    def shard(self, w, b, rank, n):
        return super().shard(w, b, 0, n)


class ColumnStrided(Column):
    def shard(self, w, b, rank, n):
        return w[rank::n], b[rank::n]


class ColumnWholeWeight(Column):
    def shard(self, w, b, rank, n):
        return w, b

    def forward(self, x):
        per = self.weight.shape[0] // self.world_size
        out = F.linear(Copy.apply(x), self.weight, self.bias)
        return out[:, self.rank * per:(self.rank + 1) * per]


class ColumnWholeBias(Column):
    def shard(self, w, b, rank, n):
        return super().shard(w, b, rank, n)[0], b


class ColumnNoBias(Column):
    def forward(self, x):
        return F.linear(Copy.apply(x), self.weight)


class ColumnAveragedBackward(Column):
    def forward(self, x):
        return F.linear(conj("F", ident, allmean).apply(x), self.weight, self.bias)


class ColumnFOnOutput(Column):
    def forward(self, x):
        return Copy.apply(F.linear(x, self.weight, self.bias))


class ColumnNoClone(Column):
    """nn.Parameter(linear.weight[s:e]) without a copy: right values, the whole weight kept."""

    def __init__(self, linear, rank, world_size):
        nn.Module.__init__(self)
        per = linear.out_features // world_size
        self.weight = nn.Parameter(linear.weight[rank * per:(rank + 1) * per])
        self.bias = nn.Parameter(linear.bias.detach()[rank * per:(rank + 1) * per].clone())


class ColumnBiasNoClone(Column):
    def __init__(self, linear, rank, world_size):
        super().__init__(linear, rank, world_size)
        per = linear.out_features // world_size
        self.bias = nn.Parameter(linear.bias.detach()[rank * per:(rank + 1) * per])


WRONG_COLUMNS = [
    (ColumnNoClone, r"keeps a parameter of shape \(\d, 6\) that shares its storage with the full "
                    r"layer's weight \(12, 6\) .*: all 72 numbers of it stay alive in your "
                    r"layer, of which this parameter uses \d+, so the full layer is kept"),
    (ColumnBiasNoClone, r"shape \(\d,\) that shares its storage with the full layer's bias "
                        r"\(12,\)"),
    (ColumnFOnOutput, "applies f to its output"),
    (ColumnAllReduceForward, "forward makes 1 collective"),
    (ColumnNoF, "no communication in the backward"),
    (ColumnWrongDim, "wrong dimension"),
    (ColumnWrongDimBounds, "wrong dimension .* give some ranks all of it and others nothing"),
    (ColumnNoOffset, "kept the rows of rank 0"),
    (ColumnStrided, "strided"),
    (ColumnWholeWeight, "keeps the whole weight"),
    (ColumnWholeBias, "whole bias"),
    (ColumnNoBias, "lacks the bias"),
    (ColumnAveragedBackward, "averages dL/dx"),
]


@pytest.mark.parametrize("cls,match", WRONG_COLUMNS)
def test_wrong_column_named(cls, match):
    fails(lab11.check_column_parallel, cls, match=match, timeout=T)


# --------------------------------------------------------------------------------------------
# Part 3's decision: which dimension of linear.weight each layer cuts, with a reason
# --------------------------------------------------------------------------------------------

SHAPE = (12, 6)          # nn.Linear(6, 12).weight.shape, as torch builds it
DENSE = (1, 0)           # the same layers as Keras Dense layers: kernel (in, out)


@pytest.mark.parametrize("col,row,shape", [(0, 1, SHAPE), (-2, -1, [12, 6]),
                                           (0, 1, nn.Linear(6, 12).weight.shape)])
def test_a_right_split_decision_passes(col, row, shape, capsys):
    lab11.check_split_decision(col, row, shape, DENSE)
    assert capsys.readouterr().out.startswith("✔ your decision")


@pytest.mark.parametrize("col,row", [(0, 1), (1, 0), (1, 1)])
def test_a_false_layout_claim_is_refused_whatever_the_dims(col, row):
    # "nn.Linear stores its weight as (in_features, out_features)": refused with the right
    # numbers too, since the numbers would rest on a layout torch does not build
    message = fails(lab11.check_split_decision, col, row, (6, 12), DENSE,
                    match=r"weight_shape = \(6, 12\) says nn.Linear\(6, 12\) stores its weight "
                          r"as \(in_features, out_features\), but that is not the weight torch "
                          r"builds")
    assert "column_weight_dim" not in message and "row_weight_dim" not in message
    second = fails(lab11.check_split_decision, col, row, (6, 12), DENSE,
                   match="that is not the weight")
    assert "print nn.Linear(6, 12).weight.shape" in second


def test_a_shape_no_linear_6_12_could_have_is_refused():
    fails(lab11.check_split_decision, 0, 1, (12, 12), DENSE,
          match=r"weight_shape = \(12, 12\) is not the shape of nn.Linear\(6, 12\).weight")


@pytest.mark.parametrize("col,row,phrase", [
    (1, 1, r"column_weight_dim = 1 cuts the dimension of the column layer's Linear\(6, "
           r"12\).weight that, in the layout you stated \(\(12, 6\) for Linear\(6, 12\)\), "
           r"runs over its input features"),
    (0, 0, r"row_weight_dim = 0 cuts the dimension of the row layer's Linear\(12, 6\).weight "
           r"that, in the layout you stated .* runs over its output features"),
    (1, 0, r"column_weight_dim = 1 .* keeps whole \(and row_weight_dim = 0 does the same in "
           r"the row layer\); only the hidden features are split"),
])
def test_a_wrong_dim_is_sent_back_with_its_cause_not_the_answer(col, row, phrase):
    first = fails(lab11.check_split_decision, col, row, SHAPE, DENSE, match=phrase)
    # the second meeting of the same mistake adds what to change: a way to find out, never
    # the dimension itself
    second = fails(lab11.check_split_decision, col, row, SHAPE, DENSE, match=phrase)
    assert "Run the check again" in first and "mark which of its two sizes" in second
    for answer in ("column_weight_dim = 0", "row_weight_dim = 1", "dimension 0", "dim 0",
                   "dimension 1", "dim 1", "first dimension", "second dimension"):
        assert answer not in first and answer not in second


def test_a_typo_in_the_dims_then_the_fix_passes():
    # the layout right and the numbers swapped (a typo): refused for the numbers only, and
    # the same layout with the numbers fixed passes (no memory of the first attempt)
    fails(lab11.check_split_decision, 1, 0, SHAPE, DENSE, match="column_weight_dim = 1")
    lab11.check_split_decision(0, 1, SHAPE, DENSE)


@pytest.mark.parametrize("dense,phrase", [
    ((0, 1), r"dense_dims puts the column layer's cut on dimension 0 of its kernel: the "
             r"Dense\(12\) on 6 inputs keeps a kernel of shape \(6, 12\), \(input features, "
             r"units\), whose dimension 0 runs over its inputs \(the model's width, 6\), which "
             r"every rank keeps whole \(and the row layer's entry does the same\); only the "
             r"hidden features are split. Your pair is your torch dimensions \(0, 1\) again"),
    ((1, 1), r"dense_dims puts the row layer's cut on dimension 1 of its kernel: the Dense\(6\) "
             r"on 12 inputs keeps a kernel of shape \(12, 6\).* runs over its units \(the "
             r"model's width, 6\)"),
    ((0, 0), r"the column layer's cut on dimension 0"),
])
def test_a_wrong_keras_pair_is_named_by_what_it_cuts(dense, phrase):
    # the torch answer copied into Keras's layout (the recall answer), or half of it
    first = fails(lab11.check_split_decision, 0, 1, SHAPE, dense, match=phrase)
    assert "Run the check again" in first
    if dense != (0, 1):
        assert "torch dimensions" not in first
    second = fails(lab11.check_split_decision, 0, 1, SHAPE, dense, match=phrase)
    assert "write the" in second and "kernel shape as Keras builds it" in second


@pytest.mark.parametrize("dense", [(1, 0), [-1, -2]])
def test_a_right_keras_pair_passes(dense, capsys):
    lab11.check_split_decision(0, 1, SHAPE, dense)
    assert "in torch's layout and in Keras's" in capsys.readouterr().out


@pytest.mark.parametrize("dense", [(1,), (1, 2), "1, 0", (True, 0)])
def test_a_keras_pair_that_is_not_two_dims_is_refused(dense):
    fails(lab11.check_split_decision, 0, 1, SHAPE, dense,
          match="dense_dims should be a pair \\(column, row\\)")


@pytest.mark.parametrize("col,row,shape,phrase", [
    (2, 1, SHAPE, "column_weight_dim should be a dimension"),
    (0, True, SHAPE, "row_weight_dim should be a dimension"),
    (0, 1, "(12, 6)", "weight_shape should be the shape you expect"),
    (0, 1, (12.0, 6), "weight_shape should be the shape you expect"),
])
def test_a_split_decision_that_is_not_dims_and_a_shape_is_refused(col, row, shape, phrase):
    fails(lab11.check_split_decision, col, row, shape, DENSE, match=phrase)


def test_an_unwritten_split_decision_is_a_todo():
    with pytest.raises(NotImplementedError, match="write column_weight_dim"):
        lab11.check_split_decision(None, 1, SHAPE, DENSE)
    with pytest.raises(NotImplementedError, match="write weight_shape"):
        lab11.check_split_decision(0, 1, None, DENSE)
    with pytest.raises(NotImplementedError, match="write dense_dims too"):
        lab11.check_split_decision(0, 1, SHAPE)


def test_the_layer_checks_refuse_a_wrong_decision_before_running_the_code():
    fails(lab11.check_column_parallel, Column, 1,
          match=r"your decision \(column_weight_dim = 1\) is not right yet")
    fails(lab11.check_row_parallel, Row, 0,
          match=r"your decision \(row_weight_dim = 0\) is not right yet")


def test_code_that_cuts_another_dim_than_declared_is_refused():
    message = fails(lab11.check_column_parallel, ColumnWrongDim, 0, world_sizes=(2,),
                    timeout=T, match=r"cut along dimension 1 of linear.weight \(12, 6\), but you "
                                     r"declared column_weight_dim = 0")
    assert "does not do what your own decision says" in message


def test_right_layers_with_the_decision_pass(capsys):
    lab11.check_column_parallel(Column, 0, world_sizes=(3,), timeout=T)
    lab11.check_row_parallel(Row, 1, world_sizes=(3,), timeout=T)
    assert capsys.readouterr().out.count("✔") == 2


# --------------------------------------------------------------------------------------------
# The row-parallel layer
# --------------------------------------------------------------------------------------------


class Row(nn.Module):
    """Right: columns [r·per, (r+1)·per) of the weight, the whole bias, added after g."""

    def __init__(self, linear, rank, world_size):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        w = linear.weight.detach()
        per = w.shape[1] // world_size
        self.weight = nn.Parameter(self.shard(w, rank, world_size).clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())
        self.per = per

    def shard(self, w, rank, n):
        per = w.shape[1] // n
        return w.narrow(1, rank * per, per)

    def forward(self, h):
        return Reduce.apply(F.linear(h, self.weight)) + self.bias


class RowBiasOnRankZero(Row):
    def __init__(self, linear, rank, world_size):
        super().__init__(linear, rank, world_size)
        if rank != 0:
            self.bias = None

    def forward(self, h):
        part = F.linear(h, self.weight, self.bias)
        return Reduce.apply(part)


class RowChunk(Row):
    def shard(self, w, rank, n):
        return w.chunk(n, dim=1)[rank]


class RowTransposedBiasOnRankZero(nn.Module):
    """Right: the block stored as (in, out); the bias held and added before g, on rank 0
    only."""

    def __init__(self, linear, rank, world_size):
        super().__init__()
        per = linear.in_features // world_size
        self.w = nn.Parameter(linear.weight.detach().t()[rank * per:(rank + 1) * per].clone())
        self.b = nn.Parameter(linear.bias.detach().clone()) if rank == 0 else None
        self.rank = rank

    def forward(self, h):
        part = h @ self.w
        return ReduceInPlace.apply(part + self.b if self.rank == 0 else part)


class RowBiasHeldEverywhereAddedOnRankZero(Row):
    """Wrong (a learner's): every rank holds the whole bias, rank 0 adds it before g; the
    others' copy gets no gradient, a dead parameter."""

    def forward(self, h):
        part = F.linear(h, self.weight)
        return Reduce.apply(part + self.bias if self.rank == 0 else part)


class RowTransposedBiasEverywhereAddedOnRankZero(RowTransposedBiasOnRankZero):
    def __init__(self, linear, rank, world_size):
        super().__init__(linear, rank, world_size)
        self.b = nn.Parameter(linear.bias.detach().clone())


class RowInPlaceNoClone(Row):
    def forward(self, h):
        return ReduceInPlaceNoClone.apply(F.linear(h, self.weight)) + self.bias


class RowNoClone(Row):
    """The weight's columns as a view, and the full layer's bias itself: the full layer kept."""

    def __init__(self, linear, rank, world_size):
        super().__init__(linear, rank, world_size)
        per = linear.in_features // world_size
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * per:(rank + 1) * per])


class RowBiasAliased(Row):
    def __init__(self, linear, rank, world_size):
        super().__init__(linear, rank, world_size)
        self.bias = linear.bias


def test_row_parameters_sharing_the_full_layers_storage_are_named():
    fails(lab11.check_row_parallel, RowNoClone, world_sizes=(2,), timeout=T,
          match=r"shares its storage with the full layer's weight \(6, 12\) .*all 72 numbers")
    fails(lab11.check_row_parallel, RowBiasAliased, world_sizes=(2,), timeout=T,
          match=r"shares its storage with the full layer's bias \(6,\) .*the full layer's "
                r"tensor itself stays in your layer")
    message = fails(lab11.check_row_parallel, RowNoClone, world_sizes=(2,), timeout=T,
                    match="shares its storage")
    assert "copy the block (.clone())" in message


class RowBiasBlocks(Row):
    """Right: the bias in blocks of its output features, one per rank, each added (padded to
    the output's width) to the rank's partial product before g."""

    def __init__(self, linear, rank, world_size):
        super().__init__(linear, rank, world_size)
        per = linear.out_features // world_size
        self.lo, self.hi = rank * per, (rank + 1) * per
        self.bias = nn.Parameter(linear.bias.detach()[self.lo:self.hi].clone())

    def forward(self, h):
        part = F.linear(h, self.weight)
        return Reduce.apply(part + F.pad(self.bias, (self.lo, part.shape[-1] - self.hi)))


class RowBiasPlaceholder(Row):
    """Wrong (a learner's, accepted before): rank 0 holds the bias, every other rank a bias of
    zeros, each added before g. One forward and backward are right; each copy gets the whole
    dL/db, so one SGD step moves the sum's bias world_size times."""

    def __init__(self, linear, rank, world_size):
        super().__init__(linear, rank, world_size)
        if rank != 0:
            self.bias = nn.Parameter(torch.zeros_like(self.bias))

    def forward(self, h):
        return Reduce.apply(F.linear(h, self.weight, self.bias))


def test_a_zero_placeholder_bias_is_named_by_what_training_does_to_it():
    message = fails(lab11.check_row_parallel, RowBiasPlaceholder, timeout=T,
                    match=r"after one SGD step \(lr 0\.1\) of each rank's own parameters, "
                          r"RowBiasPlaceholder's output on rank 0 holds the bias's step 2 "
                          r"times, where the full layer's holds it once")
    assert "rank 1 holds a bias of zeros" in message
    assert "each of them gets the whole dL/db" in message
    assert "hold the row bias's numbers once" not in message       # the cause only, first
    message = fails(lab11.check_row_parallel, RowBiasPlaceholder, world_sizes=(3,), timeout=T,
                    match="holds the bias's step 3 times")
    assert "ranks 1, 2 hold a bias of zeros" in message
    assert "hold the row bias's numbers once over the ranks" in message   # met again: the fix
    fails(lab11.check_tp_mlp, mlp_of(Column, RowBiasPlaceholder), world_sizes=(2,), timeout=T,
          match=r"output on rank 0 holds the bias's step 2 times, where the full MLP's")


@pytest.mark.parametrize("row,choice,phrase", [
    (Row, 0, "copies stay equal because every rank computes the same thing"),
    (RowBiasOnRankZero, 4, "rank 1 has nothing to train"),
    (RowBiasBlocks, 1, "Rank 1 holds features [2, 4) of b"),
])
def test_the_bias_gradient_prediction_is_measured_with_the_learners_design(row, choice, phrase,
                                                                            capsys):
    right = lab11.BIAS_GRAD_CHOICES[choice]
    wrong = lab11.BIAS_GRAD_CHOICES[2]
    guess = predict("lab11", "rank 1's row-bias gradient", wrong,
                    choices=lab11.BIAS_GRAD_CHOICES)
    lab11.check_row_parallel(row, world_sizes=(3,), timeout=T, bias_prediction=guess)
    out = " ".join(capsys.readouterr().out.split())
    assert f"measured: {right} — not what happened." in out and phrase in out
    guess = predict("lab11", f"rank 1's row-bias gradient, {row.__name__}", right,
                    choices=lab11.BIAS_GRAD_CHOICES)
    lab11.check_row_parallel(row, world_sizes=(3,), timeout=T, bias_prediction=guess)
    assert f"measured: {right} — right." in " ".join(capsys.readouterr().out.split())


def test_the_bias_prediction_needs_three_ranks():
    guess = predict("lab11", "q", lab11.BIAS_GRAD_CHOICES[0], choices=lab11.BIAS_GRAD_CHOICES)
    with pytest.raises(ValueError, match="world_sizes must include 3"):
        lab11.check_row_parallel(Row, world_sizes=(2,), timeout=T, bias_prediction=guess)


RIGHT_ROWS = [Row, RowBiasOnRankZero, RowChunk, RowTransposedBiasOnRankZero,
              RowInPlaceNoClone, RowBiasBlocks]


@pytest.mark.parametrize("cls", RIGHT_ROWS)
def test_right_row_pass(cls, capsys):
    sizes = lab11.WORLD_SIZES if cls is Row else (3,)
    lab11.check_row_parallel(cls, world_sizes=sizes, timeout=T)
    assert capsys.readouterr().out.count("✔") == 1


def test_right_row_pass_on_four_ranks(capsys):
    lab11.check_row_parallel(Row, world_sizes=(4,), timeout=T)
    assert "✔" in capsys.readouterr().out


class RowNoReduce(Row):
    def forward(self, h):
        return F.linear(h, self.weight) + self.bias


class RowBiasEveryRank(Row):
    def forward(self, h):
        return Reduce.apply(F.linear(h, self.weight, self.bias))


class RowBiasScaled(Row):
    def forward(self, h):
        return Reduce.apply(F.linear(h, self.weight) + self.bias / self.world_size)


class RowBiasStoredScaled(Row):
    def __init__(self, linear, rank, world_size):
        super().__init__(linear, rank, world_size)
        self.bias = nn.Parameter(linear.bias.detach() / world_size)

    def forward(self, h):
        return Reduce.apply(F.linear(h, self.weight, self.bias))


class RowBackwardAllReduce(Row):
    def forward(self, h):
        return conj("G", allsum, allsum).apply(F.linear(h, self.weight)) + self.bias


class RowWrongDim(Row):
    def shard(self, w, rank, n):
        per = w.shape[0] // n
        return w[rank * per:(rank + 1) * per]


class RowWrongDimBounds(Row):
    # the input features' block bounds on dim 0 (6 rows): rank 0 keeps all, rank 1 none
    def shard(self, w, rank, n):
        per = w.shape[1] // n
        return w[rank * per:(rank + 1) * per]


class RowNoOffset(Row):
    def shard(self, w, rank, n):
        return super().shard(w, 0, n)


class RowAveraged(Row):
    def forward(self, h):
        return conj("G", allmean, ident).apply(F.linear(h, self.weight)) + self.bias


class RowBiasAfterOnRankZeroOnly(Row):
    def forward(self, h):
        out = Reduce.apply(F.linear(h, self.weight))
        return out + self.bias if self.rank == 0 else out


class RowGOnInput(Row):
    def forward(self, h):
        return F.linear(Reduce.apply(h), self.weight) + self.bias


WRONG_ROWS = [
    (RowGOnInput, "applies g to its input"),
    (RowNoReduce, "no communication in RowNoReduce.s forward"),
    (RowBiasEveryRank, "adds the bias on every rank before the all-reduce"),
    (RowBiasScaled, "1/2 of its gradient"),
    (RowBiasStoredScaled, "divided by the world size.* the whole dL/db .* moves 2 times as far"),
    (RowBackwardAllReduce, "backward all-reduces"),
    (RowWrongDim, "wrong dimension"),
    (RowWrongDimBounds, "wrong dimension .* give some ranks all of it and others nothing"),
    (RowNoOffset, "kept the columns of rank 0"),
    (RowAveraged, "averages the partial products"),
    (RowBiasAfterOnRankZeroOnly, "rank 1 lacks the bias"),
]


@pytest.mark.parametrize("cls,match", WRONG_ROWS)
def test_wrong_row_named(cls, match):
    fails(lab11.check_row_parallel, cls, match=match, timeout=T)


# --------------------------------------------------------------------------------------------
# The MLP
# --------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, plain, rank, world_size):
        super().__init__()
        if plain[0].out_features % world_size:
            raise ValueError(f"hidden size {plain[0].out_features} is not divisible by "
                             f"{world_size} ranks")
        self.up = Column(plain[0], rank, world_size)
        self.act = plain[1]
        self.down = Row(plain[2], rank, world_size)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class UnevenColumn(Column):
    def shard(self, w, b, rank, n):
        return w.tensor_split(n, dim=0)[rank], b.tensor_split(n)[rank]


class UnevenRow(Row):
    def shard(self, w, rank, n):
        return w.tensor_split(n, dim=1)[rank]


class MLPUneven(nn.Module):
    """Handles any hidden size: blocks of sizes that differ by one."""

    def __init__(self, plain, rank, world_size):
        super().__init__()
        self.up = UnevenColumn(plain[0], rank, world_size)
        self.act = plain[1]
        self.down = UnevenRow(plain[2], rank, world_size)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


RIGHT_MLPS = [MLP, MLPUneven]


@pytest.mark.parametrize("cls", RIGHT_MLPS)
def test_right_mlp_pass(cls, capsys):
    lab11.check_tp_mlp(cls, timeout=T)
    out = capsys.readouterr().out
    assert out.count("✔") == 1
    assert ("refused" if cls is MLP else "handled") in out


def test_right_mlp_with_in_place_all_reduces_passes(capsys):
    # f's backward and g's forward all-reduce the tensor they were given, as Megatron-LM does
    lab11.check_tp_mlp(mlp_of(ColumnTransposed, RowInPlaceNoClone), world_sizes=(3,), timeout=T)
    assert capsys.readouterr().out.count("✔") == 1


def test_prediction_stacked_mlps_make_three_then_four_all_reduces(capsys):
    measured = lab11.count_all_reduces(MLP, timeout=T)
    assert measured == (3, 4)
    # the 50/50 guess "4" for data is wrong; "3" for both is wrong on the second case
    lab11.check_prediction(predict("lab11", "data", 4, unit="all-reduces"), measured,
                           predict("lab11", "grad", 4, unit="all-reduces"))
    out = capsys.readouterr().out
    assert "measured: 3 all-reduces — not what happened." in out
    assert "measured: 4 all-reduces — right." in out
    assert "first MLP's f does not" in out and "the first MLP's f all-reduces too — 4" in out
    lab11.check_prediction(predict("lab11", "data", 3, unit="all-reduces"), measured,
                           predict("lab11", "grad", 3, unit="all-reduces"))
    out = capsys.readouterr().out
    assert "measured: 3 all-reduces — right." in out
    assert "measured: 4 all-reduces — not what happened." in out
    lab11.check_prediction(predict("lab11", "data", 3, unit="all-reduces"), measured,
                           predict("lab11", "grad", 4, unit="all-reduces"))
    assert capsys.readouterr().out.count("— right.") == 2


def test_prediction_needs_both_cases():
    guess = predict("lab11", "data", 3, unit="all-reduces")
    with pytest.raises(NotImplementedError, match="write your second prediction"):
        lab11.check_prediction(guess, (3, 4))
    fails(lab11.check_prediction, guess, 3, guess, match="the pair that "
                                                          "lab11.count_all_reduces returned")


def test_prediction_parameters_of_rank_one(capsys):
    # the second bias whole on every rank: 24 + 4 + 24 + 6
    measured = lab11.count_parameters(MLP)
    assert measured == 58
    lab11.check_parameters_prediction(predict("lab11", "numbers", 54, unit="numbers"),
                                      measured, MLP)
    out = " ".join(capsys.readouterr().out.split())
    assert "measured: 58 numbers — not what happened." in out
    assert "more than a third of the plain MLP's 162" in out
    lab11.check_parameters_prediction(predict("lab11", "numbers", 58, unit="numbers"),
                                      measured, MLP)
    assert "— right." in capsys.readouterr().out
    # the second bias held by rank 0 only: rank 1 holds a third of the rest
    on_zero = mlp_of(Column, RowBiasOnRankZero)
    measured = lab11.count_parameters(on_zero)
    assert measured == 52
    lab11.check_parameters_prediction(predict("lab11", "numbers", 52, unit="numbers"),
                                      measured, on_zero)
    out = " ".join(capsys.readouterr().out.split())
    assert "— right." in out and "no second bias" in out
    # the second bias in blocks: rank 1 holds its block of 2
    blocks = mlp_of(Column, RowBiasBlocks)
    measured = lab11.count_parameters(blocks)
    assert measured == 54
    lab11.check_parameters_prediction(predict("lab11", "numbers", 54, unit="numbers"),
                                      measured, blocks)
    out = " ".join(capsys.readouterr().out.split())
    assert "— right." in out and "its block of the second bias (2) = 54" in out


class MLPVagueRefusal(MLP):
    def __init__(self, plain, rank, world_size):
        if plain[0].out_features % world_size:
            raise RuntimeError("bad hidden size")
        super().__init__(plain, rank, world_size)


class MLPDropsRemainder(nn.Module):
    def __init__(self, plain, rank, world_size):
        super().__init__()
        self.up = Column(plain[0], rank, world_size)
        self.act = plain[1]
        self.down = Row(plain[2], rank, world_size)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class MLPGeluAfter(MLP):
    def forward(self, x):
        return self.act(self.down(self.up(x)))


@functools.cache   # the same pair, the same class: its launches are replayed
def mlp_of(column_cls, row_cls):
    """A TPMLP built from the given layers (refusing a hidden size the world size does not
    divide)."""
    class Built(MLP):
        def __init__(self, plain, rank, world_size):
            super().__init__(plain, rank, world_size)
            self.up = column_cls(plain[0], rank, world_size)
            self.down = row_cls(plain[2], rank, world_size)

    Built.__name__ = Built.__qualname__ = f"MLP_{column_cls.__name__}_{row_cls.__name__}"
    return Built


def test_right_mlp_with_the_row_bias_in_blocks_passes(capsys):
    lab11.check_tp_mlp(mlp_of(Column, RowBiasBlocks), world_sizes=(3,), timeout=T)
    assert capsys.readouterr().out.count("✔") == 1


def test_right_mlp_transposed_bias_on_rank_zero_pass(capsys):
    # shards stored as (in, out); the row bias held and added on rank 0 only (right)
    lab11.check_tp_mlp(mlp_of(ColumnTransposed, RowTransposedBiasOnRankZero),
                       world_sizes=(3,), timeout=T)
    assert capsys.readouterr().out.count("✔") == 1


DEAD_BIAS_ROWS = [RowBiasHeldEverywhereAddedOnRankZero,
                  RowTransposedBiasEverywhereAddedOnRankZero]


@pytest.mark.parametrize("row", DEAD_BIAS_ROWS)
def test_a_row_bias_held_on_every_rank_but_added_on_rank_zero_is_refused(row):
    # every value is right, but rank 1's copy of the bias gets no gradient: a dead parameter
    message = fails(lab11.check_row_parallel, row, world_sizes=(2,), match="on rank 1 holds a "
                    r"bias parameter of shape \(6,\) whose \.grad is still None after the "
                    r"backward", timeout=T)
    assert "dead parameter" in message and "find_unused_parameters=True" in message
    message = fails(lab11.check_tp_mlp, mlp_of(Column, row), world_sizes=(3,),
                    match=r"'s row layer on rank 1 holds a bias parameter of shape \(6,\) "
                          r"whose \.grad is still None", timeout=T)
    message = fails(lab11.check_tp_mlp, mlp_of(Column, row), world_sizes=(3,),
                    match="dead parameter", timeout=T)
    assert "hold the bias only on the ranks whose forward adds it" in message


class ColumnDetachedBias(Column):
    def forward(self, x):
        return F.linear(Copy.apply(x), self.weight, self.bias.detach())


class ColumnBiasNotParameter(Column):
    def __init__(self, linear, rank, world_size):
        super().__init__(linear, rank, world_size)
        bias = self.bias.detach().clone()
        del self.bias
        self.bias = bias


class RowDetachedWeight(Row):
    def forward(self, h):
        return Reduce.apply(F.linear(h, self.weight.detach())) + self.bias


# g's backward sums the (already replicated) gradient and divides by the world size: every
# value comes out right, but the backward makes a second all-reduce
RowGBackwardMean = type("RowGBackwardMean", (Row,), {
    "forward": lambda self, h: conj("G", allsum, allmean).apply(F.linear(h, self.weight))
    + self.bias})


WRONG_MLP_LAYERS = [
    ((ColumnDetachedBias, Row), r"column layer's bias \(plain\[0\]\.bias\) on rank 0 gets no "
                                r"gradient"),
    ((ColumnBiasNotParameter, Row), r"no nn.Parameter that is a block of the column layer's "
                                    r"bias"),
    ((Column, RowDetachedWeight), r"row layer's weight \(plain\[2\]\.weight\) on rank 0 gets "
                                  r"no gradient"),
    ((Column, RowBiasScaled), r"row layer's bias \(plain\[2\]\.bias\) on rank 0 is 1/2 of"),
    ((Column, RowBiasStoredScaled), "row layer's bias .* divided by the world size"),
    ((Column, RowGBackwardMean), "so a collective runs outside them, or twice"),
]


@pytest.mark.parametrize("layers,match", WRONG_MLP_LAYERS)
def test_wrong_mlp_gradients_named(layers, match):
    # each of these gives the plain MLP's output and dL/dx: only the parameters' gradients
    # (or the collectives) show the mistake
    fails(lab11.check_tp_mlp, mlp_of(*layers), match=match, timeout=T)


WRONG_MLPS = [
    (MLPVagueRefusal, r"does not name both the hidden size \(16\) and the world size"),
    (MLPDropsRemainder, "does not split into 3 equal blocks"),
    (MLPGeluAfter, "differs from the plain MLP"),
]


@pytest.mark.parametrize("cls,match", WRONG_MLPS)
def test_wrong_mlp_named(cls, match):
    fails(lab11.check_tp_mlp, cls, match=match, timeout=T)


# --------------------------------------------------------------------------------------------
# The arrangement the lesson did not show: a LayerNorm between the two layers
# --------------------------------------------------------------------------------------------




def gather_fn(name, backward):
    """An all-gather of the hidden blocks along the features, with ``backward(grad, rank, n,
    per)`` giving this rank's gradient."""

    def forward(ctx, block):
        n, rank = dist.get_world_size(), dist.get_rank()
        parts = [torch.empty_like(block) for _ in range(n)]
        dist.all_gather(parts, block.contiguous())
        ctx.rank, ctx.n, ctx.per = rank, n, block.shape[-1]
        return torch.cat(parts, dim=-1)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(lambda ctx, g: backward(g, ctx.rank, ctx.n, ctx.per)),
    })


def _reduce_scatter(g, rank, n, per):
    out = torch.empty(g.shape[0], per)
    dist.reduce_scatter(out, [c.contiguous() for c in g.split(per, dim=-1)])
    return out


def _all_reduce_then_block(g, rank, n, per):
    return allsum(g.contiguous())[:, rank * per:(rank + 1) * per]


def _split(g, rank, n, per):          # Megatron's gather_from_tensor_model_parallel_region
    return g[:, rank * per:(rank + 1) * per].clone()


def _averaged(g, rank, n, per):
    return _all_reduce_then_block(g, rank, n, per) / n


GatherRS = gather_fn("GatherRS", _reduce_scatter)
GatherAR = gather_fn("GatherAR", _all_reduce_then_block)
GatherSplit = gather_fn("GatherSplit", _split)
GatherMean = gather_fn("GatherMean", _averaged)
# the statistics summed over the ranks: a sum whose gradient is needed by every rank's part
SumStats = conj("SumStats", allsum, allsum)
SumStatsNoBackward = conj("SumStatsNoBackward", allsum, ident)


class Normed(nn.Module):
    """Right: the hidden blocks gathered (reduce-scatter backward), the norm over the whole
    row, this rank's block of its output into the row layer."""
    gather = GatherRS

    def __init__(self, plain, rank, world_size):
        super().__init__()
        self.up, self.act, self.norm = Column(plain[0], rank, world_size), plain[1], plain[2]
        self.down = Row(plain[3], rank, world_size)
        self.per = plain[0].out_features // world_size
        self.rank = rank

    def forward(self, x):
        hidden = self.gather.apply(self.act(self.up(x)))
        mine = self.norm(hidden)[:, self.rank * self.per:(self.rank + 1) * self.per]
        return self.down(mine)


class NormedAR(Normed):
    gather = GatherAR


class NormedSplit(Normed):
    gather = GatherSplit


class NormedMean(Normed):
    gather = GatherMean


class NormedStats(nn.Module):
    """Right: the norm from the ranks' sums, all-reduced forward and backward: the row's sum,
    then the squared deviations from its mean summed (1 number a row each); the blocks of
    torch.chunk (16 on 3 ranks: 6, 6, 4)."""
    stats = SumStats
    column, row = ColumnChunk, RowChunk

    def __init__(self, plain, rank, world_size):
        super().__init__()
        self.up, self.act = self.column(plain[0], rank, world_size), plain[1]
        self.down = self.row(plain[3], rank, world_size)
        self.h, self.eps = plain[0].out_features, plain[2].eps

    def forward(self, x):
        a = self.act(self.up(x))
        mean = self.stats.apply(a.sum(-1, keepdim=True)) / self.h
        var = self.stats.apply((a - mean).square().sum(-1, keepdim=True)) / self.h
        return self.down((a - mean) / torch.sqrt(var + self.eps))


class NormedStatsOnePass(NormedStats):
    """The one-pass statistics (Σa, Σa², one stacked all-reduce; var = E[a²] − E[a]²): exact
    with a small mean, cancelled in float32 when the hidden activations have a large mean."""

    def forward(self, x):
        a = self.act(self.up(x))
        sums = self.stats.apply(torch.stack([a.sum(-1), a.square().sum(-1)], dim=-1))
        mean = sums[:, :1] / self.h
        var = sums[:, 1:] / self.h - mean.square()
        return self.down((a - mean) / torch.sqrt(var + self.eps))


class NormedStatsShifted(NormedStats):
    """Right: shifted sums, Σ(a − K) and Σ(a − K)² in one stacked all-reduce, K a value every
    rank shares (the first layer's mean bias when built, the same on every rank)."""

    def __init__(self, plain, rank, world_size):
        super().__init__(plain, rank, world_size)
        self.shift = float(plain[0].bias.detach().mean())

    def forward(self, x):
        a = self.act(self.up(x))
        d = a - self.shift
        sums = self.stats.apply(torch.stack([d.sum(-1), d.square().sum(-1)], dim=-1))
        mean = sums[:, :1] / self.h
        var = sums[:, 1:] / self.h - mean.square()
        return self.down((d - mean) / torch.sqrt(var + self.eps))


class NormedStatsNoBackward(NormedStats):
    stats = SumStatsNoBackward


class NormedStatsOnePassNoBackward(NormedStatsOnePass):
    stats = SumStatsNoBackward


class NormedStatsRefusing(NormedStats):
    """Right: the statistics, and a hidden size the world size does not divide refused on
    every rank before any collective."""

    def __init__(self, plain, rank, world_size):
        h = plain[0].out_features
        if h % world_size:
            raise ValueError(f"hidden size {h} does not split over {world_size} ranks")
        super().__init__(plain, rank, world_size)


class NormedStatsFloorBlocks(NormedStats):
    """size // n features a rank: with 16 on 3 ranks, feature 15 belongs to no rank."""
    column, row = Column, Row


class NormedStats64(NormedStats):
    """Right values, the sums all-reduced in float64: twice the bytes."""

    def forward(self, x):
        a = self.act(self.up(x))
        sums = self.stats.apply(torch.stack([a.sum(-1), a.square().sum(-1)], -1).double())
        sums = sums.float()
        mean = sums[:, :1] / self.h
        var = sums[:, 1:] / self.h - mean.square()
        return self.down((a - mean) / torch.sqrt(var + self.eps))


class NormedStatsHFromBlock(NormedStats):
    """h taken as this rank's block times the world size: right for equal blocks only."""

    def __init__(self, plain, rank, world_size):
        super().__init__(plain, rank, world_size)
        self.h = self.up.weight.shape[0] * world_size


class NormedStatsDetachedDown(NormedStats):
    row = RowDetachedWeight


class NormedStatsPlaceholderBias(NormedStats):
    row = RowBiasPlaceholder


class NormedLocal(Normed):
    """The norm on this rank's block only: no communication for it."""

    def forward(self, x):
        a = self.act(self.up(x))
        return self.down(F.layer_norm(a, (a.shape[-1],), eps=self.norm.eps))


MeanOfCopies = conj("MeanOfCopies", lambda t: allsum(t) / dist.get_world_size(), ident)


class NormedTwice(Normed):
    """Right values, but the gathered row (the same on every rank) all-reduced and divided."""

    def forward(self, x):
        hidden = MeanOfCopies.apply(self.gather.apply(self.act(self.up(x))))
        mine = self.norm(hidden)[:, self.rank * self.per:(self.rank + 1) * self.per]
        return self.down(mine)


class NormedStatsThrice(NormedStats):
    """Right values, but the sums all-reduced in three calls (Σa twice), each with its own
    all-reduce in the backward."""

    def forward(self, x):
        a = self.act(self.up(x))
        mean = self.stats.apply(a.sum(-1, keepdim=True)) / self.h
        mean_again = self.stats.apply(a.sum(-1, keepdim=True)) / self.h
        var = self.stats.apply(a.square().sum(-1, keepdim=True)) / self.h - mean_again.square()
        return self.down((a - mean) / torch.sqrt(var + self.eps))


class NormedSummedBlocks(Normed):
    """g (an all-reduce) on the hidden block, where the norm needs the features side by side."""

    def forward(self, x):
        a = Reduce.apply(self.act(self.up(x)))
        return self.down(F.layer_norm(a, (a.shape[-1],), eps=self.norm.eps))


class NormedWholeRow(Normed):
    """The row layer kept whole on every rank, fed the whole normed row."""

    def __init__(self, plain, rank, world_size):
        super().__init__(plain, rank, world_size)
        self.down = plain[3]

    def forward(self, x):
        return self.down(self.norm(self.gather.apply(self.act(self.up(x)))))


RIGHT_NORMED = [NormedStats, NormedStatsRefusing, NormedStatsShifted]


@pytest.mark.parametrize("cls", RIGHT_NORMED)
def test_right_normed_mlp_passes(cls, capsys):
    lab11.check_normed_mlp(cls, timeout=T)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "LayerNorm(12)" in out
    assert "both weights" in out and "after 2 SGD steps" in out
    assert "bias shifted by 1000 (a large mean) the output within 0.001 on 2 ranks" in out
    assert "sends 40 B per rank in the forward and 40 B in the backward" in out
    how = "refused on every rank" if cls is NormedStatsRefusing else "handled with blocks of [6, 6, 4]"
    assert f"h = 16 on 3 ranks {how}" in out


def test_the_budget_is_what_the_statistics_send_measured():
    # an all-reduce of 5 rows × 2 float32: 40 B whole, a ring sends 2(n-1)/n of it per rank
    assert lab11.norm_budget(2) == 40 and abs(lab11.norm_budget(3) - 160 / 3) < 1e-9
    assert lab11.ring_bytes("all_gather", 120, 3) == 240
    assert lab11.ring_bytes("reduce_scatter", 240, 2) == 120


WRONG_NORMED = [
    (NormedLocal, r"a norm over each rank's own block of 6 hidden features gives: rank 0 normalises "
                  r"row 0 by its block's mean -?\d\.\d{3}"),
    (NormedSplit, r"counts only the paths through this rank's own block of the norm's output"),
    (NormedStatsNoBackward, r"counts only the paths through this rank's own block"),
    (NormedStatsOnePassNoBackward, r"counts only the paths through this rank's own block"),
    (NormedMean, r"is 1/2 of the plain MLP's .* averages the ranks' parts"),
    (NormedTwice, r"all-reduce no. 1 of NormedTwice's forward \(2 ranks\) sums a tensor of shape "
                  r"\(5, 12\) that every rank holds the same"),
    (NormedWholeRow, r"keeps a whole weight of shape \(6, 12\)"),
    (NormedStatsThrice, r"makes 4 collectives in the forward on rank 0 .* its values are right"),
    (NormedSummedBlocks, r"a norm of the ranks' hidden blocks added together gives: an "
                         r"all-reduce of the blocks adds rank 0's features 0–5 to rank 1's 6–11"),
    # right values, but more bytes than the cheapest correct exchange (40 B a pass on 2 ranks)
    # the gather named first, by the forward alone: a reduce-scatter backward is refused too
    (Normed, r"Normed's forward on rank 0 \(2 ranks\) all-gathers the hidden blocks for the "
             r"norm: that all-gather alone sends 120 B per rank, already 3× the 40 B the "
             r"cheapest correct exchange sends in a whole pass — whatever the backward does, a "
             r"reduce-scatter there included\. The all-gather brings every rank the other "
             r"ranks' 6 hidden features of each of the 5 rows, and it grows with h"),
    (NormedAR, r"NormedAR's forward on rank 0 \(2 ranks\) all-gathers the hidden blocks for "
               r"the norm: that all-gather alone sends 120 B per rank"),
    # E[a²] − E[a]²: exact with a small mean, cancelled with the bias shifted by 1000
    (NormedStatsOnePass, r"NormedStatsOnePass's output on rank 0 \(2 ranks\) is off torch's "
                         r"LayerNorm MLP by up to 0\.1\d+ when the hidden activations have a "
                         r"large mean — the first layer's bias shifted by 1000, .* where float32 "
                         r"allows 0\.001; with a small mean it matched\. The variance loses it to "
                         r"cancellation if it is E\[x²\] − E\[x\]²: in float32, row 0 has "
                         r"E\[x²\] = 999927\.3125 and E\[x\]² = 999927\.1250, which agree in "
                         r"their first 6 digits, so their difference 0\.1875 is mostly rounding, "
                         r"where the row's variance is 0\.4088"),
    (NormedStats64, r"forward on rank 0 \(2 ranks\) sends 80 B per rank for the norm \(all_reduce "
                    r"of 10 numbers: 80 B, .*\), 2\.0× the 40 B"),
    (NormedStatsFloorBlocks, r"hidden size 16 on 3 ranks: NormedStatsFloorBlocks's ranks hold "
                             r"blocks of \[5, 5, 5\] hidden features, 15 in all — 1 of the 16 "
                             r"features belong to no rank"),
    (NormedStatsHFromBlock, r"output on rank 0 \(3 ranks, h = 16, blocks of \[6, 6, 4\] hidden "
                            r"features\) differs from the plain MLP's by up to [\d.e-]+, where the "
                            r"runs with equal blocks matched it"),
    (NormedStatsDetachedDown, r"on rank 0 \(2 ranks, h = 12\) the second weight's block of hidden "
                              r"features \[0, 6\) has no gradient"),
    (NormedStatsPlaceholderBias, r"after one SGD step .* holds the bias's step 2 times"),
]


@pytest.mark.parametrize("cls,match", WRONG_NORMED)
def test_wrong_normed_mlp_named(cls, match):
    message = fails(lab11.check_normed_mlp, cls, match=match, timeout=T)
    assert "(Run the check again after your change" in message


def test_a_backward_that_sends_nothing_back_met_twice_adds_what_to_change():
    fails(lab11.check_normed_mlp, NormedSplit, match="counts only the paths", timeout=T)
    message = fails(lab11.check_normed_mlp, NormedSplit, match="counts only the paths",
                    timeout=T)
    assert "sum the ranks' gradients before each rank keeps its block" in message


def test_a_gather_met_twice_is_told_what_the_norm_needs_of_the_other_ranks():
    match = "that all-gather alone sends 120 B per rank"
    fails(lab11.check_normed_mlp, Normed, match=match, timeout=T)
    message = fails(lab11.check_normed_mlp, Normed, match=match, timeout=T)
    assert "per-row sums over each rank's block (two numbers a row in all), all-reduced" in message


def test_a_one_pass_variance_met_twice_is_told_to_square_deviations_from_a_shared_value():
    match = "cancellation if it is E"
    fails(lab11.check_normed_mlp, NormedStatsOnePass, match=match, timeout=T)
    message = fails(lab11.check_normed_mlp, NormedStatsOnePass, match=match, timeout=T)
    assert "Square deviations from a value every rank shares" in message


def test_the_large_mean_numbers_are_measured():
    # the numbers the one-pass sentence prints: float32 cancellation, and the two-pass form
    # within the tolerance where the one-pass is 100x outside it
    from dpcourse.checks import _lab11_norm as norm
    sim = norm.one_pass_cancellation(2)
    assert abs(sim["ex2"] - sim["m2"]) / sim["ex2"] < 1e-6
    assert abs(sim["var"] - sim["true_var"]) > 0.1 * sim["true_var"]
    assert sim["one_pass_err"] > 100 * norm.LARGE_ATOL
    plain, x, _ = norm._normed_case(norm.H, norm.SHIFT)
    with torch.no_grad():
        a = torch.nn.functional.gelu(x @ plain[0].weight.T + plain[0].bias)
        mean = sum(a[:, b].sum(-1, keepdim=True) for b in norm._blocks(2)) / norm.H
        var = sum((a[:, b] - mean).square().sum(-1, keepdim=True) for b in norm._blocks(2)) / norm.H
        y = ((a - mean) / torch.sqrt(var + norm.NORM_EPS)) @ plain[3].weight.T + plain[3].bias
        err = float((y - plain(x)).abs().max())
    assert 0 < err < norm.LARGE_ATOL / 5


def test_the_normed_predictions_are_measured_and_explained(capsys):
    guess = predict("lab11", "what a silent backward of the norm's exchange breaks", "the output",
                    choices=lab11.NORM_CHOICES)
    nbytes = predict("lab11", "fewest bytes of the norm's forward exchange", 120, unit="bytes")
    lab11.check_normed_mlp(NormedStats, timeout=T, prediction=guess, bytes_prediction=nbytes)
    out = capsys.readouterr().out
    assert "dL/dx and the first layer's gradients" in out and "gather_from_tensor" in out
    assert re.search(r"dL/dx by \d+ %", out)
    assert re.search(r"measured: 40(\.0)? bytes — not what happened", out), out
    assert re.search(r"not\s+the\s+sum\s+of\s+squares:\s+E\[x²\]\s+−\s+E\[x\]²\s+cancels", out), out
    assert re.search(r"Gathering\s+the\s+hidden\s+blocks\s+instead\s+sends\s+120 B\s+here", out), out


# --------------------------------------------------------------------------------------------
# Stretch: the GPipe step and the bubble
# --------------------------------------------------------------------------------------------


def gpipe(stage, rank, world_size, m, inputs, targets, loss_fn, shape, *, divide=True,
          zero_each=False, interleave=False, track_input=True, reverse=False, time_waits=False,
          never_wait=False):
    """A right GPipe step with isend; each keyword switches on one mistake (or a variant)."""
    last = rank == world_size - 1
    saved, events, sends, loss = {}, [], [], 0.0

    def forward(i):
        t_wait = time.perf_counter()
        if rank == 0:
            x = inputs[i]
        else:
            x = torch.empty(shape)
            dist.recv(x, src=rank - 1)
            if track_input:
                x.requires_grad_()
        t0 = t_wait if time_waits else time.perf_counter()
        y = stage(x)
        if last:
            y = loss_fn(y, targets[i]) / (m if divide else 1)
        events.append(("F", i, t0, time.perf_counter()))
        if not last:
            out = y.detach()
            sends.append((dist.isend(out, rank + 1), out))
        saved[i] = (x, y)
        return y.item() if last else 0.0

    def backward(i):
        x, y = saved.pop(i)
        t_wait = time.perf_counter()
        grad = None
        if not last:
            grad = torch.empty(shape)
            dist.recv(grad, src=rank + 1)
        if zero_each:
            stage.zero_grad()
        t0 = t_wait if time_waits else time.perf_counter()
        y.backward(grad)
        events.append(("B", i, t0, time.perf_counter()))
        if rank > 0:
            sends.append((dist.isend(x.grad, rank - 1), x.grad))

    if interleave:   # 1F1B
        warm = min(world_size - rank - 1, m)
        for i in range(warm):
            loss += forward(i)
        for i in range(m - warm):
            loss += forward(warm + i)
            backward(i)
        for i in range(m - warm, m):
            backward(i)
    else:
        for i in range(m):
            loss += forward(i)
        for i in (reversed(range(m)) if reverse else range(m)):
            backward(i)
    for work, _ in ([] if never_wait else sends):
        work.wait()
    return (loss if last else None), events


def bubble(events, stages):
    busy = sum(e[4] - e[3] for e in events)
    start, end = min(e[3] for e in events), max(e[4] for e in events)
    return 1.0 - busy / (stages * (end - start))


def test_right_gpipe_passes(capsys):
    lab11.check_gpipe(gpipe, bubble, timeout=T)
    assert capsys.readouterr().out.count("✔") == 1


def gpipe_reversed(*args):
    return gpipe(*args, reverse=True)


def test_backwards_in_reverse_order_pass(capsys):
    lab11.check_gpipe(gpipe_reversed, bubble, stages=(3,), timeout=T)
    assert "✔" in capsys.readouterr().out


def gpipe_not_accumulated(*args):
    return gpipe(*args, zero_each=True)


def gpipe_not_divided(*args):
    return gpipe(*args, divide=False)


def gpipe_1f1b(*args):
    return gpipe(*args, interleave=True)


def gpipe_no_requires_grad(*args):
    return gpipe(*args, track_input=False)


def gpipe_stale_start(*args):
    loss, events = gpipe(*args)
    first = events[0][2]
    return loss, [(k, i, first if k == "B" else s, e) for k, i, s, e in events]


def gpipe_times_waits(*args):
    return gpipe(*args, time_waits=True)


def gpipe_never_waits(*args):
    # the isends' handles are dropped: the last stage returns with its gradients' sends pending
    return gpipe(*args, never_wait=True)


def gpipe_batched_p2p(stage, rank, world_size, m, inputs, targets, loss_fn, shape):
    """Right: every message through batch_isend_irecv, each batch waited on."""
    last, saved, events, loss = rank == world_size - 1, [], [], 0.0

    def exchange(op, t, peer):
        for work in dist.batch_isend_irecv([dist.P2POp(op, t, peer)]):
            work.wait()

    for i in range(m):
        if rank == 0:
            x = inputs[i]
        else:
            x = torch.empty(shape)
            exchange(dist.irecv, x, rank - 1)
            x.requires_grad_()
        t0 = time.perf_counter()
        y = stage(x)
        if last:
            y = loss_fn(y, targets[i]) / m
            loss += y.item()
        events.append(("F", i, t0, time.perf_counter()))
        if not last:
            exchange(dist.isend, y.detach(), rank + 1)
        saved.append((x, y))
    for i, (x, y) in enumerate(saved):
        grad = None
        if not last:
            grad = torch.empty(shape)
            exchange(dist.irecv, grad, rank + 1)
        t0 = time.perf_counter()
        y.backward(grad)
        events.append(("B", i, t0, time.perf_counter()))
        if rank > 0:
            exchange(dist.isend, x.grad, rank - 1)
    return (loss if last else None), events


def test_right_gpipe_with_batched_p2p_passes(capsys):
    lab11.check_gpipe(gpipe_batched_p2p, bubble, stages=(2,), timeout=T)
    assert capsys.readouterr().out.count("✔") == 1


WRONG_GPIPES = [
    (gpipe_times_waits, "time waiting for .* a message, not only the computation"),
    (gpipe_never_waits, r"stage \d returned from gpipe_step with \d+ non-blocking send\(s\) still "
                        r"pending .* leaves its neighbour waiting"),
    (gpipe_not_accumulated, "not accumulated"),
    (gpipe_not_divided, "4 times too large"),
    (gpipe_1f1b, "every forward first"),
    (gpipe_no_requires_grad, "the tensor it received has no gradient after the backward"),
    (gpipe_stale_start, "overlap"),
]


@pytest.mark.parametrize("fn,match", WRONG_GPIPES)
def test_wrong_gpipe_named(fn, match):
    fails(lab11.check_gpipe, fn, bubble, match=match, timeout=T)


def bubble_formula(events, stages):
    m = sum(1 for e in events if e[0] == 0 and e[1] == "F")
    return (stages - 1) / (m + stages - 1)


def bubble_busy(events, stages):
    return 1.0 - bubble(events, stages)


def bubble_own_span(events, stages):
    shares = []
    for s in range(stages):
        mine = [e for e in events if e[0] == s]
        span = max(e[4] for e in mine) - min(e[3] for e in mine)
        shares.append(1 - sum(e[4] - e[3] for e in mine) / span)
    return sum(shares) / stages


@pytest.mark.parametrize("fn,match", [
    (bubble_formula, "whatever the timeline"),
    (bubble_busy, "busy share"),
    (bubble_own_span, "its own first and last"),
])
def test_wrong_bubble_named(fn, match):
    fails(lab11.check_gpipe, gpipe, fn, match=match, timeout=T)


def test_measure_bubble_refuses_timed_waits():
    fails(lab11.measure_bubble, gpipe_times_waits, bubble, micro=(2,), timeout=T,
          match="waiting for")


def test_measure_bubble_refuses_a_bubble_below_the_formula(capsys):
    fails(lab11.measure_bubble, gpipe, lambda events, stages: 0.05, micro=(2,), timeout=T,
          match=r"below \(K−1\)/\(M\+K−1\) = 0.333")


def test_measure_bubble_of_a_right_step_prints_its_table(capsys):
    lab11.measure_bubble(gpipe, bubble, micro=(1, 4), timeout=T)
    out = capsys.readouterr().out
    assert "measured ≥ formula" in out and "at M = 4" in out


def test_an_unfilled_todo_stops_before_any_rank_starts():
    def todo(size, rank, world_size):
        raise NotImplementedError("TODO: write this part")

    with pytest.raises(NotImplementedError):
        lab11.check_block_of(todo)


def test_a_wrong_pair_sent_again_is_named_as_a_repeat_not_a_new_pair():
    """The fifth learner re-sent their first wrong pair after a second one and was told "a new
    pair … diagnosis no. 2": a repeat is named as the repeat it is."""
    fails(lab11.check_diagnosis, "both", "both", match="is not right")
    fails(lab11.check_diagnosis, "forward", "forward", match="diagnosis no. 2")
    again = fails(lab11.check_diagnosis, "both", "both", match="is not right")
    assert "You sent this very pair before, and it came back then too." in again
    assert "a new pair" not in again
    sp = dict(zip(lab11.SP_KEYS, ["all-reduce"] * 4))
    fails(lab11.check_sequence_parallel, sp, match="not all right")
    other = dict(sp, **{"f forward": "nothing"})
    fails(lab11.check_sequence_parallel, other, match="answer no. 2")
    repeat = fails(lab11.check_sequence_parallel, sp, match="not all right")
    assert "You sent this very set before" in repeat and "answer no." not in repeat


# --------------------------------------------------------------------------------------------
# The runs judged in one launch (see _answers_in_one_launch): (worker, world size) -> the
# arguments of each run the tests above ask the checks for. Each check still asks for its runs
# one by one; a run not listed here launches on its own, as the check a learner runs does.
# --------------------------------------------------------------------------------------------


def _runs():
    from dpcourse.checks import _lab11_gpipe, _lab11_layers, _lab11_mlp, _lab11_norm
    from dpcourse.checks._lab11_diagnose import H, ODD_H
    from dpcourse.checks._lab11_pipeline import _CHECK_DELAY_S, _M

    conj, layer = lab11._conjugates_worker, _lab11_layers._layer_worker
    mlp, normed = _lab11_mlp._mlp_worker, _lab11_norm.normed_worker
    pipe = _lab11_gpipe._gpipe_worker
    column = lambda classes: [(c, "column") for c in classes]   # noqa: E731
    row = lambda classes: [(c, "row") for c in classes]         # noqa: E731
    right_normed = RIGHT_NORMED + [NormedStatsFloorBlocks, NormedStatsHFromBlock]
    return {
        (conj, 2): RIGHT_CONJUGATES + [(f, g) for f, g, _ in WRONG_CONJUGATES],
        (conj, 3): RIGHT_CONJUGATES,
        (layer, 2): (column([Column] + [c for c, _ in WRONG_COLUMNS])
                     + row([Row, RowNoClone, RowBiasAliased, RowBiasPlaceholder]
                           + [c for c, _ in WRONG_ROWS] + DEAD_BIAS_ROWS)),
        (layer, 3): column(RIGHT_COLUMNS) + row(RIGHT_ROWS + [RowBiasPlaceholder]),
        (mlp, 2): [(c, H) for c in RIGHT_MLPS + [mlp_of(Column, RowBiasPlaceholder)]
                   + [mlp_of(*layers) for layers, _ in WRONG_MLP_LAYERS]
                   + [c for c, _ in WRONG_MLPS]],
        (mlp, 3): [(c, h) for c in RIGHT_MLPS + [
            mlp_of(ColumnTransposed, RowInPlaceNoClone), mlp_of(Column, RowBiasBlocks),
            mlp_of(ColumnTransposed, RowTransposedBiasOnRankZero), MLPVagueRefusal,
            MLPDropsRemainder] for h in (H, ODD_H)]
                  + [(mlp_of(Column, row_cls), H) for row_cls in DEAD_BIAS_ROWS],
        (normed, 2): ([(c,) for c in RIGHT_NORMED + [c for c, _ in WRONG_NORMED]]
                      + [(c, H, lab11.SHIFT) for c in right_normed + [NormedStatsOnePass]]),
        (normed, 3): ([(c,) for c in right_normed + [NormedStatsOnePass]]
                      + [(c, ODD_H) for c in right_normed]),
        (pipe, 2): ([(fn, _M, _CHECK_DELAY_S) for fn in [gpipe, gpipe_batched_p2p]
                     # (a rank that raises leaves its neighbour waiting: launched alone)
                     + [fn for fn, _ in WRONG_GPIPES
                        if fn not in (gpipe_never_waits, gpipe_no_requires_grad)]]
                    + [(gpipe_times_waits, 2, 0.01)] + [(gpipe, m, 0.01) for m in (1, 2, 4)]
                    # its sends left pending: last, when nothing after it could receive them
                    + [(gpipe_never_waits, _M, _CHECK_DELAY_S)]),
        (pipe, 3): [(fn, _M, _CHECK_DELAY_S) for fn in (gpipe, gpipe_reversed)],
    }


ONE_LAUNCH = _runs()
