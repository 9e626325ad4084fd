"""Check for lab 10: five broken torchrun scripts; the learner names each bug and fixes it.

The scripts live in ``lib/dpcourse/scripts/lab10/`` (:func:`script` reads one, :func:`show`
prints it with line numbers and the multiple-choice options). Each trains the same tiny model
on the same tiny data for three epochs on every rank and saves rank 0's weights to ``--out``.
None of the five is a bug lesson 10 shows:

1. ``bug1_sampler.py`` — each rank's DistributedSampler has its own seed: the ranks take their
   slices of *different* permutations, so an epoch reads some examples twice, others never;
2. ``bug2_loader.py``  — the sampler is built but the loader shuffles by itself: every rank
   reads the whole data set, in the same order (the ranks duplicate each other);
3. ``bug3_clip.py``    — each rank clips its own gradient before the average: the replicas
   agree, but the clipped norm is a rank's, not the global batch's;
4. ``bug4_start.py``   — every rank broadcasts with ``src=rank``: each thinks it is the sender,
   nobody receives, and the run hangs before the first step. A fix that deletes the broadcast
   (or seeds every rank alike instead), sends after the first forward or names a sender the
   group lacks is refused by its text, each by its own cause (:mod:`._lab10_start`);
5. ``bug5_mean.py``    — the loss is divided by the world size *and* the gradients are
   averaged: divided twice, every step world_size times too small. Its fix carries the lab's
   design decision, three answers :func:`check_decision` judges against the repair the fix
   made (:func:`kept_division`).

:func:`check_answer` judges a multiple-choice answer and says why a wrong option is not it.
:func:`check_fixes` runs the fixed scripts under torchrun (all at once, for time), loads the
weights each one saved, and compares them with :func:`simulate`: the same training, every
rank's replica in this one process, done right. A data-parallel run done right equals it to
float tolerance; when a fix does not, :func:`simulate` replays each known mistake, and the
check names the one whose weights the script reproduced. Bug 5's fix runs on 3 ranks (a
``/ 2`` is right on 2 ranks only), every fix with ``--seed 3`` (a fix that hard-codes the seed
fails).

Stretch: :func:`check_replicas_in_sync` — the learner's detector for replicas that differ, run
on 3 ranks over a grid of cases, and judged from the evidence the grid gives: which rank differs
(0, 1, 2), which parameter (the first, the last, a bfloat16 or float64 one of odd size in a
second model, and a 0-dim one there), and how (0.5 off; then a +1e-3/-1e-3 pair, a position-weighted pair, a swap, a
sign flip, one unit in the last place in float32 and in float64, +0.0 against -0.0, NaNs of
other bits). A spy records the one number each rank passes into a collective: verdicts that go
in unlike and come out "in sync" on every rank name a combination that lets "same" win.
"Exactly equal" is the same bits: the same NaN on every replica is in sync. It must return a
Python bool.
Used in solutions/lab10_bug_hunt.py; tests in tests/test_lab10_checks.py. This module holds
the learner's diagnosis (:func:`check_line`, :func:`check_answer`) and the judgement of the fixes
(:func:`check_fix`, :func:`check_fixes`, :func:`judge_fix`, and what a fix's text shows before
any launch). One idea per module besides, every name importable from here:
:mod:`dpcourse.checks._lab10_scripts` (the five scripts and what the learner is asked about
each), :mod:`dpcourse.checks._lab10_edit` (the line tools), :mod:`dpcourse.checks._lab10_simulate`
(the reference run and the mistakes it replays), :mod:`dpcourse.checks._lab10_run` (a fixed
script run under torchrun), :mod:`dpcourse.checks._lab10_start` (bug 4: where the replicas'
first weights come from), :mod:`dpcourse.checks._lab10_decision` (bug 5's design decision),
:mod:`dpcourse.checks._lab10_predict` (the prediction about script 1) and
:mod:`dpcourse.checks._lab10_detector` (the stretch).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from dpcourse.checks import check_timeout, fail, passed, recorded
from dpcourse.checks._lab10_decision import KEPT, LOSS_HOLDS, check_decision, kept_division
from dpcourse.checks._lab10_detector import _mixed_model, check_replicas_in_sync
from dpcourse.checks._lab10_edit import delete_line, insert_line, move_line
from dpcourse.checks._lab10_predict import check_prediction, examples_read
from dpcourse.checks._lab10_run import _MISMATCHED, run_fix
from dpcourse.checks._lab10_scripts import (ANSWERS, BUG_LINES, CHOICES, CLIP, EFFECT, EFFECTS,
                                            KNOWN_EFFECTS, LOOK_AGAIN, MADE_OF, ORDER_LINES,
                                            SCRIPT_DIR, SCRIPTS, SEED, WORLD_SIZES, _is_number,
                                            bug_lines, options, script, show)
from dpcourse.checks._lab10_simulate import BUGS, SUSPECTS, TOL, _data, _distance, simulate
from dpcourse.checks._lab10_start import (_end_gap, _mask_agreement, _name_hang, _read_fix_4,
                                          _start_gap)

# _mixed_model, _MISMATCHED, _data, _start_gap, _end_gap and _mask_agreement are imported for
# tests/test_lab10_checks.py, which reads them through this module

__all__ = ["SCRIPTS", "CHOICES", "ANSWERS", "BUGS", "BUG_LINES", "EFFECTS", "script", "show",
           "options",
           "bug_lines", "check_line", "move_line", "delete_line", "insert_line", "check_answer", "simulate", "run_fix",
           "judge_fix", "check_fix", "check_fixes", "examples_read", "check_prediction",
           "check_replicas_in_sync", "kept_division", "check_decision", "KEPT",
           "LOSS_HOLDS"]


@recorded(name="check_line {n}")
def check_line(n: int, line, effect) -> None:
    """The learner's own diagnosis of bug ``n``, before any option: ``line`` is the number of
    the line (as :func:`show` prints it) where the bug is, ``effect`` the number that answers
    the bug's question about what the script does (:data:`EFFECTS`), worked out from its lines.
    ``effect`` is judged first: a wrong number leaves the line unjudged, so trying line numbers
    confirms nothing. A right line then prints the options for :func:`check_answer`; a wrong
    one is sent back with a question, and from the second wrong line for the same bug on, with
    a request to work out the line's effect first."""
    __tracebackhide__ = True
    if n not in SCRIPTS:
        raise ValueError(f"there are five bugs, 1 to 5; got {n!r}")
    if line is None or line is Ellipsis or effect is None or effect is Ellipsis:
        raise NotImplementedError(f"write line{n} and effect{n} first, then run this check.")
    lines = script(n).splitlines()
    if isinstance(line, bool) or not isinstance(line, int) or not 1 <= line <= len(lines):
        fail(f"line{n} should be one line number of {SCRIPTS[n]}, 1 to {len(lines)} as the "
             f"listing numbers them; got {line!r}.")
    question, answer, tol, how = EFFECTS[n]
    if not _is_number(effect) or effect != effect:
        fail(f"effect{n} should be a number ({question}); got {effect!r}.")
    # the fact first: a line is neither confirmed nor refused for a wrong number, so trying
    # line numbers with any number finds nothing
    if abs(float(effect) - answer) > tol:
        why = next((cause for value, near, cause in KNOWN_EFFECTS.get(n, ())
                    if abs(float(effect) - value) <= near), MADE_OF[n])
        fail(f"effect{n} = {effect!r} is not what {SCRIPTS[n]} does ({question}), so line "
             f"{line} is not judged: {why}.", fix=how)
    code = lines[line - 1].strip() or "(a blank line)"
    if any(piece in lines[line - 1] for piece in ORDER_LINES.get(n, ())):
        passed(f"bug {n} is the order of two lines, and line {line} is one side of it: the "
               f"average comes after the clip (moving the all-reduce above the clip repairs it "
               f"too). The options speak of the other side, line {bug_lines(n)[0]}: the clip, "
               f"which runs on this rank's own gradient. Now set answer{n}.")
        options(n)
        return
    if line not in bug_lines(n):
        fail(f"Line {line} (`{code}`) is not where bug {n} is: it does here what it would do in "
             f"a correct script. To find the line, {LOOK_AGAIN[n]}.",
             fix=f"Trying lines one by one finds a line, not the reason. Before the next one, "
                 f"read the line you suspect and work out what it does to the run — "
                 f"{EFFECT[n]} — and try it only if that differs from one device training on "
                 f"the global batch.")
    other = [str(i) for i in bug_lines(n) if i != line]
    also = f"; line {' and '.join(other)} is the other half of it, and counts too" if other else ""
    passed(f"bug {n} is on line {line} (effect{n} = {effect:g}{also}). Now say what is wrong "
           f"there: set answer{n} to the option that says it.")
    options(n)


@recorded(name="check_answer {n}")
def check_answer(n: int, answer) -> None:
    """Judge the multiple-choice answer for bug ``n``: say why a wrong option is not it."""
    __tracebackhide__ = True
    if n not in CHOICES:
        raise ValueError(f"there are five bugs, 1 to 5; got {n!r}")
    letters = [o for o, _, _ in CHOICES[n]]
    if not isinstance(answer, str) or answer.strip().upper() not in letters:
        fail(f"Answer bug {n} with one letter among {', '.join(letters)}; got {answer!r}.")
    answer = answer.strip().upper()
    why = next(w for o, _, w in CHOICES[n] if o == answer)
    if why is not None:
        fail(f"Bug {n} is not {answer}: {why}")
    passed(f"bug {n}: {next(t for o, t, _ in CHOICES[n] if o == answer)}")


# --- what a fix shows before any launch, and the judgement of its weights -------------------

def _precheck(n: int, text) -> None:
    """Everything that needs no launch: a TODO left, not a script, unchanged, not Python."""
    __tracebackhide__ = True
    if n not in SCRIPTS:
        raise ValueError(f"there are five scripts, 1 to 5; got {n!r}")
    if text is None or text is Ellipsis or "NotImplementedError" in str(text):
        raise NotImplementedError(f"the fix for bug {n} is still a TODO: write the fixed "
                                  f"script's text, then run this check.")
    if not isinstance(text, str):
        fail(f"The fix for bug {n} should be the fixed script's text (a str), got "
             f"{type(text).__name__}.")
    if text.strip() == script(n).strip():
        fail(f"The fix for bug {n} is the broken script unchanged: did the replace() find "
             f"the text it looks for?")
    try:
        compile(text, SCRIPTS[n], "exec")
    except SyntaxError as err:
        fail(f"The fix for bug {n} is not valid Python (line {err.lineno}: {err.msg}).")
    _read_fix(n, text)


def _lines_with(text: str, piece: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if piece in ln and not
            ln.strip().startswith("#")]


def _clip_in_average_loop(text: str) -> bool:
    """Whether a ``clip_grad_norm_`` call sits inside a ``for`` loop whose body also all-reduces
    (the per-parameter averaging loop of script 3), at any depth of that loop's body."""
    import ast

    def calls(node, name):
        return any(isinstance(c, ast.Call) and name in ast.unparse(c.func)
                   for c in ast.walk(node))

    loops = [node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.For)]
    # the innermost loops that all-reduce: the epoch and batch loops hold the averaging loop
    averaging = [loop for loop in loops if calls(loop, "all_reduce")
                 and not any(inner is not loop and calls(inner, "all_reduce")
                             for inner in ast.walk(loop) if isinstance(inner, ast.For))]
    return any(calls(loop, "clip_grad_norm_") for loop in averaging)


def _read_fix(n: int, text: str) -> None:
    """Mistakes a fix shows in its text, said before any launch — the ones whose weights alone
    cannot tell (a learning rate that makes up for a gradient, clipping that changes nothing)."""
    __tracebackhide__ = True
    if n == 1:
        for line in _lines_with(text, "DistributedSampler("):
            seed = re.search(r"seed\s*=\s*([^,)]*)", line)
            if seed and re.search(r"\brank\b", seed.group(1)):
                cause, fix = BUGS["sampler_seed_rank"]
                fail(f"Fix 1: {cause} (its seed is `{seed.group(1).strip()}`)", fix=fix)
    if n == 3:
        lines = text.splitlines()
        clip = [i for i, ln in enumerate(lines) if "clip_grad_norm_" in ln]
        step = [i for i, ln in enumerate(lines) if "opt.step()" in ln]
        if clip and step and min(clip) > max(step):
            fail("Fix 3: clip_grad_norm_ now runs after opt.step(): the step has already used "
                 "the gradients, so clipping them afterwards changes no weight.")
        if _clip_in_average_loop(text):
            fail("Fix 3: clip_grad_norm_ now runs inside the loop that averages the gradients, "
                 "once per parameter, on gradients of which some are already summed over the "
                 "ranks and others are still this rank's own.",
                 fix="Clip once, after that loop has averaged every gradient: a line inserted "
                     "or moved before a line of the loop takes that line's indentation.")
    if n == 4:
        for line in _lines_with(text, "dist.broadcast("):
            if re.search(r"src\s*=\s*rank\b", line):
                fail("Fix 4: the broadcast still names src=rank: every rank names itself as "
                     "the one that sends, so no rank receives.",
                     fix="A rooted collective needs the same root on every rank.")
        _read_fix_4(text)
    if n == 5 and _lines_with(text, "lr") != _lines_with(script(5), "lr"):
        fail("Fix 5: you changed the learning rate to make up for the gradients: they are "
             "still divided by world_size twice, and a larger lr undoes that for SGD only — "
             "Adam, weight decay or clipping would see gradients world_size times too small.",
             fix="Keep the learning rate and divide once.")


def judge_fix(n: int, weights) -> None:
    """Nothing if ``weights`` (or the sentence :func:`run_fix` returned) are right for bug
    ``n``; else fail naming the bug the weights reproduce."""
    __tracebackhide__ = True
    if isinstance(weights, str):
        fail(f"Fix {n}: {weights}")
    ws, clip = WORLD_SIZES[n], CLIP.get(n)
    # script 4 seeds every rank differently: a right fix starts every replica from one rank's
    # weights, whichever rank sends them
    senders = range(ws) if n == 4 else (0,)
    d = min(_distance(weights, simulate(ws, clip=clip, init_from=s)) for s in senders)
    if d <= TOL:
        return
    for name in SUSPECTS[n]:
        if _distance(weights, simulate(ws, variant=name, clip=clip)) <= TOL:
            cause, fix = BUGS[name]
            fail(f"Fix {n}: {cause}", fix=fix)
    fail(f"Fix {n}: the final weights differ from a correct run on {ws} ranks by up to {d:.3g} "
         f"and match none of the mistakes the check knows.",
         fix="Change only what the bug needs.")


@recorded(name="check_fix {n}")
def check_fix(n: int, text: str, timeout: float | None = None,
              launcher: str = "torchrun") -> None:
    """Run one fixed script under torchrun (``timeout``: 60 s, or ``DPCOURSE_CHECK_TIMEOUT`` if
    more) and compare its weights with the reference."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, 60.0)
    _precheck(n, text)
    judge_fix(n, _name_hang(n, text, run_fix(n, text, timeout, launcher)))
    passed(f"fix {n}: the weights equal a correct data-parallel run on {WORLD_SIZES[n]} ranks")


@recorded
def check_fixes(fixes: dict, timeout: float | None = None, launcher: str = "torchrun") -> None:
    """Run every fixed script under torchrun at the same time (a launch costs seconds) and
    judge each, in order (``timeout`` per script: 60 s, or ``DPCOURSE_CHECK_TIMEOUT`` if more)."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, 60.0)
    if not isinstance(fixes, dict) or not fixes:
        fail("Pass a dict {bug number: fixed script text}, e.g. {1: fixed1, 2: fixed2}.")
    for n in sorted(fixes):
        _precheck(n, fixes[n])
    with ThreadPoolExecutor(max_workers=len(fixes)) as pool:
        results = dict(zip(sorted(fixes), pool.map(
            lambda n: run_fix(n, fixes[n], timeout, launcher), sorted(fixes))))
    for n in sorted(fixes):
        judge_fix(n, _name_hang(n, fixes[n], results[n]))
    passed(f"fixes {', '.join(map(str, sorted(fixes)))}: every script ends with the weights "
           f"of a correct data-parallel run")
