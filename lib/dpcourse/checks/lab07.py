"""Checks for lab07: ``assign_buckets(params, bucket_cap_mb)`` and the learner's bucketed,
hook-driven data-parallel wrapper (a class with ``finish_gradient_synchronization()``).

``check_assign_buckets`` runs in this process on eleven sets of parameters (SmallCNN at two
caps, parameters larger than the cap, float64 parameters, parameters exactly the size of the
cap, a cap that holds the whole model, a frozen layer, a bucket boundary between 1 MB and
1 MiB, three models of several dtypes). It asks for DDP's rule — add the parameter to the
open bucket of its dtype, close the bucket once it has reached the cap — with the buckets
in the order they complete, and names: forward order, a
bucket closed before the next parameter would exceed the cap (the other usual rule, not
DDP's), a bucket left open when it lands exactly on the cap (closed only once over it), a
bucket per parameter, everything in one bucket, elements counted instead of bytes, 4
bytes assumed per element, a cap counted in MB (10**6 bytes) instead of MiB, parameters lost
or repeated, frozen parameters bucketed or weighed, two dtypes in one bucket, a bucket closed
when the dtype changes, one byte count for all dtypes, the buckets in the order they were
opened, the still-open buckets put last (torch's own list when DDP rebuilds; the order they
complete is the lab's rule) or the dtypes one after the other (judged over the three mixed
cases at once).
``check_bucket_prediction`` compares the learner's predicted bucket count for part 1's puzzle
with torch's own reducer function, run on it.

``check_bucketed_ddp`` runs the class for 3 steps on 2 ranks (4 buckets that fill out of
order) and then 3 ranks (another cap, 3 buckets), on a model with a frozen parameter whose
output layer is registered before the hidden layer it follows; then real
``DistributedDataParallel`` on the same shards. While the learner's class runs,
``dist.all_reduce`` is replaced by a spy that records every call (size, the buffer's storage,
``async_op``, when it was launched and when it was waited on), fills the learner's buffer with
NaN while the all-reduce is in flight, and hands the reduced values over **only when the
handle is waited on**. A hook registered before the learner's own stores each local gradient
and the moment it arrived. From that record the check names: a hook on the frozen parameter,
one all-reduce per parameter, messages that are not a bucket's flat buffer, a blocking
all-reduce, buckets launched out of bucket order, a bucket launched before all of its
gradients had arrived in this step (a bucket judged complete by `p.grad is not None`, which
zero_grad(set_to_none=False) makes true for all), a bucket launched later than it could have
been (every one only at the end of the backward, or after the backward), waiting inside the
hook, not waiting, no reset between steps, old handles waited on again, values read before
wait(), an all-reduce of a temporary, gradients that are not views of their bucket (or whose
fresh gradient never reached the bucket: a view made p.grad once and trusted, or p.grad
pointed back at the view and the fresh tensor dropped), views that
overlap or point into another bucket, add_ where copy_ belongs (three ways), a missing or
fixed division; a value wrong in no known way gets the launch and arrival times of its bucket.
Then parameters the second step leaves out (in the first bucket, in the last, in both): no
error, an error that names them wrongly or names only the first waiting bucket's, and an error
raised with launched all-reduces still in flight.

``check_topk_hook`` (the stretch) runs the learner's DDP communication hook — top-k with
error feedback — in real DDP on 2 and 3 ranks and compares every call with a replay of the
algorithm on the same buckets (see the section's comment below); right values are then held
to the lab's asynchrony: no blocking collective in the hook, and a future still pending when
the hook returns on a rank that arrived ahead of the others. Among the wrong values it names,
by replaying each: no error feedback, values not magnitudes, a residual kept from this call's
gradient instead of the corrected one, or never cleared, a sum or an overwrite, the division.

A mistake met again in this kernel gets its fix, which says what to reconsider and where
(a lesson 07 section, a hint), never the code to type.

``measure_launches`` and ``check_prediction`` are the lab's predict-then-measure cell: on
part 2's model, whose bucket 1 fills before bucket 0, how many gradients have arrived when the
learner's own wrapper launches bucket 1 (its in-order launch: after bucket 0, not when full).

This module holds the public checks of part 1 and the stretch and names every other one; each
idea has a module of its own: part 1's rules and cases in
:mod:`~dpcourse.checks._lab07_buckets` and its puzzle in :mod:`~dpcourse.checks._lab07_puzzle`;
part 2's test bench (model, collective spy, storage census) in
:mod:`~dpcourse.checks._lab07_bench`, its runs on 2 and 3 ranks in
:mod:`~dpcourse.checks._lab07_bucketed`, its two extra models (two dtypes, an unused
parameter) in :mod:`~dpcourse.checks._lab07_cases` and the diagnosis of a step in
:mod:`~dpcourse.checks._lab07_diagnose`; the prediction in :mod:`~dpcourse.checks._lab07_predict`;
the stretch's probe, worker, replay and diagnosis in :mod:`~dpcourse.checks._lab07_topk`.
"""

from __future__ import annotations

from . import check_timeout, fail, passed, recorded, require_answer
from ._lab07_bench import CONFIGS, DEFAULT_TIMEOUT
from ._lab07_bucketed import check_bucketed_ddp
from ._lab07_buckets import (_DDP_CLOSING_FIX, _LIBRARY_ASSIGNMENT, _OTHER_RULES,
                             _TORCH_ASSIGNMENT, MiB, _bucket_cases, _calls_torch_assignment,
                             _frozen_problem, _is_library_assignment, _mb_cap_problem,
                             _no_library_assignment, _no_torch_assignment, _reverse_walk,
                             bucket_problem, mixed_problem, order_rule_of)
from ._lab07_puzzle import (BUCKET_QUESTION, PUZZLE, PUZZLE_CAP_MB, _puzzle_params,
                            explain_puzzle, show_bucket_puzzle)
from ._lab07_predict import (PREDICTION_BUCKET, PREDICTION_CAP_MB, PREDICTION_QUESTION,
                             check_prediction, measure_launches, show_prediction_model)
from ._lab07_topk import (_HOOK_STEPS, _SENT_PER_ENTRY, HOOK_FRACTION, HOOK_WORLD_SIZES,
                          _diagnose_hook, _launch_hook, _topk_worker)

__all__ = ["check_assign_buckets", "show_bucket_puzzle", "check_bucket_prediction",
           "check_bucketed_ddp", "check_topk_hook", "check_prediction", "measure_launches",
           "show_prediction_model", "CONFIGS", "DEFAULT_TIMEOUT", "HOOK_WORLD_SIZES",
           "HOOK_FRACTION", "PREDICTION_CAP_MB", "PREDICTION_BUCKET", "PREDICTION_QUESTION",
           "BUCKET_QUESTION"]


# --------------------------------------------------------------------------------------------
# assign_buckets (its cases, rules and sentences: _lab07_buckets)
# --------------------------------------------------------------------------------------------


@recorded
def check_assign_buckets(assign_buckets) -> None:
    """Run ``assign_buckets(params, bucket_cap_mb)`` on eleven sets of parameters and caps."""
    __tracebackhide__ = True
    require_answer(assign_buckets, "assign_buckets")
    if _is_library_assignment(assign_buckets):
        fail(_LIBRARY_ASSIGNMENT)
    if _calls_torch_assignment(assign_buckets):
        fail(_TORCH_ASSIGNMENT)
    counts, problems, got, answers, problems_at = [], [], [], [], []
    library = []            # per case that called the course's reference: answer == its answer?
    cases = _bucket_cases()
    for what, everything, cap in cases:
        try:
            with _no_torch_assignment() as called, _no_library_assignment() as ours:
                buckets = assign_buckets(list(everything), cap)
        except NotImplementedError:
            raise
        except Exception as exc:
            fail(f"assign_buckets raised {type(exc).__name__}: {exc} ({what}).")
        if ours:        # the course's reference called: is the answer simply its answer?
            from ..overlap import assign_buckets as reference
            same = [[id(p) for p in b] for b in reference(
                [p for p in everything if p.requires_grad], cap)]
            try:
                library.append([[id(p) for p in b] for b in buckets] == same)
            except TypeError:
                library.append(False)
        if called:
            fail(_TORCH_ASSIGNMENT)
        answers.append(buckets)
        ids = {id(p): i for i, p in enumerate(p for p in everything if p.requires_grad)}
        try:
            got.append([[ids.get(id(p)) for p in b] for b in buckets])
        except TypeError:
            got.append(None)
    if library and all(library):    # the course's reference, handed on unchanged
        fail(_LIBRARY_ASSIGNMENT)
    several = [len({p.dtype for p in ps}) > 1 for _, ps, _ in cases]
    # the order of the buckets, judged over every case of several dtypes at once
    how = order_rule_of([g for g, s in zip(got, several) if s])
    for (what, everything, cap), buckets, mixed in zip(cases, answers, several):
        params = [p for p in everything if p.requires_grad]
        problem = (_frozen_problem(buckets, everything, cap, what)
                   or (mixed_problem(buckets, params, cap, what, how) if mixed
                       else bucket_problem(buckets, params, cap, what)))
        problems_at.append(problem)
        if problem:
            problems.append(problem)
        else:
            counts.append(len(buckets))
    # the cases of one dtype and no frozen parameter (those have sentences of their own)
    plain = [k for k, (_, ps, _) in enumerate(cases)
             if all(p.requires_grad for p in ps) and len({p.dtype for p in ps}) == 1]
    if problems and all(got[k] is not None for k in plain):
        mb = _mb_cap_problem(got, cases, plain)
        if mb:
            fail(mb, fix=mb.fix)
        # Sizes measured in the wrong unit give buckets that are right for that unit in
        # every case: name the unit rather than the first over-full bucket.
        for variant, size_of in (("counted elements (p.numel()) as bytes", lambda p: p.numel()),
                                 ("assumed 4 bytes per element", lambda p: 4 * p.numel())):
            predicted = [_reverse_walk(cases[k][1], cases[k][2] * MiB, size_of) for k in plain]
            if [got[k] for k in plain] == predicted:
                k = next(k for k in plain if problems_at[k])
                what, ps, cap = cases[k]
                right = _reverse_walk(ps, cap * MiB)
                fail(f"the buckets are what you get if you {variant}, so the cap was compared "
                     f"with a number that is not the parameter's bytes ({what}: "
                     f"{len(got[k])} bucket(s) where DDP makes {len(right)}). The cap bounds "
                     f"each message's bytes on the wire, and an element's bytes depend on its "
                     f"dtype ({ps[0].dtype} here: {ps[0].element_size()} each).",
                     fix=("reconsider what the cap bounds — a message's bytes — and how many "
                          "bytes one element of each dtype takes."))
        for rule, sentence in _OTHER_RULES:
            predicted = [rule([p.numel() * p.element_size() for p in cases[k][1]],
                              cases[k][2] * MiB) for k in plain]
            if [got[k] for k in plain] == predicted:
                ddps = {k: len(_reverse_walk(cases[k][1], cases[k][2] * MiB)) for k in plain}
                k = next((k for k in plain if len(got[k]) != ddps[k]), plain[0])
                fail(sentence.format(example=f"{cases[k][0]}: {len(got[k])} bucket(s) where "
                                             f"DDP makes {ddps[k]}"), fix=_DDP_CLOSING_FIX)
    if problems:
        fail(problems[0], fix=problems[0].fix)
    passed(f"assign_buckets: reverse order, each bucket closed once it reached the cap, in bytes, "
           f"frozen parameters in no bucket, one open bucket per dtype, buckets in the order "
           f"they complete ({'/'.join(map(str, counts))} buckets in the {len(cases)} cases)")


def check_bucket_prediction(guess, assign_buckets=None) -> None:
    """Compare the learner's predicted number of buckets for part 1's puzzle with the buckets
    torch's own reducer function makes of it (run now), and say why, and what the other counts
    would have meant; with ``assign_buckets``, say whether the learner's makes the same."""
    __tracebackhide__ = True
    from . import reveal

    learners = None
    if assign_buckets is not None:
        params = _puzzle_params()
        ids = {id(p): i for i, p in enumerate(params)}
        try:
            learners = [[ids.get(id(p)) for p in b] for b in assign_buckets(params, PUZZLE_CAP_MB)]
        except NotImplementedError:
            raise
        except Exception as exc:
            fail(f"assign_buckets raised {type(exc).__name__}: {exc} (part 1's "
                 f"{len(PUZZLE)} parameters).", fix="make part 1's check pass first.")
    count, why = explain_puzzle(guess, learners)
    reveal(guess, count, close=guess.value == count, explanation=why)


# --------------------------------------------------------------------------------------------
# Stretch: a top-k communication hook with error feedback (its probe, worker, replay and
# diagnosis: _lab07_topk)
# --------------------------------------------------------------------------------------------


@recorded
def check_topk_hook(hook, state_cls, world_sizes=HOOK_WORLD_SIZES, fraction=HOOK_FRACTION,
                    timeout: float | None = None) -> None:
    """Run the learner's comm hook in real DDP (probe model, 12 steps, two buckets after DDP's
    rebuild) on 2 and 3 ranks; compare every hook call with top-k + error feedback replayed on
    the same buckets, weigh what each rank sends, and name the mistake when they differ."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    require_answer(hook, "topk_hook")
    for world_size in world_sizes:
        results = _launch_hook(hook, state_cls, world_size, fraction, timeout)
        _diagnose_hook(results, world_size, state_cls(fraction).k)
    shown = " and ".join(map(str, world_sizes))
    passed(f"{getattr(hook, '__name__', 'hook')}: top-k with error feedback equals the replay "
           f"on {shown} ranks for {_HOOK_STEPS} steps, sending ≤ {_SENT_PER_ENTRY} bytes per "
           f"selected entry (a float32 value and an int64 index; {fraction:.0%} of the "
           f"entries), still in flight when the hook returned")
