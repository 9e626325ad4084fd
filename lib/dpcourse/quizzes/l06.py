"""Lesson 06's check-yourself questions (``lessons/06_ring_allreduce.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("06"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "How many bytes does each worker send in a ring all-reduce of K bytes over N workers?",
     "options": ["K", "2(N−1)K/N", "2(N−1)K"],
     "answer": 1,
     "why": ["Exact only at N = 2; as N grows the count approaches 2K: N−1 chunks of K/N, twice.",
             "Right: N−1 chunks in the reduce-scatter and N−1 in the all-gather, each K/N.",
             "That is what device 0 moves in DataParallel (lesson 02), not a ring worker."]},
    {"q": "Going from 8 to 1024 workers, with every link of the ring at the same speed, what "
          "happens to the ring's bandwidth term?",
     "options": ["It grows 128 times", "It barely changes: 2(N−1)/N tends to 2",
                 "It shrinks to zero"],
     "answer": 1,
     "why": ["That is a single, unsharded parameter server's link.",
             "Right: the latency term 2(N−1)α grows instead. But the condition matters: 1024 "
             "GPUs span many servers, and a ring's step waits for its slowest link. With one "
             "50 GB/s NIC per server (against 450 GB/s NVLink) β is the network's and the "
             "term is about ten times the one-server NVLink one; with a NIC per GPU, NCCL's "
             "parallel rings share the server's 400 GB/s and it is about 1.3 times.",
             "Every worker still sends almost 2K bytes."]},
    {"q": "Every rank calls a blocking dist.send to its right neighbour, then dist.recv from its "
          "left. What happens?",
     "options": ["It works on any transport: a blocking send returns once its message is "
                 "buffered, before the receiver posts its recv",
                 "With gloo it hangs even on tiny tensors; over an MPI library that sends small "
                 "messages eagerly it works on tiny ones and hangs on big ones",
                 "It works on tiny tensors and hangs on big ones, whatever the transport: small "
                 "messages are always buffered"],
     "answer": 1,
     "why": ["Only if every send were buffered; with gloo none is: lab 06 part 4 hangs on 12 "
             "elements.",
             "Right (lab 06 part 4 shows gloo hang on 12 elements); correct code must not rely on a "
             "send being buffered: lab 06 has you decide how.",
             "Only a transport that buffers small messages (an MPI library's eager sends) works "
             "on tiny tensors; gloo hangs on 12 elements too: lab 06 part 4 runs it."]},
    {"q": "Your fitted α is 50 µs and 1/β is 2 GB/s. For 1 KB messages, what dominates a ring "
          "all-reduce over 8 ranks?",
     "options": ["the latency term 2(N−1)α", "the bandwidth term", "neither: they are equal"],
     "answer": 0,
     "why": ["Right: 14 × 50 µs = 0.7 ms, against about 1 µs of transfer.",
             "1.75 KB at 2 GB/s is under a microsecond.",
             "They differ by almost three orders of magnitude."]},
]
