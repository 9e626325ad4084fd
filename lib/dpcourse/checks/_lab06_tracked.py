"""What moved where in lab 06's NumPy all-gather: the learner's phase runs again on tracked
arrays (:class:`_Tracked`, views of the workers' arrays), which note in a :class:`_Log` every
write into a worker's array and the worker the written value came from.

The record only: :func:`dpcourse.checks._lab06_numpy._refuse_not_a_ring` reads it and names a
chunk copied from a worker that is not the left neighbour, more than one chunk in one write,
or chunks passed on in another order than the ring's steps. Kept apart because it is NumPy
machinery (a subclass of ``np.ndarray`` and its ``__array_ufunc__``), not the lab's rules.
"""

from __future__ import annotations

import numpy as np


class _Log:
    """The memory of each worker's array, and every write into it with where its value came
    from: ``writes`` holds (dest worker, start, stop, source) with source (worker, start, stop)
    or None when the value came from no one worker's chunk; ``reads`` holds (worker, start,
    stop) for every view or element taken of a worker's array, in order."""

    def __init__(self, arrays):
        self.roots = arrays
        self.writes: list = []
        self.reads: list = []

    def where(self, arr):
        """(worker, start, stop) when ``arr`` is a view into a worker's array, else None."""
        if not isinstance(arr, np.ndarray) or arr.size == 0:
            return None
        ptr = arr.__array_interface__["data"][0]
        for w, root in enumerate(self.roots):
            base = root.__array_interface__["data"][0]
            if base <= ptr < base + root.nbytes:
                start = (ptr - base) // root.itemsize
                return w, start, min(start + arr.size, root.size)
        return None

    def guess(self, dest):
        """The source of a value that carries none (np.copy, a scalar): the latest read of the
        same elements on another worker's array before the write."""
        w, a, b = dest
        for rw, ra, rb in reversed(self.reads):
            if rw != w and (ra, rb) == (a, b):
                return rw, ra, rb
        return None


class _Tracked(np.ndarray):
    """A worker's array (or a view or copy of one) that notes, in its :class:`_Log`, every
    write into a worker's array and the worker the written value came from."""

    def __array_finalize__(self, obj):
        self._log = getattr(obj, "_log", None)
        self._src = None
        if self._log is None:
            return
        here = self._log.where(self)
        if here is not None:
            self._log.reads.append(here)
        elif isinstance(obj, np.ndarray):  # a copy: remember where its values were taken
            self._src = self._log.where(obj) or getattr(obj, "_src", None)

    def __getitem__(self, key):
        out = super().__getitem__(key)
        log = getattr(self, "_log", None)
        if log is not None and not isinstance(out, np.ndarray):
            here = log.where(self)
            if here is not None and isinstance(key, (int, np.integer)):
                k = here[1] + int(key) % self.size
                log.reads.append((here[0], k, k + 1))
        return out

    def __setitem__(self, key, value):
        log = getattr(self, "_log", None)
        if log is not None:
            target = self.view(np.ndarray)[key]
            here = log.where(self)
            if isinstance(target, np.ndarray):
                dest = log.where(target)
            elif here is not None and isinstance(key, (int, np.integer)):
                k = here[1] + int(key) % self.size
                dest = (here[0], k, k + 1)
            else:
                dest = None
            if dest is not None:
                src = None
                if isinstance(value, _Tracked):
                    src = log.where(value) or value._src
                if src is None:
                    src = log.guess(dest)
                if src != dest:
                    log.writes.append((*dest, src))
        super().__setitem__(key, value)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        log = next((x._log for x in (*inputs, *(out or ())) if isinstance(x, _Tracked)
                    and x._log is not None), None)
        plain = [x.view(np.ndarray) if isinstance(x, _Tracked) else x for x in inputs]
        if out is not None:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, _Tracked) else o
                                  for o in out)
        result = getattr(ufunc, method)(*plain, **kwargs)
        if log is not None and out is not None:
            for o in out:
                dest = log.where(o) if isinstance(o, np.ndarray) else None
                if dest is None:
                    continue
                srcs = [log.where(x) or getattr(x, "_src", None) for x in inputs
                        if isinstance(x, _Tracked)]
                srcs = [s for s in srcs if s is not None and s[0] != dest[0]]
                log.writes.append((*dest, srcs[0] if srcs else log.guess(dest)))
            return out[0] if len(out) == 1 else out
        return result


def _transfers(fn, start, owner, with_owner: bool = True):
    """Run ``fn`` on tracked copies of ``start`` (and ``owner``, when given or ``with_owner``:
    the learner's phase takes it); return (the log, the tracked arrays), or None when the run
    cannot be read (it raised, or left its result anywhere but in the arrays it was given:
    then the transfers are not judged)."""
    roots = [a.copy() for a in start]
    log = _Log(roots)
    arrays = [r.view(_Tracked) for r in roots]
    for a in arrays:
        a._log, a._src = log, None
    try:
        if owner is None and not with_owner:
            fn(list(arrays))
        else:
            fn(list(arrays), list(range(len(start))) if owner is None else list(owner))
    except Exception:  # noqa: BLE001 - already judged on plain arrays; this run only watches
        return None
    return log, roots


def _chunk_of(bounds, a: int, b: int):
    """The chunk index whose elements [a, b) are, or None when they span or split chunks."""
    for c, (lo, hi) in enumerate(bounds):
        if lo <= a and b <= hi:
            return c
    return None
