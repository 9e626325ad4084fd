"""One worker of TensorFlow's MultiWorkerMirroredStrategy, for lesson 05.

Not run by hand: ``dpcourse.mirrored.run_multiworker`` starts N copies of it, each with a
``TF_CONFIG`` that lists every worker's address and says which one it is, e.g.::

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]},
                "task": {"type": "worker", "index": 0}}' \\
        python -m dpcourse.tf_multiworker_worker WORKDIR

On a real cluster the addresses are the machines' and each runs one such process; here all
are on 127.0.0.1. WORKDIR holds ``config.json`` (a ``MultiWorkerConfig``) and, optionally, the
initial weights; the worker writes ``result{index}.json`` and ``weights{index}.npz`` there.

Each worker takes its own slice of every global batch (worker i: rows i*B/N .. (i+1)*B/N),
the strategy sums the workers' gradients over the network (a collective all-reduce over gRPC),
and every worker applies the same update: afterwards all hold identical weights, equal to one
process trained on the global batch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def main(workdir: str) -> None:
    """One worker: join the cluster that ``TF_CONFIG`` lists, train ``config.json``'s steps on
    this worker's slice of every global batch, write its losses and final weights to
    ``workdir``.

    Shown in lesson 05, §9.
    """
    t0 = time.perf_counter()
    import numpy as np
    import tensorflow as tf
    import keras

    from dpcourse import data, mirrored

    tf.get_logger().setLevel("ERROR")
    workdir = Path(workdir)
    cfg = json.loads((workdir / "config.json").read_text())
    tf_config = json.loads(os.environ["TF_CONFIG"])
    index = tf_config["task"]["index"]
    num_workers = len(tf_config["cluster"]["worker"])

    # Reads TF_CONFIG and connects to the other workers (it waits for them to start).
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

    global_batch = cfg["global_batch"]
    per_worker = global_batch // num_workers
    ds = data.load("shapes10", n_train=cfg["n_train"], n_test=10, seed=cfg["seed"])
    full = mirrored.make_dataset(ds.x_train, ds.y_train, global_batch)
    lo, hi = index * per_worker, (index + 1) * per_worker
    mine = full.map(lambda x, y: (x[lo:hi], y[lo:hi])).take(cfg["steps"])
    # The function is called once per worker (input_pipeline_id == index): each feeds its own
    # slice, so no automatic sharding is involved.
    dist = strategy.distribute_datasets_from_function(lambda ctx: mine)

    with strategy.scope():
        model = mirrored.build_keras_cnn(seed=cfg["seed"])
        optimizer = keras.optimizers.SGD(learning_rate=cfg["lr"])
    if cfg.get("init_weights"):
        with np.load(cfg["init_weights"]) as z:
            mirrored.set_torch_layout_weights(model, [z[f"w{k}"] for k in range(len(z.files))])
    step = mirrored.make_train_step(strategy, model, optimizer, global_batch)
    losses = [float(step(batch)) for batch in dist]

    weights = mirrored.keras_weights_as_torch(model)
    np.savez(workdir / f"weights{index}.npz", **{f"w{k}": w for k, w in enumerate(weights)})
    (workdir / f"result{index}.json").write_text(json.dumps(
        {"losses": losses, "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dpcourse.tf_multiworker_worker WORKDIR (run by "
                 "dpcourse.mirrored.run_multiworker, with TF_CONFIG set)")
    main(sys.argv[1])
    sys.stdout.flush()
    # Skip interpreter shutdown: TF's collective threads can hang or abort in it, after the
    # results are already on disk.
    os._exit(0)
