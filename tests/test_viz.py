"""The interactive parts of dpcourse.viz, driven headless (ipywidgets needs no frontend): the
ring stepper (lesson 06), the slider explorers (lessons 02 and 06-09) and the check-yourself
quiz (every lesson). Each test moves a control and checks what the page would show; the
fallbacks are checked with ipywidgets made unimportable.

Widgets are found by type (and description), never by their position in a box, so a
re-arranged layout does not break a test that is about behaviour."""

import builtins
import importlib

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


@pytest.mark.parametrize("nn", [f"{k:02d}" for k in range(12)])
def test_every_lessons_quiz_is_well_formed(nn):
    from dpcourse import quizzes

    qs = quizzes.questions(nn)
    assert qs is quizzes.questions(f"{nn}_any_name")
    for i, item in enumerate(qs):
        assert set(item) == {"q", "options", "answer", "why"}, (nn, i)
        assert 0 <= item["answer"] < len(item["options"]) == len(item["why"]) >= 2, (nn, i)
        assert len(set(item["options"])) == len(item["options"]), (nn, i)  # radio values


def test_a_quizs_options_are_shuffled_with_their_why_and_the_answer_kept():
    """questions() permutes the written options, the same way every time; each option keeps its
    'why', the answer index still names the written right option, and across all lessons no
    position holds more than half of the right answers (written down, 34 of 59 sat second)."""
    from collections import Counter

    from dpcourse import quizzes

    places = Counter()
    for nn in [f"{k:02d}" for k in range(12)]:
        written = importlib.import_module(f"dpcourse.quizzes.l{nn}").QUESTIONS
        shown = quizzes.questions(nn)
        assert len(shown) == len(written)
        for w, s in zip(written, shown):
            assert sorted(zip(s["options"], s["why"])) == sorted(zip(w["options"], w["why"]))
            assert s["options"][s["answer"]] == w["options"][w["answer"]]
            places[s["answer"]] += 1
    assert max(places.values()) <= sum(places.values()) / 2, places


def test_quizzes_name_a_lesson_by_its_number():
    from dpcourse import quizzes

    with pytest.raises(ValueError, match="by its two digits"):
        quizzes.questions("mirrored")
    with pytest.raises(ValueError, match="lesson 99 has no quiz"):
        quizzes.questions("99")


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
    assert labels[0] == "bucket 0"      # the index only: contents and sizes are lab 07
    assert not any("c.4.w" in label or "classifier" in label for label in labels)
    with pytest.raises(ValueError):
        viz.bucket_timelines_figure({})


# --- lesson 02: one DataParallel step on a clock, recorded -----------------------------------


def _dp_step(n_devices=3, batch=7):
    import torch
    from torch import nn

    from dpcourse import dp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    X, y = torch.randn(batch, 4), torch.randint(0, 3, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    devs = dp.devices_for(n_devices, kind="cpu")
    return model, X, y, devs, opt


def test_record_dp_step_records_each_piece_where_it_ran_and_steps_like_the_plain_model():
    import copy

    import torch
    import torch.nn.functional as F

    model, X, y, devs, opt = _dp_step()
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    F.cross_entropy(plain(X), y).backward()
    plain_opt.step()

    step = viz.record_dp_step(model, X, y, devs, opt)
    assert step["chunk_sizes"] == [3, 3, 1]
    spans = step["spans"]
    solo = [s for s in spans if s[1] not in ("forward", "backward")]
    # device 0 alone does every piece but the forward and the backward, once each, in order
    assert [s[1] for s in solo] == [p for p in viz.l02_data_parallel.STEP_PHASES
                                    if p not in ("forward", "backward")]
    assert all(s[0] == 0 for s in solo)
    assert all(a[3] <= b[2] for a, b in zip(solo, solo[1:]))
    for d in range(3):  # every device: one forward, at least one backward span, nothing else
        assert [s[1] for s in spans if s[0] == d and s[1] == "forward"] == ["forward"]
        assert any(s[0] == d and s[1] == "backward" for s in spans)
    assert {s[1] for s in spans if s[0] > 0} == {"forward", "backward"}
    assert all(s[2] <= s[3] for s in spans)
    by = {p: next(s for s in solo if s[1] == p) for p in (s[1] for s in solo)}
    forwards = [s for s in spans if s[1] == "forward"]
    backwards = [s for s in spans if s[1] == "backward"]
    assert all(by["replicate"][3] <= f[2] and f[3] <= by["gather"][2] for f in forwards)
    assert all(by["loss + gather backward"][3] <= b[2] and b[3] <= by["reduce onto device 0"][2]
               for b in backwards)
    # one autograd thread on the CPU: the replicas' backward spans never overlap
    assert not any(a is not b and a[2] < b[3] and b[2] < a[3] for a in backwards
                   for b in backwards)
    assert step["threads"] == {"forward": 3, "backward": 1}
    # it is a real training step: the weights are those of the plain model's step
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    # and it leaves no hook behind on the module: a second step records as well
    assert not any(p._post_accumulate_grad_hooks or p._backward_hooks
                   for p in model.parameters())
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert viz.record_dp_step(model, X, y, devs, opt)["chunk_sizes"] == [3, 3, 1]


def test_record_dp_step_refuses_no_device():
    model, X, y, _, opt = _dp_step()
    with pytest.raises(ValueError, match="at least one device"):
        viz.record_dp_step(model, X, y, [], opt)


def test_dp_timeline_figure_draws_every_span_and_device_0s_solo_pieces():
    step = {"chunk_sizes": [2, 2],
            "spans": [(0, "scatter", 0.0, 1.0), (0, "replicate", 1.0, 4.0),
                      (0, "forward", 4.0, 9.0), (1, "forward", 5.0, 8.0),
                      (0, "gather", 9.0, 9.5), (0, "loss", 9.5, 10.0),
                      (0, "loss + gather backward", 10.0, 10.5), (0, "backward", 10.5, 12.0),
                      (1, "backward", 12.0, 14.0), (0, "reduce onto device 0", 14.0, 15.0),
                      (0, "optimizer step", 15.0, 16.0)],
            "threads": {"forward": 2, "backward": 1}}
    fig = viz.dp_timeline_figure(step)
    lanes, side = fig.axes
    bars = [(round(p.get_x(), 3), round(p.get_width(), 3)) for p in lanes.patches]
    # a grey background per device, then one bar per span at its start (short ones widened)
    assert bars[:2] == [(0.0, 16.0), (0.0, 16.0)]
    assert [x for x, _ in bars[2:]] == [s[2] for s in step["spans"]]
    assert [t.get_text() for t in lanes.get_yticklabels()] == ["device 1", "device 0"]
    solo = [s for s in step["spans"] if s[1] not in ("forward", "backward")]
    assert sorted(round(p.get_width(), 3) for p in side.patches) == \
        sorted(s[3] - s[2] for s in solo)
    assert side.get_title() == "device 0 alone: 7.5 ms"  # 1 + 3 + 0.5 + 0.5 + 0.5 + 1 + 1


# --- lesson 04: torchrun's log, its picture, DistributedSampler's index map ------------------

_AGENT_LOG = """\
I1128 00:19:13.792000 10104 torch/distributed/launcher/api.py:257]   nproc_per_node           : 2
I1128 00:19:13.792000 10104 torch/distributed/launcher/api.py:257]   rdzv_endpoint            : 127.0.0.1:55407
I1128 00:19:13.792000 10104 torch/distributed/launcher/api.py:257]   max_restarts             : 1
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553] [default] Rendezvous complete for workers. Result:
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553]   restart_count={n}
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553]   master_addr=localhost
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553]   master_port=37745
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553]   group_rank=0
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553]   group_world_size=1
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553]   local_ranks=[0, 1]
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553]   role_ranks=[0, 1]
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553]   global_ranks=[0, 1]
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553]   role_world_sizes=[2, 2]
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553]   global_world_sizes=[2, 2]
I1128 00:19:14.390000 10104 torch/distributed/elastic/agent/server/api.py:553]   event_log_handler=null
[rank 0] RANK=0 attempt {n}
"""
_FAILED = """\
E1128 00:19:14.710000 10104 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 10216) of binary: python
I1128 00:19:14.710000 10104 torch/distributed/elastic/agent/server/api.py:942] [default] Worker group FAILED. 1/1 attempts left; will restart worker group
"""
_FINISHED = """\
I1128 00:19:15.261000 10104 torch/distributed/elastic/agent/server/api.py:932] [default] worker group successfully finished. Waiting 300 seconds for other agents to finish.
"""


def test_torchrun_log_reads_the_messages_torch_writes():
    """The parser reads the words of the installed torch's agent: every key it reads is in
    SimpleElasticAgent._rendezvous's log format, the failure and restart messages in its
    sources, so a torch that rewords them fails here and not in a lesson."""
    import inspect

    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.multiprocessing import api as mp_api

    source = inspect.getsource(api)
    assert "Rendezvous complete for workers. Result:" in source
    for key in viz.l04_ddp_in_practice._RDZV_KEYS:
        assert f"  {key}=%({key})s" in source
    assert "attempts left;" in source and "will restart worker group" in source
    assert "worker group successfully finished" in source
    assert "failed (exitcode: %s) local_rank: %s" in inspect.getsource(mp_api)


def test_torchrun_log_turns_an_agents_output_into_its_events():
    events = viz.torchrun_log(_AGENT_LOG.replace("{n}", "0") + _FAILED
                              + _AGENT_LOG.replace("{n}", "1") + _FINISHED)
    assert [e["event"] for e in events] == ["config", "rendezvous", "failed", "restart",
                                            "rendezvous", "finished"]
    assert events[0] == {"event": "config", "rdzv_endpoint": "127.0.0.1:55407",
                         "max_restarts": 1, "nproc_per_node": 2}
    assert events[1] == {"event": "rendezvous", "restart_count": 0, "master_addr": "localhost",
                         "master_port": 37745, "group_rank": 0, "group_world_size": 1,
                         "local_ranks": [0, 1], "global_ranks": [0, 1],
                         "global_world_sizes": [2, 2]}
    assert events[2] == {"event": "failed", "exitcode": -9, "local_rank": 1}
    assert events[3] == {"event": "restart", "attempts_left": 1}
    assert events[4]["restart_count"] == 1
    with pytest.raises(ValueError, match="LOGLEVEL=INFO"):
        viz.torchrun_log("[rank 0] hello\n")
    with pytest.raises(ValueError, match="without"):
        viz.torchrun_log("\n".join(_AGENT_LOG.replace("{n}", "0").splitlines()[:6]))


def test_torchrun_figure_writes_what_each_agent_gave_its_workers():
    node = [_AGENT_LOG.replace("{n}", "0").replace("group_world_size=1", "group_world_size=2")
            .replace("local_ranks=[0, 1]", "local_ranks=[0]")
            .replace("global_world_sizes=[2, 2]", "global_world_sizes=[2]")]
    node.append(node[0].replace("group_rank=0", "group_rank=1")
                .replace("global_ranks=[0, 1]", "global_ranks=[1]"))
    node[0] = node[0].replace("global_ranks=[0, 1]", "global_ranks=[0]")
    agents = [viz.torchrun_log(text) for text in reversed(node)]  # in any order
    restart = viz.torchrun_log(_AGENT_LOG.replace("{n}", "0") + _FAILED
                               + _AGENT_LOG.replace("{n}", "1") + _FINISHED)
    fig = viz.torchrun_figure(agents, restart)
    left, right = fig.axes
    texts = [t.get_text() for t in left.texts]
    assert "node 0: torchrun agent\ngroup_rank 0 of 2" in texts
    assert "worker\nRANK=0\nLOCAL_RANK=0\nWORLD_SIZE=2" in texts
    assert "worker\nRANK=1\nLOCAL_RANK=0\nWORLD_SIZE=2" in texts
    assert any("127.0.0.1:55407" in t for t in texts)
    assert sum("workers' store" in t for t in texts) == 1
    texts = [t.get_text() for t in right.texts]
    assert "RANK=1\nLOCAL_RANK=1\nWORLD_SIZE=2\ndied: exit code -9 (SIGKILL)" in texts
    assert "RANK=0\nLOCAL_RANK=0\nWORLD_SIZE=2\nstopped by the agent" in texts
    assert sum(t.startswith("attempt ") for t in texts) == 2
    assert any("TORCHELASTIC_RESTART_COUNT=1" in t for t in texts)
    assert "the group finished" in texts


def test_torchrun_figure_reads_the_dead_worker_from_the_workers_output():
    """The agent logs one failure, the earliest by a whole-second clock: here rank 0's
    follow-on crash. Given ``killed`` (from the workers' own output), the figure marks rank 1."""
    restart = viz.torchrun_log(_AGENT_LOG.replace("{n}", "0")
                               + _FAILED.replace("exitcode: -9", "exitcode: 1")
                               .replace("local_rank: 1", "local_rank: 0")
                               + _AGENT_LOG.replace("{n}", "1") + _FINISHED)
    fig = viz.torchrun_figure([restart], restart, killed={1: 11})
    texts = [t.get_text() for t in fig.axes[1].texts]
    assert "RANK=1\nLOCAL_RANK=1\nWORLD_SIZE=2\nkilled itself after step 11\n(its own output)" \
        in texts
    assert "RANK=0\nLOCAL_RANK=0\nWORLD_SIZE=2\nended with the group" in texts
    assert any("local_rank 0,\nexit code 1" in t for t in texts)
    assert not any("died" in t for t in texts)


def test_sampler_slots_mark_the_padding_the_real_sampler_appends():
    from torch.utils.data import DistributedSampler

    n, ranks = 10, 4
    dealt = {}
    for epoch in (0, 1):
        samplers = [DistributedSampler(range(n), num_replicas=ranks, rank=r, seed=0)
                    for r in range(ranks)]
        for s in samplers:
            s.set_epoch(epoch)
        dealt[epoch] = [list(s) for s in samplers]
    slots = viz.sampler_slots(dealt, n)
    for epoch, per_rank in slots.items():
        real = [i for row in per_rank for i, padded in row if not padded]
        padded = [i for row in per_rank for i, padded in row if padded]
        assert sorted(real) == list(range(n))        # every sample once
        assert len(padded) == 2 and [r for r, row in enumerate(per_rank) if row[-1][1]] == [2, 3]
        order = [per_rank[p % ranks][p // ranks][0] for p in range(12)]
        assert padded == order[:2]                   # the epoch's first samples again
    assert dealt[0] != dealt[1]
    fig = viz.sampler_index_map_figure(dealt, n)
    assert [ax.get_title() for ax in fig.axes] == ["set_epoch(0)", "set_epoch(1)"]
    for ax, epoch in zip(fig.axes, (0, 1)):
        shown = [int(t.get_text()) for t in ax.texts]
        assert shown == [i for row in dealt[epoch] for i in row]
        red = [p for p in ax.patches if p.get_facecolor()[0] > 0.8]
        assert len(red) == 2
    with pytest.raises(ValueError, match="different lengths"):
        viz.sampler_slots({0: [[0, 1], [2]]}, 3)


def test_show_code_folded_keeps_the_code_behind_a_click(monkeypatch):
    """``show_code(obj, folded="▶ label")`` (a lab's answer in a lesson): the HTML holds the
    highlighted code inside ``<details>`` under the label, which JupyterLab, the website and
    GitHub's static view all open only on a click; the plain text, what a viewer without HTML
    shows, holds no line of the code."""
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display",
                        lambda *objs, **kw: shown.extend((o, kw) for o in objs))
    snippet = "def secret_answer(x):\n    return x * 42 + 7\n"
    viz.show_code(snippet, folded="▶ The reference answer — open after your lab passes")
    (bundle, kw), = shown
    assert kw.get("raw") is True and set(bundle) == {"text/html", "text/plain"}
    page = bundle["text/html"]
    assert page.startswith('<details class="dpcourse-folded-code"><summary>▶ The reference '
                           "answer — open after your lab passes</summary>")
    assert page.rstrip().endswith("</details>") and 'class="highlight' in page
    assert "secret_answer" in page and "42" in page
    plain = bundle["text/plain"]
    assert "folded" in plain and "secret_answer" not in plain and "42" not in plain
    shown.clear()
    viz.show_code(snippet)  # unfolded, as before: the highlighted code itself
    (code, kw), = shown
    assert isinstance(code, IPython.display.Code) and "secret_answer" in code._repr_html_()


def test_folded_output_keeps_printed_claims_behind_a_click(monkeypatch):
    """``with viz.folded_output("▶ label"):`` (claims that state a lab's answer): what the block
    prints is HTML inside ``<details>``, escaped; the plain text holds none of it; a block that
    raises still shows what it printed before."""
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display",
                        lambda *objs, **kw: shown.extend((o, kw) for o in objs))
    with viz.folded_output("▶ The counts — open after your lab passes"):
        print("✔ the answer is 3 < 4")
    (bundle, kw), = shown
    assert kw.get("raw") is True
    page, plain = bundle["text/html"], bundle["text/plain"]
    assert page.startswith("<details") and page.rstrip().endswith("</details>")
    assert "the answer is 3 &lt; 4" in page and "answer" not in plain and "folded" in plain
    shown.clear()
    with pytest.raises(RuntimeError), viz.folded_output("▶ x"):
        print("before")
        raise RuntimeError("a failed claim")
    (bundle, _), = shown
    assert "before" in bundle["text/html"]


def test_step_time_bars_show_every_round_beside_the_median():
    names, rounds = ["a", "b"], [[0.10, 0.30, 0.20], [0.15, 0.25, 0.35]]
    fig = viz.step_time_bars_figure(names, [0.20, 0.25], "t", rounds=rounds)
    ax = fig.axes[0]
    dots = [line for line in ax.get_lines() if line.get_marker() == "o"]
    assert [sorted(line.get_xdata()) for line in dots] == [[100.0, 200.0, 300.0],
                                                          [150.0, 250.0, 350.0]]
    assert ax.get_xlim()[1] >= 350.0
    assert not viz.step_time_bars_figure(names, [0.20, 0.25]).axes[0].get_lines()
