"""Lesson 08's check-yourself questions (``lessons/08_sharded_data_parallel.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("08"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "With mixed-precision Adam, which part of a parameter's 16 bytes is largest?",
     "options": ["The weights the model computes with: every rank needs all of them, whole, "
                 "in its forward and its backward",
                 "The gradients: every rank holds its micro-batch's full gradient from the "
                 "backward until the all-reduce",
                 "The optimizer state: the fp32 master weights, Adam's momentum and its variance"],
     "answer": 2,
     "why": ["2 bytes (bf16), however many ranks need them whole.",
             "2 bytes (bf16), however long they are held.",
             "Right: 12 of the 16 bytes, which is why ZeRO shards it first."]},
    {"q": "Gradients and weights in the same dtype: why does ZeRO-1 send no more than DDP?",
     "options": ["It sends each rank only its slice's gradients, 1/N of them, where DDP sends "
                 "every gradient to every rank",
                 "DDP's all-reduce is a reduce-scatter plus an all-gather; ZeRO-1 does the same "
                 "two halves, with the step in between",
                 "It skips the all-gather: each rank steps its own slice, so the other slices' "
                 "weights never travel"],
     "answer": 1,
     "why": ["A ring all-reduce does not send every gradient everywhere either: its first half "
             "is that same reduce-scatter.",
             "Right: the same volume, for less memory.",
             "Without the all-gather the ranks' weights would drift apart: every forward needs "
             "every weight."]},
    {"q": "Everything in bf16: why does ZeRO-3 send 1.5× DDP's bytes?",
     "options": ["It all-gathers each layer's weights twice — for the forward and again for "
                 "the backward — and reduce-scatters the gradients: three halves",
                 "It all-reduces each layer's gradients in the backward, like DDP, and "
                 "all-gathers the layer's weights once, before its forward",
                 "Each layer's shard is padded to a multiple of N, and the padding of every "
                 "layer adds up to half of DDP's volume"],
     "answer": 0,
     "why": ["Right: 3Ψ against DDP's 2Ψ.",
             "There is no all-reduce in ZeRO-3: a rank keeps only its gradient shard, so the "
             "reduce-scatter is enough — and the backward needs the weights gathered again.",
             "Padding adds well under 1 % here."]},
    {"q": "Your ZeRO-2 reduce-scatters every gradient in step(), after the backward. What "
          "did it save?",
     "options": ["Memory from step() to the next zero_grad() only, not the peak: after the "
                 "backward every full gradient exists at once",
                 "The peak: the gradients are sharded, so no rank holds more than its 1/N slice "
                 "of them at any moment",
                 "Traffic: its reduce-scatter sends half of what DDP's all-reduce sends, so the "
                 "step sends half the bytes"],
     "answer": 0,
     "why": ["Right, as in ZeRO-1 — and nothing at all if zero_grad() follows step() at once, "
             "since it drops ZeRO-1's gradients too. The peak falls only when buckets are "
             "reduce-scattered and dropped during the backward (lab 08).",
             "They are sharded only once the reduce-scatter has run; before it every rank holds "
             "all of them.",
             "The all-gather after the step sends the other half: the same traffic as DDP."]},
    {"q": "FSDP2 with param_dtype=bf16 and reduce_dtype=fp32: what collective volume does a "
          "step have per parameter (section 5's convention, the root aside)?",
     "options": ["6 bytes: three 2-byte collectives, as in the ZeRO paper (fp16)",
                 "8 bytes: two bf16 all-gathers and an fp32 reduce-scatter",
                 "12 bytes: everything in fp32"],
     "answer": 1,
     "why": ["The reduce-scatter runs in reduce_dtype, fp32: 4 bytes, not 2.",
             "Right: 2 + 2 + 4, what section 6 measured; on a ring a rank sends (N − 1)/N of "
             "it, 4 bytes at N = 2.",
             "The all-gathers run in param_dtype, bf16."]},
    {"q": "A 13-B model, 8 \"40-GB\" A100s (40 GiB = 42.9 GB each): DDP does not fit. What does?",
     "options": ["ZeRO-1", "ZeRO-2", "ZeRO-3"],
     "answer": 2,
     "why": ["4 + 12/8 = 5.5 bytes per parameter: 71.5 GB before any activation.",
             "2 + 14/8 = 3.75 bytes per parameter: 48.75 GB before any activation.",
             "Right: 16/8 = 2 bytes per parameter, 26 GB, which leaves room for activations."]},
]
