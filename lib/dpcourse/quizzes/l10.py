"""Lesson 10's check-yourself questions (``lessons/10_bug_zoo.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("10"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "A 2-rank job hangs. Rank 0's stack shows it inside `dist.all_reduce`; rank 1 has "
          "returned from its training function. Which bug is the most likely?",
     "options": ["A NaN in rank 1's gradients",
                 "A collective that rank 1 never calls (a rank-0-only branch, or rank 1 left "
                 "the loop earlier)",
                 "A forgotten set_epoch"],
     "answer": 1,
     "why": ["A NaN does not block a collective: it travels through it.",
             "Right: rank 0 waits for a partner that will never come. (Rank 1's process is "
             "still running: had it exited, gloo would have failed rank 0 within seconds with "
             "'Connection closed by peer'.)",
             "That changes the data order, not which collectives run."]},
    {"q": "Every rank logs exactly the same loss, yet the weight checksums differ across "
          "ranks after step 1. What happened?",
     "options": ["The loss was all-reduced and backpropagated; the gradients were never "
                 "averaged",
                 "The sampler gave the ranks overlapping samples",
                 "The collective order differs"],
     "answer": 0,
     "why": ["Right: a rank's weights enter the averaged loss only through its own term, so "
             "each rank steps its own gradient / N.",
             "Overlapping samples change what is learned, not whether the replicas agree.",
             "That would hang or fail, not run on quietly."]},
    {"q": "All ranks' losses are NaN. How do you find where it started?",
     "options": ["Look at rank 0's weights",
                 "Record each rank's local loss or gradient norm *before* the all-reduce and "
                 "find the first non-finite one",
                 "Set NCCL_DEBUG=INFO"],
     "answer": 1,
     "why": ["After the all-reduce every rank is NaN alike.",
             "Right: that names the rank and the step (and then the batch).",
             "NCCL_DEBUG shows the transport, not the values."]},
    {"q": "On NCCL (default settings), after DDP's constructor has run on both ranks, rank 1 "
          "never joins one of rank 0's all_reduce calls. Where does rank 0's program stop?",
     "options": ["Inside dist.all_reduce, which raises at the timeout",
                 "Nowhere in particular: all_reduce returned at once; Python runs on until it "
                 "needs the result, and at the timeout the watchdog aborts the whole process",
                 "It never stops: NCCL has no timeout"],
     "answer": 1,
     "why": ["That is gloo's behaviour (and NCCL's with TORCH_NCCL_BLOCKING_WAIT=1, or a "
             "timeout given to work.wait).",
             "Right: the communicator exists (DDP's constructor broadcast formed it), so NCCL "
             "only queues the work; the watchdog thread tears the process down. (Had this been "
             "the group's first NCCL collective, rank 0 would block inside the call, forming "
             "the communicator.)",
             "A plain NCCL group's default timeout is 10 minutes (a mixed "
             "\"cpu:gloo,cuda:nccl\" group gets 30); the watchdog enforces it."]},
    {"q": "Which of these does TORCH_DISTRIBUTED_DEBUG=DETAIL catch?",
     "options": ["Ranks calling different collectives, or with different shapes, or a rank "
                 "that never calls one",
                 "Replicas with different initial weights",
                 "Two ranks writing the same file"],
     "answer": 0,
     "why": ["Right: before each collective it runs a monitored barrier and compares the "
             "call's fingerprint across the ranks — on every call, so it costs time.",
             "The collectives match; only the values differ: a checksum finds it.",
             "File writes are not collectives."]},
]
