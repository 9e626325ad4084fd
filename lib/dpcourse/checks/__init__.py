"""Lab checks: one short line when the learner's code is right, one sentence naming the mistake
when it is not.

Each lab has its own module (``dpcourse.checks.lab01`` ...). A check runs the learner's function
on small inputs, compares it with the reference in the library, and — where a plausible wrong
answer leaves a recognisable trace (gradients N times too big, weights unchanged, a rank that
never returns) — says which mistake it is. tests/test_lab*_checks.py prove that each named
mistake is caught.

What every check shares lives here, once:

* :func:`recorded`, the decorator above every public check: when ``DPCOURSE_PROGRESS`` names a
  file, each check appends one JSON line to it (learner, lab, check, passed or the mistake
  named, time) for the instructor's table (``python -m dpcourse progress PATH``,
  :mod:`dpcourse.tools.progress`). Writing it never fails the learner's cell.
* :func:`check_timeout` and :func:`slowness`: a multi-process check takes ``timeout=`` (seconds);
  ``DPCOURSE_CHECK_TIMEOUT`` raises every check's default for a whole class (a crowded server
  makes a right answer slow), and a timeout's message says it may be slowness, not a deadlock.
* :func:`run_ranks`: a launch of the learner's code on N ranks whose timeout, unfilled TODO or
  exception becomes the one sentence a check says.
* :func:`predict` and :func:`reveal`: a prediction the learner writes before a measurement, and
  the comparison a lab's check makes afterwards, both recorded for the instructor's table.
* :func:`fail`'s ``fix=``: a sentence names the mistake's cause; what to change joins it only
  when the same mistake comes back (``DPCOURSE_FIX_AFTER``, :func:`fix_after`).
* :func:`refuse_reference`: a check refuses the library's own reference answer passed as the
  learner's (the lab asks for the learner's code, and the library's passes every check).

ARCHITECTURE.md at the repository root says where this sits in the library.
"""

from __future__ import annotations

import ast
import contextvars
import dataclasses
import datetime
import numbers
import functools
import getpass
import inspect
import json
import os
import re
import sys
import textwrap
import time

__all__ = ["LabCheckError", "ClaimError", "passed", "fail", "fix_after", "claim", "has_todo", "require_answer",
           "refuse_reference", "recorded", "Prediction", "predict", "reveal", "keep",
           "kept_prediction", "wrong_answers", "forget",
           "check_timeout", "slowness", "run_ranks", "short_mistake", "PROGRESS_ENV",
           "TIMEOUT_ENV", "LEARNER_ENV", "FIX_AFTER_ENV"]

PROGRESS_ENV = "DPCOURSE_PROGRESS"  # a file: every check appends one JSON line to it
LEARNER_ENV = "DPCOURSE_LEARNER"  # who the learner is (else JUPYTERHUB_USER, else the OS user)
TIMEOUT_ENV = "DPCOURSE_CHECK_TIMEOUT"  # seconds: the least timeout any multi-process check uses


class LabCheckError(AssertionError):
    """The learner's answer is wrong; the message names the mistake in one sentence."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def _render_traceback_(self) -> list[str]:
        """What IPython shows in place of the traceback (``InteractiveShell.showtraceback``
        asks an exception for this first): the sentence alone. The frames would print the
        check's own source around the failing line, and with it the fix that :func:`fail`
        holds back until the mistake comes again."""
        return [f"{type(self).__name__}: {self.message}"]


def passed(what: str) -> None:
    """Print the one-line success message.

    Returns None on purpose: a check is usually the last line of a lab cell, and a returned
    string would be echoed there as a second copy of the line.
    """
    print(f"✔ {what}")


FIX_AFTER_ENV = "DPCOURSE_FIX_AFTER"  # the how-many-th time a mistake is met shows its fix
_FIX_AFTER_DEFAULT = 2
_FIX_LATER = ("(Run the check again after your change: if this same mistake comes back, the "
              "check will say what to change.)")
_mistakes_met: dict[tuple[str, str, str], int] = {}  # (learner, check, fix) -> times met here


def fix_after() -> int:
    """How many times a learner meets the same mistake before a check's sentence adds its fix:
    ``DPCOURSE_FIX_AFTER`` (1 shows the fix at once; an instructor may set it for a short
    workshop), else 2: the first time, the sentence names the cause and leaves the change to
    the learner."""
    raw = os.environ.get(FIX_AFTER_ENV, "").strip()
    try:
        return max(1, int(raw)) if raw else _FIX_AFTER_DEFAULT
    except ValueError:
        return _FIX_AFTER_DEFAULT


def fail(message: str, *, fix: str | None = None):
    """Raise LabCheckError without our own frames cluttering the learner's traceback.

    ``message`` names the mistake by its cause (what the check saw, and why it is wrong).
    ``fix``, when given, is what to change; it joins the sentence only when the learner meets
    the same mistake (same check, same fix) again in this kernel — see :func:`fix_after` — so
    the first meeting is a cause to reason from, not a line to copy."""
    __tracebackhide__ = True  # pytest and IPython hide this frame
    if fix:
        key = (learner(), _current_check.get() or "", fix)
        met = _mistakes_met[key] = _mistakes_met.get(key, 0) + 1
        message = message.rstrip()
        if met < fix_after():
            tail = _FIX_LATER
        elif message.endswith((".", "!", "?", ")")):   # a new sentence, with its own opening
            tail = f"What to change: {fix}"
        else:
            tail = fix
        message = f"{message} {tail}"
    raise LabCheckError(message)


def has_todo(obj) -> bool:
    """True if a function, or any method of a class, still raises NotImplementedError at the
    top level of its body: a lab TODO left as generated. Checks call it before starting ranks,
    so an unfilled lab stops at once with NotImplementedError. False if the source is not
    available."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body:
                if isinstance(stmt, ast.Raise) and stmt.exc is not None:
                    exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
                    if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                        return True
    return False


def require_answer(answer, name: str, kind: str = "function") -> None:
    """A check's first lines: ``answer`` must be the learner's ``kind`` ("function" or "class")
    itself, not a call's result or an instance (a :func:`fail` naming ``name``), and its TODOs
    must be replaced (``NotImplementedError``, before any rank starts)."""
    __tracebackhide__ = True
    if kind == "class":
        if not isinstance(answer, type):
            fail(f"the check needs your class itself ({name}, not {name}(...)), got "
                 f"{type(answer).__name__}.")
    elif not callable(answer) or isinstance(answer, type):
        fail(f"the check needs your function itself ({name}), got {type(answer).__name__}.")
    if has_todo(answer):
        where = " in a method" if kind == "class" else ""
        raise NotImplementedError(f"{name} still raises NotImplementedError{where}: replace the "
                                  f"TODOs with your answer.")


def refuse_reference(answer, name: str, *references, why: str = "") -> None:
    """Fail when ``answer`` is one of the library's ``references`` (the function or class a
    lesson imports, e.g. ``dpcourse.train.train_one_epoch``): it passes the check by
    construction, so passing it proves nothing. ``why`` may add what the lab wants instead."""
    __tracebackhide__ = True
    for ref in references:
        if answer is ref or (getattr(answer, "__code__", None) is not None
                             and getattr(answer, "__code__", None) is getattr(ref, "__code__", 0)):
            where = f"{getattr(ref, '__module__', 'dpcourse')}.{getattr(ref, '__qualname__', name)}"
            fail(f"{name} is the library's own reference answer ({where}), which this check "
                 f"is built to accept: the lab asks for your own {name}"
                 + (f" — {why.rstrip('.')}." if why else "."))


class ClaimError(AssertionError):
    """A lesson's claim did not hold on this run; the message names the claim and its values."""


def claim(statement: str, condition, **values) -> None:
    """State a lesson's claim and prove it: print ``✔ statement`` if ``condition`` is true,
    otherwise raise :class:`ClaimError` naming the claim and the values it was judged on.

    Every fact a lesson prints goes through here (ARCHITECTURE.md, the course's conventions); a test
    (tests/test_notebooks.py) fails on a notebook that prints a bare boolean instead. Pass the
    numbers behind the claim as keyword arguments: they are shown only when the claim fails, so
    the stored output stays stable while a failure says exactly what was measured::

        claim("the loss fell", last < first, first=first, last=last)
    """
    __tracebackhide__ = True
    try:
        ok = bool(condition)
    except Exception as err:  # e.g. the truth value of a multi-element tensor
        raise TypeError(f"claim {statement!r}: the condition must be a single true/false value, "
                        f"got {type(condition).__name__} ({err})") from None
    if not ok:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in values.items())
        raise ClaimError(f"claim failed: {statement}" + (f" ({shown})" if shown else ""))
    # Returns None on purpose: a returned string would be echoed a second time when the call
    # ends a notebook cell.
    print(f"✔ {statement}")


def _short(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- the class's progress: one JSON line per check ---------------------------------------------

_MESSAGE_LIMIT = 400  # characters of the mistake kept in a line: a line stays far below 4 KiB
_SHORT_LIMIT = 60
_inside_check = contextvars.ContextVar("dpcourse_inside_check", default=False)
_current_check = contextvars.ContextVar("dpcourse_current_check", default="")
_write_problems: set = set()


def learner() -> str:
    """Who is running the check: ``DPCOURSE_LEARNER``, else ``JUPYTERHUB_USER`` (set in every
    server a JupyterHub spawns), else the OS user."""
    for name in (LEARNER_ENV, "JUPYTERHUB_USER"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    try:
        return getpass.getuser()
    except Exception:  # no user name known to the OS (some containers)
        return "unknown"


def short_mistake(message: str, limit: int = _SHORT_LIMIT) -> str:
    """The mistake a check named, cut to its first clause (up to the first ``:``, ``;``, `` — ``
    or sentence end) and to ``limit`` characters: what fits in a cell of the class table."""
    text = " ".join(str(message).split())
    for sep in (": ", "; ", " — ", ". "):
        head = text.split(sep, 1)[0]
        if head:
            text = head
    text = text.rstrip(".")
    if len(text) > limit:
        text = text[: limit - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"
    return text


def _progress_line(lab: str, check: str, outcome: str, message: str, seconds: float,
                   **extra) -> bytes:
    """One record of the progress file, encoded; ``extra`` keys are added (or replace)."""
    entry = {
        "learner": learner(),  # first key: a reader finds a record's start by it
        "lab": lab,
        "check": check,
        "passed": outcome == "passed",
        "outcome": outcome,  # passed, mistake, todo (an unfilled TODO), error, interrupted
        "mistake": "" if outcome == "passed" else short_mistake(message),
        "message": " ".join(str(message).split())[:_MESSAGE_LIMIT],
        "seconds": round(seconds, 2),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }
    return (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")


def write_progress(path: str, line: bytes) -> bool:
    """Append one line to ``path`` with ONE ``write`` on a descriptor opened with ``O_APPEND``:
    the kernel moves to the end and writes in one step, so lines from many learners' processes
    never interleave (on a local file system; not over NFS). Returns False, after one note on
    stderr per path and process, when the file cannot be written — a check's result never
    depends on it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return True
    except Exception as exc:  # an unwritable progress file must never fail a learner's cell
        if path not in _write_problems:
            _write_problems.add(path)
            try:
                print(f"(dpcourse: the check ran as usual, but its result could not be recorded "
                      f"in {path}: {type(exc).__name__}; tell your instructor)", file=sys.stderr)
            except Exception:
                pass
        return False


def recorded(fn=None, *, name: str | None = None):
    """Decorator for a public lab check: when ``DPCOURSE_PROGRESS`` names a file, append one line
    per call — learner, lab (the check's module), check (``name``, formatted with the call's
    arguments, e.g. ``"check_answer {n}"``, else the function's name), passed or the mistake its
    :class:`LabCheckError` named, time. A check called by another check is not recorded twice.
    The check itself runs, returns and raises exactly as without the decorator."""
    if fn is None:
        return functools.partial(recorded, name=name)
    # checks/lab11.py and the modules it is split into (checks/_lab11_decisions.py) are lab11
    module = fn.__module__.rsplit(".", 1)[-1]
    lab = re.match(r"_?(lab\d\d)_|(.*)", module + "_").group(1) or module
    signature = inspect.signature(fn) if name else None

    @functools.wraps(fn)
    def check(*args, **kwargs):
        __tracebackhide__ = True
        named = _current_check.set(_current_check.get() or fn.__name__)  # for slowness()
        try:
            return _run(*args, **kwargs)
        finally:
            _current_check.reset(named)

    def _run(*args, **kwargs):
        __tracebackhide__ = True
        path = os.environ.get(PROGRESS_ENV, "").strip()
        if not path or _inside_check.get():
            return fn(*args, **kwargs)
        token = _inside_check.set(True)
        start = time.monotonic()
        outcome, message = "interrupted", "stopped before it finished"
        try:
            result = fn(*args, **kwargs)
            outcome, message = "passed", ""
            return result
        except LabCheckError as exc:
            outcome, message = "mistake", exc.message
            raise
        except NotImplementedError as exc:
            outcome, message = "todo", f"TODO not filled: {exc}"
            raise
        except Exception as exc:
            outcome, message = "error", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            _inside_check.reset(token)
            try:
                label = fn.__name__
                if signature is not None:
                    bound = signature.bind_partial(*args, **kwargs)
                    label = name.format(**bound.arguments)
                write_progress(path, _progress_line(lab, label, outcome, message,
                                                   time.monotonic() - start))
            except Exception:  # recording never changes what the check did
                pass

    return check


# --- predictions: written before a measurement, compared after it ------------------------------


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What a learner predicted before a measurement: returned by :func:`predict`, handed to the
    lab's check that compares it with the measurement (through :func:`reveal`)."""

    lab: str
    question: str
    value: object
    unit: str = ""
    late: bool = False  # written after this kernel had shown the measurement: not recorded

    def shown(self, value=None) -> str:
        value = self.value if value is None else value
        text = _number(value) if _is_number(value) else str(value)
        return f"{text} {self.unit}".rstrip()


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _number(value) -> str:
    if isinstance(value, numbers.Integral):
        return str(int(value))
    return f"{float(value):.4g}"


_revealed: dict[tuple[str, str, str], Prediction] = {}  # (learner, lab, question) -> the first
# prediction whose measurement this kernel has shown


def predict(lab: str, question: str, value, *, unit: str = "", choices=None) -> Prediction:
    """Record the learner's prediction for ``question`` before the measurement runs.

    ``value`` is a number (int or float), or one of ``choices`` when the question is a choice.
    Prints one line, appends the prediction to the progress file (when ``DPCOURSE_PROGRESS``
    names one: the instructor sees what the room expected) and returns a :class:`Prediction`
    for the lab's check to compare with the measurement."""
    __tracebackhide__ = True
    if value is None or value is Ellipsis:
        raise NotImplementedError(f"write your prediction for {question!r} first (a "
                                  f"{'choice' if choices else 'number'}), then run this cell")
    if choices is not None:
        choices = list(choices)
        if value not in choices:
            fail(f"your prediction for {question!r} is {value!r}, which is not one of the "
                 f"choices: {', '.join(map(repr, choices))}.")
    elif not _is_number(value):
        fail(f"your prediction for {question!r} must be a number (an int or a float), got "
             f"{type(value).__name__} {value!r}.")
    elif value != value or value in (float("inf"), float("-inf")):
        fail(f"your prediction for {question!r} must be a finite number, got {value!r}.")
    first = _revealed.get((learner(), lab, question))
    if first is not None and first.value == value and first.unit == unit:  # a cell re-run
        print(f"Prediction unchanged — {question}: {first.shown()}, the one this kernel has "
              f"already compared with the measurement.")
        return first
    if first is not None:  # the measurement is known: a new guess is no prediction
        guess = Prediction(lab, question, value, unit, late=True)
        print(f"Prediction noted — {question}: {guess.shown()}. This kernel has already shown "
              f"the measurement, so your first prediction, {first.shown()}, is the one kept "
              f"for the class; this one is compared but not recorded.")
        return guess
    guess = Prediction(lab, question, value, unit)
    _record(lab, f"predict {question}", "predicted",
            f"predicted {guess.shown()}", {"predicted": _jsonable(value)})
    print(f"Prediction recorded — {question}: {guess.shown()}. Now run the measurement.")
    return guess


def reveal(prediction: Prediction, measured, *, close: bool, explanation: str,
           how: str = "measured") -> None:
    """Compare a :class:`Prediction` with what was measured, for a lab's check: print whether it
    was right and ``explanation`` (why the measured value is what it is, in a sentence or two)
    and record both. A prediction is not graded: a wrong one never raises. ``how`` names where
    the value came from in the printed line and the record: ``"modelled"`` for a value a model
    computed rather than a run measured (lab 06's time per step)."""
    __tracebackhide__ = True
    if not isinstance(prediction, Prediction):
        fail(f"the check needs the Prediction that predict(...) returned, got "
             f"{type(prediction).__name__}: pass the value of the predict(...) cell.")
    verdict = "right" if close else "not what happened"
    late = " (made after the measurement was shown)" if prediction.late else ""
    print(f"Your prediction{late}: {prediction.shown()}; {how}: "
          f"{prediction.shown(measured)} — {verdict}.")
    if explanation:
        print(textwrap.fill(" ".join(explanation.split()), width=100))
    if not prediction.late:
        keep(prediction, measured, close=close, how=how)


def keep(prediction: Prediction, measured, *, close: bool, how: str = "measured") -> None:
    """Keep ``prediction`` as the learner's answer to its question and record it beside
    ``measured`` — what :func:`reveal` does, without printing, for a check that words its own
    sentence (lab 06's declared in-flight count). Only the first one compared is kept: a later
    answer to the same question never replaces it (see :func:`kept_prediction`)."""
    key = (learner(), prediction.lab, prediction.question)
    if key in _revealed:
        return
    _revealed[key] = prediction
    _record(prediction.lab, f"predict {prediction.question}", "compared",
            f"predicted {prediction.shown()}, {how} {prediction.shown(measured)}",
            {"predicted": _jsonable(prediction.value), "measured": _jsonable(measured),
             "close": bool(close), **({} if how == "measured" else {"how": how})})


def kept_prediction(lab: str, question: str) -> Prediction | None:
    """The prediction (or declared decision) for ``question`` that this kernel has already
    compared with its measurement, the one kept for the class; None before that. A check uses
    it to hold a learner to a first decision instead of accepting one tuned to the measurement."""
    return _revealed.get((learner(), lab, question))


_wrong_answers: dict[tuple[str, str, str], list] = {}  # (learner, lab, question) -> answers


def wrong_answers(lab: str, question: str) -> list:
    """The wrong answers to a decision question (one with a handful of possible answers) that
    this kernel has sent back to the learner, oldest first. It is the stored list itself: the
    check appends the answer it refuses, and names a second, different wrong answer as a search
    over the choices rather than a diagnosis (lab 11's diagnoses)."""
    return _wrong_answers.setdefault((learner(), lab, question), [])


def forget() -> None:
    """Forget every mistake met, prediction kept and wrong answer sent back in this kernel, as
    if the learner started afresh (the tests call it before each test: a first attempt)."""
    _mistakes_met.clear()
    _revealed.clear()
    _wrong_answers.clear()


def _jsonable(value):
    if _is_number(value):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    return value if isinstance(value, (str, bool, type(None))) else str(value)


def _record(lab: str, check: str, outcome: str, message: str, extra: dict) -> None:
    path = os.environ.get(PROGRESS_ENV, "").strip()
    if not path:
        return
    try:
        # a prediction is not a mistake, right or wrong
        write_progress(path, _progress_line(lab, check, outcome, message, 0.0,
                                            **extra, mistake=""))
    except Exception:  # recording never changes what the learner's cell does
        pass


# --- timeouts and launches of the learner's code -----------------------------------------------


def check_timeout(timeout: float | None, default: float) -> float:
    """The seconds a multi-process check waits for its ranks: ``timeout`` when the learner
    passes one (``check_x(fn, timeout=120)``); otherwise the check's ``default``, raised to
    ``DPCOURSE_CHECK_TIMEOUT`` when the environment sets more (an instructor sets it for a whole
    class on a crowded server)."""
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return float(default)
    try:
        floor = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds: set it to e.g. 120, "
                         f"or unset it") from None
    if not floor > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: the timeout must be a positive number of "
                         f"seconds")
    return max(float(default), floor)


def slowness(timeout: float) -> str:
    """The clause a timeout message carries when the check cannot tell a deadlock from a slow
    machine: on a crowded server a right answer can be slow, and the learner is told which
    longer timeout to try and where it goes (the check cell's own call)."""
    longer = 120 if timeout < 120 else 60 * round(2 * timeout / 60)
    check = _current_check.get()
    where = f"{check}(..., timeout={longer})" if check else f"timeout={longer}"
    return (f"no answer within {timeout:g} s — on a crowded server this may be slowness: run "
            f"the check again with a longer timeout, {where}")


def timed_out(sentence: str, timeout: float, diagnosed: bool = False) -> str:
    """A timeout's sentence (what the deadlock would be) joined with :func:`slowness` — unless
    the check ``diagnosed`` a deadlock (a rank waits for a peer that has already returned), when
    a longer timeout cannot help and saying so would send the learner the wrong way."""
    sentence = sentence.rstrip().rstrip(".")
    if diagnosed:
        return f"{sentence}."
    return f"{sentence}; but {slowness(timeout)}."


def run_ranks(worker, world_size: int, *args, timeout: float, hang, backend: str | None = "gloo",
              failed=None, todo: str | None = None) -> list:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` ranks with
    ``dpcourse.launch.spawn`` and return their results; what went wrong becomes the check's one
    sentence, the same way in every lab:

    * no answer within ``timeout`` s: ``hang`` is the deadlock's explanation (a string, said
      after "rank(s) ... never finished within N s — a deadlock:"; or a function of the
      ``LaunchTimeoutError`` returning the whole sentence), followed by :func:`slowness`;
    * a rank raised ``NotImplementedError``: the lab's TODO is not filled — re-raised as such,
      not as a mistake (``todo``, when given, is its message, with ``{summary}`` and ``{rank}``
      filled in);
    * a rank raised anything else: ``failed(exc)`` may name the mistake (by calling
      :func:`fail`); otherwise "your code raised on rank r: ...".
    """
    __tracebackhide__ = True
    from dpcourse import launch

    try:
        return launch.spawn(worker, world_size, *args, backend=backend, timeout=timeout,
                            show_output=False)
    except launch.LaunchTimeoutError as exc:
        # A rank still waiting after another has returned waits for a collective that peer will
        # never call: a deadlock, whatever the machine's speed.
        diagnosed = bool(getattr(exc, "finished", None)) and bool(exc.pending)
        if callable(hang):
            sentence = hang(exc)
        else:
            who = ", ".join(map(str, exc.pending)) or "some rank"
            sentence = f"rank(s) {who} never finished within {timeout:g} s — a deadlock: {hang}"
        if diagnosed:
            done = ", ".join(map(str, exc.finished))
            sentence = (f"{sentence.rstrip().rstrip('.')} (rank(s) {done} had already returned, "
                        f"so no longer timeout can help)")
        fail(timed_out(sentence, timeout, diagnosed=diagnosed))
    except launch.RankFailedError as exc:
        if exc.summary.startswith("NotImplementedError"):
            raise NotImplementedError(
                todo.format(summary=exc.summary, rank=exc.rank) if todo
                else f"{exc.summary} (on rank {exc.rank})") from None
        if failed is not None:
            failed(exc)
        fail(f"your code raised on rank {exc.rank}: {exc.summary}")
