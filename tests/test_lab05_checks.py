"""Lab 05's checks: the reference passes, each plausible mistake fails with a sentence naming it."""

import pytest

from dpcourse import mirrored  # first: sets TF's quiet env and loads triton before TF
from dpcourse import devices

devices.split_tf_devices(3, "CPU")  # before anything else touches TF; the checks use the spare

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from dpcourse.checks import LabCheckError, lab05  # noqa: E402

SUM, MEAN = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN


@pytest.fixture(scope="module")
def strategy():
    return mirrored.make_strategy(["/cpu:0", "/cpu:1"])


def loss_right(labels, logits, global_batch):
    return tf.nn.compute_average_loss(mirrored.per_example_loss(labels, logits),
                                      global_batch_size=global_batch)


def loss_reduce_mean(labels, logits, global_batch):
    return tf.reduce_mean(mirrored.per_example_loss(labels, logits))


def make_right(strategy, lr):
    with strategy.scope():
        return mirrored.build_keras_cnn(), keras.optimizers.SGD(learning_rate=lr)


def make_model_outside(strategy, lr):
    model = mirrored.build_keras_cnn()
    with strategy.scope():
        return model, keras.optimizers.SGD(learning_rate=lr)


def make_optimizer_outside(strategy, lr):
    with strategy.scope():
        model = mirrored.build_keras_cnn()
    return model, keras.optimizers.SGD(learning_rate=lr)


def make_step(loss_fn, loss_op=SUM, acc_op=MEAN):
    def distributed_train_step(strategy, model, optimizer, dist_batch, global_batch):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = loss_fn(y, logits, global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            acc = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.float32))
            return loss, acc
        loss, acc = strategy.run(step_fn, args=dist_batch)
        return strategy.reduce(loss_op, loss, axis=None), strategy.reduce(acc_op, acc, axis=None)
    return distributed_train_step


def test_reference_passes(strategy, capsys):
    lab05.check_per_replica_loss(loss_right, strategy)
    lab05.check_model_and_optimizer(make_right, strategy)
    lab05.check_train_step(make_step(loss_right), make_right, strategy)
    assert capsys.readouterr().out.count("✔") == 3


def test_reference_batch_has_nonzero_accuracy():
    # the SUM-vs-MEAN accuracy diagnosis needs an accuracy that is not 0 before the step
    x, y = lab05.reference_batch()
    logits = mirrored.build_keras_cnn(seed=3)(x).numpy()
    assert (logits.argmax(-1) == y).mean() > 0


def test_reduce_mean_loss_is_named(strategy):
    with pytest.raises(LabCheckError, match="reduce_mean"):
        lab05.check_per_replica_loss(loss_reduce_mean, strategy)


def test_reduce_mean_in_the_step_is_named(strategy):
    with pytest.raises(LabCheckError, match=r"2x too big.*reduce_mean.*compute_average_loss"):
        lab05.check_train_step(make_step(loss_reduce_mean), make_right, strategy)


def test_sum_where_mean_is_meant_is_named(strategy):
    with pytest.raises(LabCheckError, match="SUM is used where MEAN is meant"):
        lab05.check_train_step(make_step(loss_right, SUM, SUM), make_right, strategy)


def test_mean_where_sum_is_meant_is_named(strategy):
    with pytest.raises(LabCheckError, match="reduce them with SUM, not MEAN"):
        lab05.check_train_step(make_step(loss_right, MEAN, MEAN), make_right, strategy)


def test_model_outside_scope_is_named(strategy):
    with pytest.raises(LabCheckError, match="model's variables .* outside strategy.scope"):
        lab05.check_model_and_optimizer(make_model_outside, strategy)
    with pytest.raises(LabCheckError, match="outside strategy.scope"):
        lab05.check_train_step(make_step(loss_right), make_model_outside, strategy)


def test_optimizer_outside_scope_is_named(strategy):
    with pytest.raises(LabCheckError, match="optimizer was created outside strategy.scope"):
        lab05.check_model_and_optimizer(make_optimizer_outside, strategy)


def test_no_update_is_named(strategy):
    def lazy_step(strategy, model, optimizer, dist_batch, global_batch):
        def step_fn(x, y):
            logits = model(x, training=True)
            return (loss_right(y, logits, global_batch),
                    tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.float32)))
        loss, acc = strategy.run(step_fn, args=dist_batch)
        return strategy.reduce(SUM, loss, axis=None), strategy.reduce(MEAN, acc, axis=None)
    with pytest.raises(LabCheckError, match="weights did not change"):
        lab05.check_train_step(lazy_step, make_right, strategy)



# --- answers tied to one batch size or replica count, and right answers written differently --

def loss_implicit_global(labels, logits, global_batch):
    # right inside strategy.run: the replica context tells compute_average_loss the replica count
    return tf.nn.compute_average_loss(mirrored.per_example_loss(labels, logits))


def loss_sum_over_global(labels, logits, global_batch):
    return tf.reduce_sum(mirrored.per_example_loss(labels, logits)) / global_batch


def loss_mean_over_replicas(labels, logits, global_batch):
    # right for equal slices: the local mean divided by the number of replicas
    ctx = tf.distribute.get_replica_context()
    return tf.reduce_mean(mirrored.per_example_loss(labels, logits)) / ctx.num_replicas_in_sync


def loss_fixed_64(labels, logits, global_batch):
    return tf.nn.compute_average_loss(mirrored.per_example_loss(labels, logits),
                                      global_batch_size=64)


def loss_fixed_two_replicas(labels, logits, global_batch):
    return tf.reduce_mean(mirrored.per_example_loss(labels, logits)) / 2


def loss_summed(labels, logits, global_batch):
    return tf.reduce_sum(mirrored.per_example_loss(labels, logits))


@pytest.mark.parametrize("fn", [loss_implicit_global, loss_sum_over_global,
                                loss_mean_over_replicas])
def test_right_losses_pass(fn, strategy, capsys):
    lab05.check_per_replica_loss(fn, strategy)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "on 3 replicas" in out  # the spare device was used


@pytest.mark.parametrize("fn, phrase", [
    (loss_fixed_64, "divided the summed loss by 64"),
    (loss_fixed_two_replicas, "on 3 replicas"),
    (loss_summed, "returns the sum"),
])
def test_losses_tied_to_one_setup_fail(fn, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_per_replica_loss(fn, strategy)
    assert phrase in str(err.value), str(err.value)


def step_counting_correct(strategy, model, optimizer, dist_batch, global_batch):
    # right: accuracy as a count of hits, summed over replicas and divided once
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_implicit_global(y, logits, global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        hits = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.float32))
        return loss, hits
    loss, hits = strategy.run(step_fn, args=dist_batch)
    return (strategy.reduce(SUM, loss, axis=None),
            strategy.reduce(SUM, hits, axis=None) / global_batch)


@pytest.mark.parametrize("step", [make_step(loss_implicit_global), step_counting_correct,
                                  make_step(loss_mean_over_replicas)],
                         ids=["implicit-global-batch", "hits-summed", "mean-over-replicas"])
def test_right_steps_pass(step, strategy, capsys):
    lab05.check_train_step(step, make_right, strategy)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "48 on 2" in out and "63 on 3" in out


@pytest.mark.parametrize("step, phrase", [
    (make_step(loss_fixed_64), "divided by a fixed 64"),
    (make_step(loss_fixed_two_replicas), "divided by a fixed 2 replicas"),
])
def test_steps_tied_to_one_setup_fail(step, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_train_step(step, make_right, strategy)
    assert phrase in str(err.value), str(err.value)


# --- stretch: distribute_datasets_from_function and the partial last batch --------------------

def _dataset_maker(per_replica=True, shard=True, drop=False):
    def make(strategy, x, y, global_batch):
        def dataset_fn(ctx):
            ds = tf.data.Dataset.from_tensor_slices((x, y))
            if shard:
                ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            size = ctx.get_per_replica_batch_size(global_batch) if per_replica else global_batch
            return ds.batch(size, drop_remainder=drop)
        return strategy.distribute_datasets_from_function(dataset_fn)
    return make


def test_right_datasets_pass(strategy, capsys):
    lab05.check_dataset_fn(_dataset_maker(), strategy)
    lab05.check_dataset_fn(_dataset_maker(shard=False), strategy)  # one pipeline: same thing
    assert capsys.readouterr().out.count("✔") == 2


@pytest.mark.parametrize("make, phrase", [
    (_dataset_maker(per_replica=False), "get_per_replica_batch_size"),
    (_dataset_maker(drop=True), "keep the partial last batch"),
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
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        for batch in dist_dataset:
            strategy.run(step_fn, args=batch)
    return train_epoch


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
    assert capsys.readouterr().out.count("✔") == 2


@pytest.mark.parametrize("fn, phrase", [
    (_epoch("global"), "divided by the full global batch"),
    (_epoch("implicit"), "compute_average_loss without global_batch_size"),
    (_epoch("mean"), "local mean divided by the replica count"),
    (epoch_skipping_partial, "changed nothing"),
])
def test_partial_batch_mistakes_are_named(fn, phrase, strategy):
    with pytest.raises(LabCheckError) as err:
        lab05.check_partial_batch_epoch(fn, strategy)
    assert phrase in str(err.value), str(err.value)
