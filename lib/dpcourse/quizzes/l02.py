"""Lesson 02's check-yourself questions (``lessons/02_data_parallel.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("02"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "In nn.DataParallel, where do the replicas' gradients end up after backward()?",
     "options": ["On every GPU, each holding the same combined result",
                 "On the original parameters on device 0, carried back through the backward "
                 "of the broadcast that made the copies",
                 "On each replica, which steps its own optimizer"],
     "answer": 1,
     "why": ["No: that is what an all-reduce leaves; here the gradients go one way, onto "
             "device 0 (with NCCL's reduce when available), and only device 0 holds the "
             "result.",
             "Right: broadcast forward, its backward brings every copy's gradient back to "
             "device 0 — autograd does it; how they are combined is lab 02's part 4.",
             "There is one optimizer, on the original parameters; replicas are rebuilt each step."]},
    {"q": "After one nn.DataParallel forward in training mode, where do the module's BatchNorm "
          "running statistics come from?",
     "options": ["From the whole batch", "From device 0's chunk alone",
                 "From the average of every replica's chunk"],
     "answer": 1,
     "why": ["Each replica sees only its chunk; none sees the whole batch.",
             "Right: the folded answer after the lab's pointer measured them bit-identical to "
             "those of a copy that saw chunk 0 alone.",
             "The folded answer after the lab's pointer measured them bit-identical to those of "
             "a copy that saw chunk 0 alone: no average of the chunks."]},
    {"q": "In this lesson's strawman dp, which copies one device at a time (a naive parameter "
          "server; not torch's nn.DataParallel, whose NCCL collectives pipeline the bytes), "
          "with 8 devices and a model of K parameters, how many numbers of weights and "
          "gradients cross device 0's link per step?",
     "options": ["3.5K", "14K", "8K"],
     "answer": 1,
     "why": ["That is what one rank of a ring all-reduce sends plus receives, 4(N−1)K/N at "
             "N = 8, counted the same way: not device 0 of this dp.",
             "Right: 2(N−1)K = 14K — K out to each of 7 copies, K gradients back from each (the "
             "batch's chunks and outputs cross it too, an amount that grows with the batch).",
             "Close, but the weights go out to 7 copies AND 7 gradients come back."]},
    {"q": "On a laptop with no GPU, what does nn.DataParallel(model)(X) do?",
     "options": ["Raises an error", "Splits the batch over CPU threads",
                 "Calls the module on the whole batch, silently"],
     "answer": 2,
     "why": ["It does not complain — which is why this course builds its own.",
             "It has no CPU devices to scatter to.",
             "Right: with no device_ids it just calls model(X)."]},
]
