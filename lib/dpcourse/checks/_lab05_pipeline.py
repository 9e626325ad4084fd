"""Lab 05 stretch A: ``make_dist_dataset(strategy, x, y, global_batch)`` builds each replica's
input pipeline with ``strategy.distribute_datasets_from_function``. Every step must hold the next
``global_batch`` samples in order, each replica taking its batches from its own pipeline (the
short last step's split compared with what the contract, or the learner's own dataset
function, implies); a global batch the replicas do not divide handled by the learner's own
decision (the accepted decisions and the named wrong ones are in the tests); and the dataset
function, called as on 2 workers, must cut the data by input pipeline. The stretch's data and
global batches live here too: stretch B and the stretch's prediction use them.

Imported by :mod:`dpcourse.checks.lab05`, where the lab calls it.
"""

from __future__ import annotations

import re

import numpy as np

from dpcourse.checks import fail, passed, recorded
from dpcourse.checks._lab05_common import _local, strategies_for, tf


_N_SAMPLES, _GLOBAL = 100, 32  # 32 + 32 + 32 + 4: on 2 replicas the last step is 4 and 0


def stretch_data():
    """The stretch's data: 100 samples of 8 features, labels 0-9 (fixed)."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(_N_SAMPLES, 8)).astype(np.float32)
    y = rng.integers(0, 10, size=_N_SAMPLES).astype(np.int64)
    return x, y


def stretch_global(n: int) -> int:
    """The global batch the stretch's checks use on ``n`` replicas (100 samples): 32 where ``n``
    divides it, else 12 per replica (36 on 3), so that the last step is short."""
    return _GLOBAL if _GLOBAL % n == 0 else 12 * n


def _expected_split(n: int, global_batch: int) -> list:
    """Per-replica sizes of each step when every replica takes whole per-replica batches of one
    pipeline in turn (``distribute_datasets_from_function``)."""
    per = global_batch // n
    steps = []
    for start in range(0, _N_SAMPLES, global_batch):
        steps.append([max(0, min(per, _N_SAMPLES - start - r * per)) for r in range(n)])
    return steps


@recorded
def check_dataset_fn(make_dist_dataset, strategy) -> None:
    """Stretch: ``make_dist_dataset(strategy, x, y, global_batch)`` must give, at every step, the
    next ``global_batch`` samples in order, each replica taking its batches from its own input
    pipeline (``strategy.distribute_datasets_from_function``); the check compares each step's
    per-replica pieces, the short last step's included, with what that contract implies. Tried
    on the lab's strategy and on one with a replica more, and with a global batch the replicas
    do not divide, which is the learner's decision to make (the check accepts a decision that is
    the learner's own and keeps every step's size, and names one that does not)."""
    __tracebackhide__ = True
    tried, odd = [], []
    for strat in strategies_for(strategy):
        n = strat.num_replicas_in_sync
        gb = stretch_global(n)
        _check_dataset_once(make_dist_dataset, strat, gb)
        tried.append(f"{gb} on {n}")
        if n > 1:
            odd.append(_check_indivisible(make_dist_dataset, strat, gb + 1))
    pipelines = _check_two_pipelines(make_dist_dataset, strategy)
    passed(f"make_dist_dataset: each step the next global batch in whole per-replica batches, "
           f"in order, the short last step kept ({', '.join(tried)} replicas), a global "
           f"batch the replicas do not divide handled ({', '.join(odd)}), and {pipelines}")


_FROM_FUNCTION = ("distribute_datasets_from_function",
                  "experimental_distribute_datasets_from_function")


def _captured_dataset_fn(make_dist_dataset, strategy, x, y, global_batch: int):
    """The function ``make_dist_dataset`` hands to the strategy's
    ``distribute_datasets_from_function`` (None if it hands none)."""
    captured = []
    originals = {name: getattr(strategy, name) for name in _FROM_FUNCTION}

    def spy_of(original):
        def spy(dataset_fn, *args, **kwargs):
            captured.append(dataset_fn)
            return original(dataset_fn, *args, **kwargs)
        return spy

    for name, original in originals.items():
        setattr(strategy, name, spy_of(original))
    try:
        make_dist_dataset(strategy, x, y, global_batch)
    finally:
        for name in originals:
            delattr(strategy, name)   # the instance's spy gone, the class's method shows again
    return captured[0] if captured else None


PIPELINES = 2


def _check_two_pipelines(make_dist_dataset, strategy) -> str:
    """The dataset function of ``make_dist_dataset``, called as on ``PIPELINES`` workers of
    ``strategy``'s replica count each (a ``tf.distribute.InputContext`` per pipeline): the
    pipelines together must yield every sample once, each in per-replica batches of the
    global batch over all the replicas in sync (on every worker)."""
    __tracebackhide__ = True
    x, y = stretch_data()
    n = strategy.num_replicas_in_sync
    gb = stretch_global(n)
    fn = _captured_dataset_fn(make_dist_dataset, strategy, x, y, gb)
    if fn is None:
        return "no dataset function to try on two input pipelines"
    where = {float(v): i for i, v in enumerate(x[:, 0])}
    replicas = PIPELINES * n
    per = gb // replicas
    at = (f"(the dataset function called as on {PIPELINES} workers of {n} replicas each: "
          f"{PIPELINES} input pipelines, {replicas} replicas in sync, global batch {gb})")
    seen, sizes = [], []
    for pid in range(PIPELINES):
        ctx = tf.distribute.InputContext(num_input_pipelines=PIPELINES, input_pipeline_id=pid,
                                         num_replicas_in_sync=replicas)
        try:
            batches = [np.asarray(b[0]) for b in fn(ctx)]
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001
            fail(f"your dataset function raised {type(exc).__name__} {at}: "
                 f"{str(exc).splitlines()[0] if str(exc) else ''}")
        seen.append([where.get(float(row[0]), -1) for b in batches for row in b])
        sizes.append([len(b) for b in batches])
    counts = [len(s) for s in seen]
    if all(sorted(s) == list(range(_N_SAMPLES)) for s in seen):
        fail(f"each of the {PIPELINES} input pipelines yielded all {_N_SAMPLES} samples {at}: "
             f"your dataset function keeps the whole data whatever its input_context says, so "
             f"on {PIPELINES} workers every sample is trained on {PIPELINES} times an epoch, and "
             f"the workers' steps repeat each other's samples.",
             fix="Shard the data by the context's number of input pipelines and its pipeline "
                 "id.")
    if seen[0] and all(sorted(s) == sorted(seen[0]) for s in seen[1:]):
        fail(f"the {PIPELINES} input pipelines yielded the same {counts[0]} samples {at}: the "
             f"data was cut into pieces, but every pipeline kept the same piece — the pipeline "
             f"id did not choose it.",
             fix="Choose each pipeline's piece by input_context.input_pipeline_id.")
    union = sorted(i for s in seen for i in s)
    if len(union) == len(set(union)) < _N_SAMPLES and all(
            abs(c - _N_SAMPLES / replicas) <= 1 for c in counts):
        fail(f"the {PIPELINES} input pipelines yielded {counts} samples, {len(union)} of "
             f"{_N_SAMPLES} in all {at}: the data was cut into {replicas} pieces, one per "
             f"replica in sync, and each pipeline kept one — but each pipeline feeds all "
             f"{n} replicas of its worker, which take different batches from it.",
             fix="Shard by the number of input pipelines, not replicas.")
    if union != list(range(_N_SAMPLES)):
        fail(f"the {PIPELINES} input pipelines yielded {counts} samples {at}, {len(set(union))} "
             f"different ones of {_N_SAMPLES}: together they must yield every sample once.")
    # whole per-replica batches, but for the last step's: its (fewer) samples the pipeline may
    # share out over the worker's replicas as it decides
    wrong = [(pid, s) for pid, s in enumerate(sizes) if any(b != per for b in s[:-n]) or
             any(b > per for b in s)]
    if wrong:
        pid, s = wrong[0]
        fail(f"pipeline {pid} yielded batches of {s[:3]} samples {at}, but a replica's batch "
             f"is the global batch over all {replicas} replicas in sync, {gb} / {replicas} = "
             f"{per}: with batches of {s[0]} every step would hold {s[0] * replicas} samples, "
             f"not {gb}.",
             fix="Ask the input_context for the per-replica batch size; it counts the replicas "
                 "of every worker.")
    return (f"{PIPELINES} input pipelines (as on {PIPELINES} workers) split the data "
            f"{counts[0]} + {counts[1]}, in batches of {per}")


def _check_indivisible(make_dist_dataset, strategy, global_batch: int) -> str:
    """A global batch the replicas do not divide: refused by the learner's own ValueError naming
    both numbers, or adapted — steps of ``global_batch`` samples in the data's order, nothing
    dropped, the replicas' shares differing by a sample. Rounding the per-replica size, and
    TF's own error, are named."""
    __tracebackhide__ = True
    x, y = stretch_data()
    n = strategy.num_replicas_in_sync
    where = {float(v): i for i, v in enumerate(x[:, 0])}
    try:
        dist = make_dist_dataset(strategy, x, y, global_batch)
        arrays = [[np.asarray(v) for v in _local(strategy, b[0])] for b in dist]
        steps = [[len(v) for v in step] for step in arrays]
    except NotImplementedError:
        raise
    except ValueError as exc:   # refused: is the refusal the learner's own, and clear?
        _check_refusal(exc, global_batch, n)
        return f"{global_batch} on {n} refused"
    except Exception as exc:  # noqa: BLE001
        fail(f"with global_batch={global_batch} on {n} replicas make_dist_dataset raised "
             f"{type(exc).__name__}: {str(exc).splitlines()[0]} — a refused argument is a "
             f"ValueError, the error a caller expects for a bad value, not another error.",
             fix="Raise ValueError naming the global batch and the replica count.")
    order = [where.get(float(row[0]), -1) for step in arrays for v in step for row in v]
    want = [min(global_batch, _N_SAMPLES - i) for i in range(0, _N_SAMPLES, global_batch)]
    if [sum(st) for st in steps] == want and order == list(range(_N_SAMPLES)):
        return f"{global_batch} on {n} adapted as {'+'.join(map(str, steps[0]))}"
    sizes = [sum(st) for st in steps]
    fail(f"with global_batch={global_batch} on {n} replicas your steps held {sizes[:3]} samples "
         f"(per replica {steps[0] if steps else []}): {global_batch} is not a multiple of {n}, so "
         f"no single per-replica batch size makes a step of {global_batch} — rounding it makes "
         f"every step the wrong size, and a loop told {global_batch} divides each step's loss by "
         f"a count the step does not hold.",
         fix="Either refuse such a global batch with your own ValueError naming both numbers, "
             "or give the replicas shares that differ by a sample, so that every step still "
             "holds the next global batch.")


def _check_refusal(exc: ValueError, global_batch: int, n: int) -> None:
    """The stretch's refusal must be the learner's own ValueError, naming both numbers: TF's
    ``InputContext.get_per_replica_batch_size`` raises one by itself for such a batch, from
    inside the strategy's call of the dataset function, and that is TF deciding, not you."""
    __tracebackhide__ = True
    import traceback
    frames = traceback.extract_tb(exc.__traceback__)
    origin = frames[-1] if frames else None
    said = str(exc).splitlines()[0] if str(exc) else ""
    if origin is not None and "/tensorflow/" in origin.filename.replace("\\", "/"):
        fail(f"with global_batch={global_batch} on {n} replicas the ValueError came from "
             f"TensorFlow, not from your function: {origin.name} (in "
             f"{origin.filename.split('site-packages/')[-1]}) raised {said!r} while the strategy "
             f"called your dataset function. TF refused for you, from inside its own machinery: "
             f"the lab asks for your decision, made and explained by make_dist_dataset itself.",
             fix="Check the global batch in make_dist_dataset before building any pipeline, and "
                 "decide there: your own ValueError naming both numbers, or shares that keep "
                 "every step at the global batch.")
    if not (re.search(rf"(?<!\d){global_batch}(?!\d)", said)
            and re.search(rf"(?<!\d){n}(?!\d)", said)):
        fail(f"with global_batch={global_batch} on {n} replicas your make_dist_dataset raised "
             f"ValueError({said!r}): the refusal is right, but its message does not name both "
             f"the global batch ({global_batch}) and the replica count ({n}), so whoever meets it "
             f"cannot see what did not divide.",
             fix="Put both numbers in the ValueError's message.")


def _check_dataset_once(make_dist_dataset, strategy, gb: int) -> None:
    __tracebackhide__ = True
    x, y = stretch_data()
    n = strategy.num_replicas_in_sync
    at = f"(global batch {gb} on {n} replicas)"
    where = {float(v): i for i, v in enumerate(x[:, 0])}   # sample -> its index in the data
    try:
        dist = make_dist_dataset(strategy, x, y, gb)
        steps = [[np.asarray(v) for v in _local(strategy, b[0])] for b in dist]
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"make_dist_dataset raised {type(exc).__name__} {at}: {str(exc).splitlines()[0]}")
    split = [[len(v) for v in step] for step in steps]
    sizes = [sum(s) for s in split]
    order = [where.get(float(row[0]), -1) for step in steps for v in step for row in v]
    want = [min(gb, _N_SAMPLES - i) for i in range(0, _N_SAMPLES, gb)]
    if n > 1 and split and split[0] and split[0][0] == gb:
        fail(f"replica 0 got {gb} samples in the first step {at}, a whole global batch: "
             f"global_batch is the size of the whole step over the {n} replicas, not one "
             f"replica's.",
             fix="Batch each replica's pipeline by its share of the global batch.")
    if sorted(order) == list(range(_N_SAMPLES)) and order != list(range(_N_SAMPLES)):
        fail(f"every sample arrives once, in steps of {sizes} {at}, but not in the data's order "
             f"(the first step starts with samples {order[:4]}): the contract makes each step "
             f"the next {gb} samples of the data, unshuffled.",
             fix="Leave the data in its order (no shuffle).")
    if len(set(order)) < _N_SAMPLES:
        kept = sorted(set(order))
        if n > 1 and len(kept) == len(range(0, _N_SAMPLES, n)) and all(
                (i - kept[0]) % n == 0 for i in kept):
            nth = f"{n}{'nd' if n == 2 else 'rd' if n == 3 else 'th'}"
            fail(f"an epoch gave {len(kept)} of {_N_SAMPLES} samples, every {nth} one {at}: the "
                 f"data was sharded into {n} pieces (one per replica) and only one kept — but "
                 f"there is one input pipeline here (one per worker), and the replicas already "
                 f"take different batches from it.",
                 fix="Shard by the number of input pipelines, not replicas.")
        if kept == list(range(len(kept))) and len(kept) % gb == 0:
            fail(f"an epoch gave {len(kept)} of {_N_SAMPLES} samples (steps of {sizes}) {at}: "
                 f"the partial last batch was dropped — this exercise is about handling it.",
                 fix="Keep the remainder when batching.")
        fail(f"an epoch gave {len(kept)} of {_N_SAMPLES} samples (steps of {sizes}) {at}: "
             f"every sample must arrive once.")
    if sizes != want:
        fail(f"the steps hold {sizes} samples {at} (expected {want}, in the data's order).")
    if split != _expected_split(n, gb) and _captured_dataset_fn(make_dist_dataset, strategy, x, y,
                                                                 gb) is None:
        fail(f"the samples and their order are right {at}, but the last step's {want[-1]} samples "
             f"were split {'+'.join(map(str, split[-1]))} over the replicas (expected "
             f"{'+'.join(map(str, _expected_split(n, gb)[-1]))}): that is a global batch split "
             f"by the strategy, as experimental_distribute_dataset splits one, not replicas "
             f"taking whole per-replica batches from a pipeline in turn.",
             fix="Build the dataset with strategy.distribute_datasets_from_function and batch it "
                 "by the per-replica size.")
