"""Lesson 03's check-yourself questions (``lessons/03_ddp_first_principles.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("03"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "A model with no dropout and no training-mode BatchNorm: you move from one GPU with "
          "batches of 16 to 4 ranks, each with a shard of 16 samples "
          "and its loss the mean over its shard, every rank ending each backward with the average "
          "of the 4 ranks' gradients. One step of the 4 ranks, with plain SGD at lr 0.1, is...",
     "options": ["one process's step on the 64 samples together, at lr 0.1",
                 "four one-process steps of 16 samples each, at lr 0.1",
                 "one process's step on 16 samples, at lr 0.4"],
     "answer": 0,
     "why": ["Right: the average of four equal shards' mean-loss gradients is the gradient of the "
             "mean loss over the 64 samples, so an epoch takes a quarter of the steps, each on a "
             "batch 4 times bigger (keeping the learning rate is a choice: lesson 04, section 6) "
             "— and every rank applies the same update.",
             "Four steps would each start from weights the previous one updated; here all four "
             "shards' gradients come from the same weights and make one update.",
             "The averaged gradient is the global batch's, with nothing scaled by 4: the same "
             "lr, 4 times the samples."]},
    {"q": "Why does the first backward under DDP with its default flags all-reduce one bucket "
          "holding every gradient?",
     "options": ["It will rebuild the buckets from the order it observes in this backward; "
                 "until then it plays safe and reduces everything once, after the whole "
                 "backward",
                 "The first bucket is capped at 1 MiB and the model is small",
                 "gloo cannot all-reduce several buckets at once"],
     "answer": 0,
     "why": ["Right: the initial size limit is sys.maxsize; the rebuild happens before the "
             "next forward run with gradients enabled. (With find_unused_parameters=True and no static_graph the reducer "
             "never rebuilds, so DDP buckets by size from the start.)",
             "This lesson's model was seven times the cap and still went in one bucket.",
             "From the second iteration on, gloo all-reduced several buckets."]},
    {"q": "After 10 steps, are DDP's weights bit-for-bit equal to one process on the global "
          "batch?",
     "options": ["Yes, always", "No, but they agree to 1e-5; and across the ranks they ARE "
                 "bit-for-bit equal", "No, they drift apart by design"],
     "answer": 1,
     "why": ["Summing in two halves rounds differently from summing in one go.",
             "Right: every rank applies the very same all-reduced numbers.",
             "They agree to 1e-5 here; nothing drifts on purpose."]},
    {"q": "Every rank forgets sampler.set_epoch(epoch). What happens?",
     "options": ["Ranks read overlapping data", "The program hangs at the second epoch",
                 "Every epoch uses the same shuffled order"],
     "answer": 2,
     "why": ["Not when all forget: every rank stays at epoch 0, so they agree and the shards "
             "stay disjoint. Overlap comes from ranks on different epochs.",
             "Nothing is communicated by the sampler, so nothing can hang.",
             "Right: the shuffle is seeded with seed + epoch, and the epoch stays 0."]},
    {"q": "You train a model with BatchNorm under DDP with its defaults on 4 ranks and save rank "
          "0's state_dict. Its running statistics are...",
     "options": ["averaged over the 4 ranks by DDP's all-reduce",
                 "those of the last rank to finish its forward",
                 "rank 0's own, from rank 0's shards; the other ranks copied them before their "
                 "training forwards"],
     "answer": 2,
     "why": ["Buffers get no gradient, so the all-reduce never touches them.",
             "The broadcast comes from rank 0, in every case this lesson shows.",
             "Right: forward_sync_buffers broadcasts from rank 0, so rank 0's are never "
             "overwritten (outside lesson 04's Join, where the source is the highest-numbered "
             "rank not yet joined). SyncBatchNorm (lesson 04) gives whole-batch statistics."]},
]
