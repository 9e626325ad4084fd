"""dpcourse.mirrored: the Keras twin of SmallCNN, the custom loop's scaling, the multi-worker
launcher's clean-up. TF runs here on 2 logical CPU devices."""

import os
import time

import numpy as np
import psutil
import pytest

from dpcourse import mirrored  # first: quiet TF env, triton before TF (see mirrored._preload_triton)
from dpcourse import devices

devices.split_tf_devices(2, "CPU")  # before anything else touches TF in this process

import torch  # noqa: E402

from dpcourse import data, models  # noqa: E402


@pytest.fixture(scope="module")
def strategy():
    return mirrored.make_strategy(["/cpu:0", "/cpu:1"])


@pytest.fixture(scope="module")
def batch():
    ds = data.load("shapes10", n_train=32, n_test=1, seed=2)
    return data.normalize(ds.x_train), ds.y_train


def test_keras_twin_computes_what_torch_computes(batch):
    x, _ = batch
    torch.manual_seed(1)
    tm = models.SmallCNN()
    km = mirrored.copy_torch_weights(tm, mirrored.build_keras_cnn(seed=7))
    assert km.count_params() == sum(p.numel() for p in tm.parameters())
    with torch.no_grad():
        want = tm(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
    np.testing.assert_allclose(km(x).numpy(), want, atol=1e-5)
    for a, b in zip(mirrored.keras_weights_as_torch(km), tm.parameters()):
        np.testing.assert_array_equal(a, b.detach().numpy())


def test_flatten_order_matters(batch):
    # Without reordering the first dense layer's rows the two models disagree: the test above
    # would not be able to pass by luck.
    x, _ = batch
    torch.manual_seed(1)
    tm = models.SmallCNN()
    km = mirrored.copy_torch_weights(tm, mirrored.build_keras_cnn())
    dense = [l for l in km.layers if l.__class__.__name__ == "Dense"][0]
    dense.kernel.assign(tm.classifier[1].weight.detach().numpy().T)  # naive transpose
    with torch.no_grad():
        want = tm(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
    assert not np.allclose(km(x).numpy(), want, atol=1e-3)


def test_mirrored_gradient_equals_single_device_and_reduce_mean_is_n_times(strategy, batch):
    x, y = batch
    single = mirrored.build_keras_cnn(seed=4)
    with strategy.scope():
        rep = mirrored.build_keras_cnn(seed=4)
    g1 = mirrored.single_replica_gradients(single, x, y)
    for a, b in zip(mirrored.mirrored_gradients(strategy, rep, x, y), g1):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for a, b in zip(mirrored.mirrored_gradients(strategy, rep, x, y, "reduce_mean"), g1):
        np.testing.assert_allclose(a, 2 * b, atol=1e-6)
    for a, b in zip(mirrored.mirrored_gradients(strategy, rep, x, y, grad_reduce="mean"), g1):
        np.testing.assert_allclose(a, b / 2, atol=1e-6)
    # A Keras loss object under the strategy already scales its slice's mean by 1/N
    # (keras/src/losses/loss.py, scale_loss_for_distribution): right for equal slices, and
    # dividing by N once more is half the gradient on 2 replicas.
    for a, b in zip(mirrored.mirrored_gradients(strategy, rep, x, y, "keras"), g1):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for a, b in zip(mirrored.mirrored_gradients(strategy, rep, x, y, "keras_over_replicas"), g1):
        np.testing.assert_allclose(a, b / 2, atol=1e-6)
    with pytest.raises(ValueError, match="loss_scaling must be one of"):
        mirrored.mirrored_gradients(strategy, rep, x, y, "keras_mean")


def test_default_cross_device_ops_on_cpu_is_a_ring_all_reduce(strategy):
    # TF 2.21's MirroredExtended._make_collective_ops_with_fallbacks: all-CPU devices -> RING.
    assert mirrored.cross_device_ops_in_use(strategy) == ("CollectiveAllReduce", "RING")
    import tensorflow as tf

    to_one = mirrored.make_strategy(["/cpu:0", "/cpu:1"], tf.distribute.ReductionToOneDevice())
    assert mirrored.cross_device_ops_in_use(to_one) == ("ReductionToOneDevice", None)


def test_strategies_of_two_sizes_coexist(batch):
    # Without a key range per strategy, a 1-replica and a 2-replica CollectiveAllReduce would
    # both number their groups from 1 and TF aborts the second.
    x, y = batch
    for names in (["/cpu:0", "/cpu:1"], ["/cpu:0"], ["/cpu:0", "/cpu:1"]):
        strat = mirrored.make_strategy(names)
        with strat.scope():
            rep = mirrored.build_keras_cnn(seed=4)
        g = mirrored.mirrored_gradients(strat, rep, x[:8], y[:8])
        assert all(np.isfinite(a).all() for a in g)


def test_counting_shows_which_ops_carried_the_gradients(strategy, batch):
    import keras
    import tensorflow as tf

    x, y = batch
    with strategy.scope():
        rep = mirrored.build_keras_cnn(seed=4)
        opt = keras.optimizers.SGD(0.1)
    ds = tf.data.Dataset.from_tensor_slices(((x * 0).astype(np.uint8), y)).batch(8)
    with mirrored.count_cross_device_calls() as calls:
        mirrored.train_steps(strategy, rep, opt, ds, 1, 8)
    assert calls.counts[("CollectiveAllReduce", "batch_reduce")] == 1
    assert calls.tensors[("CollectiveAllReduce", "batch_reduce")] == len(rep.trainable_variables)
    assert calls.counts[("ReductionToOneDevice", "reduce")] == 1
    from tensorflow.python.distribute import cross_device_ops as cdo

    assert "wrapper" not in cdo.CollectiveAllReduce.batch_reduce_implementation.__name__


def test_compile_wraps_only_mixed_float16_in_loss_scaling():
    import keras

    for policy, wrapped in (("mixed_float16", True), ("mixed_bfloat16", False), (None, False)):
        m = mirrored.build_keras_cnn(dtype=policy)
        opt = keras.optimizers.SGD(0.1)
        m.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        assert isinstance(m.optimizer, keras.optimizers.LossScaleOptimizer) == wrapped, policy


def test_bad_input_is_one_sentence(batch):
    x, y = batch
    with pytest.raises(ValueError, match="global_batch must be a positive int"):
        mirrored.make_dataset((x * 0).astype(np.uint8), y, 0)
    with pytest.raises(TypeError, match="uint8 images"):
        mirrored.make_dataset(x, y, 8)
    with pytest.raises(ValueError, match="loss_scaling must be one of"):
        mirrored.per_replica_loss(y, np.zeros((len(y), 10), np.float32), 32, "mean")
    with pytest.raises(ValueError, match="does not split over"):
        mirrored.run_multiworker(mirrored.MultiWorkerConfig(global_batch=63), 2)


def test_checkpoint_restores_across_strategies(strategy, tmp_path):
    with strategy.scope():
        rep = mirrored.build_keras_cnn(seed=1)
    path = mirrored.save_checkpoint(tmp_path, rep, step=5)
    plain = mirrored.build_keras_cnn(seed=2)
    assert mirrored.restore_checkpoint(path, plain) == 5
    for a, b in zip(plain.get_weights(), rep.get_weights()):
        np.testing.assert_array_equal(a, b)


def _children():
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def test_multiworker_timeout_kills_every_worker():
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(mirrored.MultiWorkerError, match="not done after"):
        mirrored.run_multiworker(mirrored.MultiWorkerConfig(steps=1), 2, timeout=1.0)
    assert time.monotonic() - t0 < 15
    assert _children() - before == set()
