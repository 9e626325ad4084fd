# %% [markdown]
# # Lab 05 — a MirroredStrategy custom training loop
#
# In lesson 05 you saw `strategy.run`, `strategy.reduce` and `tf.nn.compute_average_loss`. Here
# you write the loop yourself, in three pieces, each with a check:
#
# 1. the loss one replica differentiates (the scaling that makes N replicas equal one device);
# 2. the model and optimizer, created where the strategy can mirror them;
# 3. one training step that returns the global batch's loss and accuracy, reduced correctly.
#
# **First, the devices.** TensorFlow fixes its devices the first time anything uses them, so
# the very first code cell splits the CPU (or GPU) into logical devices — in every fresh kernel,
# before any other TensorFlow code. If you restart the kernel, run it first again.

# %% tags=["parameters"]
world_size = None     # replicas; None: from the hardware profile (2 on a CPU-only machine)
global_batch = 64
lr = 0.1

# %%
from dpcourse import devices, mirrored   # importing TF is fine: nothing has touched a device yet

profile = devices.choose_profile()
n_replicas = world_size or profile.tf_devices
# On the CPU, one logical device more than the strategy uses: the checks also try your code on
# n_replicas + 1 replicas, so that nothing in it can be tied to one replica count.
spare = 1 if profile.tf_device_type == "CPU" else 0
device_names = devices.split_tf_devices(n_replicas + spare)  # before any other TF code
strategy = mirrored.make_strategy(device_names[:n_replicas])
print("replicas in sync:", strategy.num_replicas_in_sync)

# %%
import numpy as np
import tensorflow as tf
import keras

from dpcourse.checks import lab05

# %% [markdown]
# ## 1. The per-replica loss
#
# Each replica sees `global_batch / N` examples. The optimizer **sums** the replicas' gradients
# (an all-reduce), so each replica's loss must be its share of the *global* mean: the sum of its
# per-example losses divided by the global batch size. `mirrored.per_example_loss(labels, logits)`
# gives the per-example cross-entropies.

# %%
def per_replica_loss(labels, logits, global_batch):
    losses = mirrored.per_example_loss(labels, logits)
    ### BEGIN SOLUTION: divide the summed per-example losses by the *global* batch (one TF call)
    return tf.nn.compute_average_loss(losses, global_batch_size=global_batch)
    ### END SOLUTION


lab05.check_per_replica_loss(per_replica_loss, strategy)

# %% [markdown]
# ## 2. Model and optimizer under the strategy
#
# Build `mirrored.build_keras_cnn()` and `keras.optimizers.SGD(learning_rate=lr)` so that their
# variables are mirrored: one copy per replica, kept equal by the strategy.

# %%
def make_model_and_optimizer(strategy, lr):
    ### BEGIN SOLUTION: create both inside the strategy's scope
    with strategy.scope():
        model = mirrored.build_keras_cnn()
        optimizer = keras.optimizers.SGD(learning_rate=lr)
    ### END SOLUTION
    return model, optimizer


model, optimizer = lab05.check_model_and_optimizer(make_model_and_optimizer, strategy, lr)

# %% [markdown]
# ## 3. One step
#
# `step_fn` runs on every replica with its slice of the batch. It returns the replica's loss
# (already a share of the global mean) and the replica's accuracy (a mean over its *own*
# examples). Reduce each to one number with `strategy.reduce(op, value, axis=None)`: pick
# `tf.distribute.ReduceOp.SUM` or `tf.distribute.ReduceOp.MEAN` for each, by what it is.

# %%
def distributed_train_step(strategy, model, optimizer, dist_batch, global_batch):
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = per_replica_loss(y, logits, global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.float32))
        return loss, accuracy

    loss, accuracy = strategy.run(step_fn, args=dist_batch)
    ### BEGIN SOLUTION: reduce the loss and the accuracy over the replicas, each with the right op
    loss = strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)
    accuracy = strategy.reduce(tf.distribute.ReduceOp.MEAN, accuracy, axis=None)
    ### END SOLUTION
    return loss, accuracy


lab05.check_train_step(distributed_train_step, make_model_and_optimizer, strategy,
                       global_batch=global_batch, lr=lr)

# %% [markdown]
# ## 4. Train a little
#
# With the pieces checked, run a few steps on the course's data set: the loss is the global
# batch's mean, as printed by one device would.

# %%
from dpcourse import data

ds = data.load("shapes10", n_train=1024, n_test=10, seed=0)
train = mirrored.make_dataset(ds.x_train, ds.y_train, global_batch, shuffle=True, seed=0)
step = tf.function(distributed_train_step)
losses = []
for batch in strategy.experimental_distribute_dataset(train.take(6)):
    loss, acc = step(strategy, model, optimizer, batch, global_batch)
    losses.append(float(loss))
print("steps run:", len(losses))
assert all(np.isfinite(losses)) and all(0 < l < 5 for l in losses)

# %% [markdown]
# ## Stretch (optional): your own input pipeline, and a partial last batch
#
# A workshop can stop here. `experimental_distribute_dataset` split one global batch for you.
# With `strategy.distribute_datasets_from_function(dataset_fn)` you build each input pipeline
# yourself: `dataset_fn(input_context)` shards the data by `input_context.input_pipeline_id`
# (one pipeline per worker machine; here there is one) and batches by the **per-replica**
# batch, `input_context.get_per_replica_batch_size(global_batch)`. The replicas then take
# consecutive batches of that pipeline.
#
# Then the detail every tutorial skips: 100 samples in global batches of 32 leave a last step
# of 4 — on 2 replicas, 4 samples on one and **none** on the other. Dividing by `global_batch`
# makes that step 8 times too small; `compute_average_loss` without `global_batch_size` guesses
# 4 × 2 = 8; `reduce_mean` of no samples is NaN. The right divisor is the number of samples the
# step really has: the replicas' sizes summed with the replica context's `all_reduce`. (The
# same goes for metrics: with unequal slices, the MEAN of the replicas' accuracies from part 3
# is no longer the accuracy of the step; sum the correct predictions and divide by that count.)
#
# Write `make_dist_dataset(strategy, x, y, global_batch)` (in order, no shuffling, the partial
# batch kept), then the two TODOs in `train_epoch`'s step: the step's real sample count, and the
# loss divided by it (the gradient lines after them are given).

# %%
def make_dist_dataset(strategy, x, y, global_batch):
    ### BEGIN SOLUTION: dataset_fn(ctx): shard by ctx, batch by ctx.get_per_replica_batch_size(global_batch); distribute_datasets_from_function
    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(ctx.get_per_replica_batch_size(global_batch))

    return strategy.distribute_datasets_from_function(dataset_fn)
    ### END SOLUTION


lab05.check_dataset_fn(make_dist_dataset, strategy)


# %%
def train_epoch(strategy, model, optimizer, dist_dataset):
    def step_fn(x, y):
        ### BEGIN SOLUTION: n_global, the step's real sample count: the replica context's all_reduce (SUM) of this replica's batch size
        ctx = tf.distribute.get_replica_context()
        n_global = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.shape(y)[0])
        ### END SOLUTION
        with tf.GradientTape() as tape:
            ### BEGIN SOLUTION: loss = the summed per-example losses / n_global, cast to float32 first (a size is an int32, and TF will not divide a float by an int)
            losses = mirrored.per_example_loss(y, model(x, training=True))
            loss = tf.reduce_sum(losses) / tf.cast(n_global, tf.float32)
            ### END SOLUTION
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for batch in dist_dataset:
        strategy.run(step_fn, args=batch)


lab05.check_partial_batch_epoch(train_epoch, strategy)
