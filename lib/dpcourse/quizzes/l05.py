"""Lesson 05's check-yourself questions (``lessons/05_mirrored_strategy.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("05"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "On the CPU profile (or the one-GPU profile), in a fresh kernel, you create a "
          "tf.Variable and only then call devices.split_tf_devices(2). What happens?",
     "options": ["The split applies from now on", "A clear error: restart the kernel and split first",
                 "TF silently ignores it"],
     "answer": 1,
     "why": ["TF fixes its devices on first use; they cannot change afterwards.",
             "Right: the split must be the first thing a TF program does. (No error where none is "
             "needed: with 2 or more real GPUs the helper splits nothing and returns /gpu:0 and "
             "/gpu:1; after an earlier split into 2 or more devices it returns the first 2.)",
             "The course's helper refuses it with a message rather than ignoring it."]},
    {"q": "Each of 4 replicas computes tf.reduce_mean of its per-example losses. With "
          "MirroredStrategy and plain SGD, the step is:",
     "options": ["right", "4 times too big", "4 times too small"],
     "answer": 1,
     "why": ["It would be right under DDP, which averages; TF sums.",
             "Right: the strategy SUMS the replicas' gradients of per-replica means, so the "
             "gradient is 4 times too big, and so is SGD's step (Adam's would barely change: it "
             "divides by the gradient's own running size).",
             "That is compute_average_loss combined with averaging the gradients."]},
    {"q": "Which batch size do you give a tf.data pipeline that you pass to "
          "strategy.experimental_distribute_dataset?",
     "options": ["the per-replica batch", "the global batch", "either; TF rescales it"],
     "answer": 1,
     "why": ["That is DDP's convention (per_rank_batch), and what a pipeline for "
             "distribute_datasets_from_function batches by — not this function's.",
             "Right: the strategy splits each global batch over the replicas (fit does the "
             "same); a distribute_datasets_from_function pipeline batches per replica instead.",
             "TF does not guess: for this function the number you give is the global batch."]},
    {"q": "What is the main structural difference between MirroredStrategy and DDP?",
     "options": ["MirroredStrategy does not all-reduce gradients",
                 "One process drives all replicas in MirroredStrategy; DDP runs a process per device",
                 "DDP cannot use more than one GPU per machine"],
     "answer": 1,
     "why": ["It does: apply_gradients sums them across replicas.",
             "Right: this lesson's figure and side-by-side table show it.",
             "DDP runs one process per GPU, as many GPUs as you have."]},
]
