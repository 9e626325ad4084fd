"""Lesson 00's check-yourself questions (``lessons/00_start_here.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("00"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "Your machine has one GPU. Which backend do the multi-rank cells that follow the "
          "profile (lesson 03's core comparison, lesson 04's torchrun scripts) use?",
     "options": ["gloo", "nccl, with both ranks on the GPU", "nccl on the GPU for rank 0, gloo for rank 1"],
     "answer": 0,
     "why": ["Right: with fewer GPUs than ranks the profile falls back to gloo, which runs anywhere.",
             "By default NCCL refuses two ranks on one GPU (the installed NCCL says \"Multiple "
             "Ranks are using the same GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1 …\"); "
             "the course does not lift that default, so each NCCL rank owns its device.",
             "Every rank of a group passes the same backend string to init_process_group, and "
             "here there is one GPU for two ranks. (One group may use one backend per device type, e.g. "
             "\"cpu:gloo,cuda:nccl\"; that is not what this option says.)"]},
    {"q": "A lab check stops with a LabCheckError. What should you read?",
     "options": ["The whole traceback, from the bottom up",
                 "Nothing: re-run the cell until it passes",
                 "The one-sentence message: it names the mistake"],
     "answer": 2,
     "why": ["The traceback is mostly the check's own machinery; the message is written for you.",
             "The checks are deterministic: the same code gives the same verdict.",
             "Right: each check recognises the usual mistakes and says which one you made."]},
    {"q": "Why can `dpcourse.launch.spawn` run a function you defined in a notebook cell, when "
          "`torch.multiprocessing.spawn` (which starts fresh interpreters) cannot?",
     "options": ["It runs the function in threads, not processes",
                 "It sends the function's code itself (cloudpickle) instead of its import path",
                 "It copies the whole notebook into each process"],
     "answer": 1,
     "why": ["The ranks are real processes, as on a cluster.",
             "Right: plain pickle stores a function by name, and a cell's `__main__` cannot be "
             "imported by a fresh process; cloudpickle ships the code by value. (Forked "
             "processes, torch's start_processes(..., start_method='fork'), inherit the cell's "
             "functions instead, but fork is unsafe once CUDA or threads are running.)",
             "Only the function (and what it refers to) travels."]},
]
