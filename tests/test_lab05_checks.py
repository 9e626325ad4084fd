"""Lab 05's checks: the reference passes, each plausible mistake fails with a sentence naming it."""

import contextlib
import functools
from pathlib import Path

import pytest

from dpcourse import mirrored  # first: sets TF's quiet env and loads triton before TF
from dpcourse import devices

# One intra-op thread for TensorFlow in this process, as tests/conftest.py's OMP_NUM_THREADS=1
# is for torch (TF's own pool does not read it): the replicas already run side by side, and on
# the suite's 2 shared cores a pool of a thread per core spins for threads that are not running
# (measured here at load 6-8, 2026-11-28: a part-3 check 1.3-1.6 s of CPU against 1.6-1.8 s, a
# partial-batch epoch check 3.4 against 4.5). What the tests prove does not depend on it (the
# checks compare with tolerances). Set in-process only, so nbval's kernels keep TF's default;
# where this xdist worker already started TF for another file, it is left as it is.
try:
    mirrored.tf.config.threading.set_intra_op_parallelism_threads(1)
except RuntimeError:
    pass

devices.split_tf_devices(3, "CPU")  # before anything else touches TF; the checks use the spare

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from dpcourse.checks import LabCheckError, lab05  # noqa: E402
from dpcourse.checks import _lab05_epoch, _lab05_padded  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SUM, MEAN = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN


@pytest.fixture(scope="module")
def strategy():
    return mirrored.make_strategy(["/cpu:0", "/cpu:1"])


def _step_count(labels):
    """The step's sample count, summed over the replicas while the step runs (the answer's
    divisor: part 1's function is given no batch size)."""
    return tf.distribute.get_replica_context().all_reduce(SUM, tf.shape(labels)[0])


def loss_right(labels, logits, penalty=None):
    # the arithmetic part 1 asks for (the solution's)
    global_batch = _step_count(labels)
    losses = mirrored.per_example_loss(labels, logits)
    loss = tf.reduce_sum(losses) / tf.cast(global_batch, losses.dtype)
    if penalty is None:
        return loss
    return loss + penalty / tf.distribute.get_replica_context().num_replicas_in_sync


def loss_tf_nn(labels, logits, penalty=None):
    # right numbers, but through the two tf.nn functions that hide part 1's arithmetic
    global_batch = _step_count(labels)
    loss = tf.nn.compute_average_loss(mirrored.per_example_loss(labels, logits),
                                      global_batch_size=global_batch)
    return loss if penalty is None else loss + tf.nn.scale_regularization_loss(penalty)


def loss_reduce_mean(labels, logits):
    return tf.reduce_mean(mirrored.per_example_loss(labels, logits))


def make_right(strategy, lr, start=None):
    with strategy.scope():
        model, optimizer = mirrored.build_keras_cnn(), keras.optimizers.SGD(learning_rate=lr)
    if start is not None:
        model.set_weights(start.get_weights())
    return model, optimizer


_SHARED: dict = {}   # (id(strategy), lr) -> (strategy, model, optimizer)


def make_shared(strategy, lr):
    """make_right's pair, built once per strategy and learning rate and handed out again: for
    the tests whose subject is the step (a mirrored CNN built under a strategy costs about half
    of each step the check runs). check_train_step sets the weights to its start before every
    step, and plain SGD keeps no state a step depends on, so each step runs as on a fresh
    pair. The check's own call of a maker that builds anew for every step runs in the tests
    of wrong makers (outside the scope, a fixed learning rate, momentum, the notebook's
    strategy), in test_a_step_running_the_notebooks_strategy_is_named (its step runs another
    strategy on the model it is handed: nothing shared) and, through all eight steps of a
    passing check, in solutions/lab05's nbval run (the solution's make_model_and_optimizer)."""
    key = (id(strategy), lr)
    if key not in _SHARED:
        _SHARED[key] = (strategy, *make_right(strategy, lr))
    return _SHARED[key][1:]


def make_model_outside(strategy, lr):
    model = mirrored.build_keras_cnn()
    with strategy.scope():
        return model, keras.optimizers.SGD(learning_rate=lr)


def make_optimizer_outside(strategy, lr):
    with strategy.scope():
        model = mirrored.build_keras_cnn()
    return model, keras.optimizers.SGD(learning_rate=lr)


NOMINAL = 64   # the notebook's global_batch, the size of a full step


def make_step(loss_fn, loss_op=SUM, acc_op=SUM, acc="hits", report_mean_loss=False):
    """acc="hits": each replica returns its count of right predictions and its sample count,
    both summed, divided once at the end (right); acc="fraction": its accuracy over its own
    slice, reduced with acc_op; acc="weighted": that fraction times its slice size / the step's
    count (right on every split where no replica is empty: nan times 0 on an empty one);
    acc="nominal": the summed count divided by NOMINAL, a full step's size (the learner's bug).
    report_mean_loss: the loss reported is each replica's reduce_mean, reduced with loss_op."""
    def distributed_train_step(strategy, model, optimizer, dist_batch):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = loss_fn(y, logits)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            right = tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.float32)
            count = tf.cast(tf.shape(y)[0], tf.float32)
            if acc in ("hits", "nominal"):
                a = tf.reduce_sum(right)
            elif acc == "fraction":
                a = tf.reduce_mean(right)
            else:
                step = tf.distribute.get_replica_context().all_reduce(SUM, count)
                a = tf.reduce_mean(right) * count / step
            if report_mean_loss:
                loss = tf.reduce_mean(mirrored.per_example_loss(y, logits))
            return loss, a, count
        loss, a, count = strategy.run(step_fn, args=dist_batch)
        if loss_op is None:
            return loss, a
        a = strategy.reduce(acc_op, a, axis=None)
        if acc == "hits":
            a = a / strategy.reduce(SUM, count, axis=None)
        elif acc == "nominal":
            a = a / NOMINAL
        return strategy.reduce(loss_op, loss, axis=None), a
    return distributed_train_step


def steps_replayed(step):
    """``step`` (a test's distributed_train_step, met twice by one test) with each step the
    check feeds it run for real the first time and replayed after: the weights it left on the
    model and what it returned are handed back (launches_replayed's idea for a step run
    eagerly, whose replica threads running the CNN are most of a part-3 check's time). Keyed
    by the strategy, the learning rate and the step's samples as each replica holds them; the
    check resets the weights to the same start before every step. Everything else — the
    model, scope and optimizer checks, the judgement, the memory of mistakes and the sentence
    — runs again. Only for steps that read no strategy from outside and do not call the
    library's answer (the check's spies see the first meeting only)."""
    runs: dict = {}

    def distributed_train_step(strategy, model, optimizer, dist_batch):
        key = (id(strategy), float(np.asarray(optimizer.learning_rate.numpy())),
               tuple(tuple(np.asarray(v).ravel().tolist())
                     for v in strategy.experimental_local_results(dist_batch[1])),
               tuple(float(np.asarray(v).sum())
                     for v in strategy.experimental_local_results(dist_batch[0])))
        if key not in runs:
            try:
                out = step(strategy, model, optimizer, dist_batch)
            except Exception as exc:  # noqa: BLE001 - replayed as the check met it
                runs[key] = ("raised", exc, model.get_weights())
                raise
            runs[key] = ("returned", out, model.get_weights())
            return out
        how, value, weights = runs[key]
        model.set_weights(weights)
        if how == "raised":
            raise value
        return value
    return distributed_train_step


# The reference answers (loss_right, make_right, make_step(loss_right)) are the solution's
# per_replica_loss, make_model_and_optimizer and distributed_train_step: nbval runs their three
# checks in solutions/lab05_mirrored_strategy.ipynb and compares what they print (the ✔, the
# splits tried: 18 as 6+6+6, 5 as 3+2, the penalty's 5 as 3+2 on 2 and 7 as 3+3+1 on 3, 1 as 1+0,
# 2 as 1+1+0, the tf.function epoch's last steps 4+0 on 2 and 12+12+4 on 3; 48 on 2, 63 on 3,
# 6+2 on 2, 6+2+2 on 3, 1+0 on 2, 1+0+0 on 3) with the stored output; the tests here run the
# other right answers and the wrong ones.


def test_reference_batch_has_nonzero_accuracy():
    # the SUM-vs-MEAN accuracy diagnosis needs an accuracy that is not 0 before the step
    x, y = lab05.reference_batch()
    logits = mirrored.build_keras_cnn(seed=3)(x).numpy()
    assert (logits.argmax(-1) == y).mean() > 0


# (reduce_mean per replica in part 1: test_loss_messages_give_the_cause_then_the_fix and
# test_part1_divisors_are_named_by_their_cause[own-slice] name it by "the number of samples that
# replica holds itself")


def test_reduce_mean_in_the_step_is_named(strategy):
    with pytest.raises(LabCheckError, match=r"2x too big.*reduce_mean over its own examples"):
        lab05.check_train_step(make_step(loss_reduce_mean), make_shared, strategy)


def test_mean_where_sum_is_meant_is_named(strategy):
    # learner LR3_05: "Shares add up" in the first message handed over the fix
    step = steps_replayed(make_step(loss_right, MEAN, MEAN))   # the second meeting replayed
    with pytest.raises(LabCheckError) as first:
        lab05.check_train_step(step, make_shared, strategy)
    msg = " ".join(str(first.value).split())
    assert "mean (MEAN) of the replicas' shares" in msg and "a second time" in msg, msg
    assert "Shares add up" not in msg, msg
    with pytest.raises(LabCheckError, match="What to change: Shares add up to the mean"):
        lab05.check_train_step(step, make_shared, strategy)


def test_model_outside_scope_is_named(strategy):
    with pytest.raises(LabCheckError, match="model's variables .* outside strategy.scope"):
        lab05.check_model_and_optimizer(make_model_outside, strategy)
    with pytest.raises(LabCheckError, match="outside strategy.scope"):
        lab05.check_train_step(make_step(loss_right), make_model_outside, strategy)


def test_optimizer_outside_scope_is_named(strategy):
    with pytest.raises(LabCheckError, match="optimizer was created outside strategy.scope"):
        lab05.check_model_and_optimizer(make_optimizer_outside, strategy)


def make_optimizer_built_inside(strategy, lr):
    """The optimizer constructed outside the scope, then built inside it (wrong: Keras creates
    its step counter and learning rate in the constructor, base_optimizer.py __init__)."""
    with strategy.scope():
        model = mirrored.build_keras_cnn()
    optimizer = keras.optimizers.SGD(learning_rate=lr)
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    return model, optimizer


def test_optimizer_constructed_outside_and_built_inside_is_named(strategy):
    model, optimizer = make_optimizer_built_inside(strategy, 0.1)
    assert not strategy.extended.variable_created_in_scope(optimizer.iterations.value)  # hint 2
    with pytest.raises(LabCheckError, match="optimizer was created outside strategy.scope"):
        lab05.check_model_and_optimizer(make_optimizer_built_inside, strategy)


def test_no_update_is_named(strategy):
    def lazy_step(strategy, model, optimizer, dist_batch):
        def step_fn(x, y):
            logits = model(x, training=True)
            return (loss_right(y, logits),
                    tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.float32)))
        loss, acc = strategy.run(step_fn, args=dist_batch)
        return strategy.reduce(SUM, loss, axis=None), strategy.reduce(MEAN, acc, axis=None)
    with pytest.raises(LabCheckError, match="weights did not change"):
        lab05.check_train_step(lazy_step, make_shared, strategy)



# --- answers tied to one batch size or replica count, and right answers written differently --

def loss_implicit_global(labels, logits):
    # right inside strategy.run: the replica context tells compute_average_loss the replica count
    return tf.nn.compute_average_loss(mirrored.per_example_loss(labels, logits))


def loss_sum_over_global(labels, logits, penalty=None):
    # right too: the penalty split over the replicas in proportion to their slices
    global_batch = tf.cast(_step_count(labels), tf.float32)
    losses = mirrored.per_example_loss(labels, logits)
    share = tf.cast(tf.size(losses), tf.float32) / global_batch
    return (tf.reduce_sum(losses) + (0.0 if penalty is None else penalty * global_batch * share)
            ) / global_batch


def loss_mean_over_replicas(labels, logits):
    # right for equal slices: the local mean divided by the number of replicas
    ctx = tf.distribute.get_replica_context()
    return tf.reduce_mean(mirrored.per_example_loss(labels, logits)) / ctx.num_replicas_in_sync


def loss_fixed_64(labels, logits):
    return tf.nn.compute_average_loss(mirrored.per_example_loss(labels, logits),
                                      global_batch_size=64)


def loss_fixed_two_replicas(labels, logits):
    return tf.reduce_mean(mirrored.per_example_loss(labels, logits)) / 2


def loss_summed(labels, logits):
    return tf.reduce_sum(mirrored.per_example_loss(labels, logits))


def loss_sum_over_cast_global(labels, logits, penalty=None):
    # right too: the whole penalty on replica 0 alone
    global_batch = _step_count(labels)
    losses = mirrored.per_example_loss(labels, logits)
    loss = tf.reduce_sum(losses) * (1.0 / tf.cast(global_batch, losses.dtype))
    if penalty is None:
        return loss
    first = tf.distribute.get_replica_context().replica_id_in_sync_group == 0
    return loss + tf.where(first, penalty, 0.0)


def loss_mean_split_by_hand(labels, logits, penalty=None):
    # right too: the penalty split over the replicas with the replica count of the context
    global_batch = tf.cast(_step_count(labels), tf.float32)
    ctx = tf.distribute.get_replica_context()
    losses = mirrored.per_example_loss(labels, logits)
    extra = 0.0 if penalty is None else penalty * global_batch / ctx.num_replicas_in_sync
    return (tf.reduce_sum(losses) + extra) / global_batch


_cal, _srl = tf.nn.compute_average_loss, tf.nn.scale_regularization_loss   # aliases, bound early


def loss_alias_average(labels, logits, penalty=None):
    global_batch = _step_count(labels)
    loss = _cal(mirrored.per_example_loss(labels, logits), global_batch_size=global_batch)
    return loss if penalty is None else loss + penalty / (
        tf.distribute.get_replica_context().num_replicas_in_sync)


def loss_alias_scale(labels, logits, penalty=None):
    global_batch = tf.cast(_step_count(labels), tf.float32)
    losses = mirrored.per_example_loss(labels, logits)
    loss = tf.reduce_sum(losses) / global_batch
    return loss if penalty is None else loss + _srl(penalty)


def _loss_with_default(labels, logits, penalty=None, avg=tf.nn.compute_average_loss):
    global_batch = _step_count(labels)
    loss = avg(mirrored.per_example_loss(labels, logits), global_batch_size=global_batch)
    return loss if penalty is None else loss + penalty / (
        tf.distribute.get_replica_context().num_replicas_in_sync)


def _loss_via_helper(labels, logits, penalty=None):
    return loss_tf_nn(labels, logits, penalty)


@pytest.mark.parametrize("fn, used, fix", [
    (loss_tf_nn, "tf.nn.compute_average_loss (it uses tf.nn.scale_regularization_loss as well)",
     None),
    (loss_alias_average, "tf.nn.compute_average_loss",
     "Divide the replica's summed per-example losses yourself"),
    (loss_alias_scale, "tf.nn.scale_regularization_loss",
     "Add this replica's share of the penalty yourself"),
    (_loss_with_default, "tf.nn.compute_average_loss", None),
    (_loss_via_helper, "tf.nn.compute_average_loss", None),
], ids=["called", "alias-average", "alias-scale", "default-arg", "helper"])
def test_tf_nn_functions_that_hide_part_1_are_refused(fn, used, fix, strategy, part1_epochs):
    with epochs_batched(part1_epochs):   # the batch's epochs, judged in both meetings
        with pytest.raises(LabCheckError) as err:
            lab05.check_per_replica_loss(fn, strategy)
        msg = " ".join(str(err.value).split())
        assert f"gives the right numbers, but it uses {used}" in msg, msg
        assert "why that is right on N replicas" in msg, msg
        assert "What to change" not in msg and "Divide the replica" not in msg, msg
        if fix:   # each of the two refusals carries a fix of its own, shown the second time
            with pytest.raises(LabCheckError) as err:
                lab05.check_per_replica_loss(fn, strategy)
            assert fix in str(err.value), str(err.value)


# The answers to part 1 that run its epoch to the end (right numbers: passed, or refused after
# them): check_per_replica_loss's epochs for all of them, on 2 and 3 replicas, come from one
# eager pass and one tf.function per replica count (lab05.epoch_of_loss_results, lab 04's
# f1_results idea) instead of an eager run and a trace each; the check judges each answer's
# outcome as it judges its own runs. Everything else — the steps, the penalty, the refusal and
# its sentence — runs for real in every meeting.
PART1_RUNS_ITS_EPOCH = [loss_tf_nn, loss_alias_average, loss_alias_scale, _loss_with_default,
                        _loss_via_helper, loss_sum_over_global, loss_sum_over_cast_global,
                        loss_mean_split_by_hand]


@pytest.fixture(scope="module")
def part1_epochs(strategy):
    return lab05.epoch_of_loss_results(PART1_RUNS_ITS_EPOCH, strategy)


@contextlib.contextmanager
def epochs_batched(results):
    """check_per_replica_loss judging the batch's epochs (``results``) for the answers in it."""
    real = lab05._check_epoch_of_loss

    def judged(fn, strat):
        outcome = results.get((fn, id(strat)))
        assert outcome is not None, fn   # an answer of the batch, on a strategy of the batch
        return real(fn, strat, outcome)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lab05, "_check_epoch_of_loss", judged)
        yield


def test_solution_uses_the_arithmetic():
    src = (ROOT / "solutions" / "lab05_mirrored_strategy.py").read_text()
    body = src[src.index("def per_replica_loss"):src.index("lab05.check_per_replica_loss(")]
    assert "compute_average_loss" not in body and "scale_regularization_loss" not in body, body


# --- part 1's regularised step: the penalty is the same on every replica, counted once -----

def _penalised(part):
    def loss(labels, logits, penalty=None):
        global_batch = _step_count(labels)
        losses = mirrored.per_example_loss(labels, logits)
        loss = tf.nn.compute_average_loss(losses, global_batch_size=global_batch)
        if penalty is None:
            return loss
        return loss + part(penalty, tf.cast(global_batch, tf.float32),
                           tf.distribute.get_replica_context())
    return loss


def loss_three_arguments(labels, logits):   # no penalty parameter
    global_batch = _step_count(labels)
    return tf.nn.compute_average_loss(mirrored.per_example_loss(labels, logits),
                                      global_batch_size=global_batch)


PENALTY_MISTAKES = [
    (_penalised(lambda p, gb, ctx: p),
     "the 2 replicas' values add up to the step's mean loss plus 2 x the penalty (a step of 5 "
     "samples as 3+2 on 2 replicas, penalty 0.75): every replica added the whole penalty"),
    (loss_three_arguments, "per_replica_loss takes 2 arguments (labels, logits), but the "
                           "contract's regularised step calls it with penalty= as well"),
    (_penalised(lambda p, gb, ctx: 0.0 * p), "the penalty was left out"),
    (_penalised(lambda p, gb, ctx: p / gb),
     "every replica divided the penalty by the step's sample count (5), as the per-example "
     "losses are divided"),
    (_penalised(lambda p, gb, ctx: tf.nn.compute_average_loss(
        tf.reshape(p, [1]), global_batch_size=tf.cast(gb, tf.int32))),
     "every replica divided the penalty by the step's sample count (5)"),
]


# (the whole penalty on every replica, PENALTY_MISTAKES[0], and the penalty over the global
# batch, PENALTY_MISTAKES[3]: named by their sentences in test_penalty_mistakes_get_their_own_fix,
# which meets each twice)
@pytest.mark.parametrize("fn, phrase", [PENALTY_MISTAKES[i] for i in (1, 2, 4)],
                         ids=["no-penalty-arg", "left-out", "compute-average-loss"])
def test_penalty_mistakes_are_named(fn, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_per_replica_loss(fn, strategy)
    assert phrase in " ".join(str(err.value).split()), str(err.value)


def test_penalty_mistakes_get_their_own_fix(strategy):
    # the whole penalty on every replica first: its cause, then its fix; the penalty over the
    # global batch met next is a different idea, and its first meeting does not hand over a fix
    whole, whole_phrase = PENALTY_MISTAKES[0]
    with pytest.raises(LabCheckError) as first:
        lab05.check_per_replica_loss(whole, strategy)
    assert whole_phrase in " ".join(str(first.value).split()), str(first.value)
    # learner LR3_05: "it is not split over them the way the samples are" was the fix, first time
    assert "count it once" not in str(first.value), str(first.value)
    assert "not split" not in str(first.value), str(first.value)
    with pytest.raises(LabCheckError, match="not split over them the way the samples are: count "
                                            "it once per step, over all the replicas together"):
        lab05.check_per_replica_loss(whole, strategy)
    over_global, over_global_phrase = PENALTY_MISTAKES[3]
    with pytest.raises(LabCheckError) as first:
        lab05.check_per_replica_loss(over_global, strategy)
    assert over_global_phrase in " ".join(str(first.value).split()), str(first.value)
    assert "What to change" not in str(first.value), str(first.value)
    with pytest.raises(LabCheckError, match="Keep the penalty out of the division"):
        lab05.check_per_replica_loss(over_global, strategy)


def test_a_fixed_replica_count_for_the_penalty_is_named(strategy):
    # / 2 is right on the lab's 2 replicas: the spare third replica shows it
    with pytest.raises(LabCheckError) as err:
        lab05.check_per_replica_loss(_penalised(lambda p, gb, ctx: p / 2), strategy)
    msg = " ".join(str(err.value).split())
    assert "the 3 replicas' values add up to the step's mean loss plus 1.5 x the penalty" in msg
    assert "every replica added the penalty / 2, but this step runs on 3 replicas" in msg, msg


@pytest.mark.parametrize("fn", [loss_sum_over_global, loss_sum_over_cast_global,
                                loss_mean_split_by_hand])
def test_right_losses_pass(fn, strategy, capsys, part1_epochs):
    # (loss_right, the solution's: solutions/lab05's nbval run, see above)
    with epochs_batched(part1_epochs):
        lab05.check_per_replica_loss(fn, strategy)
    out = capsys.readouterr().out
    # the spare device was used, and uneven slices were tried
    assert out.count("✔") == 1 and "18 as 6+6+6" in out and "5 as 3+2" in out, out
    assert "a penalty once per step (5 as 3+2 on 2, 7 as 3+3+1 on 3)" in out, out


@pytest.mark.parametrize("fn, phrase", [
    # (loss_fixed_64: test_part1_divisors_are_named_by_their_cause[cal-python-64], "divided the
    # summed loss by 64, but ..."; loss_implicit_global, right for equal slices only, a partial
    # last batch breaks it (issue 37): test_loss_messages_give_the_cause_then_the_fix, "slice
    # size times the replica count")
    (loss_fixed_two_replicas, "on 3 replicas"),
    (loss_summed, "returns the sum"),
    # right for equal slices only: a partial last batch breaks it (issue 37)
    (loss_mean_over_replicas, "slice size times the replica count"),
])
def test_losses_tied_to_one_setup_fail(fn, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_per_replica_loss(fn, strategy)
    assert phrase in str(err.value), str(err.value)


def _step_counting_hits(loss_fn, counts_summed):
    """Right steps that count each replica's correct predictions: counts_summed, the replicas'
    hits and sample counts both summed and divided once; else each replica's hits divided by the
    step's count found in the step, the shares summed."""
    def distributed_train_step(strategy, model, optimizer, dist_batch):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = loss_fn(y, logits)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            hits = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.float32))
            if counts_summed:
                return loss, hits, tf.cast(tf.size(y), tf.float32)
            return loss, hits / tf.cast(_step_count(y), tf.float32)
        out = strategy.run(step_fn, args=dist_batch)
        loss, acc = (strategy.reduce(SUM, v, axis=None) for v in out[:2])
        return loss, (acc / strategy.reduce(SUM, out[2], axis=None) if counts_summed else acc)
    return distributed_train_step


step_counts_both = _step_counting_hits(loss_sum_over_global, counts_summed=True)
step_share_of_hits = _step_counting_hits(loss_right, counts_summed=False)


@pytest.mark.parametrize("step", [step_counts_both, step_share_of_hits],
                         ids=["hits-and-counts-summed", "shares-of-hits"])
def test_right_steps_pass(step, strategy, capsys):
    # (hits summed, make_step(loss_right), the solution's: solutions/lab05's nbval run)
    lab05.check_train_step(step, make_shared, strategy)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "48 on 2" in out and "63 on 3" in out, out
    assert "6+2 on 2," in out and "6+2+2 on 3," in out, out  # the uneven step
    assert "1+0 on 2," in out and "1+0+0 on 3 replicas" in out, out  # the short last step


def test_the_short_step_holds_one_right_sample():
    x, y = lab05.reference_batch(64)
    hit = mirrored.build_keras_cnn(seed=3)(x, training=False).numpy().argmax(-1) == y
    for n in (2, 3):
        slices = lab05.short_slices(n)
        assert [len(s) for s in slices] == [1] + [0] * (n - 1) and hit[slices[0]].all()


def test_a_step_given_the_batch_size_is_named(strategy):
    # the contract before learner LR4_05: the loop handed the step its nominal size
    def old_step(strategy, model, optimizer, dist_batch, global_batch):
        return make_step(loss_right)(strategy, model, optimizer, dist_batch)
    with pytest.raises(LabCheckError) as err:
        lab05.check_train_step(old_step, make_shared, strategy)
    msg = " ".join(str(err.value).split())
    assert ("distributed_train_step requires 5 arguments (strategy, model, optimizer, "
            "dist_batch, global_batch), but a training loop calls it with (strategy, model, "
            "optimizer, dist_batch) only: nothing hands it `global_batch`") in msg, msg
    assert "What to change" not in msg, msg


def test_accuracy_over_the_nominal_batch_size_is_named(strategy):
    # learner LR4_05: hits divided by the full step's size; one device divides by the step's own
    # count. The first step that is not 64 (48 on 2) shows it, with both numbers
    step = steps_replayed(make_step(loss_right, acc="nominal"))   # the second meeting replayed
    with pytest.raises(LabCheckError) as first:
        lab05.check_train_step(step, make_shared, strategy)
    msg = " ".join(str(first.value).split())
    assert "correct predictions of this step divided by 64, but the step holds 48 samples" in msg, msg
    assert "nominal batch size" in msg and "this one holds 48" in msg, msg
    assert "short last step of 1 sample, classified right, would be reported as 1/64 = 0.0156" \
        in msg, msg
    assert "Count the step's samples while it runs" not in msg, msg
    with pytest.raises(LabCheckError) as second:
        lab05.check_train_step(step, make_shared, strategy)
    assert "Count the step's samples while it runs" in str(second.value), str(second.value)


def test_accuracy_over_the_nominal_size_on_the_short_last_step(strategy):
    # a step that divides by 64 only when the step is not full-sized by 64's multiples would
    # pass every full step: the short last step alone (1 right sample on 2) reports 1/64
    def short_only(strategy, model, optimizer, dist_batch):
        loss, acc = make_step(loss_right)(strategy, model, optimizer, dist_batch)
        count = sum(int(tf.size(v)) for v in strategy.experimental_local_results(dist_batch[1]))
        return loss, acc * count / NOMINAL if count == 1 else acc
    with pytest.raises(LabCheckError) as err:
        lab05.check_train_step(short_only, make_shared, strategy)
    msg = " ".join(str(err.value).split())
    assert ("the accuracy returned (0.0156) is the 1 correct prediction of this step divided "
            "by 64, but the step holds 1 sample (split 1+0 over 2 replicas): the batch's "
            "accuracy before the update is 1.0000") in msg, msg


def step_counts_averaged(strategy, model, optimizer, dist_batch):
    # hits summed, but the replicas' sample counts combined with MEAN
    step = make_step(loss_right)
    loss, acc = step(strategy, model, optimizer, dist_batch)
    return loss, acc * strategy.num_replicas_in_sync   # hits / (counts summed / N)


def test_sample_counts_averaged_are_named(strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_train_step(step_counts_averaged, make_shared, strategy)
    msg = " ".join(str(err.value).split())
    assert "added up and divided by the mean (MEAN) of their sample counts (slices of 6+2: " \
           "8/2), where one device divides by their sum, the step's 8 samples" in msg, msg


def test_an_empty_replicas_own_mean_is_named_on_the_short_step(strategy):
    # right on every split where each replica holds a sample; the short last step leaves one
    # empty, whose own mean is 0/0
    with pytest.raises(LabCheckError) as err:
        lab05.check_train_step(make_step(loss_right, acc="weighted"), make_shared, strategy)
    msg = " ".join(str(err.value).split())
    assert "the reduced accuracy is nan" in msg and "split 1+0 over 2 replicas" in msg, msg
    assert "replica 1 holds no sample of this step, and a mean over its own slice is 0/0" in msg, msg


def test_uneven_step_tells_mean_of_means_apart():
    # every slice holds one right prediction, so neither mean of means is the batch's value
    x, y = lab05.reference_batch(64)
    logits = mirrored.build_keras_cnn(seed=3)(x, training=False).numpy()
    per_ex, hit = mirrored.per_example_loss(y, logits).numpy(), logits.argmax(-1) == y
    for n in (2, 3):
        slices = lab05.uneven_slices(n)
        assert [len(s) for s in slices] == [6] + [2] * (n - 1)
        assert all(hit[s].sum() == 1 for s in slices)
        idx = np.concatenate(slices)
        for of in (per_ex, hit.astype(float)):
            assert abs(np.mean([of[s].mean() for s in slices]) / of[idx].mean() - 1) > 0.01


@pytest.mark.parametrize("step, phrase", [
    # (per-replica accuracy fractions reduced with MEAN: test_step_messages_give_the_cause...)
    # the loss reported as each replica's reduce_mean, reduced with MEAN
    (make_step(loss_right, MEAN, acc="hits", report_mean_loss=True),
     "loss returned"),
    # the gradient's divisor is slice size x replicas: part 1's mistake, seen in the step
    (make_step(loss_implicit_global), "slices of 6+2, and each replica's loss was divided"),
    (make_step(loss_mean_over_replicas), "slices of 6+2, and each replica's loss was divided"),
])
def test_uneven_step_mistakes_are_named(step, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_train_step(step, make_shared, strategy)
    assert phrase in str(err.value), str(err.value)
    assert "mean of means" in str(err.value) or "slice size" in str(err.value)


def test_library_answers_are_refused(strategy):
    with pytest.raises(LabCheckError, match="mirrored.per_replica_loss, the library's answer"):
        lab05.check_per_replica_loss(mirrored.per_replica_loss, strategy)
    # (a per_replica_loss that calls the library's answer with the step's count:
    # test_the_library_answer_with_a_counted_size_is_refused, the same run and sentence)
    with pytest.raises(LabCheckError, match="mirrored.train_step, the library's answer"):
        lab05.check_train_step(mirrored.train_step, make_shared, strategy)
    with pytest.raises(LabCheckError, match="calls dpcourse.mirrored.per_replica_loss"):
        lab05.check_train_step(make_step(lambda y, lg: mirrored.per_replica_loss(y, lg, _step_count(y))),
                               make_shared, strategy)


def make_fixed_lr(strategy, lr):
    with strategy.scope():
        return mirrored.build_keras_cnn(), keras.optimizers.SGD(learning_rate=0.1)


def test_fixed_learning_rate_is_named(strategy):
    # the lab's lr is 0.1 too: the check tries another one
    with pytest.raises(LabCheckError, match=r"learning rate is 0.1, but .* lr=0.037"):
        lab05.check_model_and_optimizer(make_fixed_lr, strategy, 0.1)
    # in part 3 the learning rate is blamed, not part 1's divisor
    with pytest.raises(LabCheckError, match=r"learning rate is 0.1, but .* lr=0.037"):
        lab05.check_train_step(make_step(loss_right), make_fixed_lr, strategy, lr=0.1)


def test_other_learning_rates_pass(strategy, capsys):
    # (a maker building anew for each of the eight steps: solutions/lab05's nbval run)
    lab05.check_model_and_optimizer(make_right, strategy, 0.05)
    lab05.check_train_step(make_step(loss_right), make_shared, strategy, lr=0.05)
    assert capsys.readouterr().out.count("✔") == 2


def step_first_replica(strategy, model, optimizer, dist_batch):
    # no reduction: replica 0's values returned
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_right(y, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.float32))
    loss, acc = strategy.run(step_fn, args=dist_batch)
    return (strategy.experimental_local_results(loss)[0],
            strategy.experimental_local_results(acc)[0])


def test_no_reduction_is_named(strategy):
    with pytest.raises(LabCheckError, match="replica 0's value alone"):
        lab05.check_train_step(step_first_replica, make_shared, strategy)
    with pytest.raises(LabCheckError, match="per-replica values"):
        lab05.check_train_step(make_step(loss_right, None, None), make_shared, strategy)


@pytest.mark.parametrize("step, phrase", [
    (make_step(loss_fixed_64), "divided by a fixed 64"),
    (make_step(loss_fixed_two_replicas), "divided by a fixed 2 replicas"),
])
def test_steps_tied_to_one_setup_fail(step, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_train_step(step, make_shared, strategy)
    assert phrase in str(err.value), str(err.value)


# --- stretch: distribute_datasets_from_function and the partial last batch --------------------

def _dataset_maker(per_replica=True, shard=True, drop=False, shuffle=False, by_replicas=False,
                   size=None, refuse="own", pipeline_id=True, per_strategy=False,
                   by_batches=False):
    """size="floor" / "ceil": the per-replica batch rounded instead of refused when the replicas
    do not divide the global batch. refuse="own": the learner's own ValueError naming both
    numbers (right); "tf": no check of its own, TF's get_per_replica_batch_size raises; "vague":
    its own ValueError naming neither number."""
    def make(strategy, x, y, global_batch):
        n = strategy.num_replicas_in_sync
        if size is None and global_batch % n:
            if refuse == "own":
                raise ValueError(f"{global_batch} samples do not split over {n} replicas")
            if refuse == "vague":
                raise ValueError("bad global batch")

        def dataset_fn(ctx):
            ds = tf.data.Dataset.from_tensor_slices((x, y))
            if shuffle:
                ds = ds.shuffle(100, seed=1)
            if by_replicas:
                ds = ds.shard(ctx.num_replicas_in_sync, ctx.input_pipeline_id)
            elif shard:
                ds = ds.shard(ctx.num_input_pipelines,
                              ctx.input_pipeline_id if pipeline_id else 0)
            if size == "floor":
                per = global_batch // n
            elif size == "ceil":
                per = -(-global_batch // n)
            elif per_strategy:   # the strategy's replicas: one worker's, not all in sync
                per = global_batch // strategy.num_replicas_in_sync
            else:
                per = ctx.get_per_replica_batch_size(global_batch) if per_replica else global_batch
            if by_batches:   # batch first, then give each pipeline every n-th batch
                return ds.batch(per, drop_remainder=drop).shard(ctx.num_input_pipelines,
                                                                ctx.input_pipeline_id)
            return ds.batch(per, drop_remainder=drop)
        return strategy.distribute_datasets_from_function(dataset_fn)
    return make


# _dataset_maker() (sharded by pipeline, per-replica batches, its own ValueError) is the
# solution's make_dist_dataset: its ✔ ("32 on 2, 36 on 3 replicas", "2 input pipelines (as on 2
# workers) split the data 50 + 50, in batches of 8") is compared by solutions/lab05's nbval run.


def test_pipelines_cut_batch_by_batch_pass_too(strategy, capsys):
    # the learner's finding: the contract now says the pipelines may cut the data sample by
    # sample or batch by batch; batch by batch gives 52 + 48 on 2 pipelines
    lab05.check_dataset_fn(_dataset_maker(shard=False, by_batches=True), strategy)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "split the data 52 + 48, in batches of 8" in out, out


def test_a_dataset_function_that_ignores_its_input_context_is_named(strategy):
    # one pipeline cannot tell: the check calls the function as on 2 workers
    unsharded = _dataset_maker(shard=False)
    with pytest.raises(LabCheckError) as err:
        lab05.check_dataset_fn(unsharded, strategy)
    msg = str(err.value)
    assert "each of the 2 input pipelines yielded all 100 samples" in msg, msg
    assert "keeps the whole data whatever its input_context says" in msg, msg
    assert "pipeline id." not in msg, msg
    with pytest.raises(LabCheckError, match="Shard the data by the context's number of input "
                                            "pipelines and its pipeline id"):
        lab05.check_dataset_fn(unsharded, strategy)


def test_tensorflows_own_refusal_is_not_the_learners(strategy):
    # ctx.get_per_replica_batch_size raises ValueError by itself for 33 on 2: TF decided, not
    # the learner (the lab asks for the learner's own error)
    with pytest.raises(LabCheckError) as err:
        lab05.check_dataset_fn(_dataset_maker(refuse="tf"), strategy)
    msg = str(err.value)
    assert "global_batch=33 on 2 replicas the ValueError came from TensorFlow" in msg, msg
    assert "get_per_replica_batch_size" in msg and "raise your own" not in msg, msg
    with pytest.raises(LabCheckError, match="Check the global batch in make_dist_dataset"):
        lab05.check_dataset_fn(_dataset_maker(refuse="tf"), strategy)


def test_a_refusal_naming_neither_number_is_named(strategy):
    with pytest.raises(LabCheckError, match=r"does not name both the global batch \(33\)"):
        lab05.check_dataset_fn(_dataset_maker(refuse="vague"), strategy)


@pytest.mark.parametrize("size, steps", [("floor", "[32, 32, 32]"), ("ceil", "[34, 34, 32]")])
def test_indivisible_global_batch_is_refused(size, steps, strategy):
    # 33 on 2 replicas: rounding the per-replica batch changes every step's size
    with pytest.raises(LabCheckError) as err:
        lab05.check_dataset_fn(_dataset_maker(size=size), strategy)
    msg = str(err.value)
    assert "global_batch=33 on 2 replicas your steps held " + steps in msg, msg
    assert "33 is not a multiple of 2" in msg and "raise ValueError" not in msg, msg
    with pytest.raises(LabCheckError, match="refuse such a global batch with your own "
                                            "ValueError naming both numbers, or give"):
        lab05.check_dataset_fn(_dataset_maker(size=size), strategy)   # the fix, second time


def make_adapting(strategy, x, y, global_batch):
    # the other defensible decision: keep every step at the global batch, the replicas' shares
    # differing by a sample (17 + 16 for 33 on 2)
    n = strategy.num_replicas_in_sync

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines,
                                                              ctx.input_pipeline_id)
        if global_batch % n == 0:
            return ds.batch(ctx.get_per_replica_batch_size(global_batch))

        def pieces(xb, yb):
            b = tf.shape(xb)[0]
            return tf.data.Dataset.range(n).map(
                lambda r: (xb[tf.cast(r, tf.int32) * b // n:(tf.cast(r, tf.int32) + 1) * b // n],
                           yb[tf.cast(r, tf.int32) * b // n:(tf.cast(r, tf.int32) + 1) * b // n]))
        return ds.batch(global_batch).flat_map(pieces)
    return strategy.distribute_datasets_from_function(dataset_fn)


def make_adapting_always(strategy, x, y, global_batch):
    # the adaptation applied to every global batch: the short last step's 4 samples as 2 + 2
    n = strategy.num_replicas_in_sync

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines,
                                                              ctx.input_pipeline_id)

        def pieces(xb, yb):
            b = tf.shape(xb)[0]
            return tf.data.Dataset.range(n).map(
                lambda r: (xb[tf.cast(r, tf.int32) * b // n:(tf.cast(r, tf.int32) + 1) * b // n],
                           yb[tf.cast(r, tf.int32) * b // n:(tf.cast(r, tf.int32) + 1) * b // n]))
        return ds.batch(global_batch // ctx.num_input_pipelines).flat_map(pieces)
    return strategy.distribute_datasets_from_function(dataset_fn)


def test_an_adaptation_of_every_global_batch_passes(strategy, capsys):
    # its own pipeline, its own split of the short last step (2 + 2): the contract holds
    lab05.check_dataset_fn(make_adapting_always, strategy)
    assert capsys.readouterr().out.count("✔") == 1
    from dpcourse.checks import predict
    x, y = lab05.stretch_data()
    sizes = lab05.last_step_sizes(strategy, make_adapting_always(strategy, x, y, 32))
    assert sizes == [2, 2], sizes
    lab05.check_pipeline_prediction(predict("lab05", "adapted split", 4, unit="samples"), sizes)
    out = " ".join(capsys.readouterr().out.split())
    assert "your pipeline shared the 4 samples left at the end out as 2+2" in out, out
    assert "whole batches" not in out, out


def test_an_adapted_indivisible_global_batch_passes(strategy, capsys):
    # stretch A's decision is the learner's: refusing and adapting are both accepted
    lab05.check_dataset_fn(make_adapting, strategy)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "33 on 2 adapted as 16+17, 37 on 3 adapted as 12+12+13" \
        in out, out


def test_stretch_global_batches():
    assert [lab05.stretch_global(n) for n in (1, 2, 3, 4)] == [32, 32, 36, 32]
    assert lab05._expected_split(3, 36)[-1] == [12, 12, 4]


def make_global_split(strategy, x, y, global_batch):
    # the right samples in the right order, but a global batch split 2 + 2 at the end
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    return strategy.experimental_distribute_dataset(ds)


@pytest.mark.parametrize("make, phrase", [
    (_dataset_maker(per_replica=False), "a whole global batch"),
    (_dataset_maker(drop=True), "partial last batch was dropped"),
    (_dataset_maker(shuffle=True), "but not in the data's order"),
    (_dataset_maker(by_replicas=True), "every 2nd one (global batch 32 on 2 replicas): the data "
                                       "was sharded into 2 pieces (one per replica)"),
    (make_global_split, "split 2+2"),
    (_dataset_maker(pipeline_id=False), "the 2 input pipelines yielded the same 50 samples"),
    (_dataset_maker(per_strategy=True), "pipeline 0 yielded batches of [16, 16, 16] samples"),
])
def test_dataset_mistakes_are_named(make, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_dataset_fn(make, strategy)
    assert phrase in str(err.value), str(err.value)


def _epoch(divisor="all_reduce"):
    def train_epoch(strategy, model, optimizer, dist_dataset):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                losses = mirrored.per_example_loss(y, model(x, training=True))
                if divisor == "all_reduce":
                    n = tf.distribute.get_replica_context().all_reduce(SUM, tf.size(y))
                    loss = tf.reduce_sum(losses) / tf.cast(n, tf.float32)
                elif divisor == "all_reduce_float":
                    n = tf.distribute.get_replica_context().all_reduce(
                        SUM, tf.cast(tf.shape(y)[0], tf.float32))
                    loss = tf.nn.compute_average_loss(losses) * 0 + tf.reduce_sum(losses) / n
                elif divisor == "global":
                    loss = tf.nn.compute_average_loss(losses, global_batch_size=32)
                elif divisor == "implicit":
                    loss = tf.nn.compute_average_loss(losses)
                elif divisor == "mean":
                    loss = tf.reduce_mean(losses) / 2
                elif divisor == "sum_local_n":   # learner LR2_05's probe, as written
                    n = tf.distribute.get_replica_context().num_replicas_in_sync
                    loss = tf.reduce_sum(losses) / tf.cast(tf.shape(y)[0] * n, tf.float32)
                elif divisor == "mean_n":
                    loss = tf.reduce_mean(losses) / tf.cast(
                        tf.distribute.get_replica_context().num_replicas_in_sync, tf.float32)
                elif divisor == "static_shape":
                    n = tf.distribute.get_replica_context().all_reduce(SUM, x.shape[0])
                    loss = tf.reduce_sum(losses) / tf.cast(n, tf.float32)
                elif divisor == "static_float":
                    n = tf.distribute.get_replica_context().all_reduce(SUM, float(y.shape[0]))
                    loss = tf.reduce_sum(losses) / n
                elif divisor == "static_constant":   # passes eagerly: only a trace shows it
                    n = tf.distribute.get_replica_context().all_reduce(
                        SUM, tf.constant(float(y.shape[0])))
                    loss = tf.reduce_sum(losses) / n
                elif divisor == "static_or_16":   # right eagerly; traced, None becomes 16
                    k = y.shape[0] if y.shape[0] is not None else 16
                    n = tf.distribute.get_replica_context().all_reduce(SUM, tf.constant(k))
                    loss = tf.reduce_sum(losses) / tf.cast(n, tf.float32)
                elif divisor == "len":   # a Python int, run as written (eagerly)
                    n = tf.distribute.get_replica_context().all_reduce(SUM, len(y))
                    loss = tf.reduce_sum(losses) / tf.cast(n, tf.float32)
                elif divisor == "keras":   # default reduction: own slice mean x 1/N
                    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
                        y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        for batch in dist_dataset:
            strategy.run(step_fn, args=batch)
    return train_epoch


# Each answer once per kind: a test meeting _epoch(kind) again meets the same function, so a
# replayed run (stretch_runs_replayed) is found by it.
_epoch = functools.lru_cache(maxsize=None)(_epoch)


# Stretch B's answers met more than once in this file (a mistake met twice for its fix, the same
# answer in two tests): each distinct run — the answer, the strategy, as written or in
# tf.function, which epoch — is made for real the first time and replayed after
# (launches_replayed's idea for an epoch: a run's dataset iterator and trace cost more than the
# judgement). Kept for the module: a test run alone, or first, makes its runs for real.
_STRETCH_RUNS: dict = {}


class _SpyShown(_lab05_epoch._LossSpy):
    """The check's loss spy, noting which spy is active, for a replayed run to hand its notes."""
    active: list = []

    def __enter__(self):
        _SpyShown.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _SpyShown.active.remove(self)
        return super().__exit__(*exc)


class _WeightsOf:
    """The model a replayed run trained: its weights after the run, as the real one's were."""

    def __init__(self, weights):
        self._weights = weights

    def get_weights(self):
        return [w.copy() for w in self._weights]


@pytest.fixture
def stretch_runs_replayed(monkeypatch):
    """Stretch B's runs of an answer (``_lab05_epoch._fresh_run``'s run, with what its loss spy
    noted, and ``_lab05_padded._run_padded``) made once per distinct run in this module and
    replayed after: a run replays what it returned (the weights it left, the spy's notes) or
    raises what it raised. Everything around a run — the one-device replays, the judgement,
    the memory of mistakes and the sentence — runs again."""
    real_fresh, real_padded = _lab05_epoch._fresh_run, _lab05_padded._run_padded

    def notes(spy):
        return None if spy is None else (list(spy.targets), spy.implicit, spy.keras_mean)

    def fresh_run(train_epoch, strategy, dist, traced):
        key = ("epoch", train_epoch, id(strategy), traced, isinstance(dist, list))
        if key in _STRETCH_RUNS:
            how, value, noted = _STRETCH_RUNS[key]

            def replay():
                if noted is not None:
                    spy = _SpyShown.active[-1]
                    spy.targets.extend(noted[0])
                    spy.implicit, spy.keras_mean = noted[1], noted[2]
                if how == "raised":
                    raise value
            return _WeightsOf(value if how == "returned" else []), replay
        model, run = real_fresh(train_epoch, strategy, dist, traced)

        def record():
            spy = _SpyShown.active[-1] if _SpyShown.active else None
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - replayed as the check met it
                _STRETCH_RUNS[key] = ("raised", exc, notes(spy))
                raise
            _STRETCH_RUNS[key] = ("returned", model.get_weights(), notes(spy))
        return model, record

    def run_padded(train_epoch, strategy, traced, at, data=None):
        __tracebackhide__ = True
        key = ("padded", train_epoch, id(strategy), traced, at, data is None)
        spy = _SpyShown.active[-1] if _SpyShown.active else None
        if key not in _STRETCH_RUNS:
            try:
                _STRETCH_RUNS[key] = ("returned", real_padded(train_epoch, strategy, traced, at,
                                                              data), notes(spy))
            except LabCheckError as exc:   # its sentence has no fix: the same every meeting
                _STRETCH_RUNS[key] = ("raised", exc, None)
        else:
            noted = _STRETCH_RUNS[key][2]
            if noted is not None and spy is not None:
                spy.targets.extend(noted[0])
        how, value, _ = _STRETCH_RUNS[key]
        if how == "raised":
            raise value
        return [w.copy() for w in value]

    monkeypatch.setattr(_lab05_epoch, "_LossSpy", _SpyShown)
    monkeypatch.setattr(_lab05_epoch, "_fresh_run", fresh_run)
    monkeypatch.setattr(_lab05_padded, "_run_padded", run_padded)


def epoch_skipping_partial(strategy, model, optimizer, dist_dataset):
    inner = _epoch()
    full = []
    for batch in dist_dataset:
        if sum(len(v) for v in strategy.experimental_local_results(batch[1])) == 32:
            full.append(batch)
    inner(strategy, model, optimizer, full)


def test_right_partial_epochs_pass(strategy, capsys):
    lab05.check_partial_batch_epoch(_epoch(), strategy)
    lab05.check_partial_batch_epoch(_epoch("all_reduce_float"), strategy)
    out = capsys.readouterr().out
    assert out.count("✔") == 2 and "4+0 on 2, 12+12+4 on 3 replicas" in out, out


@pytest.fixture(scope="module")
def strategy3(strategy):
    return lab05.strategies_for(strategy)[1]


@pytest.mark.parametrize("fn, phrase", [
    # on 3 replicas the last step is 12 + 12 + 4: the slices differ, and none is empty
    (_epoch("implicit"), "compute_average_loss without global_batch_size"),
    (_epoch("global"), "divided by a fixed 32 (global batch 36 on 3 replicas"),
])
def test_partial_batch_mistakes_on_three_replicas(fn, phrase, strategy3):
    assert strategy3.num_replicas_in_sync == 3
    with pytest.raises(LabCheckError) as err:
        lab05.check_partial_batch_epoch(fn, strategy3)
    assert phrase in str(err.value) and "12+12+4" in str(err.value), str(err.value)


def test_a_local_mean_names_the_empty_replicas_nan(strategy, stretch_runs_replayed):
    # finding: reduce_mean / N on 4 + 0 has a cause sentence of its own, with the step's numbers:
    # replica 0's mean / 2 where its share is its mean (all 4 samples), replica 1's 0/0 = nan
    for fn in (_epoch("mean"), _epoch("mean_n")):
        with pytest.raises(LabCheckError) as err:
            lab05.check_partial_batch_epoch(fn, strategy)
        msg = " ".join(str(err.value).split())
        # learner LR2_05: the sentence describes the code as a learner writes it (the sum over
        # its own slice size x replicas), naming reduce_mean / N as the same number
        assert "each replica's loss was its summed loss divided by its own slice size times " \
               "the replica count (the same number as its own reduce_mean divided by the " \
               "replica count) — replica 0 differentiated" in msg, msg
        assert "its summed loss over its 4 samples / (4 x 2 = 8)" in msg, msg
        assert "its own mean over its 4 samples" in msg and "/ 2 replicas" in msg, msg
        assert "(its summed loss / the step's 4 samples), 2 times what it differentiated" \
            in msg, msg
        assert "replica 1, holding none, differentiated nan: 0 losses / (0 x 2) is 0/0, as " \
               "reduce_mean of no losses is" in msg, msg
        assert "compute_average_loss" not in msg, msg


def test_a_local_mean_is_named_on_three_replicas_too(strategy3):
    with pytest.raises(LabCheckError) as err:
        lab05.check_partial_batch_epoch(_epoch("mean_n"), strategy3)
    msg = " ".join(str(err.value).split())
    assert "its summed loss divided by its own slice size times the replica count" in msg \
        and "12+12+4" in msg, msg
    assert "its summed loss over its 12 samples / (12 x 3 = 36)" in msg, msg
    assert "its own mean over its 12 samples" in msg and "/ 3 replicas" in msg, msg
    assert "the step's 28 samples), 1.3 times what it differentiated" in msg, msg


def test_the_local_mean_gives_the_fix_the_second_time(strategy, stretch_runs_replayed):
    for _ in range(2):
        with pytest.raises(LabCheckError) as err:
            lab05.check_partial_batch_epoch(_epoch("mean_n"), strategy)
    assert "sum the replicas' counts inside the step" in str(err.value), str(err.value)


@pytest.mark.parametrize("fn, phrase", [
    (_epoch("global"), "divided by the full global batch"),
    (_epoch("implicit"), "compute_average_loss without global_batch_size"),
    # (_epoch("mean"), its summed loss divided by its own slice size times the replica count:
    # test_a_local_mean_names_the_empty_replicas_nan, with the step's numbers)
    (_epoch("sum_local_n"), "its summed loss over its 4 samples / (4 x 2 = 8)"),
    (epoch_skipping_partial, "changed nothing"),
    (_epoch("static_shape"), "an int, a Python number, reached the replica context's "
                             "all_reduce where it needs a tensor of this replica's count"),
    (_epoch("len"), "an int, a Python number, reached the replica context's all_reduce"),
    (_epoch("static_float"), "a float, a Python number, reached the replica context's "
                             "all_reduce where it needs a tensor of this replica's count"),
])
def test_partial_batch_mistakes_are_named(fn, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_partial_batch_epoch(fn, strategy)
    assert phrase in str(err.value), str(err.value)


def test_a_static_shape_count_is_refused_under_tf_function(strategy, stretch_runs_replayed):
    # learner finding (false accept): tf.constant(float(y.shape[0])) trains right eagerly, but a
    # traced loop sees a batch dimension of None
    with pytest.raises(LabCheckError) as err:
        lab05.check_partial_batch_epoch(_epoch("static_constant"), strategy)
    msg = " ".join(str(err.value).split())
    assert "raised TypeError wrapped in tf.function" in msg and "'NoneType'" in msg, msg
    assert "a count read off a static shape" in msg and "the batch dimension is None" in msg, msg
    assert "in user code" not in msg and "Count the samples" not in msg, msg
    with pytest.raises(LabCheckError, match="Count the samples with a tensor operation"):
        lab05.check_partial_batch_epoch(_epoch("static_constant"), strategy)


def epoch_counting_in_python(strategy, model, optimizer, dist_dataset):
    # learner LR3_05's probe: the step's count summed in Python from the local results
    for batch in dist_dataset:
        n = sum(int(t.shape[0]) for t in strategy.experimental_local_results(batch[1]))

        def step_fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(mirrored.per_example_loss(y, model(x, training=True))) / n
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(step_fn, args=batch)


def test_a_python_count_in_the_loop_is_named(strategy, stretch_runs_replayed):
    # learner LR3_05: AutoGraph's raw "'n' must be defined before the loop" was passed through
    with pytest.raises(LabCheckError) as first:
        lab05.check_partial_batch_epoch(epoch_counting_in_python, strategy)
    msg = " ".join(str(first.value).split())
    assert "'n' must be defined before the loop" in msg, msg
    assert ("a Python number inside a traced step is fixed when tf.function traces it" in msg
            and "the step's count must be a tensor, summed across the replicas inside the step"
            in msg), msg
    assert "all_reduce" not in msg, msg
    with pytest.raises(LabCheckError, match="What to change: Count this replica's samples inside "
                                            "step_fn with a tensor operation"):
        lab05.check_partial_batch_epoch(epoch_counting_in_python, strategy)


def test_a_count_fixed_when_traced_is_named(strategy):
    # right eagerly; traced, the static shape's None falls back to a number fixed at trace time
    with pytest.raises(LabCheckError) as err:
        lab05.check_partial_batch_epoch(_epoch("static_or_16"), strategy)
    msg = " ".join(str(err.value).split())
    assert "run eagerly, train_epoch matched one device" in msg, msg
    assert "wrapped in tf.function (as a training loop is, to run fast) its weights differ" in msg


@pytest.mark.parametrize("fixture", ["strategy", "strategy3"])
def test_a_keras_loss_object_is_named_by_its_reduction(fixture, request):
    # learner finding: named as the Keras loss object's SUM_OVER_BATCH_SIZE, without the
    # reduce_mean NaN that does not apply to it (Keras divides with divide_no_nan)
    strat = request.getfixturevalue(fixture)
    with pytest.raises(LabCheckError) as err:
        lab05.check_partial_batch_epoch(_epoch("keras"), strat)
    msg = " ".join(str(err.value).split())
    assert "a Keras loss object with the reduction 'sum_over_batch_size'" in msg, msg
    assert "SUM_OVER_BATCH_SIZE" in msg and "nan" not in msg.lower(), msg
    assert "reduce_mean" not in msg and "compute_average_loss" not in msg, msg
    n = strat.num_replicas_in_sync
    assert (f"divided by 4 x 2 = 8, where the step holds 4" if n == 2 else
            f"divided by 12 x 3 = 36, where the step holds 28") in msg, msg


# --- predictions: compared and explained, never refused ------------------------------------

def test_pipeline_prediction_is_revealed(strategy, capsys):
    from dpcourse.checks import predict
    x, y = lab05.stretch_data()
    assert lab05.last_step_sizes(strategy, make_global_split(strategy, x, y, 32)) == [2, 2]
    sizes = lab05.last_step_sizes(strategy, _dataset_maker()(strategy, x, y, 32))
    assert sizes == [4, 0]
    lab05.check_pipeline_prediction(predict("lab05", "q2", 2), sizes)
    out = capsys.readouterr().out
    assert "measured: 4 — not what happened." in out, out


@pytest.fixture(scope="module")
def last_step_measured(strategy):
    """Part 4's measurement on 2 replicas: 15 global batches of 64 and one sample more."""
    with strategy.scope():
        model = mirrored.build_keras_cnn(seed=3)
    x, y = lab05.reference_batch(lab05.epoch_size(64), seed=1)
    epoch = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)   # the remainder kept
    return lab05.last_step(strategy, strategy.experimental_distribute_dataset(epoch), model, 64)


def test_the_last_step_runs_an_empty_replica(last_step_measured):
    # what part 4 asks the learner to predict: the measurement itself, not the lab's words
    m = last_step_measured
    assert m["steps"] == 16 and m["sizes"] == [1, 0] and m["called"] == [0, 1], m
    assert np.isnan(m["means"][1]) and m["shares"][1] == 0.0, m
    assert np.isclose(m["shares"][0] * 64, m["step_mean"], rtol=1e-5), m


def test_the_ceiling_rule_is_what_the_explanation_states():
    from dpcourse.checks._lab05_predict import pieces
    assert [pieces(64, 3), pieces(4, 3), pieces(1, 2), pieces(40, 2)] == \
        [[22, 22, 20], [2, 2, 0], [1, 0], [20, 20]]


@pytest.mark.parametrize("choice, phrase", [
    ("a copy of the sample", "A copy is what DistributedSampler does"),
    ("sits the step out", "Sitting out would leave the other replicas waiting"),
    ("no such step", "batched with drop_remainder=False, so it yields the last sample"),
])
def test_each_wrong_last_step_prediction_is_explained(choice, phrase, last_step_measured,
                                                      capsys):
    from dpcourse.checks import predict
    lab05.check_last_step_prediction(
        predict("lab05", "q " + choice, choice, choices=lab05.LAST_STEP_CHOICES),
        last_step_measured)
    out = " ".join(capsys.readouterr().out.split())
    assert f"Your prediction: {choice}; measured: step_fn on an empty batch — not what " \
           f"happened." in out, out
    assert "into 2 pieces of ⌈b/2⌉ samples in replica order" in out and "1 as 1+0" in out, out
    assert "its reduce_mean is 0/0 = nan, its compute_average_loss share 0.0" in out, out
    assert "stretch B" not in out and "must count" not in out, out   # learner LR2_05
    assert phrase in out, out


def test_the_right_last_step_prediction_is_told_so(last_step_measured, capsys):
    from dpcourse.checks import predict
    right = "step_fn on an empty batch"
    lab05.check_last_step_prediction(
        predict("lab05", "q right", right, choices=lab05.LAST_STEP_CHOICES), last_step_measured)
    out = " ".join(capsys.readouterr().out.split())
    assert "samples [1, 0], step_fn called on replicas [0, 1]" in out, out
    assert "reduce_mean of its losses: [" in out and ", nan]" in out, out
    assert f"measured: {right} — right." in out and "DistributedSampler" not in out, out


def test_the_lab_text_does_not_answer_its_parts():
    # learner LR2_05: part 1's contract printed the formula and the penalty's share; part 4's
    # setup named what reduce_mean would make of an empty batch
    text = (ROOT / "solutions" / "lab05_mirrored_strategy.py").read_text()
    start = text.index("## 1. The per-replica loss")
    part1 = text[start:text.index("<details><summary>▶ Hint 1", start)]
    for said in ("Σ ℓ", "/ `global_batch`", ": once", "holds all"):
        assert said not in part1, part1
    assert "summed by the strategy" in part1 and "every split the strategy can make" in part1, part1
    # the new contract: no step size is handed over, and the decision is named as the lab's
    assert "per_replica_loss(labels, logits, penalty=None)" in part1, part1
    assert "no argument tells it how many samples" in part1 and "Your design decision" in part1, part1
    # learner LR3_05: the TODO names the piece to write, not its parts
    todo = text[text.index("def per_replica_loss"):text.index("lab05.check_per_replica_loss(")]
    assert "penalty" not in todo.split("BEGIN SOLUTION:")[1].splitlines()[0], todo
    part3 = text[text.index("## 3. One step"):text.index("<details><summary>▶ Hint 1", text.index("## 3. One"))]
    assert "plain numbers" not in part3 and "two scalar tensors" in part3, part3
    # learner LR4_05: part 3 is told no batch size, and its contract states what must hold, not
    # the answer (the fraction, the argmax formula, "any split, not only an even one")
    assert "distributed_train_step(strategy, model, optimizer, dist_batch)`" in part3, part3
    assert "global_batch" not in part3 and "what one device would report" in part3, part3
    for said in ("fraction of", "argmax", "not only an even", "uneven", "count"):
        assert said not in part3, (said, part3)
    # stretch B states its goal and contract; it does not ask whether part 1's function fits
    stretch_b = text[text.index("## Stretch B"):text.index("<details><summary>▶ Hint 1", text.index("## Stretch B"))]
    assert "is it right here" not in stretch_b and "part 1" not in stretch_b, stretch_b
    assert "must leave the weights where they are" in stretch_b, stretch_b
    part4 = text[text.index("## 0. Predict"):text.index("my_guess = ")]
    assert "reduce_mean" not in part4 and "compute_average_loss" not in part4, part4
    stretch_a = text[text.index("## Stretch A"):text.index("def make_dist_dataset")]
    assert "every full step holds" in stretch_a and "names both" in stretch_a, stretch_a


def test_the_lab_does_not_state_the_rule_before_the_prediction():
    # finding: a rule stated right before the prediction made it arithmetic
    text = (ROOT / "solutions" / "lab05_mirrored_strategy.py").read_text()
    before = text[text.index("## 0. Predict"):text.index("my_guess = ")]
    # the prediction comes before part 1, whose check runs a step where a replica holds nothing
    assert text.index("my_guess = ") < text.index("def per_replica_loss"), "prediction after part 1"
    assert "⌈" not in before and "ceil" not in before and "22 + 22" not in before, before


def test_experimental_distribute_dataset_cuts_each_batch_by_the_ceiling(strategy):
    # the rule part 4's explanation states (lab05.pieces): each batch b into N pieces of ⌈b/N⌉
    # in replica order, the last replicas the rest — 64 on 3: 22 + 22 + 20 (not
    # batch_sizes_for_worker's 22 + 21 + 21); 40 on 2: 20 + 20; 4 on 3: 2 + 2 + 0; 1 on 2: 1 + 0.
    # One full batch before each last one (the rule cuts each batch by itself: part 4's 15 full
    # batches and one sample are measured for real by last_step_measured), the full batch's
    # split read once per replica count (an iterator's setup costs more than its steps)
    from dpcourse.checks._lab05_predict import pieces
    strategy3 = lab05.strategies_for(strategy)[1]
    for strat, n_samples, last in ((strategy3, 64 + 40, 40), (strategy, 64 + 40, 40),
                                   (strategy3, 68, 4), (strategy, 65, 1), (strategy3, 65, 1)):
        n = strat.num_replicas_in_sync
        x = np.arange(n_samples, dtype=np.float32).reshape(-1, 1)
        ds = tf.data.Dataset.from_tensor_slices((x, np.zeros(n_samples, np.int64))).batch(64)
        if last == 40:
            first = next(iter(strat.experimental_distribute_dataset(ds)))
            assert [len(v) for v in strat.experimental_local_results(first[1])] == pieces(64, n)
        assert lab05.last_step_sizes(strat, strat.experimental_distribute_dataset(ds)) == \
            pieces(last, n), (n_samples, n)
    assert pieces(64, 3) == [22, 22, 20] and pieces(4, 3) == [2, 2, 0]


def test_the_checks_steps_are_the_ones_experimental_distribute_dataset_makes(strategy):
    # parts 1 and 3 feed each step with _lab05_common.distribute_slices(pieces(b, N)), not a
    # dataset's iterator (its setup cost more than the step): on every split they use (part 1's
    # 6N, 2N + 1 and N - 1, part 3's even steps), every replica holds the tensors, of the same
    # dtype and shape, on the same device as experimental_distribute_dataset's. One dataset per
    # replica count yields those global batches in turn (the rule cuts each batch by itself)
    from dpcourse.checks._lab05_common import distribute_slices, pieces
    for strat, sizes in ((strategy, [12, 5, 1, 64, 48]),
                         (lab05.strategies_for(strategy)[1], [18, 7, 2, 63, 48])):
        n = strat.num_replicas_in_sync
        batches = [lab05.reference_batch(gb, seed=gb) for gb in sizes]
        ds = tf.data.Dataset.from_tensor_slices(batches[0]).batch(sizes[0])
        for gb, batch in zip(sizes[1:], batches[1:]):
            ds = ds.concatenate(tf.data.Dataset.from_tensor_slices(batch).batch(gb))
        theirs = list(strat.experimental_distribute_dataset(ds))
        assert len(theirs) == len(sizes)
        for gb, batch, step in zip(sizes, batches, theirs):
            ours = distribute_slices(strat, batch, pieces(gb, n))
            for a, b in zip(ours, step):
                local_a, local_b = (strat.experimental_local_results(v) for v in (a, b))
                assert [t.device for t in local_a] == [t.device for t in local_b]
                assert [len(t) for t in local_b] == pieces(gb, n), (gb, n)
                for ta, tb in zip(local_a, local_b):
                    assert ta.dtype == tb.dtype and ta.shape == tb.shape, (ta.shape, tb.shape)
                    np.testing.assert_array_equal(ta.numpy(), tb.numpy())


def test_part1s_epoch_steps_are_the_ones_its_dataset_yields(strategy):
    # part 1's epoch runs its own loop eagerly on _epoch_steps (no dataset iterator) and traced
    # on distribute_datasets_from_function(_epoch_dataset_fn): the two give the same steps
    from dpcourse.checks import _lab05_epoch as epoch
    for strat in lab05.strategies_for(strategy):
        gb = lab05.stretch_global(strat.num_replicas_in_sync)
        ours = epoch._epoch_steps(strat, gb)
        theirs = list(strat.distribute_datasets_from_function(epoch._epoch_dataset_fn(gb)))
        assert len(ours) == len(theirs) == (4 if gb == 32 else 3)   # 100 samples
        for step_a, step_b in zip(ours, theirs):
            for a, b in zip(step_a, step_b):
                local_a, local_b = (strat.experimental_local_results(v) for v in (a, b))
                assert [t.device for t in local_a] == [t.device for t in local_b]
                for ta, tb in zip(local_a, local_b):
                    assert ta.dtype == tb.dtype and ta.shape == tb.shape, (ta.shape, tb.shape)
                    np.testing.assert_array_equal(ta.numpy(), tb.numpy())


# --- cause first, the fix on the second meeting ---------------------------------------------

@pytest.mark.parametrize("fn, cause, fix", [
    (loss_implicit_global, "slice size times the replica count",
     "Divide by the step's sample count: no replica holds it alone"),
    (loss_reduce_mean, "the number of samples that replica holds itself (its own mean), but "
                       "the strategy sums", "Divide the summed loss by the whole step's count"),
])
def test_loss_messages_give_the_cause_then_the_fix(fn, cause, fix, strategy):
    with pytest.raises(LabCheckError) as first:
        lab05.check_per_replica_loss(fn, strategy)
    assert cause in str(first.value) and fix not in str(first.value), str(first.value)
    assert "Run the check again" in str(first.value)
    with pytest.raises(LabCheckError) as second:
        lab05.check_per_replica_loss(fn, strategy)
    assert cause in str(second.value) and fix in str(second.value), str(second.value)


def test_accuracy_counts_never_divided_are_named_as_counts(strategy):
    # learner LR2_05: the parts beside "split 32+32" are counts of correct predictions
    step = make_step(loss_right, SUM, SUM, acc="hits")
    def undivided(strategy, model, optimizer, dist_batch):
        loss, acc = step(strategy, model, optimizer, dist_batch)
        count = sum(int(tf.size(v)) for v in strategy.experimental_local_results(dist_batch[1]))
        return loss, acc * count
    with pytest.raises(LabCheckError) as err:
        lab05.check_train_step(undivided, make_shared, strategy)
    msg = " ".join(str(err.value).split())
    assert "is the replicas' counts of correct predictions (" in msg, msg
    assert " of slices of 32+32 samples) added up and never divided by the 64 samples" in msg, msg
    assert ".0000," not in msg.split("counts of correct predictions")[1].split(")")[0], msg


def test_step_messages_give_the_cause_then_the_fix(strategy):
    # per-replica accuracy fractions reduced with MEAN: right on even slices only, named on 6+2
    step = steps_replayed(make_step(loss_right, SUM, MEAN, acc="fraction"))   # met twice
    with pytest.raises(LabCheckError) as first:
        lab05.check_train_step(step, make_shared, strategy)
    assert "accuracy returned (0.3333) is the mean of the replicas' own means" in \
        str(first.value) and "mean of means" in str(first.value), str(first.value)
    assert "a statistic that adds up" not in str(first.value), str(first.value)
    with pytest.raises(LabCheckError, match="a statistic that adds up over the replicas"):
        lab05.check_train_step(step, make_shared, strategy)


# --- part 3: the accuracy after the update is told apart from means added up (learner, round 4)

def step_reports_after_update(strategy, model, optimizer, dist_batch):
    # counts summed and divided once (right), but from the model run again after the update
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_right(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        hits = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(model(x, training=False), -1), y),
                                     tf.float32))
        return loss, hits, tf.cast(tf.shape(y)[0], tf.float32)
    loss, hits, count = strategy.run(step_fn, args=dist_batch)
    return (strategy.reduce(SUM, loss, axis=None),
            strategy.reduce(SUM, hits, axis=None) / strategy.reduce(SUM, count, axis=None))


def test_after_update_coincides_with_summed_means_on_the_first_split():
    # the learner's case: on 64 samples split 32 + 32, the accuracy after the update is exactly
    # twice the accuracy before it — what the replicas' means added up (SUM) also give; a ratio
    # alone cannot tell them apart
    x, y = lab05.reference_batch(64)
    model = mirrored.build_keras_cnn(seed=3)
    before = (model(x).numpy().argmax(-1) == y)
    halves = np.array_split(np.arange(64), 2)
    summed_means = sum(before[h].mean() for h in halves)
    grads = mirrored.single_replica_gradients(model, x, y)
    model.set_weights([w - 0.1 * g for w, g in zip(model.get_weights(), grads)])
    after = (model(x).numpy().argmax(-1) == y).mean()
    assert np.isclose(after, summed_means) and not np.isclose(after, before.mean())


def test_accuracy_after_the_update_is_named_as_such(strategy):
    step = steps_replayed(step_reports_after_update)   # the second meeting replayed
    with pytest.raises(LabCheckError) as first:
        lab05.check_train_step(step, make_shared, strategy)
    msg = str(first.value)
    assert "accuracy returned" in msg and "after this step's update" in msg, msg
    assert "added up" not in msg and "mean of" not in msg, msg   # not the summed-means cause
    with pytest.raises(LabCheckError) as second:
        lab05.check_train_step(step, make_shared, strategy)
    msg = str(second.value)
    assert "Report the accuracy of the logits the step's loss was computed from." in msg, msg
    assert "statistic that adds up" not in msg and "averages" not in msg, msg


def test_summed_means_are_named_with_their_parts(strategy):
    # the replicas' accuracy fractions summed where a mean is meant; the other cause of a 2x
    # accuracy (after the update): the split where the two differ decides
    with pytest.raises(LabCheckError) as err:
        lab05.check_train_step(make_step(loss_right, SUM, SUM, acc="fraction"), make_shared,
                               strategy)
    msg = str(err.value)
    assert "replicas' own means added up (SUM):" in msg and "after this step's" not in msg, msg


# --- part 2: the contract's plain SGD, built under the strategy given ----------------------

def make_momentum(strategy, lr):
    with strategy.scope():
        return mirrored.build_keras_cnn(), keras.optimizers.SGD(learning_rate=lr, momentum=0.9)


def test_momentum_is_named(strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_model_and_optimizer(make_momentum, strategy)
    msg = str(err.value)
    assert "SGD with momentum=0.9" in msg and "momentum=0.0" in msg, msg
    assert "one-step test cannot see it" in msg, msg
    with pytest.raises(LabCheckError, match="SGD with momentum=0.9"):
        lab05.check_train_step(make_step(loss_right), make_momentum, strategy)


# --- part 2's start: a one-device model's weights, carried into a mirrored model ------------

def make_returns_start(strategy, lr, start=None):
    with strategy.scope():
        model = start if start is not None else mirrored.build_keras_cnn()
        return model, keras.optimizers.SGD(learning_rate=lr)


def make_ignores_start(strategy, lr, start=None):   # lesson 05's lines, transcribed
    with strategy.scope():
        return mirrored.build_keras_cnn(), keras.optimizers.SGD(learning_rate=lr)


def make_clones_start(strategy, lr, start=None):
    with strategy.scope():
        model = keras.models.clone_model(start) if start is not None else \
            mirrored.build_keras_cnn()
        return model, keras.optimizers.SGD(learning_rate=lr)


def make_two_arguments(strategy, lr):
    with strategy.scope():
        return mirrored.build_keras_cnn(), keras.optimizers.SGD(learning_rate=lr)


@pytest.mark.parametrize("make, phrase", [
    (make_returns_start, "with start=, make_model_and_optimizer returned start itself: its "
                         "variables were created before, outside any strategy"),
    (make_ignores_start, "with start=, your model holds build_keras_cnn()'s own initial "
                         "weights, not start's"),
    (make_clones_start, "with start=, your model holds the weights start was *initialised* "
                        "with, not the ones it holds now"),
    (make_two_arguments, "the contract's third argument, start"),
], ids=["returns-start", "ignores-start", "clones-start", "no-start-arg"])
def test_start_mistakes_are_named(make, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_model_and_optimizer(make, strategy)
    assert phrase in str(err.value), str(err.value)


def test_start_gives_the_cause_then_the_fix(strategy, capsys):
    with pytest.raises(LabCheckError) as first:
        lab05.check_model_and_optimizer(make_ignores_start, strategy)
    assert "Copy start's weights" not in str(first.value), str(first.value)
    with pytest.raises(LabCheckError, match="Copy start's weights into the new model"):
        lab05.check_model_and_optimizer(make_ignores_start, strategy)
    lab05.check_model_and_optimizer(make_right, strategy)
    assert "starts from a one-device model's weights holds them on every replica" in \
        capsys.readouterr().out


def test_an_unbuilt_optimizer_passes(strategy, capsys):
    # the contract does not ask for optimizer.build: plain SGD has no per-variable state
    model, optimizer = lab05.check_model_and_optimizer(make_right, strategy)
    assert not optimizer.built
    assert "✔" in capsys.readouterr().out


LAB_STRATEGY = None   # the notebook's global `strategy`, read by the functions below


@pytest.fixture
def lab_strategy(strategy):
    global LAB_STRATEGY
    LAB_STRATEGY = strategy
    yield strategy
    LAB_STRATEGY = None


def make_with_global(strat, lr):
    with LAB_STRATEGY.scope():
        return mirrored.build_keras_cnn(), keras.optimizers.SGD(learning_rate=lr)


def make_optimizer_with_global(strat, lr):
    with strat.scope():
        model = mirrored.build_keras_cnn()
    with LAB_STRATEGY.scope():
        return model, keras.optimizers.SGD(learning_rate=lr)


def loss_global_replicas(labels, logits):
    return tf.reduce_mean(mirrored.per_example_loss(labels, logits)) / \
        LAB_STRATEGY.num_replicas_in_sync


def test_the_notebooks_strategy_read_from_outside_is_named(lab_strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_model_and_optimizer(make_with_global, lab_strategy)
    msg = str(err.value)
    assert "mirrored by another strategy, with 2 replicas, not by the 3-replica" in msg, msg
    assert "reads `LAB_STRATEGY` (2 replicas) from outside itself" in msg, msg
    with pytest.raises(LabCheckError, match="optimizer was created under another strategy"):
        lab05.check_model_and_optimizer(make_optimizer_with_global, lab_strategy)
    with pytest.raises(LabCheckError, match="mirrored by another strategy"):
        lab05.check_train_step(make_step(loss_right), make_with_global, lab_strategy)


def test_part1_names_a_replica_count_captured_from_outside(lab_strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_per_replica_loss(loss_global_replicas, lab_strategy)
    msg = str(err.value)
    assert "on 3 replicas" in msg and "reads `LAB_STRATEGY` (2 replicas)" in msg, msg
    assert "written into the function" not in msg, msg
    with pytest.raises(LabCheckError) as err:   # a literal 2: no captured value to name
        lab05.check_per_replica_loss(loss_fixed_two_replicas, lab_strategy)
    assert "captured from outside it" in str(err.value), str(err.value)


def step_with_global(strat, model, optimizer, dist_batch):
    return make_step(loss_right)(LAB_STRATEGY, model, optimizer, dist_batch)


def test_a_step_running_the_notebooks_strategy_is_named(lab_strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_train_step(step_with_global, make_right, lab_strategy)
    msg = str(err.value)
    assert "on 3 replicas" in msg and "reads `LAB_STRATEGY` (2 replicas)" in msg, msg


# --- every fix is a sentence of its own --------------------------------------------------

def test_fixes_start_a_sentence():
    import ast
    import inspect
    import importlib
    import pkgutil
    from dpcourse import checks
    modules = [lab05] + [importlib.import_module(f"dpcourse.checks.{m.name}")
                         for m in pkgutil.iter_modules(checks.__path__)
                         if m.name.startswith("_lab05_")]
    assert len(modules) == 9, modules   # lab05 and its eight _lab05_* modules
    tree = ast.Module(body=[ast.parse(inspect.getsource(m)) for m in modules], type_ignores=[])
    fixes = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(k.arg == "fix" for k in node.keywords):
            value = next(k.value for k in node.keywords if k.arg == "fix")
            parts = value.values if isinstance(value, ast.JoinedStr) else [value]
            if isinstance(parts[0], ast.Constant) and isinstance(parts[-1], ast.Constant):
                fixes.append(parts[0].value + " ... " + parts[-1].value)
    fixes += [how[2] for how in lab05._HOW.values() if how[2]]
    assert len(fixes) > 30
    assert all(f[0].isupper() and f.rstrip().endswith(".") for f in fixes), \
        [f for f in fixes if not (f[0].isupper() and f.rstrip().endswith("."))]


def test_stretch_b_escalation_reads_as_two_sentences(strategy, stretch_runs_replayed):
    for _ in range(2):
        with pytest.raises(LabCheckError) as err:
            lab05.check_partial_batch_epoch(_epoch("mean"), strategy)
    assert "how many samples the step holds. What to change: Ask the other replicas" in str(err.value), \
        str(err.value)


# --- part 1 is told no step size: where the divisor comes from is the learner's decision -----

def loss_given_the_step_size(labels, logits, global_batch, penalty=None):
    # the contract of the last round: a step size handed in
    return loss_right(labels, logits, penalty)


def loss_static_shape_all_reduced(labels, logits, penalty=None):
    # a Python int (the static shape) handed to all_reduce: fails at once
    n = tf.distribute.get_replica_context().all_reduce(SUM, labels.shape[0])
    return tf.reduce_sum(mirrored.per_example_loss(labels, logits)) / tf.cast(n, tf.float32)


def loss_static_shape_as_tensor(labels, logits, penalty=None):
    # right eagerly (the static shape is known there); None once a loop is traced for an epoch
    n = tf.distribute.get_replica_context().all_reduce(SUM, tf.constant(labels.shape[0]))
    loss = tf.reduce_sum(mirrored.per_example_loss(labels, logits)) / tf.cast(n, tf.float32)
    return loss if penalty is None else loss + penalty / (
        tf.distribute.get_replica_context().num_replicas_in_sync)


def loss_mean_times_own_share(labels, logits, penalty=None):
    # right wherever every replica holds a sample: its own mean x its share of the step
    own = tf.cast(tf.shape(labels)[0], tf.float32)
    return tf.reduce_mean(mirrored.per_example_loss(labels, logits)) * own / tf.cast(
        _step_count(labels), tf.float32)


def loss_own_size_times_replicas(labels, logits, penalty=None):
    ctx = tf.distribute.get_replica_context()
    return tf.reduce_sum(mirrored.per_example_loss(labels, logits)) / tf.cast(
        tf.shape(labels)[0] * ctx.num_replicas_in_sync, tf.float32)


NOTEBOOK_GLOBAL_BATCH = 64


def loss_notebook_global(labels, logits, penalty=None):
    # a Python int captured from the notebook: the size lesson 05 knew in advance
    return tf.reduce_sum(mirrored.per_example_loss(labels, logits)) / NOTEBOOK_GLOBAL_BATCH


@pytest.mark.parametrize("fn, phrase", [
    (loss_given_the_step_size,
     "per_replica_loss requires 3 arguments (labels, logits, global_batch), but the step calls "
     "it with the labels and logits of this replica's slice only"),
    (loss_reduce_mean, "divided replica 0's summed loss by 6, the number of samples that "
                       "replica holds itself (its own mean), but the strategy sums the 2 "
                       "replicas' gradients"),
    (loss_own_size_times_replicas,
     "divided replica 0's summed loss by its own slice size times the replica count (3 x 2 = "
     "6), but a step of 5 samples as 3+2 on 2 replicas"),
    (loss_implicit_global, "(compute_average_loss without global_batch_size, a Keras loss "
                           "object's default reduction, and a local mean / N all assume it)"),
    (loss_fixed_64, "divided the summed loss by 64, but a step of 12 samples as 6+6 on 2 "
                    "replicas: a number fixed before the call — written into the function (a "
                    "global_batch_size=)"),
    (loss_notebook_global, "divided the summed loss by 64, but a step of 12 samples"),
    (loss_static_shape_all_reduced,
     "'int' object has no attribute 'dtype' — an int, a Python number, reached the replica "
     "context's all_reduce"),
    (loss_static_shape_as_tensor,
     "per_replica_loss raised ValueError in a training loop over an epoch, wrapped in "
     "tf.function (global batch 32 on 2 replicas; the last step's 4 samples as 4+0): ValueError: "
     "None values not supported. — a count read off a static shape"),
    (loss_mean_times_own_share,
     "returned nan on replica 1, which holds 0 of the 1 samples (a step of 1 samples as 1+0 on "
     "2 replicas): a replica with no sample divided by a count of its own, 0"),
], ids=["step-size-argument", "own-slice", "own-slice-x-N", "cal-without-size", "cal-python-64",
        "notebook-int", "static-shape-int", "static-shape-traced", "nan-on-empty-replica"])
def test_part1_divisors_are_named_by_their_cause(fn, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_per_replica_loss(fn, strategy)
    msg = " ".join(str(err.value).split())
    assert phrase in msg, msg
    assert "What to change" not in msg, msg


def test_part1_gives_the_fix_on_the_second_meeting_only(strategy):
    for fn, fix in ((loss_own_size_times_replicas,
                     "What to change: Divide by the step's sample count: no replica holds it "
                     "alone, so it has to be put together from every replica's count while the "
                     "step runs."),
                    (loss_mean_times_own_share,
                     "What to change: Divide every replica's summed loss by a number that is the "
                     "same on every replica and never 0 while the step holds a sample."),
                    (loss_given_the_step_size,
                     "What to change: Take (labels, logits, penalty=None) and find the step's "
                     "size inside the function.")):
        with pytest.raises(LabCheckError) as first:
            lab05.check_per_replica_loss(fn, strategy)
        assert "What to change" not in str(first.value), str(first.value)
        with pytest.raises(LabCheckError) as second:
            lab05.check_per_replica_loss(fn, strategy)
        assert fix in " ".join(str(second.value).split()), str(second.value)


# (part 1's traced epoch and empty replica, "1 as 1+0", "2 as 1+1+0", "in tf.function (last
# steps 4+0 on 2, 12+12+4 on 3 replicas)": the ✔ of solutions/lab05's nbval run)


def test_the_library_answer_with_a_counted_size_is_refused(strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_per_replica_loss(
            lambda y, lg, penalty=None: mirrored.per_replica_loss(y, lg, _step_count(y)),
            strategy)
    assert "calls dpcourse.mirrored.per_replica_loss, the library's answer" in str(err.value)


# --- stretch B: a padded last step ----------------------------------------------------------

def _padded(kind="right"):
    def train_epoch(strategy, model, optimizer, dist_dataset):
        def step_fn(x, y, w):
            with tf.GradientTape() as tape:
                losses = mirrored.per_example_loss(y, model(x, training=True))
                ctx = tf.distribute.get_replica_context()
                count = tf.cast(ctx.all_reduce(SUM, tf.shape(y)[0]), tf.float32)
                real = ctx.all_reduce(SUM, tf.reduce_sum(w))
                loss = {"right": lambda: tf.math.divide_no_nan(tf.reduce_sum(losses * w), real),
                        "at_least_one": lambda: tf.reduce_sum(losses * w) / tf.maximum(real, 1.0),
                        "unguarded": lambda: tf.reduce_sum(losses * w) / real,
                        "where_unsafe": lambda: tf.where(
                            real > 0, tf.reduce_sum(losses * w) / real, 0.0),
                        "where_safe": lambda: tf.where(
                            real > 0, tf.reduce_sum(losses * w) / tf.maximum(real, 1e-12),
                            0.0),
                        "plain_when_empty": lambda: tf.cond(
                            real > 0, lambda: tf.reduce_sum(losses * w) / real,
                            lambda: tf.reduce_sum(losses) / count),
                        "part1": lambda: tf.reduce_sum(losses) / count,
                        "weighted_count": lambda: tf.reduce_sum(losses * w) / count,
                        "unweighted_real": lambda: tf.reduce_sum(losses) / real,
                        "own_weights": lambda: tf.reduce_sum(losses * w) / (
                            tf.reduce_sum(w) * ctx.num_replicas_in_sync)}[kind]()
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        for batch in dist_dataset:
            strategy.run(step_fn, args=batch)
    return train_epoch


_padded = functools.lru_cache(maxsize=None)(_padded)   # as _epoch: one function per kind


@pytest.mark.parametrize("kind", ["at_least_one"])
def test_a_right_padded_epoch_passes(kind, strategy, capsys):
    # ("right", divide_no_nan by the real count all-reduced, is the solution's train_epoch: its
    # ✔ with both phrases below is compared by solutions/lab05's nbval run)
    lab05.check_padded_epoch(_padded(kind), strategy)
    out = capsys.readouterr().out
    assert "(last steps 4 real + 28 padding on 2, 28 real + 8 padding on 3 replicas)" in out, out
    assert "a step of padding alone leaves the weights where they are" in out, out


def test_a_step_of_padding_alone_is_nan_when_divided_by_its_real_count(strategy,
                                                                       stretch_runs_replayed):
    # learner LR4_05: the mean over the real samples, unguarded, divides a step of padding by 0
    with pytest.raises(LabCheckError) as first:
        lab05.check_padded_epoch(_padded("unguarded"), strategy)
    msg = " ".join(str(first.value).split())
    assert ("the weights became nan after a step of padding alone (one step of 32 samples on 2 "
            "replicas, 16 each, all padding: every weight w is 0), run as written: the step's "
            "real samples add up to 0, and its weighted sum of losses, 0, divided by that 0 is "
            "0/0 = nan") in msg, msg
    assert "divide_no_nan" not in msg, msg
    with pytest.raises(LabCheckError) as second:
        lab05.check_padded_epoch(_padded("unguarded"), strategy)
    assert "a division that gives 0 when the count is 0" in str(second.value), str(second.value)


@pytest.mark.parametrize("kind", ["where_safe"])
def test_a_where_guard_on_a_safe_divisor_passes(kind, strategy, capsys):
    # tf.where on a denominator kept above 0: the branch not taken has a finite gradient
    lab05.check_padded_epoch(_padded(kind), strategy)
    assert "a step of padding alone leaves the weights where they are" in \
        capsys.readouterr().out


def test_a_where_guard_names_the_gradient_of_the_branch_not_taken(strategy,
                                                                  stretch_runs_replayed):
    # learner report SB3: tf.where(real > 0, sum / real, 0.0) gives a loss of 0 on a step of
    # padding alone, but the gradient of the division it did not pick is 0 x inf = nan
    with pytest.raises(LabCheckError) as first:
        lab05.check_padded_epoch(_padded("where_unsafe"), strategy)
    msg = " ".join(str(first.value).split())
    assert ("the weights became nan after a step of padding alone (one step of 32 samples on 2 "
            "replicas, 16 each, all padding: every weight w is 0), run as written, though every "
            "replica's loss was finite (0, 0): a guard such as tf.where(count > 0, sum / count, "
            "0.0) picks the value, but its gradient still flows through the division it did "
            "not pick") in msg, msg
    assert "0/0 = nan" not in msg and "divide_no_nan" not in msg, msg
    with pytest.raises(LabCheckError) as second:
        lab05.check_padded_epoch(_padded("where_unsafe"), strategy)
    again = " ".join(str(second.value).split())
    assert "Make the division itself safe" in again and "divide_no_nan" in again, again


def test_a_step_of_padding_alone_trained_on_is_named(strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_padded_epoch(_padded("plain_when_empty"), strategy)
    msg = " ".join(str(err.value).split())
    assert "the weights moved (by up to" in msg and "after a step of padding alone" in msg, msg
    assert "the step trained on its padding (zero features, label 0)" in msg, msg


@pytest.mark.parametrize("kind, phrase", [
    ("part1", "the last step trained on its padding (global batch 32 on 2 replicas; the last "
              "step's 32 samples are 4 real and 28 padding, real per replica 4+0): each "
              "replica's loss was the plain mean over every sample it was handed"),
    ("weighted_count", "the padding was weighted out of the sum, but the sum was divided by the "
                       "step's 32 samples, padding included"),
    ("unweighted_real", "the sum was divided by the 4 real samples, but the per-example losses "
                        "were not weighted"),
    ("own_weights", "the weights became nan (global batch 32 on 2 replicas; the last step's 32 "
                    "samples are 4 real and 28 padding, real per replica 4+0): replica 1 holds "
                    "only padding in the last step"),
])
def test_padded_epoch_mistakes_are_named(kind, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_padded_epoch(_padded(kind), strategy)
    msg = " ".join(str(err.value).split())
    assert phrase in msg and "What to change" not in msg, msg


def test_padded_epoch_own_weights_on_three_replicas(strategy3):
    # 12 + 12 + 4 real: no replica holds only padding, so no nan: named by its divisor
    with pytest.raises(LabCheckError) as err:
        lab05.check_padded_epoch(_padded("own_weights"), strategy3)
    assert "divided its weighted sum by its own real samples times the 3 replicas" in \
        " ".join(str(err.value).split()), str(err.value)
