"""Lab 02's stretch: ``check_threaded_apply`` — the copies' forwards in real threads, with grad
mode carried into each, errors raised in the caller (SystemExit and several at once included)
and no thread left running. Re-exported by :mod:`dpcourse.checks.lab02`.
"""

from __future__ import annotations

import threading
import time

import torch

from . import fail, passed, recorded
from .. import dp as reference
from ._lab02_common import _OWN, _not_yours, _refuse_library
from .lab01 import library_calls


# --- stretch: the copies' forwards in real threads -----------------------------------------

class _Timed(torch.nn.Module):
    """A stand-in replica: sleeps (releasing the GIL, as torch kernels do), records when it
    ran and in which thread, and returns its input times a factor that identifies it."""

    def __init__(self, factor: float, delay: float, log: list, fail_with: str | None = None,
                 raises: type[BaseException] = ValueError):
        super().__init__()
        self.factor, self.delay, self.log, self.fail_with = factor, delay, log, fail_with
        self.raises = raises
        self.started = 0  # forwards begun (a task a pool cancelled before it ran never begins)
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        self.started += 1
        t0 = time.perf_counter()
        time.sleep(self.delay)
        if self.fail_with:
            raise self.raises(self.fail_with)
        self.log.append((self.factor, threading.get_ident(), t0, time.perf_counter()))
        return x * self.factor * self.w


@recorded
def check_threaded_apply(threaded_apply) -> None:
    """Stretch: ``threaded_apply(replicas, inputs)`` runs ``replicas[i](inputs[i])`` in one
    thread per replica, at the same time, and returns the outputs in replica order, with
    autograd on or off as the caller had it, and any replica's error raised to the caller."""
    __tracebackhide__ = True
    n = 3
    log: list = []
    # Replica 0 is the slowest, so the order the threads finish in is the reverse of the order
    # of the replicas.
    reps = [_Timed(i + 1, 0.15 * (n - i), log) for i in range(n)]
    inputs = [torch.full((2,), 10.0 ** i) for i in range(n)]
    _refuse_library(threaded_apply, reference.parallel_apply, "threaded_apply", _OWN)
    try:
        with library_calls(reference.parallel_apply) as called:
            out = threaded_apply(reps, inputs)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"threaded_apply raised {type(exc).__name__}: {exc}")
    _not_yours("threaded_apply", called, _OWN)
    if not isinstance(out, (list, tuple)) or len(out) != n:
        fail(f"threaded_apply must return a list with one output per replica, got "
             f"{type(out).__name__}" + (f" of length {len(out)}" if hasattr(out, "__len__") else "")
             + ".")
    if any(o is None for o in out):
        fail("some outputs are still None: threaded_apply returned before its threads "
             "finished.", fix="join every thread before reading the results.")
    want = [reps[i].factor * inputs[i] for i in range(n)]
    if not all(isinstance(o, torch.Tensor) and torch.equal(o.detach(), w) for o, w in zip(out, want)):
        if all(isinstance(o, torch.Tensor) and torch.equal(o.detach(), w)
               for o, w in zip(out, want[::-1])):
            fail("the outputs are in the order the threads finished, not in replica order.",
                 fix="store each result at its replica's index.")
        fail("output i is not replicas[i](inputs[i]): the replicas and inputs were not kept "
             "in pairs.", fix="give each thread its own index and keep the pairs together.")
    threads = {tid for _, tid, _, _ in log}
    if threads == {threading.get_ident()}:
        fail("the replicas ran one after another in the caller's thread, so none ran beside "
             "another.", fix="start one thread per replica (threading.Thread, or a "
                             "ThreadPoolExecutor).")
    # Checked before the thread count: a finished thread's id can be reused by the next one.
    spans = sorted((t0, t1) for _, _, t0, t1 in log)
    if not any(spans[i + 1][0] < spans[i][1] for i in range(len(spans) - 1)):
        fail("the replicas each had a thread but never ran at the same time: each thread was "
             "waited for before the next one started.", fix="start every thread (or submit every "
                                                     "task) before waiting for any of them.")
    if len(threads) < n:
        fail(f"the {n} replicas ran in {len(threads)} thread(s), so some waited for others.",
             fix="give each replica a thread of its own.")
    # Grad mode: the first meeting says what the outputs carry (the symptom); why (grad mode
    # is per thread, and a new thread starts with it on) and what to change come with the second.
    if not all(o.requires_grad for o in out):
        fail("called with autograd on, the outputs of your threads carry no autograd graph "
             "(requires_grad is False), where the loop `[replicas[i](inputs[i]) for i in ...]` "
             "run by the same caller records one: a backward through them would reach no "
             "replica's weights.",
             fix="grad mode is per thread in torch: your threads did not run with the "
                 "caller's. Read torch.is_grad_enabled() in the caller and apply it in each "
                 "thread (torch.set_grad_enabled).")
    with torch.no_grad():
        quiet = threaded_apply([_Timed(1, 0.0, []) for _ in range(2)],
                               [torch.ones(2), torch.ones(2)])
    if any(o.requires_grad for o in quiet):
        fail("called under torch.no_grad(), the outputs of your threads carry an autograd "
             "graph (requires_grad is True): the threads recorded a graph the caller had "
             "turned off, where the same loop run by the caller records none (an evaluation "
             "under no_grad would keep every replica's activations alive).",
             fix="grad mode is per thread in torch, and a new thread starts with it on. Read "
                 "torch.is_grad_enabled() in the caller and apply it in each thread "
                 "(torch.set_grad_enabled).")
    broken = [_Timed(1, 0.0, []), _Timed(2, 0.0, [], fail_with="replica 1 broke")]
    try:
        threaded_apply(broken, [torch.ones(2), torch.ones(2)])
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        if not _is_that_error(exc, ValueError, "replica 1 broke"):
            fail(f"when a replica fails, the caller should see its error (replica 1 raised "
                 f"ValueError: replica 1 broke); got {type(exc).__name__}: {exc}",
                 fix="raise the replica's own exception in the caller.")
    else:
        fail("a replica raised an error in its thread and threaded_apply returned as if "
             "nothing happened: an exception ends its thread, not the caller.",
             fix="keep the exception and raise it in the caller after join.")
    _check_several_errors(threaded_apply)
    _check_no_thread_left(threaded_apply)
    _check_system_exit(threaded_apply)
    passed(f"threaded_apply ran {n} replicas at the same time in {n} threads, kept their order, "
           f"the caller's grad mode, and their errors (raised once every thread had ended, the "
           f"lowest replica's first, a SystemExit included)")


def _is_that_error(exc: BaseException, cls: type, text: str) -> bool:
    """Whether the caller got the replica's error itself: its type, its message. One that
    only carries it (raised `from` it, or with it in its message) is refused by its cause."""
    __tracebackhide__ = True
    if type(exc) is cls and text in str(exc):
        return True
    if text in _said(exc):
        fail(f"a replica raised {cls.__name__} ('{text}') and the caller got "
             f"{type(exc).__name__} ({exc}), which carries it but is not it: the contract says "
             f"the caller gets that error, as it would from the loop "
             f"`[replicas[i](inputs[i]) for i in ...]`, so code around the call that catches "
             f"{cls.__name__} (or lets a SystemExit end the program with its code) misses a "
             f"{type(exc).__name__}.",
             fix=f"raise the exception object the replica raised ({cls.__name__} here), not a "
                 f"new one around it.")
    return False


def _said(exc: BaseException) -> str:
    """The messages of ``exc`` and of the exceptions it carries (cause, context)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " ".join(parts)


def _check_system_exit(threaded_apply) -> None:
    """Replica 1 ends with SystemExit (sys.exit() somewhere in its code), a BaseException that
    is no Exception: the caller must get it (not an error carrying it), never a None in place of
    replica 1's output. A thread that SystemExit ends dies silently (threading.excepthook
    ignores it), so a worker that catches only Exception loses it."""
    __tracebackhide__ = True
    broken = [_Timed(1, 0.0, []),
              _Timed(2, 0.0, [], fail_with="replica 1 called sys.exit()", raises=SystemExit)]
    try:
        out = threaded_apply(broken, [torch.ones(2), torch.ones(2)])
    except (NotImplementedError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit is what the check wants back
        if _is_that_error(exc, SystemExit, "replica 1 called sys.exit()"):
            return
        fail(f"replica 1 ended with SystemExit ('replica 1 called sys.exit()') and the caller "
             f"got {type(exc).__name__} ({exc}), which neither is that error nor carries it.",
             fix="keep what ended each thread, BaseException included, and raise that in the "
                 "caller.")
    shown = [None if o is None else type(o).__name__ for o in out] \
        if isinstance(out, (list, tuple)) else out
    fail(f"replica 1 ended with SystemExit, and threaded_apply returned {shown} as if nothing "
         f"had happened: SystemExit is a BaseException, not an Exception, so `except "
         f"Exception` let it end replica 1's thread, which dies silently (threading ignores a "
         f"SystemExit in a thread), and the caller took the None left in its slot for an "
         f"output. (torch's own parallel_apply also catches only Exception, but looks its "
         f"results up in a dict, so its caller gets a KeyError there rather than a None.)",
         fix="catch BaseException in each worker (what ends a thread, not only Exception) and "
             "raise it in the caller after the join.")


def _check_no_thread_left(threaded_apply) -> None:
    """Replica 0 fails at once while replica 1 still sleeps 0.3 s: when the caller gets the
    error, replica 1's thread must have finished (its log entry is written at its end). A
    replica that never ran (a thread pool cancels a task still queued when the caller gets an
    error) leaves no thread behind: it is told apart by waiting, then looking whether replica 1
    began at all."""
    __tracebackhide__ = True
    delay, log = 0.3, []
    broken = [_Timed(1, 0.0, [], fail_with="replica 0 broke"), _Timed(2, delay, log)]
    try:
        threaded_apply(broken, [torch.ones(2), torch.ones(2)])
    except NotImplementedError:
        raise
    except Exception:  # noqa: BLE001 - which error came back is checked elsewhere
        unfinished = not log
        time.sleep(delay + 0.1)  # let the straggler end before the next check starts threads
        if unfinished and broken[1].started:
            fail(f"replica 0 failed at once while replica 1 still had {delay} s of work, and "
                 f"threaded_apply raised replica 0's error while replica 1's thread was still "
                 f"running: the caller went on (to retry, or to the next step) with a thread "
                 f"of the failed call still writing into replica 1's module and its output.",
                 fix="wait for every thread (join them all) before raising the error kept.")
    else:
        fail("replica 0 raised an error in its thread and threaded_apply returned as if nothing "
             "happened: an exception ends its thread, not the caller.",
             fix="keep each thread's exception and raise it in the caller after join.")


def _check_several_errors(threaded_apply) -> None:
    """Replicas 1 and 2 both raise; the caller must get replica 1's error whichever thread
    raised first (tried both ways round), as torch's parallel_apply re-raises in replica order."""
    __tracebackhide__ = True
    second = []   # the orders (which replica was slow) in which the caller got replica 2's error
    for slow in (1, 2):
        broken = [_Timed(1, 0.0, []),
                  _Timed(2, 0.2 if slow == 1 else 0.0, [], fail_with="replica 1 broke"),
                  _Timed(3, 0.2 if slow == 2 else 0.0, [], fail_with="replica 2 broke")]
        try:
            threaded_apply(broken, [torch.ones(2)] * 3)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001
            if type(exc) is ValueError and "replica 1 broke" in str(exc):
                continue
            if "replica 2 broke" in _said(exc):
                second.append(slow)
                continue
            if _is_that_error(exc, ValueError, "replica 1 broke"):
                continue
            fail(f"replicas 1 and 2 both raised, and the caller got neither error but "
                 f"{type(exc).__name__}: {exc}")
        else:
            fail("two replicas raised errors in their threads and threaded_apply returned as if "
                 "nothing happened: an exception ends its thread, not the caller.",
                 fix="keep each thread's exception and raise it in the caller after join.")
    if second:
        # slow == 1: replica 1 failed late, so replica 2's error was the first in time
        how = ("whichever thread failed first: the highest-numbered failing replica's"
               if second == [1, 2] else
               "the first to fail" if second == [1] else "the last to fail")
        fail(f"replicas 1 and 2 both raised and the caller got replica 2's error, {how}: the "
             f"contract is the lowest-numbered failing replica's, whichever thread ran faster.",
             fix="keep every thread's exception and, once all are joined, raise the one of the "
                 "lowest-numbered replica that failed.")
