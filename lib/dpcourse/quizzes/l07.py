"""Lesson 07's check-yourself questions (``lessons/07_inside_ddp.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("07"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "Why does DDP fill its buckets in the order the gradients arrive (roughly reverse "
          "registration order)?",
     "options": ["So the first layers are averaged first",
                 "The backward produces the last layers' gradients first, so the first bucket "
                 "is complete early and can be sent while the backward continues",
                 "NCCL requires it"],
     "answer": 1,
     "why": ["The first layers' gradients are computed last.",
             "Right: that is what lets communication overlap the backward.",
             "NCCL does not know about parameters at all."]},
    {"q": "Your hook launches all_reduce(..., async_op=True) and immediately calls .wait() on "
          "the handle. What happens?",
     "options": ["The gradients are wrong", "The gradients are right but nothing overlaps: "
                 "the backward stops at every bucket until it has crossed the wire",
                 "It deadlocks"],
     "answer": 1,
     "why": ["Every rank still sums the same buffers.",
             "Right: lab07's check detects it from when each wait happened.",
             "Every rank waits at the same bucket, which every rank has launched."]},
    {"q": "Buckets 0 and 1 exist; on this step bucket 1 is complete first. What does DDP's "
          "reducer do?",
     "options": ["Launches bucket 1 at once, then bucket 0",
                 "Waits: it launches bucket 0 as soon as it is complete, then bucket 1 right "
                 "after, so every rank's i-th all-reduce is the same bucket",
                 "Merges the two buckets into one all-reduce"],
     "answer": 1,
     "why": ["Then a rank whose backward ran in another order would pair a different bucket "
             "with this one: that is what next_bucket_ prevents.",
             "Right: buckets are launched strictly in bucket order.",
             "Buckets are fixed once assigned (or rebuilt after the first step)."]},
    {"q": "The backward takes 10 ms (the hooks' work in it included) and the all-reduces of "
          "all buckets 40 ms. About how much can overlap save at best?",
     "options": ["40 ms", "30 ms: everything but the last bucket's all-reduce",
                 "Up to 10 ms: only what fits under the backward, and never the last "
                 "bucket's all-reduce"],
     "answer": 2,
     "why": ["Communication cannot hide under compute that is not there.",
             "The last bucket cannot hide, right, but neither can more than the backward's "
             "10 ms of the rest: there is no more compute to hide it under.",
             "Right: the saving is at most min(B, C − C_last) = min(10, 40 − C_last)."]},
    {"q": "What goes wrong if finish_gradient_synchronization() returns without waiting?",
     "options": ["Nothing, gloo is synchronous", "optimizer.step() may read gradients the "
                 "all-reduce has not finished writing: a race, different on every run",
                 "The next forward deadlocks"],
     "answer": 1,
     "why": ["async_op=True returns before the all-reduce is done, on gloo too.",
             "Right: the copy back must come after the wait.",
             "The forward does no communication here."]},
    {"q": "The fp16 hook sends half the bytes. What does PowerSGD with approximation rank 1 "
          "send for a 1024 × 1024 weight gradient?",
     "options": ["512 × 1024 numbers", "1024 + 1024 numbers (P and Q)", "1 number"],
     "answer": 1,
     "why": ["That would be a 2x compression; PowerSGD's is far larger.",
             "Right: (n + m) r numbers, 512x fewer than the 1024² of the gradient.",
             "Approximation rank 1 keeps one column in P and one in Q, not a single number."]},
]
