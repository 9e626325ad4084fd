"""Lesson 11's check-yourself questions (``lessons/11_beyond_data_parallel.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("11"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "ZeRO-3 on 4096 GPUs holds 0.7 GB of GPT-3's model state per GPU. Why can it still "
          "not train it at batch 1 without recomputation?",
     "options": ["Its all-gathers put the whole model on every GPU at once before the forward: "
                 "175 billion bf16 weights, 350 GB",
                 "Each GPU runs whole layers on a whole sequence: 275 GB of activations (82 GB "
                 "with flash attention), which no number of ranks divides",
                 "ZeRO-3 shards the weights and gradients, but Adam's momentum and variance, "
                 "1.4 TB, stay whole on every GPU"],
     "answer": 1,
     "why": ["Only one or two layers' weights at a time (its working set).",
             "Right: activations belong to the micro-batch, not the model; 82 GB is over the "
             "85.9 GB once ZeRO-3's working set is added.",
             "It shards them too: ZeRO-3 shards all 16 bytes."]},
    {"q": "A tensor-parallel MLP's micro-batch doubles from 1 to 2 sequences. What happens to "
          "the bytes its tensor-parallel collectives carry, and to the bytes DDP all-reduces for "
          "the same MLP?",
     "options": ["Both double",
                 "Tensor parallelism's double; DDP's stay the same",
                 "DDP's double; tensor parallelism's stay the same"],
     "answer": 1,
     "why": ["DDP all-reduces gradients, whose size is the model's.",
             "Right: tensor parallelism sums activations (tokens × d), DDP gradients (Ψ).",
             "It is the other way round."]},
    {"q": "In the tensor-parallel MLP, what does the GeLU between the two layers need from "
          "the other ranks?",
     "options": ["Nothing: it acts on each feature alone, so the block is all it needs",
                 "All of their hidden features: they are all-gathered before it",
                 "Their partial sums: it is linear, so it commutes with the sum"],
     "answer": 0,
     "why": ["Right: an element-wise function of a block is the block of the function.",
             "Nothing is gathered between the two layers.",
             "GeLU is not linear; that is why it must come before the sum, not after."]},
    {"q": "A GPipe pipeline of 8 stages. How many micro-batches keep the bubble — the idle "
          "share of the step, (K−1)/(M+K−1), as section 3 measures it — under 10 %?",
     "options": ["8", "32", "64"],
     "answer": 2,
     "why": ["7/15 ≈ 47 %.", "7/39 ≈ 18 %.",
             "Right: 7/71 ≈ 9.9 %. By Narayanan et al.'s bubble fraction, (p−1)/m, idle time "
             "over compute time (the planner's idle_over_work column), 64 give 7/64 ≈ 10.9 %: "
             "under 10 % takes 71 there."]},
    {"q": "Why does Megatron-LM keep tensor parallelism inside a node?",
     "options": ["It needs more memory per GPU than pipeline parallelism, and only GPUs in one "
                 "node can pool their memory",
                 "Its collectives come in every layer, mostly on the critical path, so they "
                 "need the node's fast links (NVLink)",
                 "A DTensor's device mesh cannot span nodes: its ranks must be the GPUs of "
                 "one host"],
     "answer": 1,
     "why": ["It saves memory: each rank holds a slice of every layer's weights.",
             "Right: four all-reduces per layer per micro-batch.",
             "It can: a mesh is any set of ranks; across nodes it is just slow."]},
    {"q": "Data parallelism on 32 ranks of 16 examples, B_noise ≈ 60. Doubling to 64 ranks "
          "cuts the steps by about…",
     "options": ["2×", "1.06×", "0.5×"],
     "answer": 1,
     "why": ["Only far below B_noise.",
             "Right, with the learning rate tuned at each batch size: "
             "(1 + 60/512)/(1 + 60/1024) ≈ 1.06.",
             "More ranks never need more steps in this model."]},
]
