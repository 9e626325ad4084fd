"""Lab 05's checks: the reference passes, each plausible mistake fails with a sentence naming it."""

import pytest

from dpcourse import mirrored  # first: sets TF's quiet env and loads triton before TF
from dpcourse import devices

devices.split_tf_devices(2, "CPU")  # before anything else touches TF in this process

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
    lab05.check_per_replica_loss(loss_right)
    lab05.check_model_and_optimizer(make_right, strategy)
    lab05.check_train_step(make_step(loss_right), make_right, strategy)
    assert capsys.readouterr().out.count("✔") == 3


def test_reference_batch_has_nonzero_accuracy():
    # the SUM-vs-MEAN accuracy diagnosis needs an accuracy that is not 0 before the step
    x, y = lab05.reference_batch()
    logits = mirrored.build_keras_cnn(seed=3)(x).numpy()
    assert (logits.argmax(-1) == y).mean() > 0


def test_reduce_mean_loss_is_named():
    with pytest.raises(LabCheckError, match="reduce_mean"):
        lab05.check_per_replica_loss(loss_reduce_mean)


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
