"""The check-yourself questions that end every lesson, one module per lesson (``l00`` … ``l11``).

Why here and not in the lesson's last cell: a viewer that ignores a cell's fold (GitHub's static
view, classic Notebook) shows a folded cell's code, and a quiz's code holds its answers. The
lesson's cell is one call, ``viz.quiz(quizzes.questions("05"))``; its stored output shows the
questions, with the answers folded in a ``<details>`` block (``viz.quiz``).

Each module holds ``QUESTIONS``, a list in ``viz.quiz``'s form: ``q`` (the question),
``options``, ``answer`` (the right option's index) and ``why`` (one sentence per option).
Authors write the right answer wherever it reads best; :func:`questions` hands the lesson each
question's options in a fixed order drawn from the lesson and the question's number, so that
the right answer's place carries no pattern (written down, 34 of 59 sat second).
"""

from __future__ import annotations

import functools
import importlib
import random
import re


def questions(lesson: str) -> list[dict]:
    """Lesson ``lesson``'s questions: ``"05"``, or a name that starts with the number
    (``"05_mirrored_strategy"``)."""
    m = re.match(r"(\d\d)(?:_|$)", str(lesson))
    if not m:
        raise ValueError(f"quizzes.questions({lesson!r}): name a lesson by its two digits, "
                         f"e.g. '05'")
    try:
        module = importlib.import_module(f"{__name__}.l{m.group(1)}")
    except ModuleNotFoundError:
        raise ValueError(f"quizzes.questions({lesson!r}): lesson {m.group(1)} has no "
                         f"quiz") from None
    return _shuffled(m.group(1), module)


@functools.cache
def _shuffled(number: str, module) -> list[dict]:
    """``module.QUESTIONS`` with each question's options (and their ``why``) permuted, the same
    way on every run and machine (a ``random.Random`` seeded with the lesson and question
    number; a string seed is hashed with SHA-512, not Python's salted ``hash``)."""
    out = []
    for i, item in enumerate(module.QUESTIONS):
        order = list(range(len(item["options"])))
        random.Random(f"quiz {number}:{i}").shuffle(order)
        out.append({**item, "options": [item["options"][k] for k in order],
                    "why": [item["why"][k] for k in order], "answer": order.index(item["answer"])})
    return out
