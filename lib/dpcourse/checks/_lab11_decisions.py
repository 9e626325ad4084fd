"""Lab 11's three decisions made before any code — read, not run: in which pass f and g
communicate (``check_diagnosis``, with the learner's optional whole/partial answers), which
collective each pass of f and g makes under sequence parallelism (``check_sequence_parallel``),
and which dimension of ``linear.weight`` each layer cuts (``check_split_decision``).

Kept apart from :mod:`dpcourse.checks.lab11`, which runs the learner's code on the ranks: these
checks take answers, send a wrong one back with what it would make of the MLP's tensors (never
which value is wrong), and name a second, different wrong answer as a search
(:func:`dpcourse.checks.wrong_answers`). ``check_conjugates`` and ``check_column_parallel``
then hold the learner's code to the declared passes and dimensions. All three are imported by
``lab11``, where the lab calls them.
"""

from __future__ import annotations

import torch
from torch import nn

from . import fail, passed, recorded, wrong_answers
from ._lab11_diagnose import D, H, _NAMES
from ._lab11_layer_diagnosis import _DIM_NAMES

__all__ = ["check_diagnosis", "check_sequence_parallel", "check_split_decision", "PASSES",
           "HELD_KEYS", "HELD_VALUES", "SP_KEYS", "SP_VALUES"]


PASSES = ("forward", "backward", "both", "neither")
# the right declaration (hidden from the lab's text; the check says whether the learner's is)
_RIGHT = {"f": "backward", "g": "forward"}
# part 2's structured answer: what each rank holds of each quantity on its own, before any
# collective, "whole" (the same on every rank) or "partial" (a part the ranks must sum). The
# passes follow from it: an operation communicates in the pass that carries a partial quantity.
HELD_KEYS = ("X", "dL/dX", "Y", "dL/dY")
HELD_VALUES = ("whole", "partial")
_HELD_AT = {"X": ("f", "forward"), "dL/dX": ("f", "backward"),
            "Y": ("g", "forward"), "dL/dY": ("g", "backward")}
_HELD_WHAT = {"X": "X, the input f receives in the forward",
              "dL/dX": "dL/dX, the gradient f receives in the backward",
              "Y": "Y, the row layer's product g receives in the forward",
              "dL/dY": "dL/dY, the gradient g receives in the backward"}


def _pair_implies(declared: dict) -> str:
    """What the declared pair would make of the MLP's tensors, pass by pass, stated the same
    way whether each part is right or not: the learner judges each against the plain MLP."""
    f_fwd = declared["f"] in ("forward", "both")
    f_bwd = declared["f"] in ("backward", "both")
    g_fwd = declared["g"] in ("forward", "both")
    g_bwd = declared["g"] in ("backward", "both")
    x = ("X would be combined over the ranks before the column layer multiplies it"
         if f_fwd else "X would enter the column layer as this rank holds it")
    dx = ("dL/dX would be the sum over the ranks of their terms ∂L/∂Z_r·A_rᵀ" if f_bwd else
          "dL/dX on rank r would be its own term ∂L/∂Z_r·A_rᵀ, from its block A_r only")
    y = ("Y would be the sum over the ranks of their partial products Y_r" if g_fwd else
         "Y on rank r would be its own partial product Y_r")
    dy = ("dL/dY_r would be combined over the ranks after the layers above g" if g_bwd else
          "dL/dY_r would be dL/dY as this rank holds it after the layers above g")
    return f"{x}; {dx}; {y}; {dy}"


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


def _answers(given, name: str, keys: tuple, values: tuple, allowed: str, first: str) -> dict:
    """A learner's dict of choices — each of ``keys`` set to one of ``values`` (``allowed`` says
    which, in words) — validated and lower-cased. NotImplementedError while it, or one of its
    entries, is unwritten (``first`` says what to write first)."""
    __tracebackhide__ = True
    if given is None or given is Ellipsis:
        raise NotImplementedError(f"write {first}, then run this check.")
    if not isinstance(given, dict) or set(given) != set(keys):
        fail(f"{name} should be a dict with exactly the keys {', '.join(map(repr, keys))}, "
             f"each set to {allowed}; got {given!r}.")
    out = {}
    for key in keys:
        value = given[key]
        if value is None or value is Ellipsis:
            raise NotImplementedError(f"write {name}[{key!r}] ({allowed}) first, then run this "
                                      f"check.")
        if not isinstance(value, str) or value.strip().lower() not in values:
            fail(f"{name}[{key!r}] should be {allowed}; got {value!r}.")
        out[key] = value.strip().lower()
    return out


def _held(held) -> dict:
    """The learner's whole/partial answers, validated; NotImplementedError when unwritten."""
    __tracebackhide__ = True
    return _answers(held, "held", HELD_KEYS, HELD_VALUES,
                    "'whole' (the same on every rank) or 'partial' (a part the ranks must sum)",
                    "f_communicates_in, g_communicates_in and held first")


def _passes_from(held: dict, op: str) -> set:
    return {pass_ for key, (o, pass_) in _HELD_AT.items() if o == op and held[key] == "partial"}


def _declared_passes(value: str) -> set:
    return {"forward": {"forward"}, "backward": {"backward"}, "both": {"forward", "backward"},
            "neither": set()}[value]


def _inconsistency(declared: dict, held: dict) -> str | None:
    """The first place where a declared pass disagrees with the learner's own whole/partial
    answers, as a sentence (it restates the learner's own answers, never the right ones)."""
    for key, (op, pass_) in _HELD_AT.items():
        talks = pass_ in _declared_passes(declared[op])
        if held[key] == "partial" and not talks:
            return (f"you say {_HELD_WHAT[key]}, is partial on each rank — a part the ranks "
                    f"must sum — yet {_NAMES[op]} = {declared[op]!r} makes no collective in "
                    f"the {pass_}, so that sum is never formed")
        if held[key] == "whole" and talks:
            return (f"you say {_HELD_WHAT[key]}, is whole — the same on every rank — yet "
                    f"{_NAMES[op]} = {declared[op]!r} all-reduces it in the {pass_}, which "
                    f"would add up the same value once per rank")
    return None


# the consistent but wrong diagnoses this kernel has sent back are kept (checks.wrong_answers): a
# learner who then changes the pair is searching, and the check says so (as predict does for a
# guess written after its measurement)
DIAGNOSIS_QUESTION = "in which pass f and g communicate"
SP_QUESTION = "sequence-parallel collectives"


def _shown_pair(pair: tuple) -> str:
    return f"(f {pair[0]!r}, g {pair[1]!r})"


@recorded
def check_diagnosis(f_communicates_in, g_communicates_in, held=None) -> None:
    """The learner's own diagnosis of part 2, before any code: in which pass f and g
    communicate (each ``"forward"``, ``"backward"``, ``"both"`` or ``"neither"``). A wrong pair
    is sent back as a pair, with what it would make of the MLP's tensors, never which value is
    wrong; a different wrong pair after it is named as a search.

    ``held`` is optional help the learner asks for (part 2's Hint 2): for each of X and dL/dX
    (at f) and Y and dL/dY (at g), whether each rank holds it ``"whole"`` (the same on every
    rank) or ``"partial"`` (a part the ranks must sum) before any collective. Given, the passes
    must follow from it, and a pass that disagrees with the learner's own answers is named as
    that disagreement first."""
    __tracebackhide__ = True
    declared = _declaration(f_communicates_in, g_communicates_in, "run this check")
    answers = None if held is None else _held(held)
    if answers is not None:
        clash = _inconsistency(declared, answers)
        if clash:
            fail(f"Your passes do not follow from your own whole/partial answers: {clash}.",
                 fix="an operation communicates exactly in the pass whose quantity is partial: "
                     "make the passes and held say the same thing, then judge them against "
                     "the plain MLP.")
    tried = wrong_answers("lab11", DIAGNOSIS_QUESTION)
    pair = (declared["f"], declared["g"])
    if _wrong_passes(declared):
        earlier = [p for p in tried if p != pair]
        if pair in tried:    # sent back before: a repeat, not a new pair
            search = " You sent this very pair before, and it came back then too."
        else:
            tried.append(pair)
            search = (f" This is your diagnosis no. {len(tried)}; before it, "
                      f"{', '.join(map(_shown_pair, earlier))} came back too: a new pair "
                      f"without a new reason is a search over a handful of answers, not a "
                      f"diagnosis." if earlier else "")
        which = ("and so which of your whole/partial answers does not hold?"
                 if answers is not None else
                 "and so which tensor does a rank hold only as a part the ranks must sum?")
        fail(f"The pair ({_NAMES['f']} = {declared['f']!r}, {_NAMES['g']} = "
             f"{declared['g']!r}) is not right. Followed through the MLP, it means: "
             f"{_pair_implies(declared)}. Which of these is not what the plain MLP computes — "
             f"{which}{search}",
             fix="write ∂L/∂X and Y of the plain MLP as sums over the ranks' blocks, and mark "
                 "for each term which rank can compute it on its own.")
    after = (f" (reached after {len(tried)} wrong pair{'s' if len(tried) > 1 else ''}, the "
             f"first {_shown_pair(tried[0])}: say to yourself which tensor that diagnosis "
             f"took for whole on every rank, or for a part to sum, and why it is not, before "
             f"you write the code)"
             if tried else "")
    passed("your diagnosis: on each side of f and of g, one pass carries what every rank holds "
           "only as a part — a sum over the ranks — and the other has it whole on every rank "
           f"already{after}. Now write the code that does what you declared.")


# --------------------------------------------------------------------------------------------
# Part 2, the second diagnosis: the same f and g with sequence parallelism (no code)
# --------------------------------------------------------------------------------------------

SP_KEYS = ("f forward", "f backward", "g forward", "g backward")
SP_VALUES = ("nothing", "all-reduce", "all-gather", "reduce-scatter")
# the right answer (hidden from the lab's text): what torch's sequence-parallel plan makes,
# counted in lesson 11's folded run (tensor_parallel.sequence_parallel_worker)
_RIGHT_SP = {"f forward": "all-gather", "f backward": "reduce-scatter",
             "g forward": "reduce-scatter", "g backward": "all-gather"}
# what each answer would make of the tensor leaving the operation in that pass, stated the same
# way whether it is right or not: the learner judges each against the plain MLP
_SP_IMPLIES = {
    "f forward": {
        "nothing": "the column layer would multiply only this rank's share of the tokens",
        "all-reduce": "the column layer would multiply the ranks' token shares added together, "
                      "rows of different tokens summed into one",
        "all-gather": "the column layer would multiply every token's X, the same on every rank",
        "reduce-scatter": "the column layer would multiply a t-th of the ranks' token shares "
                          "added together, each row a sum of different tokens",
    },
    "f backward": {
        "nothing": "dL/dX would be this rank's own term ∂L/∂Z_r·A_rᵀ, for every token",
        "all-reduce": "dL/dX would be the sum over the ranks of their terms, for every token",
        "all-gather": "dL/dX would be the ranks' own terms stacked one after another, t times "
                      "the rows, none summed",
        "reduce-scatter": "dL/dX would be the sum over the ranks of their terms, for this "
                          "rank's tokens only",
    },
    "g forward": {
        "nothing": "Y would be this rank's partial product Y_r, for every token",
        "all-reduce": "Y would be the sum of the ranks' partial products, for every token, on "
                      "every rank",
        "all-gather": "Y would be the ranks' partial products stacked one after another, t "
                      "times the rows, none summed",
        "reduce-scatter": "Y would be the sum of the ranks' partial products, for this rank's "
                          "tokens only",
    },
    "g backward": {
        "nothing": "dL/dY_r would be the gradient of this rank's tokens only",
        "all-reduce": "dL/dY_r would be the ranks' gradients of different tokens added together",
        "all-gather": "dL/dY_r would be the gradient of every token, the same on every rank",
        "reduce-scatter": "dL/dY_r would be a t-th of the rows of the ranks' gradients added "
                          "together, each a sum of different tokens",
    },
}


def _sp_answers(collectives) -> dict:
    """The learner's four answers, validated; NotImplementedError when unwritten."""
    __tracebackhide__ = True
    return _answers(collectives, "sp_collectives", SP_KEYS, SP_VALUES,
                    f"one of {', '.join(map(repr, SP_VALUES))}",
                    "sp_collectives first (part 2's second diagnosis)")


@recorded
def check_sequence_parallel(sp_collectives) -> None:
    """Part 2's second diagnosis, no code: with sequence parallelism (X enters each rank as its
    share of the tokens, and each rank keeps its share of Y's tokens), which collective each
    pass of f and g makes, one of ``SP_VALUES`` for each of ``SP_KEYS``. A wrong answer comes
    back whole, with what every one of the four would make of its tensor (right or not, in the
    same form), never which is wrong; a second, different wrong answer is named as a search."""
    __tracebackhide__ = True
    answers = _sp_answers(sp_collectives)
    tried = wrong_answers("lab11", SP_QUESTION)
    if answers != _RIGHT_SP:
        shown = tuple(answers[k] for k in SP_KEYS)
        earlier = [t for t in tried if t != shown]
        if shown in tried:   # sent back before: a repeat, not a new set
            search = " You sent this very set before, and it came back then too."
        else:
            tried.append(shown)
            search = (f" This is your answer no. {len(tried)}; {len(earlier)} other set"
                      f"{'s' if len(earlier) > 1 else ''} came back before it: a new set "
                      f"without a new reason is a search, not a diagnosis." if earlier else "")
        implied = "; ".join(_SP_IMPLIES[k][answers[k]] for k in SP_KEYS)
        fail(f"Your four sequence-parallel collectives are not all right. Followed through "
             f"the MLP on this rank's tokens, they mean: {implied}. Which of these is not what "
             f"the column layer's matmul, the row layer's output and their gradients need?"
             f"{search}",
             fix="for each of the four tensors, say first what this rank holds of it (which "
                 "tokens; whole or a part to sum) and then what the next operation needs of "
                 "it: the collective is what turns the one into the other.")
    after = (f" (reached after {len(tried)} wrong set{'s' if len(tried) > 1 else ''})"
             if tried else "")
    passed(f"sequence parallelism: each of f and g all-gathers the tokens on the way into a "
           f"matmul that needs them all (f in the forward, g in the backward) and "
           f"reduce-scatters a sum that each rank needs only for its own tokens{after} — the two halves of the all-reduce your f and g make, so the same "
           f"bytes (lesson 11's folded run counts them).")


# --------------------------------------------------------------------------------------------
# Part 3's decision: which dimension of linear.weight each layer cuts, with a reason
# --------------------------------------------------------------------------------------------

# the right dimensions (hidden from the lab's text; the check says whether the learner's are)
_RIGHT_DIM = {"column": 0, "row": 1}


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


def _stated_shape(weight_shape) -> tuple:
    """The learner's ``weight_shape``, as a tuple of ints (a tuple, list or torch.Size)."""
    __tracebackhide__ = True
    ok = (isinstance(weight_shape, (tuple, list, torch.Size))
          and all(isinstance(v, int) and not isinstance(v, bool) for v in weight_shape))
    if not ok:
        fail(f"weight_shape should be the shape you expect nn.Linear({D}, {H}).weight to have, "
             f"a tuple of ints such as (3, 4); got {weight_shape!r}.")
    return tuple(int(v) for v in weight_shape)


_FIND_LAYOUT = (f"print nn.Linear({D}, {H}).weight.shape beside its in_features and "
                f"out_features, and decide the dimensions from what torch gives.")


# Keras's Dense keeps its kernel as (input features, units) and computes inputs @ kernel + bias
# (keras/src/layers/core/dense.py, Dense.build and Dense.call): the hidden features of the
# column layer are its units, dimension 1; of the row layer its inputs, dimension 0.
_RIGHT_DENSE = {"column": 1, "row": 0}


def _dense_declaration(dense_dims) -> dict:
    """The learner's ``dense_dims`` pair, validated; NotImplementedError when unwritten."""
    __tracebackhide__ = True
    if dense_dims is None or dense_dims is Ellipsis:
        raise NotImplementedError("write dense_dims too (the pair of kernel dimensions the two "
                                  "layers would cut as Keras Dense layers), then run this check.")
    ok = (isinstance(dense_dims, (tuple, list)) and len(dense_dims) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) and v in (0, 1, -1, -2)
                  for v in dense_dims))
    if not ok:
        fail(f"dense_dims should be a pair (column, row) of dimensions of a 2-D Keras kernel, "
             f"each 0 or 1; got {dense_dims!r}.")
    return {"column": dense_dims[0] % 2, "row": dense_dims[1] % 2}


def _wrong_dense(dense: dict, declared: dict) -> None:
    """Refuse a wrong Keras pair with its cause: what it cuts in Dense's layout (and, when it
    repeats the torch answer, that it does)."""
    __tracebackhide__ = True
    wrong = [kind for kind in ("column", "row") if dense[kind] != _RIGHT_DENSE[kind]]
    if not wrong:
        return
    kind = wrong[0]
    shape, what = ((f"({D}, {H})", f"its inputs (the model's width, {D})") if kind == "column"
                   else (f"({H}, {D})", f"its units (the model's width, {D})"))
    layer = f"Dense({H}) on {D} inputs" if kind == "column" else f"Dense({D}) on {H} inputs"
    copied = (f" Your pair is your torch dimensions ({declared['column']}, {declared['row']}) "
              f"again, but the kernel is not laid out like nn.Linear's weight."
              if dense == declared else "")
    both = " (and the row layer's entry does the same)" if len(wrong) == 2 else ""
    fail(f"dense_dims puts the {kind} layer's cut on dimension {dense[kind]} of its kernel: "
         f"the {layer} keeps a kernel of shape {shape}, (input features, units), whose "
         f"dimension {dense[kind]} runs over {what}, which every rank keeps whole{both}; only "
         f"the hidden features are split.{copied}",
         fix=f"write the {kind} layer's kernel shape as Keras builds it, mark which of its two "
             f"sizes is the hidden size, and take that dimension.")


@recorded
def check_split_decision(column_weight_dim, row_weight_dim, weight_shape,
                         dense_dims=None) -> None:
    """Part 3's decision, before any code: ``weight_shape``, the shape the learner expects
    ``nn.Linear(6, 12).weight`` to have (the layout their decision rests on), checked against
    the weight torch builds; then which dimension of ``linear.weight`` (0 or 1) each layer
    cuts, checked against that layout. A false layout is refused whatever the dimensions; a
    wrong dimension is sent back with what it cuts in the learner's own (right) layout, never
    the right number. ``dense_dims``: the pair ``(column, row)`` of kernel dimensions the same
    layers would cut as Keras ``Dense`` layers (kernel ``(input features, units)``), a layout
    the course does not show cut: the torch answer copied there is named as such."""
    __tracebackhide__ = True
    if weight_shape is None or weight_shape is Ellipsis:
        raise NotImplementedError("write weight_shape, column_weight_dim and row_weight_dim "
                                  "first, then run this check.")
    declared = _dim_declaration(column_weight_dim, row_weight_dim, "run this check")
    stated = _stated_shape(weight_shape)
    torch_shape = tuple(nn.Linear(D, H, device="meta").weight.shape)
    if stated != torch_shape:
        if stated == (D, H):
            fail(f"weight_shape = {stated} says nn.Linear({D}, {H}) stores its weight as "
                 f"(in_features, out_features), but that is not the weight torch builds: "
                 f"dimensions decided from this layout rest on a step that does not hold, "
                 f"whichever numbers you wrote.", fix=_FIND_LAYOUT)
        fail(f"weight_shape = {stated} is not the shape of nn.Linear({D}, {H}).weight: the "
             f"weight holds one number for each pair of an input feature ({D} of them) and an "
             f"output feature ({H}), {D * H} numbers in two dimensions.", fix=_FIND_LAYOUT)
    dense = _dense_declaration(dense_dims)
    wrong = [kind for kind in ("column", "row") if declared[kind] != _RIGHT_DIM[kind]]
    if wrong:
        kind = wrong[0]
        width, layer = (f"input features (the model's width, {D})", f"Linear({D}, {H})") \
            if kind == "column" else (f"output features (the model's width, {D})",
                                      f"Linear({H}, {D})")
        both = (f" (and row_weight_dim = {declared['row']} does the same in the row layer)"
                if len(wrong) == 2 else "")
        fail(f"{_DIM_NAMES[kind]} = {declared[kind]} cuts the dimension of the {kind} layer's "
             f"{layer}.weight that, in the layout you stated ({stated} for Linear({D}, {H})), "
             f"runs over its {width}, which every rank keeps whole{both}; only the hidden "
             f"features are split.",
             fix=f"write the shape of the {kind} layer's {layer}.weight in the layout you "
                 f"stated, and mark which of its two sizes is the hidden size.")
    _wrong_dense(dense, declared)
    passed(f"your decision: nn.Linear({D}, {H}).weight is {torch_shape}, as you said, and each "
           f"layer cuts the dimension of its weight that runs over the hidden features — in "
           f"torch's layout and in Keras's, where they sit the other way round. Now write the "
           f"layers that cut it.")
