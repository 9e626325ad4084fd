"""The interactive widgets of dpcourse.viz, driven headless (ipywidgets needs no frontend):
the ring stepper's "next" button (lesson 06) and the slider explorers (lessons 06 and after)."""

import builtins

import numpy as np
import pytest

widgets = pytest.importorskip("ipywidgets")

from dpcourse import ring, viz  # noqa: E402


def _images(box):
    """Every ipywidgets Image inside ``box``."""
    found, todo = [], [box]
    while todo:
        w = todo.pop()
        if isinstance(w, widgets.Image):
            found.append(w)
        todo.extend(getattr(w, "children", ()))
    return found


def _find(box, kind):
    found, todo = [], [box]
    while todo:
        w = todo.pop(0)
        if isinstance(w, kind):
            found.append(w)
        todo.extend(getattr(w, "children", ()))
    return found


def test_stepper_next_button_advances_and_stops_at_the_end():
    trace = ring.simulate_ring([np.arange(6.0) + r for r in range(3)])
    box = viz.ring_stepper(trace, static=False)
    assert "dpcourse-stepper" in box._dom_classes
    (button,) = [b for b in _find(box, widgets.Button) if b.description == "next"]
    (counter,) = [w for w in _find(box, widgets.Label) if "dpcourse-step-counter" in w._dom_classes]
    (slider,) = _find(box, widgets.IntSlider)
    (image,) = _images(box)
    n = slider.max + 1
    assert counter.value == f"step 1 / {n}"
    before = image.value
    button.click()
    assert slider.value == 1 and counter.value == f"step 2 / {n}"
    assert image.value != before
    for _ in range(n + 2):  # clicking past the end stays on the last step
        button.click()
    assert slider.value == n - 1 and counter.value == f"step {n} / {n}"


def _cost_explorer():
    return viz.explorer(
        viz.cost_vs_n_figure,
        {"n_max": widgets.IntSlider(value=16, min=4, max=128),
         "nbytes": widgets.FloatLogSlider(value=1e8, base=10, min=3, max=10),
         "alpha": widgets.FloatLogSlider(value=1e-5, base=10, min=-7, max=-1),
         "beta": widgets.FloatLogSlider(value=1e-9, base=10, min=-13, max=-6)},
        caption="test", description="cost-model explorer")


def test_cost_explorer_redraws_when_a_slider_moves():
    box = _cost_explorer()
    assert "dpcourse-explorer" in box._dom_classes
    (image,) = _images(box)
    first_slider = box.children[0]
    before = image.value
    first_slider.value += 3  # what three ArrowRight presses do in the browser
    assert image.value != before
    before = image.value
    box.children[1].value = 1e4
    assert image.value != before


def test_tuple_controls_become_sliders():
    def draw(n, x):
        fig = viz.new_figure(2, 2)
        fig.add_subplot(1, 1, 1).plot([0, n], [0, x])
        return fig

    box = viz.explorer(draw, {"n": (2, 1, 8), "x": (0.5, 0.0, 1.0, 0.1)}, caption="test")
    assert isinstance(box.children[0], widgets.IntSlider)
    assert isinstance(box.children[1], widgets.FloatSlider)
    (image,) = _images(box)
    before = image.value
    box.children[0].value = 5
    assert image.value != before


def test_without_ipywidgets_only_the_static_figure(monkeypatch):
    shown = []
    monkeypatch.setattr(viz, "show", lambda fig, caption=None: shown.append(caption))
    real_import = builtins.__import__

    def no_ipywidgets(name, *args, **kwargs):
        if name == "ipywidgets" or name.startswith("ipywidgets."):
            raise ImportError("no ipywidgets here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ipywidgets)
    box = viz.explorer(viz.cost_vs_n_figure,
                       {"n_max": (16, 4, 128), "nbytes": (1e8, 1e3, 1e10),
                        "alpha": (1e-5, 1e-7, 1e-1), "beta": (1e-9, 1e-13, 1e-6)},
                       caption="static only")
    assert box is None
    assert shown == ["static only"]


def test_zero_calculator_redraws():
    box = viz.explorer(viz.zero_calculator_figure,
                       {"billions": (7.5, 0.5, 200.0, 0.5), "gpu_gb": (80.0, 8.0, 192.0, 8.0),
                        "n_gpus": (64, 1, 1024)}, caption="test")
    (image,) = _images(box)
    before = image.value
    box.children[2].value = 8  # fewer GPUs: every sharded bar grows
    assert image.value != before
