"""The interactive parts of dpcourse.viz, driven headless (ipywidgets needs no frontend): the
ring stepper (lesson 06), the slider explorers (lessons 02 and 06-09) and the check-yourself
quiz (every lesson). Each test moves a control and checks what the page would show; the
fallbacks are checked with ipywidgets made unimportable.

Widgets are found by type (and description), never by their position in a box, so a
re-arranged layout does not break a test that is about behaviour."""

import builtins

import numpy as np
import pytest

widgets = pytest.importorskip("ipywidgets")

from dpcourse import ring, viz  # noqa: E402

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def find(box, kind, **attrs):
    """Every widget of type ``kind`` inside ``box`` (breadth first) whose attributes equal
    ``attrs``; ``dom_class="x"`` matches a widget carrying that CSS class."""
    found, todo = [], [box]
    while todo:
        w = todo.pop(0)
        if isinstance(w, kind) and all(
                name in w._dom_classes if key == "dom_class" else getattr(w, key) == name
                for key, name in attrs.items()):
            found.append(w)
        todo.extend(getattr(w, "children", ()))
    return found


def one(box, kind, **attrs):
    (w,) = find(box, kind, **attrs)
    return w


@pytest.fixture
def page(monkeypatch):
    """What ``IPython.display.display`` is handed, in order: ("widget", text/plain) for a
    widget view, ("png", bytes) for an image, ("markdown", text) for a caption or text."""
    from IPython import display as ipd

    shown = []

    def fake_display(*objs, raw=False, **_kwargs):
        for obj in objs:
            if raw and WIDGET_VIEW in obj:
                shown.append(("widget", obj.get("text/plain")))
            elif isinstance(obj, ipd.Image):
                shown.append(("png", obj.data))
            elif isinstance(obj, ipd.Markdown):
                shown.append(("markdown", obj.data))
            elif isinstance(obj, widgets.Widget):
                shown.append(("widget", repr(obj)))
            else:
                shown.append(("other", obj))

    monkeypatch.setattr(ipd, "display", fake_display)
    return shown


@pytest.fixture
def no_ipywidgets(monkeypatch):
    """``import ipywidgets`` raises ImportError, as on a machine without it."""
    real_import = builtins.__import__

    def guarded(name, *args, **kwargs):
        if name == "ipywidgets" or name.startswith("ipywidgets."):
            raise ImportError("no ipywidgets here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guarded)


def _trace():
    return ring.simulate_ring([np.arange(6.0) + r for r in range(3)])


# --- the ring stepper (lesson 06) ----------------------------------------------------------


def test_stepper_next_button_moves_the_figure_and_stops_at_the_end():
    trace = _trace()
    frames = viz.ring_frames(trace)
    box = viz.ring_stepper(trace, static=False)
    assert "dpcourse-stepper" in box._dom_classes
    button = one(box, widgets.Button, description="next")
    counter = one(box, widgets.Label, dom_class="dpcourse-step-counter")
    slider = one(box, widgets.IntSlider)
    image = one(box, widgets.Image)
    n = len(frames)
    assert slider.max == n - 1
    assert counter.value == f"start (0 / {n - 1})" and image.value == frames[0]
    button.click()
    assert slider.value == 1 and counter.value == f"step 1 / {n - 1}"
    assert image.value == frames[1]  # the figure of the step the counter names
    for _ in range(n + 2):  # clicking past the end stays on the last step
        button.click()
    assert slider.value == n - 1 and counter.value == f"step {n - 1} / {n - 1}"
    assert image.value == frames[-1]


def test_stepper_label_describes_the_step_shown():
    trace = _trace()
    box = viz.ring_stepper(trace, static=False)
    slider = one(box, widgets.IntSlider)
    labels = [w for w in find(box, widgets.Label) if "dpcourse-step-counter" not in w._dom_classes]
    slider.value = 3
    assert [w.value for w in labels] == [trace.describe(3)]


def test_stepper_shows_a_placeholder_line_then_every_state(page):
    trace = _trace()
    viz.ring_stepper(trace, caption="all states")
    kinds = [k for k, _ in page]
    assert kinds == ["widget", "png", "markdown"]
    # a one-line stand-in, not the widget's repr (which would hold every frame's bytes)
    assert page[0][1].startswith(f"[interactive stepper over {len(trace.steps)} ring states")
    assert page[1][1].startswith(b"\x89PNG")
    assert page[1][1] == viz.figure_to_png(viz.ring_steps_figure(trace))
    assert page[2][1] == "*Figure — all states*"


def test_stepper_without_ipywidgets_draws_every_state(page, no_ipywidgets):
    trace = _trace()
    assert viz.ring_stepper(trace, caption="all states") is None
    assert [k for k, _ in page] == ["png", "markdown"]
    assert page[0][1] == viz.figure_to_png(viz.ring_steps_figure(trace))


# --- the explorers -------------------------------------------------------------------------


def _cost_controls():
    return {"n_max": widgets.IntSlider(value=16, min=4, max=128, description="n_max"),
            "nbytes": widgets.FloatLogSlider(value=1e8, base=10, min=3, max=10,
                                             description="nbytes"),
            "alpha": widgets.FloatLogSlider(value=1e-5, base=10, min=-7, max=-1,
                                            description="alpha"),
            "beta": widgets.FloatLogSlider(value=1e-9, base=10, min=-13, max=-6,
                                           description="beta")}


def test_cost_explorer_draws_the_figure_for_the_sliders_values():
    box = viz.explorer(viz.cost_vs_n_figure, _cost_controls(), caption="test",
                       description="cost-model explorer")
    assert "dpcourse-explorer" in box._dom_classes
    image = one(box, widgets.Image)
    n_max = one(box, widgets.IntSlider, description="n_max")
    nbytes = one(box, widgets.FloatLogSlider, description="nbytes")

    def expected(**changed):
        values = dict(n_max=16, nbytes=1e8, alpha=1e-5, beta=1e-9) | changed
        return viz.figure_to_png(viz.cost_vs_n_figure(**values))

    assert image.value == expected()
    n_max.value += 3  # what three ArrowRight presses do in the browser
    assert image.value == expected(n_max=19)
    nbytes.value = 1e4
    assert image.value == expected(n_max=19, nbytes=1e4)


def test_explorer_records_the_values_its_static_figure_was_drawn_with():
    """Lesson 06 asserts that its explorer's figure shows the α and β it printed (a review
    found a figure and a printed fit of two different builds side by side)."""
    controls = _cost_controls()
    box = viz.explorer(viz.cost_vs_n_figure, controls, caption="test")
    assert box.drawn_with == dict(n_max=16, nbytes=1e8, alpha=1e-5, beta=1e-9)
    alpha = 1.823e-4  # a fitted value off the slider's 0.1 steps in log10 keeps its value
    controls = _cost_controls()
    controls["alpha"].value = alpha
    assert viz.explorer(viz.cost_vs_n_figure, controls, caption="t").drawn_with["alpha"] == alpha


def test_cost_explorer_titles_the_cheapest_of_all_five_at_each_n():
    """Rabenseifner's is in the comparison: at N = 4, 8, 16 it sends the ring's bytes in fewer
    steps, and the title says so (the title used to say 'ring cheapest at every N up to 16')."""
    fig = viz.cost_vs_n_figure(182.3e-6, 1 / 1.13e9, 102.4e6, 16)
    title = fig.axes[0].get_title()
    assert "alpha = 182.3 us, 1/beta = 1.13 GB/s" in title  # as lesson 06 prints its fit
    assert "cheapest: ring at N = 2–3, 5–7, 9–15; rabenseifner at N = 4, 8, 16" in title
    assert len(fig.axes[0].get_lines()) == 5


def test_tuple_controls_become_sliders_that_redraw():
    def draw(n, x):
        fig = viz.new_figure(2, 2)
        fig.add_subplot(1, 1, 1).plot([0, n], [0, x])
        return fig

    box = viz.explorer(draw, {"n": (2, 1, 8), "x": (0.5, 0.0, 1.0, 0.1)}, caption="test")
    n = one(box, widgets.IntSlider, description="n")
    x = one(box, widgets.FloatSlider, description="x")
    assert (n.value, n.min, n.max) == (2, 1, 8)
    assert (x.value, x.min, x.max, x.step) == (0.5, 0.0, 1.0, 0.1)
    image = one(box, widgets.Image)
    n.value = 5
    assert image.value == viz.figure_to_png(draw(5, 0.5))


def test_explorer_shows_a_placeholder_line_then_the_default_figure(page):
    box = viz.explorer(viz.cost_vs_n_figure, _cost_controls(), caption="cost",
                       description="cost-model explorer")
    assert [k for k, _ in page] == ["widget", "png", "markdown"]
    assert page[0][1].startswith("[cost-model explorer: run the notebook live")
    assert page[1][1] == viz.figure_to_png(viz.cost_vs_n_figure(1e-5, 1e-9, 1e8, 16))
    assert page[2][1] == "*Figure — cost*"


def test_explorer_without_ipywidgets_renders_the_default_figure_as_png(page, no_ipywidgets):
    box = viz.explorer(viz.cost_vs_n_figure,
                       {"n_max": (16, 4, 128), "nbytes": (1e8, 1e3, 1e10),
                        "alpha": (1e-5, 1e-7, 1e-1), "beta": (1e-9, 1e-13, 1e-6)},
                       caption="static only")
    assert box is None
    assert [k for k, _ in page] == ["png", "markdown"]
    assert page[0][1] == viz.figure_to_png(viz.cost_vs_n_figure(1e-5, 1e-9, 1e8, 16))
    assert page[1][1] == "*Figure — static only*"


def test_zero_calculator_bars_grow_with_fewer_gpus():
    box = viz.explorer(viz.zero_calculator_figure,
                       {"billions": (7.5, 0.5, 200.0, 0.5), "gpu_gb": (80.0, 8.0, 192.0, 8.0),
                        "n_gpus": (64, 1, 1024)}, caption="test")
    image = one(box, widgets.Image)
    one(box, widgets.IntSlider, description="n gpus").value = 8
    assert image.value == viz.figure_to_png(viz.zero_calculator_figure(7.5, 80.0, 8))


# --- the quiz (every lesson) ---------------------------------------------------------------

QUESTIONS = [{"q": "2 + 2?", "options": ["3", "4"], "answer": 1,
              "why": ["one short", "four it is"]}]


def test_quiz_shows_the_widget_then_the_questions_with_folded_answers(page):
    viz.quiz(QUESTIONS)
    ((kind, _), (text_kind, text)) = page
    assert kind == "widget" and text_kind == "markdown"
    assert "<details>" in text and "**4** — four it is" in text  # answers folded for static readers


def test_quiz_check_button_says_why_the_choice_is_right_or_wrong(monkeypatch):
    from IPython import display as ipd

    boxes = []
    monkeypatch.setattr(ipd, "display",
                        lambda obj, **kw: boxes.append(obj) if isinstance(obj, widgets.Widget)
                        else None)
    viz.quiz(QUESTIONS)
    (box,) = boxes
    radio = one(box, widgets.RadioButtons)
    check = one(box, widgets.Button, description="Check")
    verdict = [w for w in find(box, widgets.HTML) if not w.value.startswith("<b>1.")][0]
    check.click()
    assert "Pick an answer first" in verdict.value
    radio.value = "3"
    check.click()
    assert "not quite" in verdict.value and "one short" in verdict.value
    radio.value = "4"
    check.click()
    assert "right" in verdict.value and "four it is" in verdict.value


def test_quiz_without_ipywidgets_is_text_with_folded_answers(page, no_ipywidgets):
    viz.quiz(QUESTIONS)
    assert [k for k, _ in page] == ["markdown"]


def test_quiz_refuses_an_answer_outside_the_options():
    with pytest.raises(ValueError, match="answer must index options"):
        viz.quiz([{**QUESTIONS[0], "answer": 2}])


# --- the package: every name a lesson uses is exported -------------------------------------


def test_every_viz_name_a_lesson_or_solution_calls_is_in_all():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sources = [*root.glob("lessons/*.py"), *root.glob("solutions/*.py")]
    assert sources
    used = {(name, path.name) for path in sources
            for name in re.findall(r"\bviz\.([A-Za-z_]\w*)", path.read_text())}
    missing = sorted(f"viz.{name} ({where})" for name, where in used if name not in viz.__all__)
    assert not missing, f"used by a lesson or solution but not in viz.__all__: {missing}"


def test_each_figure_module_is_re_exported_whole():
    import importlib
    import inspect
    import pkgutil

    names = {m.name for m in pkgutil.iter_modules(viz.__path__)}
    assert names == {m.__name__.rsplit(".", 1)[1] for m in viz._MODULES}, \
        "a module of dpcourse.viz is missing from viz._MODULES (so from viz.__all__)"
    for module in viz._MODULES:
        public = {n for n, obj in vars(module).items()
                  if not n.startswith("_") and inspect.isfunction(obj)
                  and obj.__module__ == module.__name__}
        assert public == set(module.__all__), f"{module.__name__}.__all__ != its public functions"
        for name in module.__all__:
            assert getattr(viz, name) is getattr(module, name)
            assert getattr(importlib.import_module("dpcourse.viz"), name) is getattr(module, name)
    assert len(viz.__all__) == len(set(viz.__all__)), "a name is defined in two viz modules"


def test_bucket_timelines_figure_draws_one_panel_per_iteration_up_to_the_backward_end():
    one = {"backward_end": 10.0, "grads": [("a", 1.0), ("b", 8.0)],
           "buckets": [(["classifier.4.weight"] * 6, 2048, 8.5, 9.5)]}
    two = {"backward_end": 12.0, "grads": [("a", 1.0), ("b", 8.0)],
           "buckets": [(["classifier.4.weight"], 1024, 1.5, 3.0), (["f.0.w"], 1024, 8.5, 11.0)]}
    fig = viz.bucket_timelines_figure({"it 0": one, "it 2": two})
    assert len(fig.axes) == 2
    assert fig.axes[-1].get_xlim()[1] == pytest.approx(12.0 * 1.02)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert "+3 more" in labels[0] and "c.4.w" in labels[0]
    with pytest.raises(ValueError):
        viz.bucket_timelines_figure({})
