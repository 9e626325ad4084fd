"""Widgets with a static fallback: the one helper every interactive part of the course goes
through (:func:`widget_with_fallback`), the slider explorer built on it (lessons 02, 06-09),
and the check-yourself quiz at the end of every lesson.

A widget only works in a live kernel; GitHub, the rendered website and nbval see what the
cell stored. So every widget is followed by a static version that every reader sees (the
figure for the starting values, every state of a stepper, the questions with folded answers),
and no widget ever writes into an ipywidgets ``Output`` (its stored stream breaks nbval):
figures are swapped as PNG bytes in an ``ipywidgets.Image``. Without ipywidgets installed,
only the static version is shown.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .common import figure_to_png, show

__all__ = ["widget_with_fallback", "explorer", "quiz"]

_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def widget_with_fallback(build: Callable, static: Callable[[], None],
                         placeholder: str | None = None):
    """Display the widget ``build(ipywidgets)`` returns, then call ``static()`` to display what
    a reader without a live kernel sees instead. Returns the widget, or None when ipywidgets is
    missing or ``build`` returns None (then only ``static()`` runs).

    ``placeholder`` is the widget's plain-text form in the stored notebook: one line saying
    what a live kernel would show (the widget's own repr can be long — a stepper's would hold
    every frame's bytes — and nbval compares it). None keeps ipywidgets' repr.
    """
    try:
        import ipywidgets
        from IPython.display import display
    except ImportError:
        ipywidgets = None
    box = None if ipywidgets is None else build(ipywidgets)
    if box is not None:
        if placeholder is None:
            display(box)
        else:
            view = (box._repr_mimebundle_() or {}).get(_WIDGET_VIEW)
            if view is not None:
                display({_WIDGET_VIEW: view, "text/plain": placeholder}, raw=True)
    static()
    return box


# --------------------------------------------------------------------------------------------
# Sliders that redraw a library figure
# --------------------------------------------------------------------------------------------


def explorer(draw, controls: dict, caption: str, description: str = "interactive explorer",
             folded: str | None = None):
    """Sliders that redraw ``draw(**values)`` (a function returning a matplotlib figure), then
    the static figure for the starting values, for readers without a kernel. Returns the widget
    (None without ipywidgets: then only the static figure is shown); its ``drawn_with`` holds
    the values the static figure was drawn with (as the sliders hold them), so a lesson can
    assert that its figure shows the numbers it printed.

    ``controls`` maps each keyword of ``draw`` to an ipywidgets control (a slider), or to a
    tuple ``(value, min, max)`` / ``(value, min, max, step)``, made an IntSlider when all are
    ints, a FloatSlider otherwise. The figure always comes from the library's own drawing
    functions: the widget only chooses their arguments. ``folded="▶ label"`` folds the static
    figure and its caption as :func:`show` does (the widget itself cannot be folded).

    Shown in lesson 06, §3.
    """
    start = {name: spec[0] if isinstance(spec, tuple) else spec.value
             for name, spec in controls.items()}

    def build(widgets):
        sliders = {name: _make_control(widgets, name, spec) for name, spec in controls.items()}
        start.update((name, w.value) for name, w in sliders.items())  # as the sliders hold them

        def render() -> bytes:
            return figure_to_png(draw(**{name: w.value for name, w in sliders.items()}))

        image = widgets.Image(value=render(), format="png")

        def redraw(_change):
            image.value = render()

        for w in sliders.values():
            w.observe(redraw, names="value")
        box = widgets.VBox([*sliders.values(), image])
        box.add_class("dpcourse-explorer")  # what the browser tests look for
        return box

    box = widget_with_fallback(
        build, lambda: show(draw(**start), caption, folded=folded),
        placeholder=f"[{description}: run the notebook live to use the sliders; the figure for "
                    f"the default values is below]")
    if box is not None:
        box.drawn_with = dict(start)
    return box


def _make_control(widgets, name, spec):
    """A control from a ready widget or a ``(value, min, max[, step])`` tuple."""
    if not isinstance(spec, tuple):
        return spec
    kind = widgets.IntSlider if all(isinstance(v, int) for v in spec) else widgets.FloatSlider
    keys = ("value", "min", "max", "step")
    # continuous_update=False: redraw once the handle is let go, not for every pixel dragged.
    return kind(description=name.replace("_", " "), continuous_update=False,
                style={"description_width": "initial"}, **dict(zip(keys, spec)))


# --------------------------------------------------------------------------------------------
# Check-yourself questions
# --------------------------------------------------------------------------------------------


def quiz(questions: Sequence[dict], interactive: bool = True) -> None:
    """The check-yourself questions at the end of a lesson.

    ``questions`` is a list of dicts: ``q`` (the question), ``options`` (a list of answers),
    ``answer`` (the index of the right one), ``why`` (a list, one sentence per option saying why
    it is right or wrong). In a live kernel each question is a set of radio buttons with a
    *Check* button that says why the chosen answer is right or wrong. Below them, for readers
    without a kernel, the questions as text with their answers folded in a ``<details>`` block.
    """
    for i, item in enumerate(questions):
        opts, why = list(item["options"]), list(item["why"])
        if not 0 <= item["answer"] < len(opts) or len(why) != len(opts):
            raise ValueError(f"question {i + 1}: answer must index options, one 'why' per option")

    def build(widgets):
        if not interactive:
            return None
        boxes = []
        for i, item in enumerate(questions):
            radio = widgets.RadioButtons(options=list(item["options"]), value=None,
                                         layout=widgets.Layout(width="auto"))
            verdict = widgets.HTML("")
            button = widgets.Button(description="Check", layout=widgets.Layout(width="90px"))

            def on_click(_, radio=radio, verdict=verdict, item=item):
                if radio.value is None:
                    verdict.value = "<i>Pick an answer first.</i>"
                    return
                k = list(item["options"]).index(radio.value)
                mark = "✔ right" if k == item["answer"] else "✘ not quite"
                verdict.value = f"<b>{mark}</b>: {item['why'][k]}"

            button.on_click(on_click)
            boxes.append(widgets.VBox([widgets.HTML(f"<b>{i + 1}. {item['q']}</b>"), radio,
                                       widgets.HBox([button, verdict])]))
        return widgets.VBox(boxes)

    def static():
        from IPython.display import Markdown, display

        # The questions and options in plain sight, the answers folded away.
        lines = []
        for i, item in enumerate(questions):
            lines.append(f"{i + 1}. {item['q']}")
            lines.extend(f"   - {opt}" for opt in item["options"])
        lines += ["", "<details><summary><b>Answers</b></summary>", ""]
        for i, item in enumerate(questions):
            right = item["options"][item["answer"]]
            lines.append(f"{i + 1}. **{right}** — {item['why'][item['answer']]}")
        lines += ["", "</details>"]
        display(Markdown("\n".join(lines)))

    # No placeholder: the stored notebooks keep ipywidgets' own one-line repr of the questions.
    widget_with_fallback(build, static)
