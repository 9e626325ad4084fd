"""Lab 05's predictions, compared with what was measured and explained (never refused): part 4's
last step of an epoch distributed by ``experimental_distribute_dataset``, and stretch A's last
step of the learner's own pipeline.

Imported by :mod:`dpcourse.checks.lab05`, where the lab calls it.
"""

from __future__ import annotations

import numpy as np

from dpcourse.checks import reveal
from dpcourse.checks._lab05_common import pieces
from dpcourse.checks._lab05_pipeline import _N_SAMPLES, stretch_global


def last_step_sizes(strategy, dist_dataset) -> list:
    """How many samples each replica holds in the last step of ``dist_dataset``."""
    last = None
    for batch in dist_dataset:
        last = batch
    return [int(np.shape(v)[0]) for v in strategy.experimental_local_results(last[1])]


# Part 4: the last step of an epoch of 15 global batches and one sample more.
LAST_STEP_QUESTION = ("what replica 1 does in the last step of an epoch whose last global batch "
                      "holds one sample (experimental_distribute_dataset)")
LAST_STEP_CHOICES = ("a copy of the sample", "step_fn on an empty batch", "sits the step out",
                     "no such step")


def epoch_size(global_batch: int) -> int:
    """Part 4's data set: 15 global batches and one sample more."""
    return 15 * global_batch + 1


def last_step(strategy, dist_dataset, model, global_batch: int) -> dict:
    """Run the last step of ``dist_dataset`` through ``strategy.run`` (no update) and measure,
    per replica: whether ``step_fn`` was called on it, its samples, ``tf.reduce_mean`` of its
    per-example losses under ``model`` and its ``compute_average_loss`` share with
    ``global_batch_size=global_batch``; and the epoch's number of steps and the last step's
    mean loss over its samples."""
    from dpcourse import mirrored
    tf = mirrored.tf
    steps, last = 0, None
    for batch in dist_dataset:
        steps, last = steps + 1, batch
    called = []

    def step_fn(x, y):
        called.append(int(tf.get_static_value(
            tf.distribute.get_replica_context().replica_id_in_sync_group)))
        losses = mirrored.per_example_loss(y, model(x, training=False))
        return (tf.shape(y)[0], tf.reduce_mean(losses),
                tf.nn.compute_average_loss(losses, global_batch_size=global_batch),
                tf.reduce_sum(losses))

    out = strategy.run(step_fn, args=last)
    sizes, means, shares, sums = ([np.asarray(v).item() for v in
                                   strategy.experimental_local_results(o)] for o in out)
    return {"steps": steps, "sizes": sizes, "called": sorted(called), "means": means,
            "shares": shares, "step_mean": sum(sums) / max(1, sum(sizes)),
            "global_batch": global_batch}


def _fmt(values) -> str:
    return "[" + ", ".join("nan" if v != v else f"{v:.3f}" for v in values) + "]"


def check_last_step_prediction(guess, measured: dict) -> None:
    """Print what :func:`last_step` measured and compare the prediction of what replica 1 does in
    the last step with it: the explanation states TF's rule, which the measurement shows, and
    names what the chosen answer assumed."""
    sizes, n, gb = measured["sizes"], len(measured["sizes"]), measured["global_batch"]
    b = sum(sizes)
    print(f"steps in the epoch: {measured['steps']}; last step, per replica: samples {sizes}, "
          f"step_fn called on replicas {measured['called']}")
    print(f"  reduce_mean of its losses: {_fmt(measured['means'])}; compute_average_loss with "
          f"global_batch_size={gb}: {_fmt(measured['shares'])}")
    if n < 2:
        happened = "no replica 1"
    elif sizes[1] == 0 and 1 in measured["called"]:
        happened = LAST_STEP_CHOICES[1]
    elif sizes[1] > 0:
        happened = LAST_STEP_CHOICES[0]
    else:
        happened = LAST_STEP_CHOICES[2]
    piece = -(-b // n)
    why = (f"experimental_distribute_dataset cuts each batch the dataset yields into {n} pieces "
           f"of ⌈b/{n}⌉ samples in replica order, the last replicas taking what is left — a "
           f"full step's {gb} as {'+'.join(map(str, pieces(gb, n)))}, "
           f"the last step's {b} as {'+'.join(map(str, sizes))} (⌈{b}/{n}⌉ = {piece}). "
           f"It never "
           f"pads and never drops a batch the dataset kept, and no replica sits a step out: "
           f"apply_gradients all-reduces the gradients, and every replica must join an "
           f"all-reduce (lesson 05 §4). So a replica with no sample runs step_fn on a batch of "
           f"0: its reduce_mean is 0/0 = nan, its compute_average_loss share 0.0.")
    value = getattr(guess, "value", None)
    if value == LAST_STEP_CHOICES[0] and happened != value:
        why += (" A copy is what DistributedSampler does (lessons 03-04: it repeats samples so "
                "every rank holds as many); TF's strategy splits what the batch holds and no "
                "more.")
    elif value == LAST_STEP_CHOICES[2] and happened != value:
        why += (" Sitting out would leave the other replicas waiting in the gradients' "
                "all-reduce: under MirroredStrategy that raises (lesson 05 §4), so every replica "
                "runs every step, with whatever it holds.")
    elif value == LAST_STEP_CHOICES[3]:
        why += (f" The dataset was batched with drop_remainder=False, so it yields the last "
                f"sample as a batch of its own, and the strategy distributes every batch the "
                f"dataset yields: {measured['steps']} steps.")
    reveal(guess, happened, close=value == happened, explanation=why)


def check_pipeline_prediction(guess, sizes) -> None:
    """Compare the prediction of replica 0's share of the stretch's last step (100 samples,
    global batches of ``stretch_global(replicas)``) with what ``make_dist_dataset`` gave it."""
    n = len(sizes)
    gb = stretch_global(n)
    per, last = gb // n, _N_SAMPLES % gb or gb
    whole = sizes == [max(0, min(per, last - r * per)) for r in range(n)]
    reveal(guess, sizes[0], close=guess.value == sizes[0],
           explanation=(f"Each replica takes whole batches of {per} from the pipeline in turn, "
                        f"so the {last} samples left at the end fill replica 0's batch first: "
                        f"{'+'.join(map(str, sizes))}. A replica with no samples still runs the "
                        f"step, and the mean of no losses is 0/0.") if whole else
                       (f"Each replica takes the next element of your pipeline in turn, and "
                        f"your pipeline shared the {last} samples left at the end out as "
                        f"{'+'.join(map(str, sizes))}: the split of the last step is whatever "
                        f"the dataset function yields, not the strategy's."))
