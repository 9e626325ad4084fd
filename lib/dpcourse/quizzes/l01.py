"""Lesson 01's check-yourself questions (``lessons/01_single_device.py``, its last code cell
shows them with ``viz.quiz(quizzes.questions("01"))``): in ``viz.quiz``'s form."""

QUESTIONS = [
    {"q": "You run the forward pass and loss.backward() twice on the same batch, dropout "
          "off, without zero_grad between them. The gradient is:",
     "options": ["the same as after one pass", "zero", "twice as large"],
     "answer": 2,
     "why": ["backward adds into .grad; it does not overwrite it.",
             "Nothing subtracts the first gradient.",
             "Right: .grad accumulates, and with dropout off both passes compute the same "
             "gradient (with it on, each pass drops other units). Accumulating is also how "
             "gradient accumulation works."]},
    {"q": "A one-process training script spends 70% of each step waiting for data. What "
          "helps most?",
     "options": ["A second GPU, driven by the same process (nn.DataParallel)",
                 "More DataLoader workers, or a vectorised pipeline",
                 "A larger learning rate, so that fewer steps are needed"],
     "answer": 1,
     "why": ["Both GPUs would wait for the one process's slow pipeline (DDP, lesson 03, gives "
             "each GPU a process and a loader of its own).",
             "Right: the bottleneck is the input pipeline, so speed that up.",
             "The learning rate changes how far each step goes, not how long it takes."]},
    {"q": "Under torch.autocast you compute the loss after leaving the `with` block, from "
          "bfloat16 logits. Its dtype is:",
     "options": ["bfloat16, like the logits", "float32, as autocast's list asks",
                 "float64, to keep the sum exact"],
     "answer": 0,
     "why": ["Right: outside the block the op runs in its inputs' dtype — this lesson checked "
             "it.",
             "Only inside the block does autocast keep the loss in float32.",
             "Nothing here produces float64."]},
    {"q": "Two runs with the same seed on the same machine give bit-identical weights. On a "
          "different GPU model, the same seed gives:",
     "options": ["bit-identical weights: the seed fixes every draw",
                 "an error: the seed's state belongs to the other GPU",
                 "weights that may differ, more with every step"],
     "answer": 2,
     "why": ["Different hardware sums in different orders; bit-identity is not promised.",
             "Seeds work everywhere; only the results differ.",
             "Right: floating-point addition is not associative and kernels differ; each step "
             "feeds the next, so small differences grow."]},
]
