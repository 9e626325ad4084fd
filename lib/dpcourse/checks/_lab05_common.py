"""What every runner of lab 05's checks shares: TensorFlow as the library loads it, the
comparison tolerance, the fixed global batch the checks feed, the lab's strategy with one replica
more (so nothing can be tied to one replica count), the refusal of the library's own answers
(``mirrored.per_replica_loss``, ``mirrored.train_step``), and the sentence naming a strategy a
learner's function reads from outside itself.

Imported by the other ``_lab05_*`` modules and by :mod:`dpcourse.checks.lab05`.
"""

from __future__ import annotations

import functools
import types

import numpy as np

from dpcourse import data as _data
from dpcourse import mirrored
from dpcourse.checks import fail

tf = mirrored.tf
keras = mirrored.keras

_RTOL = 1e-3


def reference_batch(global_batch: int = 64, seed: int = 5):
    """A fixed global batch (normalised NHWC float32 images, int64 labels): copies of arrays
    made once per (size, seed) in a process, since every check of the lab feeds the same few."""
    x, y = _reference_batch(global_batch, seed)
    return x.copy(), y.copy()


@functools.lru_cache(maxsize=None)
def _reference_batch(global_batch: int, seed: int):
    ds = _data.load("shapes10", n_train=global_batch, n_test=1, seed=seed)
    return _data.normalize(ds.x_train), ds.y_train


def pieces(b: int, n: int) -> list:
    """How ``experimental_distribute_dataset`` cuts a batch of ``b`` over ``n`` replicas, as
    measured with TF 2.21 (tests/test_lab05_checks.py; ``_LegacyRebatchDataset`` in TF's
    ``data/experimental/ops/distribute.py``, not ``batch_sizes_for_worker``): pieces of
    ``ceil(b / n)`` in replica order, the last replicas the rest. Part 4's explanation states it,
    and the checks of parts 1 and 3 feed their steps split by it."""
    c = -(-b // n)
    return [max(0, min(c, b - r * c)) for r in range(n)]


def distribute_slices(strategy, arrays, sizes) -> tuple:
    """One step's batch as the strategy's replicas receive it: replica r holds the next
    ``sizes[r]`` rows of each of ``arrays`` (in order), as a tensor on its own device.

    With ``sizes = pieces(len(a), n)`` this is the element ``experimental_distribute_dataset``
    yields for one batch of ``arrays`` (the test of the ceiling rule compares the two on every
    split the checks use), made without the dataset's iterator, whose setup costs far more than
    the step the check runs on it."""
    bounds = np.cumsum([0, *sizes])
    devices = strategy.extended.worker_devices

    def value_fn(ctx):
        r = ctx.replica_id_in_sync_group
        with tf.device(devices[r]):
            return tuple(tf.constant(a[bounds[r]:bounds[r + 1]]) for a in arrays)
    return strategy.experimental_distribute_values_from_function(value_fn)


def required_positional(fn) -> list | None:
    """The names of ``fn``'s positional parameters that have no default (a partial's inner
    function's), or None when Python cannot say."""
    import inspect
    try:
        params = inspect.signature(getattr(fn, "func", fn)).parameters
    except (TypeError, ValueError):
        return None
    return [nm for nm, p in params.items()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _close(a, b, rtol=_RTOL) -> bool:
    return bool(np.allclose(a, b, rtol=rtol, atol=1e-6))


_OTHER: dict = {}


def strategies_for(strategy) -> list:
    """The lab's strategy and, if TF has a spare logical device of the same kind, a strategy
    with one replica more (built once and kept: TF cannot forget a strategy's devices)."""
    devices = list(strategy.extended.worker_devices)
    kind = "GPU" if any("GPU" in d.upper() for d in devices) else "CPU"
    have = [d.name for d in tf.config.list_logical_devices(kind)]
    if len(have) <= len(devices):
        return [strategy]
    names = tuple(have[:len(devices) + 1])
    if names not in _OTHER:
        _OTHER[names] = mirrored.make_strategy(list(names))
    return [strategy, _OTHER[names]]


def _local(strategy, value) -> list:
    return [np.asarray(v) for v in strategy.experimental_local_results(value)]


# The library holds lesson 05's answers; the lab asks for the learner's own.
_LIBRARY = {"per_replica_loss": "per_replica_loss", "distributed_train_step": "train_step"}


def _refuse_library(fn, what: str) -> None:
    __tracebackhide__ = True
    lib = getattr(mirrored, _LIBRARY[what])
    inner = getattr(fn, "func", fn)  # a functools.partial of it too
    if inner is lib or getattr(inner, "__code__", None) is lib.__code__:
        fail(f"{what} is dpcourse.mirrored.{_LIBRARY[what]}, the library's answer that lesson 05 "
             f"runs: it passes by construction, so passing proves nothing about your scaling.",
             fix=f"Write your own {what} in the lab's cell.")


class _LibrarySpy:
    """While active, a call of the library's answer from inside the learner's function is noted
    (the learner's function may wrap ``mirrored.per_replica_loss`` instead of being it)."""

    def __init__(self, what: str):
        self.name, self.called = _LIBRARY[what], False
        self.what = what

    def __enter__(self):
        self.original = getattr(mirrored, self.name)

        def spy(*args, **kwargs):
            self.called = True
            return self.original(*args, **kwargs)
        setattr(mirrored, self.name, spy)
        return self

    def __exit__(self, *exc):
        setattr(mirrored, self.name, self.original)
        if self.called and exc[0] is None:
            fail(f"your {self.what} calls dpcourse.mirrored.{self.name}, the library's answer "
                 f"that lesson 05 runs: the scaling it checks is then the library's, not yours.",
                 fix=f"Compute the loss in your own {self.what}, without the library's function.")
        return False


def _captured_strategies(fn) -> list:
    """(name, strategy) for each ``tf.distribute.Strategy`` that ``fn`` (or a function nested in
    it) reads from outside itself: module globals and closure cells."""
    fn = getattr(fn, "func", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    glob = getattr(fn, "__globals__", {})
    found = {nm: glob[nm] for nm in names if isinstance(glob.get(nm), tf.distribute.Strategy)}
    for nm, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            if isinstance(cell.cell_contents, tf.distribute.Strategy):
                found[nm] = cell.cell_contents
        except ValueError:   # an empty cell
            pass
    return sorted(found.items(), key=lambda kv: kv[0])


def _captured_note(fn, strategy) -> str:
    """A sentence naming a strategy that ``fn`` reads from outside itself and that is not
    ``strategy`` (the one this call runs on), or ""."""
    others = [f"`{nm}` ({obj.num_replicas_in_sync} replicas)"
              for nm, obj in _captured_strategies(fn) if obj is not strategy]
    if not others:
        return ""
    return (f" Your function reads {', '.join(others)} from outside itself, while this call runs "
            f"on {strategy.num_replicas_in_sync} replicas: a value captured from outside the "
            f"function stays what it was, whatever the call is given.")


# Part 1 asks for the arithmetic these two hide (what divides a replica's sum, and what share of
# the penalty a replica adds): each, met in the learner's per_replica_loss, is refused with its
# own cause and its own fix.
_HIDDEN = {
    "compute_average_loss": (
        "tf.nn.compute_average_loss does the division part 1 asks you to work out: which number "
        "each replica's summed loss is divided by so that the strategy's sum over N replicas is "
        "one mean over the step — also when the slices differ",
        "Divide the replica's summed per-example losses yourself, by the count the replicas "
        "found together."),
    "scale_regularization_loss": (
        "tf.nn.scale_regularization_loss does the penalty's part that part 1 asks you to work "
        "out: what share of a term every replica holds whole each replica adds, so that the "
        "strategy's sum over N replicas holds it once",
        "Add this replica's share of the penalty yourself; the replica context "
        "(tf.distribute.get_replica_context()) knows how many replicas share it."),
}


def _hidden_originals() -> dict:
    import inspect
    out = {}
    for name in _HIDDEN:
        fn = getattr(tf.nn, name)
        out[name] = {id(fn), id(inspect.unwrap(fn))}
    return out


def _hidden_referenced(fn) -> list:
    """The names of ``_HIDDEN`` that ``fn`` (or a function nested in it, or a function of the
    learner's module it calls by name) reaches by an alias: a global, a closure cell or a
    default bound to the function itself (``cal = tf.nn.compute_average_loss`` earlier, or
    ``from tensorflow.nn import compute_average_loss as cal``)."""
    import inspect
    originals = _hidden_originals()
    found, seen, todo = set(), set(), [getattr(fn, "func", fn)]
    while todo:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if code is None or id(code) in seen:
            continue
        seen.add(id(code))
        glob = getattr(f, "__globals__", {})
        values = list(getattr(f, "__defaults__", None) or ())
        values += list((getattr(f, "__kwdefaults__", None) or {}).values())
        for cell in getattr(f, "__closure__", None) or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:
                pass
        codes, names = [code], set()
        while codes:
            c = codes.pop()
            names.update(c.co_names)
            codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        values += [glob[nm] for nm in names if nm in glob]
        for v in values:
            try:
                inner = inspect.unwrap(v) if callable(v) else v
            except Exception:  # noqa: BLE001 - an object whose __wrapped__ loops
                inner = v
            for name, ids in originals.items():
                if id(v) in ids or id(inner) in ids:
                    found.add(name)
            if isinstance(v, types.FunctionType) and v.__globals__ is glob:
                todo.append(v)   # a helper of the learner's own module
    return sorted(found)


class _HiddenSpy:
    """While active, a call of ``tf.nn.compute_average_loss`` or ``tf.nn.scale_regularization_loss``
    is noted; on a clean exit, that (or an alias of either bound in the learner's function) is
    refused with its cause. Enter it outside ``_LibrarySpy`` so that the library's answer, which
    calls them, is named as the library's."""

    def __init__(self, fn, what: str):
        self.fn, self.what, self.called = fn, what, set()

    def __enter__(self):
        self.originals = {name: getattr(tf.nn, name) for name in _HIDDEN}
        for name, original in self.originals.items():
            def spy(*args, _name=name, _original=original, **kwargs):
                self.called.add(_name)
                return _original(*args, **kwargs)
            setattr(tf.nn, name, spy)
        return self

    def __exit__(self, *exc):
        __tracebackhide__ = True
        for name, original in self.originals.items():
            setattr(tf.nn, name, original)
        if exc[0] is not None:
            return False
        used = sorted(self.called | set(_hidden_referenced(self.fn)))
        if used:
            cause, fix = _HIDDEN[used[0]]
            also = (f" (it uses tf.nn.{used[1]} as well)" if len(used) > 1 else "")
            fail(f"your {self.what} gives the right numbers, but it uses tf.nn.{used[0]}{also}, "
                 f"which this part does not allow: {cause}. The lab asks you what it computes "
                 f"and why that is right on N replicas, and a call that hides it shows neither.",
                 fix=fix)
        return False
