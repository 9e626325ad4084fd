# %% [markdown]
# # Lab 05 — a MirroredStrategy custom training loop
#
# **Goal:** a custom training loop under `MirroredStrategy` whose every step changes the weights
# as one device would on the same global batch (to float rounding: the checks compare to a
# relative 1e-3), and reports that batch's loss and accuracy — whatever the number of replicas, the batch size or the learning rate. Lesson 05
# showed the pieces (`strategy.run`, mirrored variables, how the strategy combines the replicas'
# gradients); here you decide how they fit. A prediction first, then four parts, each with a
# check:
#
# 0. a prediction about the last step of an epoch (measured in part 4);
# 1. the loss one replica differentiates, with a regularisation term — **the lab's design
#    decision is here**: the strategy sums the replicas' gradients (lesson 05, at its lab
#    pointer), so a replica's own mean is not the loss to differentiate; your function is told
#    no batch size;
# 2. the model and optimizer, where the strategy can mirror them;
# 3. one training step and what it reports, told no batch size either (**a decision**: what
#    each replica returns, and how the replicas' values are combined);
# 4. the measurement of your prediction.
#
# The stretch builds each replica's input pipeline yourself (**a decision**: a global batch the
# replicas do not divide) and trains through an epoch whose last batch is padded (**a
# decision**: what a step's mean is over).
#
# Stuck? Run the check: its sentence names what is wrong. Each part also has hints, folded
# (click a "▶ Hint" label to open it): a question first, then the idea, then the
# shape of the code.
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

from dpcourse.checks import lab05, predict

# %% [markdown]
# ## 0. Predict first: an epoch's last step
#
# The checks below hand your code batches they split themselves. In training the split is
# `strategy.experimental_distribute_dataset`'s, and an epoch is rarely a whole number of global
# batches. Here the data set holds 15 global batches and **one sample more**
# (`lab05.epoch_size(global_batch)` samples), batched by `global_batch` with the remainder kept
# and distributed by that call: the epoch's last step has one sample for
# `strategy.num_replicas_in_sync` replicas — a case lesson 05 runs only in a folded cell after
# its lab pointer, to open once this lab is done.
#
# Before running anything, **predict**: in that last step, what happens on replica 1? One of
# `lab05.LAST_STEP_CHOICES`: `"a copy of the sample"` (it trains on the sample too),
# `"step_fn on an empty batch"`, `"sits the step out"` (`step_fn` is not called on it), or
# `"no such step"` (the strategy drops a batch it cannot split). Write your choice and run the
# cell: part 4 measures it, once you have a model.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# What does `apply_gradients` do with the replicas' gradients (lesson 05 §4), and what happened
# in the lesson when one replica skipped that call? What does PyTorch's `DistributedSampler` do
# when the data does not fill every rank — and is there anything in TensorFlow that would do the
# same?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — where to read</summary>
#
# TensorFlow describes this split in a docstring: `_LegacyRebatchDataset`, in
# `tensorflow/python/data/experimental/ops/distribute.py` (under `site-packages`). Read its
# first two sentences, and stop before its example, which gives the answer away. How
# many sub-batches does it make of each batch, whatever the batch's size? When a batch holds
# fewer samples than there are replicas, what can a replica's sub-batch then be?
#
# </details>

# %%
### BEGIN SOLUTION: my_guess = your prediction (one of lab05.LAST_STEP_CHOICES)
my_guess = "step_fn on an empty batch"
### END SOLUTION
guess = predict("lab05", lab05.LAST_STEP_QUESTION, my_guess, choices=lab05.LAST_STEP_CHOICES)

# %% [markdown]
# ## 1. The per-replica loss — the lab's design decision
#
# **Contract.** `per_replica_loss(labels, logits, penalty=None)` is called inside
# `strategy.run`, once per replica, with that replica's slice of the step's samples — and with
# nothing else: no argument tells it how many samples the step holds, and the slices need not be
# the same size. `penalty`, when given, is a scalar tensor: the step's regularisation term (say
# λ·Σw² over the model's weights), computed by each replica from its own copy of the mirrored
# weights. It returns one number (a scalar tensor) per replica.
#
# **What must hold:** the replicas' gradients of these numbers, summed by the strategy, equal
# one device's gradient of the step's mean loss over all its samples — plus the penalty's
# gradient when a penalty is given — on every split the strategy can make of a step, on any
# number of replicas, run eagerly and inside a training loop that `tf.function` traces once for
# a whole epoch, the epoch's short last step included. The check tries each: steps split evenly
# and unevenly on 2 and 3 replicas, with and without a penalty, then an epoch of 100 samples in
# a loop built on your function, as written and wrapped in `tf.function`.
#
# **Your design decision:** where the number each replica's summed loss is divided by comes from.
# Lesson 05 showed that the strategy sums the replicas' gradients, so a replica's own mean is
# not it; and nothing tells your function the step's size. `mirrored.per_example_loss(labels, logits)` gives the per-example cross-entropies.
# Not allowed: the library's answer `mirrored.per_replica_loss`, and `tf.nn.compute_average_loss`
# / `tf.nn.scale_regularization_loss` — this part asks for the decision they hide.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# The strategy adds the N replicas' gradients. For that sum to be the gradient of one mean over
# the step, what must every replica divide its summed loss by? Which replica knows that number —
# when one holds 3 samples and another 2, or in an epoch's last step? And when `tf.function`
# traces the loop once for every step of the epoch, what does the trace know about the size of
# a batch? The penalty: if every replica adds it, how many times does the sum hold its gradient?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# No replica holds the step's count, but each holds a piece of it: the size of its own slice, a
# value it can compute while the step runs. Lesson 05 §4 showed how replicas combine values
# while the step is still running; a number computed in Python (a static shape, a variable of
# the notebook) is fixed when the step is traced. The penalty does not split like the samples:
# it is one term, and each replica holds a copy with the same gradient — the parts of it the
# replicas add must add up to one penalty.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# This replica's sample count as a tensor read from `labels`; that count combined over the
# replicas by the replica context that `strategy.run` sets up
# (`tf.distribute.get_replica_context()`); the summed per-example losses divided by the result,
# cast to their dtype. With a penalty, add this replica's part of it: the penalty over the
# number of replicas in sync, which the same context holds.
#
# </details>

# %%
def per_replica_loss(labels, logits, penalty=None):
    losses = mirrored.per_example_loss(labels, logits)
    ### BEGIN SOLUTION: the number this replica differentiates
    replica = tf.distribute.get_replica_context()
    n_step = replica.all_reduce(tf.distribute.ReduceOp.SUM, tf.shape(labels)[0])
    loss = tf.reduce_sum(losses) / tf.cast(n_step, losses.dtype)
    if penalty is not None:
        loss += penalty / replica.num_replicas_in_sync
    return loss
    ### END SOLUTION


lab05.check_per_replica_loss(per_replica_loss, strategy)

# %% [markdown]
# ## 2. Model and optimizer under the strategy
#
# **Contract.** `make_model_and_optimizer(strategy, lr, start=None)` returns
# `(model, optimizer)`: the lesson's CNN, `mirrored.build_keras_cnn()`, and plain
# `keras.optimizers.SGD` with learning rate `lr` (no momentum or other option: the checks
# compare with plain SGD on one device), built so that every variable of either is mirrored by
# the `strategy` passed in — one copy per replica, kept equal by that strategy. The check calls
# it with more than one learning rate, and with a strategy of one replica more than the
# notebook's `strategy`.
#
# With `start` — a model of the same CNN that already exists, built on one device outside any
# strategy and trained there for a while (say, restored from a checkpoint) — the mirrored
# model must begin where `start` is: every replica holds `start`'s current weights.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Lesson 05 §2 made two `tf.Variable`s that looked the same and printed different types. What
# decided which one became a `MirroredVariable`? Which of the model and the optimizer create
# variables? And `start`'s variables: when were they created, and can anything make them
# mirrored now?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# A variable is mirrored when it is *created* while the strategy is the current one. The
# model creates its weights when it is built; the optimizer creates its step counter and its
# learning rate already in its constructor (`keras/src/optimizers/base_optimizer.py`,
# `BaseOptimizer.__init__`), and any per-weight state when it is built — so both objects must
# be constructed there, not only built: an optimizer constructed outside the scope and built
# inside it keeps an unmirrored step counter. `start`'s variables were created elsewhere
# and stay what they are: what can move from `start` to a mirrored model is values, not
# variables — and a copy of its architecture starts from its initialisers, not from where
# `start` is now.
#
# </details>

# %%
def make_model_and_optimizer(strategy, lr, start=None):
    ### BEGIN SOLUTION: a mirrored model (from start's weights, if given) and a mirrored SGD
    with strategy.scope():
        model = mirrored.build_keras_cnn()
        optimizer = keras.optimizers.SGD(learning_rate=lr)
    if start is not None:
        model.set_weights(start.get_weights())
    ### END SOLUTION
    return model, optimizer


model, optimizer = lab05.check_model_and_optimizer(make_model_and_optimizer, strategy, lr)

# %% [markdown]
# ## 3. One step, and what it reports
#
# **Contract.** `distributed_train_step(strategy, model, optimizer, dist_batch)` takes one step
# of SGD on the step's samples `dist_batch` (already split over the replicas: any step of an
# epoch, the short last one too) and returns `(loss, accuracy)`: two scalar tensors on the
# host, one number each. **What must hold:** they are what one device would report for this
# step's samples, computed from the same logits, before the update — their mean loss and their
# accuracy — on any step the strategy can hand it. Like part 1's function, it is told no batch
# size. Inside it, `step_fn` runs once per replica on the replica's slice; the gradient part is
# given, with your part 1. The check compares it with one device on steps of its own choosing.
#
# **A decision:** what each replica's `step_fn` returns for the accuracy, and how the replicas'
# values — the loss as well as the accuracy — become one number each.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# `strategy.run` gives back one value per replica. What is each replica's loss a piece of — a
# mean over its own samples, or a share of the mean over the whole step? And its accuracy? To
# get the step's value, should the pieces be added or averaged — and does your answer still
# hold when one replica holds 6 samples and another 2, or when the epoch's last step holds a
# single sample for all the replicas? Which number does one device divide by, and who knows it
# inside this function?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# The loss from part 1 is already divided by the step's count: the shares add up to the mean.
# An accuracy computed as a mean over the replica's own slice is a mean of means — equal to the
# step's accuracy only when every slice has the same size, and 0/0 on a replica that holds
# nothing; a count of correct predictions adds up without that condition, and is divided once
# at the end — by the step's count, which, as in part 1, only the running step knows. The
# strategy has one call that combines a per-replica value with a chosen operation into one
# value on the host.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# In `step_fn`: this replica's accuracy statistic from `logits` and `y` (argmax, compare, cast,
# then reduce), and what the division at the end needs from this replica; `return` them with
# the loss. After `strategy.run`: one reduction per returned value, each with the
# `tf.distribute.ReduceOp` that fits what it is, and `axis=None`; then the one division.
#
# </details>

# %%
def distributed_train_step(strategy, model, optimizer, dist_batch):
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = per_replica_loss(y, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        ### BEGIN SOLUTION: what this replica returns: the step's exact loss and accuracy follow from it
        hits = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.float32))
        count = tf.cast(tf.shape(y)[0], tf.float32)
        return loss, hits, count
        ### END SOLUTION

    ### BEGIN SOLUTION: run step_fn on every replica; the step's loss and accuracy, one number each
    loss, hits, count = strategy.run(step_fn, args=dist_batch)
    loss = strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)
    accuracy = (strategy.reduce(tf.distribute.ReduceOp.SUM, hits, axis=None)
                / strategy.reduce(tf.distribute.ReduceOp.SUM, count, axis=None))
    ### END SOLUTION
    return loss, accuracy


lab05.check_train_step(distributed_train_step, make_model_and_optimizer, strategy,
                       global_batch=global_batch, lr=lr)

# %% [markdown]
# ## 4. Measure: an epoch's last step
#
# Your prediction (part 0) meets the measurement: the cell runs the epoch's last step on every
# replica (no update) and prints what happened on each.

# %%
from dpcourse import data

ds = data.load("shapes10", n_train=lab05.epoch_size(global_batch), n_test=10, seed=0)
epoch = mirrored.make_dataset(ds.x_train, ds.y_train, global_batch, drop_remainder=False)
measured = lab05.last_step(strategy, strategy.experimental_distribute_dataset(epoch), model,
                           global_batch)
lab05.check_last_step_prediction(guess, measured)

# %% [markdown]
# With the pieces checked, run a few full steps on the course's data set: the loss printed is
# each step's mean, as one device would print it.

# %%
train = mirrored.make_dataset(ds.x_train, ds.y_train, global_batch, shuffle=True, seed=0)
step = tf.function(distributed_train_step)
losses = []
for batch in strategy.experimental_distribute_dataset(train.take(6)):
    loss, acc = step(strategy, model, optimizer, batch)
    losses.append(float(loss))
print("steps run:", len(losses))
assert all(np.isfinite(losses)) and all(0 < l < 5 for l in losses)

# %% [markdown]
# ## Stretch A (optional): your own input pipeline (one per worker)
#
# A workshop can stop here. `experimental_distribute_dataset` split global batches for you. With
# `strategy.distribute_datasets_from_function(dataset_fn)` you write the input pipeline
# yourself: TensorFlow calls `dataset_fn(input_context)` once per input pipeline (one per worker
# machine; here there is one) and does not re-split what your dataset yields: each element it
# yields is one replica's input for one step. `input_context` (a `tf.distribute.InputContext`)
# describes the pipelines and the replicas — of every worker, not only this one.
#
# **Contract.** `make_dist_dataset(strategy, x, y, global_batch)` returns such a distributed
# dataset over the arrays `x`, `y` in which every step holds the next `global_batch` samples in
# the data's order (on one worker; over a cluster, below, the order is free), every sample
# arrives once, and nothing is dropped. The check uses 100
# samples in global batches of 32 on 2 replicas, and tries your function on one replica more
# (36 samples a step on 3) — and with a global batch the replicas do not divide. Then it calls
# your dataset function itself as a cluster of 2 such workers would: two input pipelines (ids
# 0 and 1), twice the replicas in sync. Over the cluster, every sample must still arrive once
# per epoch, in steps of `global_batch`; which samples go to which pipeline is yours to choose —
# cut sample by sample or batch by batch, both keep that, and the check accepts both.
#
# **Your design decision:** what `make_dist_dataset` does with a global batch that does not
# split evenly over the replicas (33 on 2, 37 on 3) — on a cluster, over all its replicas: there
# `strategy.num_replicas_in_sync` counts every worker's replicas, as the input context's does
# (TF 2.21, `distribute/collective_all_reduce_strategy.py`). Refuse it, or adapt to it (a
# pipeline's consecutive elements go to its replicas in turn, and nothing makes them all the
# same size): both are defensible. What must hold either way: every full step holds the
# `global_batch` samples the training loop was told (only the epoch's last step may be short,
# with what is left), and an argument you refuse is refused by `make_dist_dataset` itself (an
# error TensorFlow raises for you from deep inside does not count), with an error that
# names both numbers that did not fit: the global batch and the replica count. The check accepts
# each choice that keeps this, and names by its cause each that does not.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# If every replica takes one batch from the pipeline per step, how large must the pipeline's
# batches be for a step to hold `global_batch` samples? And into how many pieces should the data
# be cut — one per replica, or one per pipeline?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# The pipeline batches by the per-replica size, global batch / replicas. Cutting the data is per
# pipeline: with one pipeline it keeps everything, and the replicas still see different samples
# because they take different batches. Lesson 05 §3 printed the fields that name the pipelines;
# for the rest: `tf.distribute.InputContext` (TF 2.21, `distribute/distribute_lib.py`) holds
# `num_input_pipelines`, `input_pipeline_id`, `num_replicas_in_sync` and
# `get_per_replica_batch_size(global_batch)`; `tf.data.Dataset.shard(num_shards, index)` keeps
# every `num_shards`-th element, starting at `index`.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# An inner `dataset_fn(ctx)`: a dataset from the tensor slices of `(x, y)`, sharded by the
# context's pipeline count and pipeline id, batched by `ctx.get_per_replica_batch_size` of the
# global batch. Return the strategy's distributed dataset made from that function.
#
# </details>

# %%
def make_dist_dataset(strategy, x, y, global_batch):
    ### BEGIN SOLUTION: a distributed dataset built from your own per-pipeline function
    n = strategy.num_replicas_in_sync
    if global_batch % n:
        raise ValueError(f"a global batch of {global_batch} does not split over {n} replicas: "
                         f"no per-replica batch size gives steps of {global_batch}")

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(ctx.get_per_replica_batch_size(global_batch))

    return strategy.distribute_datasets_from_function(dataset_fn)
    ### END SOLUTION


lab05.check_dataset_fn(make_dist_dataset, strategy)

# %% [markdown]
# **Predict again:** on 2 replicas, 100 samples in global batches of 32 leave 4 samples for the
# last step. With *your* `make_dist_dataset`, how many of those 4 does replica 0 hold? (On
# another replica count the cell measures the check's batch, `lab05.stretch_global`.)

# %%
### BEGIN SOLUTION: my_pipeline_guess = your prediction (a number of samples)
my_pipeline_guess = 4
### END SOLUTION
guess = predict("lab05", "samples on replica 0 in the last step (your own pipeline)",
                my_pipeline_guess, unit="samples")

# %%
x_s, y_s = lab05.stretch_data()
gb_s = lab05.stretch_global(strategy.num_replicas_in_sync)   # 32 on 2 replicas
lab05.check_pipeline_prediction(
    guess, lab05.last_step_sizes(strategy, make_dist_dataset(strategy, x_s, y_s, gb_s)))

# %% [markdown]
# ## Stretch B (optional): an epoch with a padded last step
#
# Part 1's loop traced once for an epoch whose last step is short. Another way to end an epoch
# keeps every step the same size — what a TPU's compiler, or one trace with static shapes,
# wants: the last batch is **padded** up to the full global batch with dummy samples (zero
# features, label 0), and every sample carries a weight `w`: 1 for a real sample, 0 for
# padding. The data set's elements are `(x, y, w)`, distributed by
# `strategy.experimental_distribute_dataset`.
#
# **Contract.** `train_epoch(strategy, model, optimizer, dist_dataset)` runs one SGD step per
# step of `dist_dataset` and is given no batch size. **What must hold:** after the epoch the
# weights are where one device leaves them after the same data without its padding (to a
# relative 1e-4), run as written and wrapped in `tf.function` — every step moves them as one
# device's step on that step's real samples alone would. A step may also hold no real sample
# at all (a loop that must run a fixed number of steps, as every worker of a cluster runs as
# many as the others, pads whole steps): such a step must leave the weights where they are, and
# finite. The check runs the stretch's 100 samples padded to whole global batches (32 on 2
# replicas, 36 on 3), then a step of padding alone.
#
# **Your decision:** what a replica's loss is made of when some of its samples are not samples,
# and how a step with none keeps the weights where they are.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# On 2 replicas the last step holds 4 real samples and 28 padding samples. What does part 1's
# function divide that step's summed loss by, and what is in the sum? What should the step's
# mean be over — and which number does each replica hold a piece of?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# The weights say which samples count: a weighted sum leaves the padding out of the sum, and
# the mean over the real samples divides it by the sum of the weights over the whole step —
# which, like part 1's count, no replica holds alone (on 2 replicas one of them holds only
# padding in the last step). A step of padding alone has a weighted sum of 0 and a real count of
# 0: what must its loss, and its gradient, be?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# The per-example losses of `model(x, training=True)`; their sum weighted by `w`; divided by the
# sum of `w` combined over the replicas by the replica context, as part 1 combined the counts —
# with a division that gives 0, not 0/0, when that sum is 0.
#
# </details>

# %%
def train_epoch(strategy, model, optimizer, dist_dataset):
    def step_fn(x, y, w):
        with tf.GradientTape() as tape:
            ### BEGIN SOLUTION: loss, what this replica differentiates
            losses = mirrored.per_example_loss(y, model(x, training=True))
            replica = tf.distribute.get_replica_context()
            n_real = replica.all_reduce(tf.distribute.ReduceOp.SUM, tf.reduce_sum(w))
            loss = tf.math.divide_no_nan(tf.reduce_sum(losses * w), n_real)
            ### END SOLUTION
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for batch in dist_dataset:
        strategy.run(step_fn, args=batch)


lab05.check_padded_epoch(train_epoch, strategy)
