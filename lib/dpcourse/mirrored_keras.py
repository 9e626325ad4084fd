"""SmallCNN's Keras twin, and moving weights between it and the torch model.

Used by lesson 05 (``lessons/05_mirrored_strategy.py``, §5 and §7) and lab 05, through
``dpcourse.mirrored``, which re-exports every name here; the strategy, the input, the loops and
multi-worker training are in :mod:`dpcourse.mirrored`.

* :func:`build_keras_cnn` — the Keras twin of ``dpcourse.models.SmallCNN`` (same layers, same
  parameter count, channels-last);
* :func:`copy_torch_weights` / :func:`set_torch_layout_weights` / :func:`keras_weights_as_torch`
  — weights from torch's layout to Keras' and back (NCHW vs NHWC flatten order included).

TensorFlow comes from :mod:`dpcourse.tf_quiet`, which quiets it before importing it.
"""

from __future__ import annotations

import numpy as np

from dpcourse.tf_quiet import keras

__all__ = ["build_keras_cnn", "copy_torch_weights", "set_torch_layout_weights",
           "keras_weights_as_torch"]


def build_keras_cnn(num_classes: int = 10, width: int = 32, dtype=None,
                    seed: int | None = 0) -> keras.Model:
    """Keras version of ``dpcourse.models.SmallCNN``: (conv 3×3 - ReLU - max-pool 2) ×3,
    flatten, dense 128 - ReLU, dense ``num_classes`` (logits). Input (N, 32, 32, 3).

    ``dtype`` is a Keras dtype policy, e.g. ``"mixed_bfloat16"``: the layers then compute in
    bfloat16 while their variables stay float32; the logits are cast back to float32 so the
    loss is computed at full precision. Build it inside ``strategy.scope()`` for mirrored
    variables. ``seed`` makes the initial weights repeatable (None: random).

    Shown in lesson 05, §7.
    """
    if width < 1 or num_classes < 1:
        raise ValueError(f"width and num_classes must be positive, got {width}, {num_classes}")
    init = (lambda k: keras.initializers.GlorotUniform(seed=None if seed is None else seed + k))
    layers = [keras.Input((32, 32, 3))]
    channels = (width, 2 * width, 2 * width)
    for k, c in enumerate(channels):
        layers += [
            keras.layers.Conv2D(c, 3, padding="same", kernel_initializer=init(k), dtype=dtype),
            keras.layers.ReLU(dtype=dtype),
            keras.layers.MaxPooling2D(2, dtype=dtype),
        ]
    layers += [
        keras.layers.Flatten(dtype=dtype),
        keras.layers.Dense(128, activation="relu", kernel_initializer=init(3), dtype=dtype),
        keras.layers.Dense(num_classes, kernel_initializer=init(4), dtype=dtype),
        # Logits back in float32 whatever the compute dtype: softmax/cross-entropy in bfloat16
        # loses the small differences between classes that the loss is made of.
        keras.layers.Activation("linear", dtype="float32"),
    ]
    model = keras.Sequential(layers, name="small_cnn")
    if dtype is not None:
        # The model's own policy is what ``compile`` reads: with "mixed_float16" it wraps the
        # optimizer in a LossScaleOptimizer (keras/src/trainers/trainer.py, Trainer.compile).
        model.dtype_policy = dtype
    return model


def _conv_and_dense(keras_model: keras.Model):
    convs = [l for l in keras_model.layers if isinstance(l, keras.layers.Conv2D)]
    denses = [l for l in keras_model.layers if isinstance(l, keras.layers.Dense)]
    if len(convs) != 3 or len(denses) != 2:
        raise ValueError("expected the model of build_keras_cnn (3 Conv2D and 2 Dense layers), got "
                         f"{len(convs)} Conv2D and {len(denses)} Dense layers")
    return convs, denses


def copy_torch_weights(torch_model, keras_model: keras.Model) -> keras.Model:
    """Give ``keras_model`` (from :func:`build_keras_cnn`) the weights of a torch ``SmallCNN``.

    Convolution kernels go from torch's (out, in, kh, kw) to Keras' (kh, kw, in, out); dense
    kernels are transposed. The first dense layer needs more: torch flattens a (C, H, W) feature
    map, Keras a (H, W, C) one, so the same input neuron has a different index. Its rows are
    reordered from C-major to channels-last, or the two models compute different functions.
    Works under a strategy (assigning to a mirrored variable sets every replica's copy).

    Shown in lesson 05, §5.
    """
    sd = {k: v.detach().cpu().numpy() for k, v in torch_model.state_dict().items()}
    if [v.ndim for v in sd.values()] != [4, 1, 4, 1, 4, 1, 2, 1, 2, 1]:
        raise ValueError("copy_torch_weights expects a dpcourse.models.SmallCNN (3 convolutions, "
                         "2 linear layers, each with a bias)")
    return set_torch_layout_weights(keras_model, list(sd.values()))






def set_torch_layout_weights(keras_model: keras.Model, arrays) -> keras.Model:
    """Assign weights given in torch's layout and order (conv1 weight, conv1 bias, ...,
    fc2 bias: what ``SmallCNN.parameters()`` yields) to the Keras CNN.

    Shown in lesson 05, §5.
    """
    convs, denses = _conv_and_dense(keras_model)
    arrays = [np.asarray(a, dtype=np.float32) for a in arrays]
    if len(arrays) != 10:
        raise ValueError(f"expected 10 arrays (5 weights, 5 biases), got {len(arrays)}")
    for k, layer in enumerate(convs):
        layer.kernel.assign(arrays[2 * k].transpose(2, 3, 1, 0))
        layer.bias.assign(arrays[2 * k + 1])
    w1 = arrays[6]                                     # (128, C*H*W), input index c*H*W + h*W + w
    c = convs[-1].filters
    hw = int(round((w1.shape[1] // c) ** 0.5))
    w1 = w1.reshape(w1.shape[0], c, hw, hw).transpose(2, 3, 1, 0).reshape(hw * hw * c, -1)
    denses[0].kernel.assign(w1)                        # (H*W*C, 128), index h*W*C + w*C + c
    denses[0].bias.assign(arrays[7])
    denses[1].kernel.assign(arrays[8].T)
    denses[1].bias.assign(arrays[9])
    return keras_model


def keras_weights_as_torch(keras_model: keras.Model) -> list[np.ndarray]:
    """The Keras model's weights in torch's layout and order (the inverse of
    :func:`copy_torch_weights`), to compare with ``[p for p in torch_model.parameters()]``.

    Shown in lesson 05, §5.
    """
    convs, denses = _conv_and_dense(keras_model)
    out = []
    for layer in convs:
        out += [layer.kernel.numpy().transpose(3, 2, 0, 1), layer.bias.numpy()]
    w1 = denses[0].kernel.numpy()
    c = convs[-1].filters
    hw = int(round((w1.shape[0] // c) ** 0.5))
    w1 = w1.reshape(hw, hw, c, -1).transpose(3, 2, 0, 1).reshape(w1.shape[1], -1)
    out += [w1, denses[0].bias.numpy(), denses[1].kernel.numpy().T, denses[1].bias.numpy()]
    return out
