"""Lesson 09's check-yourself questions (``lessons/09_beyond_lockstep.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("09"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "A synchronous parameter server and a ring all-reduce train the same weights. Why "
          "does this lesson's server (one, unsharded) not scale where the ring does?",
     "options": ["It sends more bytes in total, over the whole cluster",
                 "It synchronises every step, and the ring does not",
                 "It is a hot spot: NK per step through one node, a ring rank 2(N−1)K/N"],
     "answer": 2,
     "why": ["In total the two are about equal (2(N−1)K against 2NK elements sent).",
             "Both are lockstep: every step waits for every gradient.",
             "Right: each ring rank's bytes, 2(N−1)K/N, stay under 2K as N grows, so the "
             "bandwidth part of a step stays bounded, while the server's grows with N: NK out, "
             "then NK in, 2NKβ in lesson 06's α-β model, N²/(N−1) times a ring rank's "
             "2(N−1)K/N·β (key by key, in and out overlap: towards N²/(2(N−1))). "
             "(The ring's latency part is not bounded: 2(N−1) steps in a row, lesson 06.) "
             "A server sharded over all N workers has no hot spot (Li et al. 2014): the ring's "
             "2(N−1)K/N per rank, given full bisection bandwidth; BytePS's extra servers cut "
             "a worker's to K. So all-reduce's spread had other reasons too: no ratio of "
             "servers to workers to tune, and collective libraries (NCCL) that fit the ring to "
             "the topology (Horovod, Sergeev & Del Balso 2018)."]},
    {"q": "In the straggler race, asynchronous, what did the fast worker still wait for?",
     "options": ["Its round trips: push, step, new weights",
                 "The straggler, as in synchronous mode",
                 "Nothing: an asynchronous worker never waits"],
     "answer": 0,
     "why": ["Right: from each push to the server's answer, which can include queueing "
             "behind other pushes and time a process was not running on the shared cores "
             "(long waits, if any). How those waits spread (median, mean, the long ones' share) "
             "is printed in §1; the run records when it waited, not why.",
             "Asynchronous, the server answers each worker alone, without the straggler.",
             "The race's timeline (§1) shows grey gaps between its computations."]},
    {"q": "In the simulator, what does τ = 0 reduce to?",
     "options": ["Hogwild!, lock-free updates", "Local SGD with H = 1",
                 "Plain SGD, bit for bit"],
     "answer": 2,
     "why": ["Hogwild! is lock-free and stale by nature.",
             "That has the same update, but it is a different program.",
             "Right: each gradient is pushed right after it is computed."]},
    {"q": "Stale gradients made runs end above their starting loss. What fixes it?",
     "options": ["A larger learning rate, to catch up",
                 "A smaller step, e.g. lr divided by the staleness",
                 "More workers, to average the staleness out"],
     "answer": 1,
     "why": ["The opposite: those runs failed from large steps on stale information.",
             "Right: counted over seeds, the delay a step tolerates shrank as the step grew; "
             "with a constant τ this lesson's simulator cannot tell the staleness-aware step "
             "from a smaller fixed step.",
             "More workers make the gradients staler."]},
    {"q": "Local SGD with H = 8 compared with DDP:",
     "options": ["8× fewer bytes sent, with drift between the averages",
                 "8× fewer bytes sent, and exactly DDP's weights",
                 "The same bytes as DDP, only sent 8 steps later"],
     "answer": 0,
     "why": ["Right: one average every 8 steps, where DDP all-reduces every step; what the "
             "drift costs depends on the data (IID or not) and the step. Counted in messages "
             "the gap is smaller here: this lesson's loop all-reduces each of the model's 4 "
             "tensors on its own, while DDP packs this 52 KB model into one bucket (its first "
             "bucket holds up to 1 MiB): 2× fewer all-reduces, not 8×. Torch's "
             "PeriodicModelAverager flattens the parameters into one all-reduce.",
             "Only H = 1 with SGD (momentum and weight decay included) computes DDP's update "
             "(here equal to 1e-6: averaging weights and averaging gradients round "
             "differently); with Adam not even H = 1 does.",
             "It averages once every 8 steps: 8× less."]},
    {"q": "The global batch grows 8× and the lr stays. What did this lesson's run show?",
     "options": ["Divergence: a larger batch needs a smaller lr",
                 "Less progress per epoch; lr × 8 won most back",
                 "The same progress per epoch as the small batch"],
     "answer": 1,
     "why": ["The opposite: the larger batch's averaged gradient is less noisy, so it can take a "
             "larger step safely.",
             "Right: 8× fewer steps per epoch; lr × 8, the linear scaling rule, closed most of "
             "the gap (the claim computes how much); warmup did not help on this problem (the "
             "lesson computes what it cost, epoch by epoch).",
             "With 8× fewer steps per epoch at the same lr, it barely learned."]},
]
