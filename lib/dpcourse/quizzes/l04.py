"""Lesson 04's check-yourself questions (``lessons/04_ddp_in_practice.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("04"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "torchrun restarts your job after rank 1 dies at step 11; the last checkpoint is from "
          "step 8. What must the restarted ranks do to end with the uninterrupted run's weights?",
     "options": ["Continue from step 11 with fresh weights",
                 "Load the step-8 checkpoint and redo steps 9-11",
                 "Only rank 1 reloads; rank 0 keeps its weights in memory"],
     "answer": 1,
     "why": ["Fresh weights throw away all the training so far.",
             "Right: with the optimizer state and the data order restored, steps 9-11 are "
             "recomputed exactly.",
             "torchrun restarts ALL ranks: every rank's memory is gone."]},
    {"q": "Why does rank 0 alone save the checkpoint, to a temporary file and then os.replace?",
     "options": ["Other ranks hold different weights",
                 "All ranks hold the same weights; one writer avoids a race, and the rename means "
                 "a reader never sees half a file",
                 "torch.save only works on rank 0"],
     "answer": 1,
     "why": ["Under DDP every rank holds the same weights.",
             "Right: this lesson showed a plain save being read half-written.",
             "torch.save works anywhere; the problem is several writers and partial files."]},
    {"q": "With per_rank_batch 32, 4 ranks and accum 2, how many samples does one optimizer step "
          "see?",
     "options": ["32", "128", "256"],
     "answer": 2,
     "why": ["That is one rank's micro-batch.",
             "That is one micro-batch over all ranks; accumulation doubles it.",
             "Right: 32 × 4 × 2."]},
    {"q": "What does SyncBatchNorm send per BatchNorm layer in a training step?",
     "options": ["Nothing: it only changes the maths",
                 "An all_gather of each rank's mean, invstd and count in the forward, and an "
                 "all_reduce of two per-channel sums in the backward when its input needs a "
                 "gradient",
                 "The whole activation tensor to rank 0"],
     "answer": 1,
     "why": ["It must combine statistics across ranks, so it communicates.",
             "Right: 2C + 1 numbers per rank gathered forward, 2C summed backward (none on "
             "the raw input or after frozen layers).",
             "Only per-channel statistics travel, never activations."]},
    {"q": "Your 4 ranks each compute the accuracy of their DistributedSampler shard of a 1001-image "
          "test set and you print the mean of the 4 accuracies. What is wrong?",
     "options": ["Nothing: the shards are equal, so the mean of the accuracies is the accuracy",
                 "The shards were padded to 251 images each: 3 images are counted twice",
                 "Only rank 0's accuracy is printed"],
     "answer": 1,
     "why": ["The shards are equal only because DistributedSampler repeated 3 images to make "
             "them so: the job evaluated 1004 images.",
             "Right: give each rank images r, r + 4, ... (each once), sum right answers and "
             "counts, all_reduce, divide last.",
             "The mean over ranks does include every rank; the duplicates are the problem."]},
    {"q": "A hand-written loop all-reduces gradients with SUM and no division, on 8 ranks with "
          "plain SGD (no weight decay). Which single-rank run does it equal?",
     "options": ["The same lr, on the global batch",
                 "lr × 8, on the global batch",
                 "lr / 8, on one rank's batch"],
     "answer": 1,
     "why": ["Summing makes each step 8 × the averaged gradient (unless clipping cuts it).",
             "Right: for SGD, with or without momentum, a summed gradient at lr is an averaged "
             "one at 8·lr (bit for bit here, 8 being a power of two; up to rounding for other "
             "N). Not with weight decay (the decay is not multiplied), not under gradient "
             "clipping (when the averaged gradient is clipped too, both are cut to max_norm "
             "and the same lr matches; when only the sum is, no lr does), not for Adam.",
             "Each step still uses the gradients of all 8 ranks' batches."]},
]
