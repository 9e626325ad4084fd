"""The TensorFlow side of ``python -m dpcourse.bench scaling --tf``: MirroredStrategy on N = 1..max
devices, same synthetic CIFAR-shaped data and per-device batch as the torch rows.

    python -m dpcourse.bench scaling --tf --max-ranks 2 --steps 3   # adds "mirrored" rows
    python -m dpcourse.bench.scaling_tf --max-ranks 2 --per-device-batch 32 --steps 3 --model small

Why a child process: TensorFlow fixes its devices the first time it uses them, and splitting the
CPU into N logical devices (``devices.split_tf_devices``) must happen before that, so the
measurement runs in a fresh ``python -m dpcourse.bench.scaling_tf`` that splits into
``max_ranks`` devices once, then takes strategies over the first 1, 2, ... of them —
interleaved, repeat by repeat, like the torch rows. The child prints one JSON line; the parent
bounds its time and never imports TensorFlow (importing this module does not import it either).

Frankly: on CPU, TF's logical CPU devices share one process and one thread pool, so N "devices"
are not N cores the way N gloo processes are; the cross-device reduction is TF's default for
CPU devices, a CollectiveAllReduce with the RING implementation (``mirrored.make_strategy``),
run among the logical devices of one process. Efficiency here is relative to MirroredStrategy
on one device (TF's own single), not to the torch single-device row. With GPUs the devices are
real GPUs and the default all-reduce is CollectiveAllReduce with NCCL.

Models: "small" is ``mirrored.build_keras_cnn`` (SmallCNN's Keras twin); "resnet18" is the
CIFAR ResNet-18 written below in Keras (3x3 stem, no max-pool, [2, 2, 2, 2] basic blocks),
the same layout as ``models.resnet18_cifar``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

__all__ = ["run_tf_scaling", "measure", "keras_resnet18"]


def run_tf_scaling(max_ranks: int, per_rank_batch: int, steps: int, repeats: int,
                   model: str, timeout: float = 600.0, gpus: int = 0) -> list[dict]:
    """Rows like bench_scaling's (kind "mirrored"), measured in a bounded child process."""
    cmd = [sys.executable, "-m", "dpcourse.bench.scaling_tf", "--max-ranks", str(max_ranks),
           "--per-device-batch", str(per_rank_batch), "--steps", str(steps),
           "--repeats", str(repeats), "--model", model]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:   # subprocess.run kills the child before raising
        raise RuntimeError(f"the TensorFlow scaling run took longer than {timeout:g} s") from None
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"the TensorFlow scaling run failed (exit {out.returncode}):\n{tail}")
    samples = json.loads(out.stdout.strip().splitlines()[-1])   # {N: [images/s per repeat]}
    single = statistics.median(samples["1"])
    rows = []
    for n in range(1, max_ranks + 1):
        vals = samples[str(n)]
        img_s = statistics.median(vals)
        rows.append(dict(kind="mirrored", world_size=n, images_per_s=img_s,
                         spread=[min(vals), max(vals)], efficiency=img_s / (n * single),
                         step_ms=n * per_rank_batch / img_s * 1e3,
                         note="eff. vs Mirrored on 1 device" + (
                             "" if gpus else "; logical CPU devices share one thread pool")))
    return rows


# --- the child: everything below runs with TensorFlow imported ------------------------------

def keras_resnet18(num_classes: int = 10):
    """ResNet-18 for 32x32 inputs in Keras (channels-last), BasicBlock x [2, 2, 2, 2]."""
    import keras

    def block(x, channels, stride):
        shortcut = x
        x = keras.layers.Conv2D(channels, 3, stride, padding="same", use_bias=False)(x)
        x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
        x = keras.layers.Conv2D(channels, 3, 1, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        if stride != 1 or shortcut.shape[-1] != channels:
            shortcut = keras.layers.Conv2D(channels, 1, stride, use_bias=False)(shortcut)
            shortcut = keras.layers.BatchNormalization()(shortcut)
        return keras.layers.ReLU()(x + shortcut)

    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(64, 3, 1, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    for channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        x = block(x, channels, stride)
        x = block(x, channels, 1)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x), name="resnet18_cifar")


def measure(max_ranks: int, per_rank_batch: int, steps: int, repeats: int,
            model: str) -> dict[str, list[float]]:
    """images/s of MirroredStrategy over the first N devices, N = 1..max_ranks, interleaved."""
    from dpcourse import devices

    names = devices.split_tf_devices(max_ranks)   # before anything else touches TF
    import tensorflow as tf

    from dpcourse import mirrored

    steppers = {}
    for n in range(1, max_ranks + 1):
        strategy = mirrored.make_strategy(names[:n])
        global_batch = n * per_rank_batch
        with strategy.scope():
            net = keras_resnet18() if model == "resnet18" else mirrored.build_keras_cnn()
            opt = tf.keras.optimizers.SGD(0.01, momentum=0.9)
        X = tf.random.normal((global_batch, 32, 32, 3), seed=0)   # synthetic, CIFAR-shaped
        y = tf.random.uniform((global_batch,), 0, 10, dtype=tf.int32, seed=0)
        ds = tf.data.Dataset.from_tensor_slices((X, y)).batch(global_batch).cache().repeat()
        batches = iter(strategy.experimental_distribute_dataset(ds))
        step = mirrored.make_train_step(strategy, net, opt, global_batch)
        for _ in range(2):                       # warm-up: tracing and graph building
            float(step(next(batches)))
        steppers[n] = (step, batches, global_batch)
    samples: dict[str, list[float]] = {str(n): [] for n in steppers}
    for _ in range(repeats):
        for n, (step, batches, global_batch) in steppers.items():   # interleaved
            times = []
            for _ in range(steps):
                batch = next(batches)
                t0 = time.perf_counter()
                float(step(batch))               # float() waits for the step to finish
                times.append(time.perf_counter() - t0)
            samples[str(n)].append(global_batch / statistics.median(times))
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpcourse.bench.scaling_tf",
                                description=__doc__.split("\n")[0])
    p.add_argument("--max-ranks", type=int, default=2)
    p.add_argument("--per-device-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", choices=("small", "resnet18"), default="small")
    args = p.parse_args(argv)
    for flag in ("max_ranks", "per_device_batch", "steps", "repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    samples = measure(args.max_ranks, args.per_device_batch, args.steps, args.repeats, args.model)
    print(json.dumps(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
