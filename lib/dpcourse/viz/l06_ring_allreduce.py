"""Figures for the course: matplotlib drawings and ipywidgets steppers with a static fallback.

Lesson 06 uses the ring figures (:func:`draw_ring_step`, :func:`ring_steps_figure`,
:func:`ring_stepper`), the cost-model figure (:func:`cost_figure`) and the measured-vs-model
figure (:func:`fit_figure`). Other lessons add their figures here.

Two rules keep notebooks reproducible and nbval-safe (see DESIGN.md):

* Figures are made with ``matplotlib.figure.Figure`` (not pyplot), so nothing is drawn twice or
  left open, and shown with :func:`show`, which displays a **PNG** (nbval does not compare
  images; SVG embeds a date and would fail).
* A widget never writes into an ipywidgets ``Output`` (its stored stream breaks nbval). The
  steppers here pre-render every frame to PNG bytes and swap them in an ``ipywidgets.Image``;
  the cell also shows a static figure of all steps, so the notebook reads well without a live
  kernel (rendered HTML, GitHub, nbval).
"""

from __future__ import annotations

import io
import math
from typing import Sequence

import numpy as np

__all__ = [
    "new_figure",
    "figure_to_png",
    "show",
    "show_code",
    "quiz",
    "draw_ring_step",
    "ring_steps_figure",
    "ring_frames",
    "ring_stepper",
    "cost_figure",
    "fit_figure",
    "dp_step_figure",
    "traffic_both_ways_figure",
    "collectives_figure",
    "ddp_timeline_figure",
    "sampler_grid_figure",
    "mirrored_vs_ddp_figure",
    "overlap_timeline_figure",
    "reducer_figure",
    "overlap_model_figure",
    "bucket_sweep_figure",
    "step_time_bars_figure",
    "comm_hooks_figure",
    "zero_holdings_figure",
    "zero_memory_figure",
    "zero_tradeoff_figure",
    "zero3_timeline_figure",
    # Lesson 09
    "ps_traffic_figure",
    "staleness_figure",
    "local_sgd_figure",
    "large_batch_figure",
    "collective_trace_figure",
    "collective_traces_figure",
    "replica_checksums_figure",
    "nan_spread_figure",
    "timeout_behaviour_figure",
    "straggler_gantt_figure",
]

_PHASE_COLOURS = {"start": "#555555", "scatter-reduce": "#1f77b4", "all-gather": "#2ca02c"}


def new_figure(width: float = 6.0, height: float = 4.0, dpi: int = 80):
    """A matplotlib Figure that no pyplot state knows about (so it is shown only by :func:`show`)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=dpi)


def figure_to_png(fig, dpi: int | None = None) -> bytes:
    """The figure as PNG bytes (Agg, no backend needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    # No bbox_inches="tight": it draws the figure twice; the layouts here leave no big margins.
    fig.savefig(buf, format="png", dpi=dpi or fig.dpi, metadata={"Software": None})
    return buf.getvalue()


def show(fig, caption: str | None = None) -> None:
    """Display ``fig`` as a PNG in a notebook, then its one-line caption (what to see in it).

    Every figure in a lesson has a caption (tests/test_notebooks.py checks): pass it here. Works
    for pyplot figures too (``plt.gcf()``), which are then closed so they are not drawn twice.
    """
    try:
        from IPython.display import Image, Markdown, display
    except ImportError:  # plain Python: nothing to show on
        return
    display(Image(figure_to_png(fig)))
    if caption:
        display(Markdown(f"*Figure — {caption}*"))
    if getattr(fig, "number", None) is not None:  # a pyplot figure: forget it
        import matplotlib.pyplot as plt

        plt.close(fig)


def show_code(*objects, title: str | None = None) -> None:
    """Display the source of functions or classes, syntax-highlighted, right where a lesson uses
    them: the code a lesson's claims depend on is read in the notebook, not hidden in the library.

    Strings are shown as they are (a snippet); anything else through ``inspect.getsource``.
    """
    import inspect

    from IPython.display import Code, Markdown, display

    if title:
        display(Markdown(f"**{title}**"))
    parts = [obj if isinstance(obj, str) else inspect.getsource(obj) for obj in objects]
    display(Code("\n\n".join(p.rstrip("\n") for p in parts) + "\n", language="python"))


# --------------------------------------------------------------------------------------------
# Check-yourself questions
# --------------------------------------------------------------------------------------------


def quiz(questions: Sequence[dict], interactive: bool = True) -> None:
    """The check-yourself questions at the end of a lesson.

    ``questions`` is a list of dicts: ``q`` (the question), ``options`` (a list of answers),
    ``answer`` (the index of the right one), ``why`` (a list, one sentence per option saying why
    it is right or wrong). In a live kernel each question is a set of radio buttons with a
    *Check* button that says why the chosen answer is right or wrong. Below them, for readers
    without a kernel (GitHub, rendered HTML, where widgets do not render), the questions as
    text with their answers folded in a ``<details>`` block. No ipywidgets ``Output`` is used (it breaks nbval).
    """
    from IPython.display import Markdown, display

    for i, item in enumerate(questions):
        opts, why = list(item["options"]), list(item["why"])
        if not 0 <= item["answer"] < len(opts) or len(why) != len(opts):
            raise ValueError(f"question {i + 1}: answer must index options, one 'why' per option")
    if interactive:
        try:
            import ipywidgets as widgets
        except ImportError:
            interactive = False
    if interactive:
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
        display(widgets.VBox(boxes))
    # The static copy: questions and options in plain sight, the answers folded away.
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


# --------------------------------------------------------------------------------------------
# The ring
# --------------------------------------------------------------------------------------------


def _worker_xy(n: int, radius: float = 1.0) -> np.ndarray:
    # Worker 0 at the top, then clockwise, so "to the right" reads as clockwise.
    angles = np.pi / 2 - 2 * np.pi * np.arange(n) / n
    return np.stack([radius * np.cos(angles), radius * np.sin(angles)], axis=1)


def draw_ring_step(trace, step: int, ax=None, show_values: bool | None = None):
    """Draw step ``step`` of a :class:`dpcourse.ring.RingTrace` on ``ax`` (a new figure if None).

    Each worker is a row of N chunk cells; a cell's colour says how many workers' inputs it
    sums (white-ish = only its own, dark = all N). Arrows are this step's transfers, labelled
    with the chunk they carry. Values are written in the cells when the arrays are short.
    """
    from matplotlib import colormaps
    from matplotlib.patches import FancyArrowPatch, Rectangle

    if ax is None:
        ax = new_figure(4.2, 4.2).add_subplot(1, 1, 1)
    n = trace.n
    if not 0 <= step < len(trace.steps):
        raise ValueError(f"step must be in 0..{len(trace.steps) - 1}, got {step}")
    s = trace.steps[step]
    if show_values is None:
        show_values = trace.length <= n and n <= 6
    cmap = colormaps["Blues"]
    xy = _worker_xy(n)
    cell = min(0.22, 1.1 / n)
    for w in range(n):
        x0 = xy[w, 0] - n * cell / 2
        y0 = xy[w, 1] - cell / 2
        for c in range(n):
            k = s.contributions[w, c]
            colour = cmap(0.15 + 0.85 * (k - 1) / max(1, n - 1))
            ax.add_patch(Rectangle((x0 + c * cell, y0), cell, cell, facecolor=colour,
                                   edgecolor="black", linewidth=0.8))
            if show_values:
                a, b = trace.bounds[c]
                if b > a:
                    v = s.buffers[w][a]
                    ax.text(x0 + (c + 0.5) * cell, y0 + cell / 2, f"{v:g}", ha="center",
                            va="center", fontsize=7, color="white" if k > n / 2 else "black")
        ax.text(xy[w, 0], xy[w, 1] + cell * 0.9, f"worker {w}", ha="center", va="bottom",
                fontsize=8)
    colour = _PHASE_COLOURS.get(s.phase, "black")
    gap = 2 * np.pi / n
    for t in s.transfers:
        # From just past the sender to just before the receiver, inside the ring of workers,
        # so arrows never cover the chunk cells or the names.
        a0 = np.pi / 2 - gap * t.src - 0.22 * gap
        a1 = np.pi / 2 - gap * t.src - 0.78 * gap
        r = 0.62
        p = (r * np.cos(a0), r * np.sin(a0))
        q = (r * np.cos(a1), r * np.sin(a1))
        ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=12,
                                     connectionstyle="arc3,rad=-0.2", color=colour, lw=1.4))
        am = np.pi / 2 - gap * t.src - 0.5 * gap
        ax.text(0.36 * np.cos(am), 0.36 * np.sin(am), f"c{t.chunk}", ha="center",
                va="center", fontsize=8, color=colour)
    title = "start" if s.phase == "start" else f"step {step}: {s.phase}"
    ax.set_title(title, fontsize=9, color=colour)
    if len(ax.figure.axes) == 1:
        ax.figure.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.93)
    ax.set_xlim(-1.55, 1.55)
    ax.set_ylim(-1.45, 1.55)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def ring_steps_figure(trace, cols: int | None = None, steps: Sequence[int] | None = None):
    """All steps (or ``steps``) of a ring trace side by side: the static version of the stepper."""
    steps = list(range(len(trace.steps))) if steps is None else list(steps)
    cols = cols or min(len(steps), 4)
    rows = math.ceil(len(steps) / cols)
    fig = new_figure(2.6 * cols, 2.6 * rows + 0.3)  # height: see subplots_adjust below
    for i, st in enumerate(steps):
        draw_ring_step(trace, st, fig.add_subplot(rows, cols, i + 1))
    height = 2.6 * rows + 0.3
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=1 - 0.5 / height, wspace=0.02,
                        hspace=0.12)
    fig.suptitle(f"ring all-reduce, N={trace.n} workers, {trace.length} elements "
                 f"(colour: how many inputs a chunk sums)", fontsize=10)
    return fig


def ring_frames(trace, dpi: int = 70) -> list[bytes]:
    """One PNG per step, for the stepper."""
    frames = []
    for st in range(len(trace.steps)):
        ax = draw_ring_step(trace, st)
        frames.append(figure_to_png(ax.figure, dpi=dpi))
    return frames


def ring_stepper(trace, static: bool = True,
                 caption: str = "every state of the ring: after N−1 scatter-reduce steps each "
                                "worker owns one complete chunk; N−1 all-gather steps later "
                                "every worker holds every complete chunk."):
    """Show an interactive stepper (play button + slider) over the ring's steps, then — unless
    ``static=False`` — a static figure of every step. Returns the widget (None without
    ipywidgets).

    The widget is displayed with a short plain-text fallback instead of the widget's repr
    (which would print every frame's bytes), so stored notebooks stay small and stable.
    """
    try:
        import ipywidgets as widgets
        from IPython.display import display
    except ImportError:
        widgets = None
    box = None
    if widgets is not None:
        frames = ring_frames(trace)
        last = len(frames) - 1
        image = widgets.Image(value=frames[0], format="png")
        slider = widgets.IntSlider(value=0, min=0, max=last, description="step")
        play = widgets.Play(value=0, min=0, max=last, interval=900, description="play")
        widgets.jslink((play, "value"), (slider, "value"))
        label = widgets.Label(value=trace.describe(0))
        # A plain "next" button and a counter: the slider alone is fiddly to move by exactly
        # one step, and a browser test clicks this button by its name.
        counter = widgets.Label(value=f"step 1 / {last + 1}")
        counter.add_class("dpcourse-step-counter")
        next_button = widgets.Button(description="next", layout=widgets.Layout(width="70px"))

        def on_change(change):
            i = change["new"]
            image.value = frames[i]
            label.value = trace.describe(i)
            counter.value = f"step {i + 1} / {last + 1}"

        def on_next(_button):
            slider.value = min(slider.value + 1, last)  # stops at the last step

        slider.observe(on_change, names="value")
        next_button.on_click(on_next)
        box = widgets.VBox([widgets.HBox([play, slider, next_button, counter]), label, image])
        box.add_class("dpcourse-stepper")
        bundle = box._repr_mimebundle_() or {}
        view = bundle.get("application/vnd.jupyter.widget-view+json")
        if view is not None:
            display({"application/vnd.jupyter.widget-view+json": view,
                     "text/plain": f"[interactive stepper over {last + 1} ring states: run the "
                                   f"notebook live to use it; all states are drawn below]"},
                    raw=True)
    if static:
        show(ring_steps_figure(trace), caption)
    return box


def explorer(draw, controls: dict, caption: str, description: str = "interactive explorer"):
    """Sliders that redraw ``draw(**values)`` (a function returning a matplotlib figure), then
    the static figure for the default values, for readers without a kernel. Returns the widget
    (None without ipywidgets: then only the static figure is shown).

    ``controls`` maps each keyword of ``draw`` to an ipywidgets control (a slider), or to a
    tuple ``(value, min, max)`` / ``(value, min, max, step)``, made an IntSlider when all are
    ints, a FloatSlider otherwise. Like :func:`ring_stepper`, the figure is PNG bytes in an
    ``ipywidgets.Image`` (an ``Output`` widget would break nbval), and the widget is displayed
    with a one-line plain-text fallback so stored notebooks stay stable. The figure always
    comes from the library's own drawing functions: the widget only chooses their arguments.
    """
    try:
        import ipywidgets as widgets
        from IPython.display import display
    except ImportError:
        widgets = None
    box = None
    if widgets is not None:
        sliders = {name: _make_control(widgets, name, spec) for name, spec in controls.items()}

        def render() -> bytes:
            return figure_to_png(draw(**{name: w.value for name, w in sliders.items()}))

        image = widgets.Image(value=render(), format="png")

        def redraw(_change):
            image.value = render()

        for w in sliders.values():
            w.observe(redraw, names="value")
        box = widgets.VBox([*sliders.values(), image])
        box.add_class("dpcourse-explorer")
        view = (box._repr_mimebundle_() or {}).get("application/vnd.jupyter.widget-view+json")
        if view is not None:
            display({"application/vnd.jupyter.widget-view+json": view,
                     "text/plain": f"[{description}: run the notebook live to use the "
                                   f"sliders; the figure for the default values is below]"},
                    raw=True)
        defaults = {name: w.value for name, w in sliders.items()}
    else:
        defaults = {name: (spec[0] if isinstance(spec, tuple) else spec.value)
                    for name, spec in controls.items()}
    show(draw(**defaults), caption)
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
# Cost models and measurements
# --------------------------------------------------------------------------------------------


def cost_vs_n_figure(alpha: float, beta: float, nbytes: float, n_max: int = 64):
    """Lesson 06's explorer: all-reduce time of every algorithm in ``ring.cost`` against N
    (2..n_max) at K = ``nbytes``, with the smallest N from which the ring is the cheapest."""
    from dpcourse.ring import ALGORITHMS, cost

    ns = list(range(2, max(int(n_max), 3) + 1))
    times = {alg: [cost(alg, n, nbytes, alpha, beta).seconds for n in ns] for alg in ALGORITHMS}
    fig = new_figure(6.5, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    labels = {"tree": "binomial tree (unpipelined)"}
    for alg in ALGORITHMS:
        ax.plot(ns, times[alg], label=labels.get(alg, alg))
    # The crossover: the first N from which the ring stays the cheapest up to n_max (ties
    # with another algorithm count as cheapest).
    ring_best = [times["ring"][i] <= min(t[i] for t in times.values()) for i in range(len(ns))]
    crossover = None
    for i in range(len(ns) - 1, -1, -1):
        if not ring_best[i]:
            break
        crossover = ns[i]
    if crossover is not None:
        ax.axvline(crossover, color="k", ls="--", lw=1)
        where = f"ring cheapest from N = {crossover}"
    else:
        where = "ring cheapest: none in range"
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("seconds per all-reduce")
    ax.set_title(f"K = {nbytes / 1e6:.3g} MB, alpha = {alpha * 1e6:.3g} us, "
                 f"1/beta = {1 / beta / 1e9:.3g} GB/s — {where}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.13, top=0.9)
    return fig


def cost_figure(alpha: float, beta: float, n_fixed: int = 8, nbytes_fixed: float = 100e6,
                ns: Sequence[int] = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
                sizes: Sequence[float] = tuple(np.logspace(3, 9, 13)),
                algorithms: Sequence[str] | None = None):
    """Two panels: all-reduce time against N (at ``nbytes_fixed``) and against K (at
    ``n_fixed``), for each algorithm under the alpha-beta model."""
    from dpcourse.ring import ALGORITHMS, cost

    algorithms = algorithms or ALGORITHMS
    fig = new_figure(10, 3.8)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    # The model's tree is the simple one (binomial, whole message per round), not NCCL's
    # pipelined double binary tree: say so on the figure.
    labels = {"tree": "binomial tree (unpipelined)"}
    for alg in algorithms:
        label = labels.get(alg, alg)
        ax1.plot(ns, [cost(alg, n, nbytes_fixed, alpha, beta).seconds for n in ns], label=label)
        ax2.loglog(sizes, [cost(alg, n_fixed, k, alpha, beta).seconds for k in sizes], label=label)
    ax1.set_xlabel("workers N")
    ax1.set_ylabel("seconds per all-reduce")
    ax1.set_title(f"K = {nbytes_fixed / 1e6:g} MB", fontsize=10)
    ax2.set_xlabel("bytes K")
    ax2.set_ylabel("seconds per all-reduce")
    ax2.set_title(f"N = {n_fixed}", fontsize=10)
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"alpha-beta model: alpha = {alpha * 1e6:g} us, 1/beta = {1 / beta / 1e9:g} GB/s",
                 fontsize=10)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.14, top=0.85, wspace=0.25)
    return fig


def fit_figure(fit):
    """Measured all-reduce times (points) against the fitted alpha-beta model (lines)."""
    fig = new_figure(6, 4)
    ax = fig.add_subplot(1, 1, 1)
    for n in sorted(set(fit.world_sizes.tolist())):
        m = fit.world_sizes == n
        k = fit.nbytes[m]
        (line,) = ax.loglog(k, fit.seconds[m], "o", label=f"measured, N={int(n)}")
        grid = np.logspace(np.log10(k.min()), np.log10(k.max()), 50)
        ax.loglog(grid, fit.predict(n, grid), "-", color=line.get_color(),
                  label=f"model, N={int(n)}")
    ax.set_xlabel("bytes K")
    ax.set_ylabel("seconds per all-reduce")
    ax.set_title(f"fit: alpha = {fit.alpha * 1e6:.1f} us, 1/beta = {fit.bandwidth / 1e9:.2f} GB/s",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.13, right=0.97, bottom=0.13, top=0.92)
    return fig


# --------------------------------------------------------------------------------------------
# Lesson 02: DataParallel
# --------------------------------------------------------------------------------------------


def dp_step_figure(chunk_sizes: Sequence[int], n_params: int):
    """Who holds what in one ``nn.DataParallel`` step: one column per device, one row per move
    (scatter, replicate, parallel_apply, gather + loss, backward's reduce-add), arrows for what
    crosses between devices. ``chunk_sizes`` and ``n_params`` come from the run being drawn."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    n = len(chunk_sizes)
    batch = sum(chunk_sizes)
    rows = ["1. scatter X", "2. replicate W", "3. parallel_apply", "4. gather + loss",
            "5. backward: reduce-add"]
    fig = new_figure(1.9 * n + 2.4, 4.6)
    ax = fig.add_axes([0.0, 0.0, 1.0, 0.92])
    ax.set_xlim(-2.2, 1.9 * n)
    ax.set_ylim(-len(rows) - 0.1, 1.05)
    ax.axis("off")
    colours = {"data": "#cfe2f3", "weights": "#fce5cd", "compute": "#d9ead3", "dev0": "#f4cccc"}

    def box(col, row, text, colour):
        x, y = 1.9 * col, -row
        ax.add_patch(FancyBboxPatch((x + 0.1, y - 0.32), 1.6, 0.64, boxstyle="round,pad=0.02",
                                    fc=colour, ec="#444444", lw=0.8))
        ax.text(x + 0.9, y, text, ha="center", va="center", fontsize=8)

    def arrow(c0, r0, c1, r1, colour="#444444"):
        ax.add_patch(FancyArrowPatch((1.9 * c0 + 0.9, -r0 - 0.33), (1.9 * c1 + 0.9, -r1 + 0.33),
                                     arrowstyle="-|>", mutation_scale=9, color=colour, lw=0.9))

    for c in range(n):
        ax.text(1.9 * c + 0.9, 0.75, f"device {c}", ha="center", fontsize=9, weight="bold")
    for r, label in enumerate(rows):
        ax.text(-2.1, -r, label, ha="left", va="center", fontsize=8.5)
    for c, size in enumerate(chunk_sizes):
        box(c, 0, f"X[{sum(chunk_sizes[:c])}:{sum(chunk_sizes[:c + 1])}]\n{size} samples",
            colours["data"])
        box(c, 1, f"copy of W\n{n_params:,} numbers" if c else f"W (original)\n{n_params:,}",
            colours["weights"])
        box(c, 2, f"forward on\n{size} samples", colours["compute"])
        arrow(c, 2, 0, 3, "#1f77b4")  # outputs travel to device 0
        if c:  # weights leave device 0, over the top of the row
            ax.add_patch(FancyArrowPatch((0.9, -1 + 0.33), (1.9 * c + 0.9, -1 + 0.33),
                                         connectionstyle="arc3,rad=-0.18", arrowstyle="-|>",
                                         mutation_scale=9, color="#e69138", lw=0.9))
    box(0, 3, f"logits of all {batch}\nmean loss", colours["dev0"])
    box(0, 4, f"grad W = sum of\n{n} replicas' grads", colours["dev0"])
    for c in range(1, n):
        box(c, 4, f"grad of copy {c}\n-> device 0", colours["weights"])
        ax.add_patch(FancyArrowPatch((1.9 * c + 0.9, -4 - 0.33), (0.9, -4 - 0.33),
                                     connectionstyle="arc3,rad=-0.18", arrowstyle="-|>",
                                     mutation_scale=9, color="#cc0000", lw=0.9))
    fig.suptitle(f"One nn.DataParallel step on {n} devices, batch {batch}: everything "
                 "passes through device 0", fontsize=10)
    return fig


def traffic_both_ways_figure(n_params: int, counted: dict[int, int],
                             ns: Sequence[int] = range(2, 17)):
    """Numbers sent plus received per step: device 0 of a copy-by-copy parameter server
    (lesson 02's DataParallel), 2(N−1)K, against one rank of a ring all-reduce, which sends
    2(N−1)K/N and receives as much, 4(N−1)K/N. ``counted`` maps N to the lesson's counted total
    for device 0 (drawn as points)."""
    ns = list(ns)
    k = n_params
    fig = new_figure(6.4, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(ns, [2 * (n - 1) * k for n in ns], "-", color="#cc0000",
            label="copy-by-copy parameter server: device 0 sends+receives 2(N−1)K")
    ax.plot(ns, [4 * (n - 1) * k / n for n in ns], "-", color="#2ca02c",
            label="ring all-reduce: one rank sends+receives 4(N−1)K/N")
    if counted:
        ax.plot(list(counted), list(counted.values()), "o", color="#cc0000",
                label="counted copies in this run (device 0)")
    ax.axhline(4 * k, color="#2ca02c", ls=":", lw=0.8)
    ax.text(ns[-1], 4 * k, "  4K", va="center", fontsize=8, color="#2ca02c")
    ax.set_xlabel("devices N")
    ax.set_ylabel("numbers sent + received per step")
    ax.set_title(f"K = {k:,} parameters", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.15, right=0.92, bottom=0.13, top=0.92)
    return fig


# --------------------------------------------------------------------------------------------
# Lesson 03: collectives, DDP's buckets on a timeline, DistributedSampler
# --------------------------------------------------------------------------------------------


def _value_box(ax, x, y, text, colour, w=1.5, h=0.6):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02",
                                fc=colour, ec="#444444", lw=0.7))
    ax.text(x, y, text, ha="center", va="center", fontsize=7.5)


def collectives_figure(before: dict, after: dict):
    """One panel per collective: what each rank holds before (left) and after (right).
    ``before[name][r]`` and ``after[name][r]`` are printable values of rank r."""
    names = list(after)
    n_ranks = len(next(iter(after.values())))
    fig = new_figure(2.6 * len(names), 0.75 * n_ranks + 1.3)
    for k, name in enumerate(names):
        ax = fig.add_axes([k / len(names) + 0.005, 0.02, 1 / len(names) - 0.01, 0.82])
        ax.set_xlim(-1.6, 3.0)
        ax.set_ylim(-n_ranks + 0.4, 0.9)
        ax.axis("off")
        ax.set_title(name, fontsize=9.5)
        ax.text(0.2, 0.55, "before", ha="center", fontsize=7.5, color="#555555")
        ax.text(2.2, 0.55, "after", ha="center", fontsize=7.5, color="#555555")
        for r in range(n_ranks):
            ax.text(-1.55, -r, f"rank {r}", va="center", fontsize=7.5)
            _value_box(ax, 0.2, -r, _fmt(before[name][r]), "#fce5cd")
            _value_box(ax, 2.2, -r, _fmt(after[name][r]), "#d9ead3")
            ax.annotate("", (1.42, -r), (0.98, -r), arrowprops=dict(arrowstyle="-|>", lw=0.8))
    fig.suptitle("The four collectives: every rank calls them, every rank's tensor changes",
                 fontsize=10)
    return fig


def _fmt(value) -> str:
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return "\n".join(_fmt(v) for v in value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f"{v:g}" for v in value) + "]"
    return f"{value:g}"


def ddp_timeline_figure(iteration: dict, title: str = ""):
    """One backward pass under DDP on one rank, from recorded times (ms from the start of the
    backward): a tick when each parameter's gradient was computed, and a bar per bucket from
    the moment its all-reduce was launched to the moment it finished.

    ``iteration`` = {"backward_end": ms, "grads": [(name, ms)], "buckets": [(names, bytes,
    start_ms, end_ms)]}.
    """
    grads, buckets = iteration["grads"], iteration["buckets"]
    fig = new_figure(8.5, 1.2 + 0.45 * (len(buckets) + 1))
    ax = fig.add_subplot(1, 1, 1)
    end = iteration["backward_end"]
    ax.axvspan(0, end, color="#eeeeee", zorder=0)
    ax.text(end, len(buckets) + 0.55, " backward() returns", fontsize=7.5, va="center")
    for name, t in grads:
        ax.plot([t, t], [len(buckets) - 0.3, len(buckets) + 0.3], color="#444444", lw=1)
    last = max(t for _, t in grads)
    ax.text(last, len(buckets) + 0.3, " last gradient", fontsize=7, va="bottom")
    for i, (names, nbytes, start, stop) in enumerate(buckets):
        y = len(buckets) - 1 - i
        ax.barh(y, stop - start, left=start, height=0.5, color="#1f77b4")
        short = ", ".join(n.replace("features.", "f.").replace("classifier.", "c.")
                          .replace(".weight", ".w").replace(".bias", ".b") for n in names)
        ax.text(stop, y, f"  {nbytes / 1024:.0f} KiB: {short}", va="center", fontsize=7)
    ax.set_yticks(range(len(buckets) + 1))
    ax.set_yticklabels([f"bucket {len(buckets) - 1 - k}" for k in range(len(buckets))]
                       + ["gradients ready"], fontsize=7.5)
    ax.set_xlabel("ms since backward() was called")
    ax.set_xlim(0, max(end, max(s for *_, s in buckets)) * 1.9)
    ax.set_ylim(-0.6, len(buckets) + 0.9)
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9.5)
    fig.subplots_adjust(left=0.16, right=0.98, bottom=0.22 if len(buckets) < 3 else 0.15,
                        top=0.88)
    return fig


def sampler_grid_figure(orders: dict):
    """DistributedSampler's index order per epoch and rank, one panel per setting.

    ``orders[label][epoch][rank]`` is the list of indices that rank reads in that epoch. Each
    cell shows an index, coloured by its value, so an order that repeats shows as a repeated
    pattern of colours."""
    labels = list(orders)
    epochs = len(orders[labels[0]])
    ranks = len(orders[labels[0]][0])
    per = len(orders[labels[0]][0][0])
    n_max = max(max(max(o) for o in per_rank) for v in orders.values() for per_rank in v) + 1
    fig = new_figure(4.2 * len(labels), 0.42 * epochs * ranks + 1.2)
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    for k, label in enumerate(labels):
        ax = fig.add_subplot(1, len(labels), k + 1)
        row = 0
        ticks = []
        for e in range(epochs):
            for r in range(ranks):
                for j, idx in enumerate(orders[label][e][r]):
                    ax.add_patch(matplotlib.patches.Rectangle((j, -row - 1), 1, 1,
                                                              fc=cmap(idx % 20), ec="white"))
                    ax.text(j + 0.5, -row - 0.5, str(idx), ha="center", va="center",
                            fontsize=7)
                ticks.append((-row - 0.5, f"epoch {e}, rank {r}"))
                row += 1
            row += 0.3
        ax.set_xlim(0, per)
        ax.set_ylim(-row, 0)
        ax.set_yticks([t for t, _ in ticks])
        ax.set_yticklabels([s for _, s in ticks], fontsize=7)
        ax.set_xticks([])
        ax.set_title(label, fontsize=9.5)
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
    fig.subplots_adjust(left=0.13, right=0.98, bottom=0.04, top=0.88, wspace=0.45)
    fig.suptitle(f"{n_max} samples over {ranks} ranks: which indices each rank reads, in order",
                 fontsize=10)
    return fig


# --------------------------------------------------------------------------------------------
# Lesson 05: one process with N replicas vs N processes
# --------------------------------------------------------------------------------------------


def mirrored_vs_ddp_figure(n: int = 2):
    """Who runs what: MirroredStrategy (one process driving n replicas) beside DDP (n processes,
    one replica each). Both all-reduce the gradients at the end of every step."""
    from matplotlib.patches import FancyBboxPatch

    fig = new_figure(9, 3.4)
    for k, (title, one_process) in enumerate((("TF MirroredStrategy", True),
                                              ("PyTorch DDP", False))):
        ax = fig.add_axes([0.02 + 0.5 * k, 0.02, 0.46, 0.86])
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 6)
        ax.axis("off")
        ax.set_title(title, fontsize=10)
        width = 8.6 / n
        if one_process:
            ax.add_patch(FancyBboxPatch((0.4, 1.5), 9.2, 4.2, boxstyle="round,pad=0.05",
                                        fc="#fff2cc", ec="#444444"))
            ax.text(5, 5.3, "one Python process: strategy.run(step_fn)", ha="center", fontsize=8)
        for r in range(n):
            x = 0.7 + r * width
            if not one_process:
                ax.add_patch(FancyBboxPatch((x - 0.15, 1.5), width - 0.3, 4.2,
                                            boxstyle="round,pad=0.05", fc="#fff2cc", ec="#444444"))
                ax.text(x + width / 2 - 0.3, 5.3, f"process, rank {r}", ha="center", fontsize=8)
            ax.add_patch(FancyBboxPatch((x, 2.0), width - 0.6, 2.6, boxstyle="round,pad=0.05",
                                        fc="#d9ead3", ec="#444444"))
            ax.text(x + width / 2 - 0.3, 3.3, f"replica {r}\nweights copy\n1/{n} of the batch",
                    ha="center", va="center", fontsize=7.5)
        ax.add_patch(FancyBboxPatch((0.6, 0.2), 8.8, 0.8, boxstyle="round,pad=0.05",
                                    fc="#cfe2f3", ec="#444444"))
        ax.text(5, 0.6, "all-reduce of gradients: SUM in apply_gradients" if one_process
                else "all-reduce of gradients: AVERAGE inside backward()", ha="center",
                va="center", fontsize=8)
    return fig


# --------------------------------------------------------------------------------------------
# Lesson 07: inside DDP
# --------------------------------------------------------------------------------------------


def overlap_timeline_figure(timeline: dict, title: str = ""):
    """One training step of a bucketed wrapper on one rank, from ``overlap.timing_worker``'s
    recorded timeline (ms since the backward began): a tick per gradient as it became ready,
    a bar per bucket from its all-reduce's launch to its end, the backward's end and the end
    of the synchronisation (wait + copy back + optimizer step)."""
    launches = {which: t for what, which, t in timeline["events"] if what == "launch"}
    dones = {which: t for what, which, t in timeline["events"] if what == "done"}
    order = sorted(launches, key=launches.get)
    n = len(order)
    fig = new_figure(8.5, 1.6 + 0.32 * (n + 1))
    ax = fig.add_subplot(1, 1, 1)
    end = timeline["backward_end"]
    ax.axvspan(0, end, color="#eeeeee", zorder=0, label="backward")
    for t in timeline["ready"]:
        ax.plot([t, t], [n - 0.35, n + 0.35], color="#444444", lw=0.8)
    for row, i in enumerate(order):
        y = n - 1 - row
        stop = dones.get(i, timeline["sync_end"])
        ax.barh(y, stop - launches[i], left=launches[i], height=0.6, color="#1f77b4")
    ax.axvline(end, color="#d62728", lw=1.2, ls="--", label="backward() returns")
    ax.axvline(timeline["sync_end"], color="#2ca02c", lw=1.2, ls=":",
               label="synchronised and stepped")
    ax.set_yticks([n] + ([n - 1, 0] if n > 1 else [0]))
    ax.set_yticklabels(["gradients ready"] + (["first bucket", f"bucket {n - 1}"] if n > 1
                                              else ["the bucket"]), fontsize=7.5)
    ax.set_xlabel("ms since backward() was called")
    ax.set_ylim(-0.8, n + 0.8)
    # outside the axes, so that it hides no bucket's bar
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9.5)
    fig.subplots_adjust(left=0.14, right=0.77, bottom=0.18, top=0.9)
    return fig


def reducer_figure():
    """Lesson 07: what DDP's reducer does with one gradient, left to right — the autograd hook,
    the gradient's place in its bucket (a copy, or the gradient *is* a view of it), the launch
    in bucket order, the wait and the copy back (none with views)."""
    from matplotlib.patches import FancyBboxPatch

    fig = new_figure(9.0, 3.3)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 4.2)
    ax.axis("off")
    steps = [
        ("1. hook", "autograd has accumulated\np.grad: the reducer's\nhook on p runs"),
        ("2. into the bucket", "copy p.grad into its slice\n(÷N on the way), or\np.grad IS the slice (view)"),
        ("3. launch in order", "bucket complete? launch it\nonly if it is next_bucket_,\nthen every ready one after"),
        ("4. wait", "end of backward: wait on\nevery bucket's all-reduce"),
        ("5. copy back", "slice → p.grad;\nskipped with\ngradient_as_bucket_view"),
    ]
    w, gap = 1.72, 0.3
    for k, (head, body) in enumerate(steps):
        x = 0.1 + k * (w + gap)
        ax.add_patch(FancyBboxPatch((x, 1.6), w, 1.9, boxstyle="round,pad=0.05",
                                    fc="#e8f0fa" if k != 2 else "#fde9d9", ec="#1f4e79"))
        ax.text(x + w / 2, 3.2, head, ha="center", va="center", fontsize=8.5, weight="bold")
        ax.text(x + w / 2, 2.35, body, ha="center", va="center", fontsize=7)
        if k:
            ax.annotate("", xy=(x - 0.02, 2.55), xytext=(x - gap + 0.02, 2.55),
                        arrowprops={"arrowstyle": "->", "lw": 1.2})
    # the buckets below: filled out of order, launched in order
    for b, (filled, sent) in enumerate([("2nd", "1st"), ("1st", "2nd, right after 0"),
                                        ("3rd", "3rd")]):
        x = 2.3 + b * 1.9
        ax.add_patch(FancyBboxPatch((x, 0.35), 1.7, 0.6, boxstyle="round,pad=0.03",
                                    fc="#ffffff", ec="#555555"))
        ax.text(x + 0.85, 0.65, f"bucket {b}: complete {filled},\nlaunched {sent}",
                ha="center", va="center", fontsize=6.8)
    ax.text(0.1, 0.65, "buckets fill out of\norder, go in order:", fontsize=7, va="center")
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.02, top=0.98)
    return fig


def overlap_model_figure(rows: Sequence[dict]):
    """Lesson 07: for each bucket cap, the step time the overlap model predicts (with overlap,
    and with every all-reduce after the backward) beside the measured ones."""
    import numpy as np

    fig = new_figure(7.6, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(rows))
    series = [("measured, overlapped", "measured_ms", "#1f77b4"),
              ("predicted, overlapped", "predicted_ms", "#9ecae1"),
              ("measured, launched after backward", "measured_after_ms", "#ff7f0e"),
              ("predicted, after backward", "predicted_after_ms", "#fdd0a2")]
    width = 0.2
    for k, (label, key, color) in enumerate(series):
        ax.bar(x + (k - 1.5) * width, [r[key] for r in rows], width, label=label, color=color)
    ax.set_xticks(x)
    ax.set_xticklabels([_cap_label(r["bucket_cap_mb"]) for r in rows], fontsize=8)
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("step time (ms)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(True, axis="y", alpha=0.3)
    fig.subplots_adjust(left=0.1, right=0.68, bottom=0.15, top=0.96)
    return fig


def _cap_label(cap) -> str:
    return "one bucket" if cap == float("inf") else f"{cap:g} MiB"


def bucket_sweep_figure(rows: Sequence[dict]):
    """Step time (ms) for each bucket cap, each bar labelled with its all-reduces per step."""
    fig = new_figure(7.0, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    labels = [_cap_label(r["bucket_cap_mb"]) for r in rows]
    ms = [r["step_s"] * 1e3 for r in rows]
    bars = ax.bar(range(len(rows)), ms, color="#1f77b4")
    for bar, r in zip(bars, rows):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                f"{r['collectives_per_step']} all-reduces", ha="center", va="bottom", fontsize=7.5)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("step time (ms, median)")
    ax.set_ylim(0, max(ms) * 1.2)
    ax.grid(True, axis="y", alpha=0.3)
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.16, top=0.95)
    return fig


def step_time_bars_figure(names: Sequence[str], seconds: Sequence[float], title: str = ""):
    """Horizontal bars: one step time (ms) per way of synchronising the gradients."""
    fig = new_figure(7.0, 0.9 + 0.45 * len(names))
    ax = fig.add_subplot(1, 1, 1)
    ms = [s * 1e3 for s in seconds]
    ax.barh(range(len(names)), ms, color=["#7f7f7f", "#ff7f0e", "#1f77b4", "#2ca02c"][
        :len(names)] if len(names) <= 4 else "#1f77b4")
    for i, v in enumerate(ms):
        ax.text(v, i, f" {v:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(ms) * 1.25)
    ax.set_xlabel("step time (ms, median)")
    if title:
        ax.set_title(title, fontsize=9.5)
    ax.grid(True, axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.3, right=0.97, bottom=0.2, top=0.88)
    return fig


def comm_hooks_figure(runs: dict, bytes_per_step: dict, window: int = 10):
    """Left: each comm hook's loss curve (a moving mean over ``window`` steps). Right: the bytes
    each one all-reduced per step, on a log scale."""
    fig = new_figure(9.0, 3.4)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name, losses in runs.items():
        x = np.asarray(losses, dtype=float)
        smooth = np.convolve(x, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(window - 1, len(x)), smooth, label=name, lw=1.3)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (mean of {window} steps)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    names = list(bytes_per_step)
    vals = [bytes_per_step[n] for n in names]
    bx.barh(range(len(names)), vals, color="#1f77b4")
    for i, v in enumerate(vals):
        bx.text(v, i, f" {v / 1024:.1f} KiB", va="center", fontsize=7.5)
    bx.set_xscale("log")
    bx.set_yticks(range(len(names)))
    bx.set_yticklabels(names, fontsize=8)
    bx.invert_yaxis()
    bx.set_xlim(min(vals) / 2, max(vals) * 8)
    bx.set_xlabel("bytes all-reduced per step (log)")
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.16, top=0.95, wspace=0.45)
    return fig


# --------------------------------------------------------------------------------------------
# Lesson 08: who holds what under ZeRO, memory counted, the memory/traffic trade-off
# --------------------------------------------------------------------------------------------

_STATE_COLOURS = {"params": "#1f77b4", "grads": "#ff7f0e", "optimizer": "#2ca02c"}
_STAGE_LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


def zero_holdings_figure(world_size: int = 4, bytes_per_kind=(2, 2, 12)):
    """Who holds what, per stage: one column per rank, one band per kind of model state (its
    height the bytes per parameter, mixed-precision Adam by default), the parameter vector
    running left to right inside each band. A replicated band is filled across; a sharded one
    only in the rank's own 1/N slice."""
    from matplotlib.patches import Rectangle

    sharded = {"ddp": (), "zero1": ("optimizer",), "zero2": ("grads", "optimizer"),
               "zero3": ("params", "grads", "optimizer")}
    kinds = ("params", "grads", "optimizer")
    n = world_size
    fig = new_figure(9.6, 3.3)
    for s, (stage, cut) in enumerate(sharded.items()):
        ax = fig.add_subplot(1, 4, s + 1)
        for rank in range(n):
            y = 0.0
            for kind, height in zip(kinds, bytes_per_kind):
                x0 = rank * 1.15
                ax.add_patch(Rectangle((x0, y), 1, height, fill=False, lw=0.6, ec="#999999"))
                if kind in cut:
                    ax.add_patch(Rectangle((x0 + rank / n, y), 1 / n, height,
                                           color=_STATE_COLOURS[kind]))
                else:
                    ax.add_patch(Rectangle((x0, y), 1, height, color=_STATE_COLOURS[kind]))
                y += height
            ax.text(rank * 1.15 + 0.5, -0.9, f"rank {rank}", ha="center", fontsize=7)
        total = sum(h / n if k in cut else h for k, h in zip(kinds, bytes_per_kind))
        ax.set_title(f"{_STAGE_LABELS[stage]}: {total:g} B/param", fontsize=9)
        ax.set_xlim(-0.1, n * 1.15)
        ax.set_ylim(-1.5, sum(bytes_per_kind) + 0.5)
        ax.axis("off")
    handles = [Rectangle((0, 0), 1, 1, color=_STATE_COLOURS[k]) for k in kinds]
    fig.legend(handles, [f"weights ({bytes_per_kind[0]} B)", f"gradients ({bytes_per_kind[1]} B)",
                         f"optimizer state ({bytes_per_kind[2]} B)"],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.12, top=0.9, wspace=0.08)
    return fig


def zero_calculator_figure(billions: float, gpu_gb: float, n_gpus: int):
    """Lesson 08's calculator: model-state GB per GPU for each stage, from
    ``zero.bytes_per_param`` (mixed-precision Adam), against the GPU's memory; bars that fit
    are green. Activations are not counted, so "fits" is a lower bound on what is needed."""
    from dpcourse import zero

    gbs = [billions * 1e9 * zero.bytes_per_param(s, n_gpus) / 1e9 for s in zero.STAGES]
    fig = new_figure(6.4, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    colours = ["#2ca02c" if gb <= gpu_gb else "#cc0000" for gb in gbs]
    bars = ax.bar(list(zero.STAGES), gbs, color=colours)
    for bar, gb in zip(bars, gbs):
        ax.text(bar.get_x() + bar.get_width() / 2, gb, f"{gb:.1f} GB\n"
                f"{'fits' if gb <= gpu_gb else 'too big'}", ha="center", va="bottom", fontsize=8)
    ax.axhline(gpu_gb, color="k", ls="--", lw=1)
    ax.text(3.45, gpu_gb, f" {gpu_gb:g} GB GPU", va="bottom", ha="right", fontsize=8)
    ax.set_ylim(0, max(max(gbs), gpu_gb) * 1.25)
    ax.set_ylabel("model state per GPU (GB)")
    ax.set_title(f"{billions:g} B parameters on {n_gpus} GPUs (mixed-precision Adam, "
                 f"activations not counted)", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.1, top=0.9)
    return fig


def zero_memory_figure(counted: dict):
    """Stacked bars of the bytes one rank holds, counted: ``counted[N][stage]`` is
    ``{"params": b, "grads": b, "optimizer": b}``; one group of bars per N."""
    ns = sorted(counted)
    stages = [s for s in _STAGE_LABELS if s in counted[ns[0]]]
    fig = new_figure(7.6, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(stages)
    for g, n in enumerate(ns):
        for i, stage in enumerate(stages):
            x = g + (i - (len(stages) - 1) / 2) * width
            bottom = 0.0
            for kind in ("params", "grads", "optimizer"):
                value = counted[n][stage][kind] / 1024
                ax.bar(x, value, width * 0.92, bottom=bottom, color=_STATE_COLOURS[kind],
                       label=kind if (g, i) == (0, 0) else None)
                bottom += value
            ax.text(x, bottom, _STAGE_LABELS[stage], rotation=90, ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(range(len(ns)))
    ax.set_xticklabels([f"N = {n}" for n in ns])
    ax.set_ylabel("KiB held by one rank (counted)")
    top = max(sum(v[k] for k in ("params", "grads", "optimizer"))
              for per in counted.values() for v in per.values()) / 1024
    ax.set_ylim(0, top * 1.3)
    ax.legend(["weights", "gradients", "optimizer state"], fontsize=8, loc="upper right")
    ax.grid(True, axis="y", alpha=0.3)
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.1, top=0.95)
    return fig


def zero3_timeline_figure(events, layer_names: Sequence[str] | None = None):
    """ZeRO-3's step, one row per layer, from recorded calls: ``events`` is
    [(layer, kind, start_ms, end_ms)] with kind "all-gather (forward)", "all-gather
    (backward)", "reduce-scatter" or "free" (:func:`dpcourse.zero.zero3_timeline_worker`).
    Bars for the collectives; a pale band where the layer's full weights exist (from a gather's
    end to the layer's next free: the layer computes in it, and in the backward the
    reduce-scatter runs in it too); a black tick where they are freed."""
    colours = {"all-gather (forward)": "#4c72b0", "all-gather (backward)": "#8172b2",
               "reduce-scatter": "#dd8452"}
    layers = sorted({e[0] for e in events if e[0] >= 0})
    names = list(layer_names) if layer_names else [f"layer {i}" for i in layers]
    fig = new_figure(8.0, 0.7 + 0.75 * len(layers))
    ax = fig.add_subplot(1, 1, 1)
    labelled = set()
    for layer in layers:
        y = len(layers) - 1 - layers.index(layer)
        mine = [e for e in events if e[0] == layer]
        held_from = None
        for _, kind, start, end in mine:
            if held_from is not None and kind == "free":
                label = "full weights held" if "held" not in labelled else None
                labelled.add("held")
                ax.barh(y, start - held_from, left=held_from, height=0.5, color="#55a868",
                        alpha=0.45, label=label, zorder=0.5)
                held_from = None
            if kind in colours:
                label = kind if kind not in labelled else None
                labelled.add(kind)
                ax.barh(y, end - start, left=start, height=0.5, color=colours[kind], label=label)
                if kind.startswith("all-gather"):
                    held_from = end
            elif kind == "free":
                ax.plot([start, start], [y - 0.3, y + 0.3], color="black", lw=1.2,
                        label="freed" if "free" not in labelled else None)
                labelled.add("free")
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels(list(reversed(names)))
    ax.set_xlabel("milliseconds into the step (rank 0)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=5,
              frameon=False)
    fig.subplots_adjust(left=0.16, right=0.98, bottom=0.38 if len(layers) < 4 else 0.28,
                        top=0.95)
    return fig


def zero_tradeoff_figure(ns_formula: Sequence[int], memory: dict, traffic: dict,
                         measured_memory: dict, measured_traffic: dict):
    """Left: bytes of model state per rank against N; right: bytes a rank sends per step
    against N. Lines: the formulas (``memory[stage][i]``, ``traffic[stage][i]`` at
    ``ns_formula[i]``); points: what this run counted (``measured_*[stage] = {N: bytes}``)."""
    fig = new_figure(9.0, 3.5)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colours = {"ddp": "#d62728", "zero1": "#9467bd", "zero2": "#8c564b", "zero3": "#17becf"}
    # DDP, ZeRO-1 and ZeRO-2 send the same: distinct line styles keep coinciding lines visible
    styles = {"ddp": ("-", 3.5, 0.45), "zero1": ("--", 1.6, 1.0), "zero2": (":", 1.8, 1.0),
              "zero3": ("-", 1.4, 1.0)}
    for axis, formula, measured, label in ((ax, memory, measured_memory, "model state per rank"),
                                           (bx, traffic, measured_traffic,
                                            "sent per rank per step")):
        for stage in formula:
            ls, lw, alpha = styles[stage]
            axis.plot(ns_formula, [v / 1024 for v in formula[stage]], ls, lw=lw, alpha=alpha,
                      color=colours[stage], label=_STAGE_LABELS[stage])
            pts = measured.get(stage, {})
            axis.plot(list(pts), [v / 1024 for v in pts.values()], "o", ms=4,
                      color=colours[stage])
        axis.set_xlabel("ranks N")
        axis.set_ylabel(f"KiB {label}")
        axis.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    bx.legend(fontsize=8)
    bx.set_title("lines: formula · dots: recorded × (N−1)/N, a ring model\n"
                 "(DDP = ZeRO-1 = ZeRO-2)", fontsize=8)
    ax.set_title("lines: formula · dots: counted", fontsize=8)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.14, top=0.9, wspace=0.3)
    return fig


# --------------------------------------------------------------------------------------------
# Lesson 09: beyond lockstep
# --------------------------------------------------------------------------------------------


def ps_traffic_figure(numel: int, measured: dict, ns: Sequence[int] = range(2, 17)):
    """Elements sent + received per step, like for like: through a parameter server (2NK: NK
    out, NK in) against through one rank of a ring all-reduce (4(N-1)K/N: 2(N-1)K/N each way);
    ``measured = {N: elements counted at the server, sent + received}``."""
    fig = new_figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    ns = list(ns)
    ax.plot(ns, [2 * n * numel / 1e3 for n in ns], "-", color="#d62728",
            label="parameter server: through the server, 2NK")
    ax.plot(ns, [4 * (n - 1) * numel / n / 1e3 for n in ns], "-", color="#1f77b4",
            label="ring all-reduce: through one rank, 4(N-1)K/N")
    ax.plot(list(measured), [v / 1e3 for v in measured.values()], "o", color="#d62728",
            label="counted at our server")
    ax.set_xlabel("workers N")
    ax.set_ylabel("elements sent + received per step (thousands)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.15, right=0.97, bottom=0.14, top=0.95)
    return fig


def staleness_figure(taus: Sequence[int], losses: dict, aware: dict | None = None,
                     start_loss: float | None = None, cap: float = 3.0):
    """Test loss after a fixed budget against the staleness τ, one line per learning rate
    (``losses[lr] = [loss at each τ]``); a diverged run (loss above ``cap`` or inf) is drawn
    as an ✕ at the cap. ``aware[lr]``: the same with staleness-aware steps, dashed."""
    fig = new_figure(6.5, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    colours = ["#2ca02c", "#1f77b4", "#d62728", "#9467bd", "#8c564b"]

    def draw(values, colour, style, label):
        shown = [min(v, cap) for v in values]
        ax.plot(taus, shown, style, color=colour, label=label)
        bad = [(t, cap) for t, v in zip(taus, values) if not v <= cap]
        if bad:
            ax.plot(*zip(*bad), "x", color=colour, ms=9, mew=2)

    for i, (lr, values) in enumerate(losses.items()):
        draw(values, colours[i % len(colours)], "o-", f"lr {lr:g}")
    for i, (lr, values) in enumerate((aware or {}).items()):
        j = list(losses).index(lr) if lr in losses else i
        draw(values, colours[j % len(colours)], "s--", f"lr {lr:g}, staleness-aware (lr/τ)")
    if start_loss is not None:
        ax.axhline(start_loss, color="grey", ls=":", lw=1)
        ax.text(taus[0], start_loss, " loss at the start", fontsize=7, va="bottom", color="grey")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(list(taus))
    ax.set_xticklabels([str(t) for t in taus])
    ax.set_xlabel("staleness τ (updates between a gradient's pull and its push)")
    ax.set_ylabel(f"test loss after the budget\n(✕: diverged, drawn at {cap:g})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.subplots_adjust(left=0.14, right=0.97, bottom=0.13, top=0.96)
    return fig


def local_sgd_figure(hs: Sequence[int], losses: Sequence[float], averages: Sequence[int],
                     ddp_loss: float | None = None):
    """Left: test loss after the budget against H; right: the averages (all-reduces) that
    took, against H, on log axes."""
    fig = new_figure(9.0, 3.4)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ax.plot(hs, losses, "o-", color="#1f77b4")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("local steps H between averages")
    ax.set_ylabel("test loss after the budget")
    ax.grid(True, alpha=0.3)
    bx.plot(hs, averages, "o-", color="#d62728")
    bx.set_xscale("log", base=2)
    bx.set_yscale("log", base=2)
    bx.set_xlabel("local steps H between averages")
    bx.set_ylabel("all-reduces in the budget")
    bx.grid(True, alpha=0.3)
    for axis in (ax, bx):
        axis.set_xticks(list(hs))
        axis.set_xticklabels([str(h) for h in hs])
    bx.set_yticks(list(averages))
    bx.set_yticklabels([str(a) for a in averages])
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.15, top=0.95, wspace=0.35)
    return fig


def local_sgd_drift_figure(hs: Sequence[int], losses: Sequence[float], start_loss: float,
                           drift: dict):
    """Left: the test loss after the budget against H, on an axis that includes the starting
    loss (a dashed line), so the spread is read against the progress made. Right: the drift
    measured at each average (``drift[h]``: one value per average, every H steps) against the
    step at which it was measured, one line per H."""
    fig = new_figure(9.0, 3.6)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ax.plot(hs, losses, "o-", color="#1f77b4", label="after the budget")
    ax.axhline(start_loss, color="grey", ls="--", lw=1, label="at the start")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(hs))
    ax.set_xticklabels([str(h) for h in hs])
    low = min(losses)
    ax.set_ylim(low - 0.1 * (start_loss - low), start_loss + 0.1 * (start_loss - low))
    ax.set_xlabel("local steps H between averages")
    ax.set_ylabel("test loss")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    from matplotlib import colormaps

    colours = colormaps["viridis"]
    for i, h in enumerate(hs):
        steps = [h * (j + 1) for j in range(len(drift[h]))]
        bx.plot(steps, [100 * d for d in drift[h]], "o-" if len(steps) < 20 else "-", ms=3,
                color=colours(i / max(1, len(hs) - 1)), label=f"H = {h}")
    bx.set_xlabel("step at which the replicas are averaged")
    bx.set_ylabel("drift before the average (%)")
    bx.legend(fontsize=7, ncol=2)
    bx.grid(True, alpha=0.3)
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.15, top=0.95, wspace=0.3)
    return fig


def large_batch_figure(curves: dict):
    """Test loss after each epoch, one line per run (``curves[label] = [loss per epoch]``)."""
    fig = new_figure(6.5, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, "o-", label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.13, top=0.96)
    return fig


# --------------------------------------------------------------------------------------------
# Lesson 10: the bug zoo
# --------------------------------------------------------------------------------------------

_OP_COLOURS = {"all_reduce": "#1f77b4", "broadcast": "#ff7f0e", "barrier": "#7f7f7f",
               "all_gather": "#2ca02c", "reduce_scatter": "#9467bd"}


def collective_trace_figure(traces: dict, title: str = "", ax=None):
    """One row per rank, one box per collective it called, in order (``traces`` from
    ``detectors.read_traces``). A box with a thick red edge is a call the rank never returned
    from; the first call where the ranks disagree is shaded."""
    from matplotlib.patches import FancyBboxPatch

    from dpcourse.detectors import compare_traces

    own = ax is None
    if own:
        fig = new_figure(6.0, 0.7 + 0.6 * len(traces))
        ax = fig.add_subplot(1, 1, 1)
    report = compare_traces(traces)
    longest = max((len(t) for t in traces.values()), default=0)
    if report.index is not None:
        ax.axvspan(report.index - 0.5, report.index + 0.5, color="#ffdddd", zorder=0)
    for r, calls in traces.items():
        for c in calls:
            colour = _OP_COLOURS.get(c["op"], "#8c564b")
            ax.add_patch(FancyBboxPatch(
                (c["i"] - 0.42, r - 0.3), 0.84, 0.6, boxstyle="round,pad=0.02",
                facecolor=colour, alpha=0.85, edgecolor="#d62728" if not c["done"] else "white",
                linewidth=3 if not c["done"] else 1))
            ax.text(c["i"], r, c["op"].replace("_", "\n", 1), ha="center", va="center",
                    fontsize=7, color="white")
        if not calls or calls[-1]["done"]:
            ax.text(len(calls) - 0.4, r, "returned", va="center", fontsize=7, color="#444444")
    ax.set_xlim(-0.6, max(longest, 1) + 0.6)
    ax.set_ylim(len(traces) - 0.4, -0.6)
    ax.set_yticks(list(traces))
    ax.set_yticklabels([f"rank {r}" for r in traces])
    ax.set_xticks(range(max(longest, 1)))
    ax.set_xlabel("collective call #")
    ax.set_title(title, fontsize=9)
    if own:
        fig.subplots_adjust(left=0.14, right=0.97, bottom=0.3 if len(traces) < 3 else 0.2,
                            top=0.85)
        return fig
    return ax


def collective_traces_figure(panels: dict):
    """:func:`collective_trace_figure` for several programs, one panel each
    (``panels[title] = traces``)."""
    n = len(panels)
    fig = new_figure(6.5, 1.25 * n + 0.4)
    for k, (title, traces) in enumerate(panels.items()):
        collective_trace_figure(traces, title, ax=fig.add_subplot(n, 1, k + 1))
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.1, top=0.94, hspace=1.0)
    return fig


def replica_checksums_figure(panels: dict):
    """``panels[title][variant]`` = per-rank lists of one number per step (a weight checksum).
    Broken runs drawn solid, fixed runs dashed; ranks that agree draw one line."""
    fig = new_figure(9.0, 3.3)
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    for k, (title, variants) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), k + 1)
        for variant, per_rank in variants.items():
            style = "-" if variant == "broken" else "--"
            for r, values in enumerate(per_rank):
                ax.plot(range(len(values)), values, style, marker="o", ms=3,
                        color=colours[r % 4] if variant == "broken" else "#555555",
                        lw=1.5 if variant == "broken" else 2.5, alpha=0.9,
                        label=f"rank {r} ({variant})")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("weight checksum")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.15, top=0.9, wspace=0.3)
    return fig


def nan_spread_figure(local: Sequence[Sequence[float]], evaluated: dict, bad: tuple | None,
                      what: str = "local gradient norm"):
    """Left: each rank's local value per step (``what``; a cross where it is NaN); right: the
    loss of the
    model after each step, broken and fixed (``evaluated[variant]`` per step). ``bad``: the
    (step, ranks) where the first NaN appeared."""
    fig = new_figure(9.0, 3.3)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    finite_max = max((v for vals in local for v in vals if math.isfinite(v)), default=1.0)
    for r, vals in enumerate(local):
        steps = range(len(vals))
        ax.plot(steps, [v if math.isfinite(v) else np.nan for v in vals], "-o", ms=3,
                color=colours[r % 4], label=f"rank {r}")
        nan_steps = [s for s in steps if not math.isfinite(vals[s])]
        # one row of marks per rank, so no rank's marks hide another's
        ax.plot(nan_steps, [finite_max * (1.1 + 0.12 * r)] * len(nan_steps), "x", ms=8, mew=2,
                color=colours[r % 4])
    if bad is not None:
        ax.axvline(bad[0], color="#d62728", ls=":", lw=1)
        ax.text(bad[0], finite_max * 0.5, f" first NaN:\n rank {bad[1][0]}", fontsize=8,
                color="#d62728")
    ax.set_title(f"{what} per rank, before all-reduce (x = NaN, one row per rank)",
                 fontsize=9)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    for variant, vals in evaluated.items():
        steps = range(len(vals))
        bx.plot(steps, [v if math.isfinite(v) else np.nan for v in vals],
                "-o" if variant == "broken" else "--s", ms=3, label=variant)
        nan_steps = [s for s in steps if not math.isfinite(vals[s])]
        bx.plot(nan_steps, [0.04] * len(nan_steps), "x", ms=8, mew=2, color="#d62728",
                transform=bx.get_xaxis_transform())  # along the bottom edge
    bx.set_title("held-out loss after each step (x = NaN)", fontsize=9)
    bx.set_xlabel("step")
    bx.legend(fontsize=7)
    for a in (ax, bx):
        a.grid(True, alpha=0.3)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.15, top=0.9, wspace=0.25)
    return fig


def timeout_behaviour_figure(timeout: float = 2.0):
    """What a rank does when its partner never joins a collective, per backend, as torch 2.14's
    source describes it (a diagram, not a measurement): gloo blocks in the call and raises at
    the timeout; NCCL enqueues the collective and returns at once, Python runs on until it
    needs the result, and the watchdog thread aborts the whole process at the timeout; with
    ``TORCH_NCCL_BLOCKING_WAIT=1`` NCCL's ``wait()`` blocks and raises instead."""
    fig = new_figure(8.0, 3.2)
    ax = fig.add_subplot(1, 1, 1)
    end = timeout * 1.6
    rows = [("gloo", [(0, timeout, "#d62728", "in all_reduce (blocked)")],
             "raises 'Timed out' in the call"),
            ("NCCL (default)", [(0, 0.06 * end, "#1f77b4", ""),
                                (0.06 * end, timeout, "#9edae5", "Python runs on (call returned)"),
                                (timeout * 0.7, timeout, "#ff7f0e", "")],
             "watchdog aborts the process (SIGABRT)"),
            ("NCCL + BLOCKING_WAIT", [(0, timeout, "#d62728", "in wait() (blocked)")],
             "wait() raises"), ]
    for y, (name, spans, outcome) in enumerate(reversed(rows)):
        for a, b, colour, label in spans:
            ax.barh(y, b - a, left=a, height=0.5, color=colour, edgecolor="black", lw=0.5)
            if label:
                ax.text((a + b) / 2, y, label, ha="center", va="center", fontsize=7)
        ax.plot([timeout], [y], "X", color="black", ms=9)
        ax.text(timeout + 0.03 * end, y, outcome, va="center", fontsize=7)
    ax.text(timeout * 0.85, 1.33, "blocks at .item()", fontsize=7, ha="center", color="#ff7f0e")
    ax.axvline(timeout, color="grey", ls=":", lw=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in reversed(rows)], fontsize=8)
    ax.set_xlim(0, end * 1.25)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xticks([0, timeout])
    ax.set_xticklabels(["collective called", "timeout"], fontsize=8)
    ax.set_title("rank 0 calls all_reduce; its partner never does", fontsize=9)
    fig.subplots_adjust(left=0.2, right=0.98, bottom=0.12, top=0.9)
    return fig


def straggler_gantt_figure(spans: dict, applied: dict, budget: float):
    """One panel per mode (``spans[mode][worker] = [("compute" | "wait", start, end), ...]``,
    seconds from the mode's start): a row per worker, computing in colour, waiting in grey.
    ``applied[mode]``: the gradients the server applied, written in the panel's title."""
    modes = list(spans)
    fig = new_figure(8.5, 1.2 + 1.1 * len(modes) * max(len(v) for v in spans.values()) / 2)
    colours = {"compute": "#1f77b4", "wait": "#d9d9d9"}
    for i, mode in enumerate(modes):
        ax = fig.add_subplot(len(modes), 1, i + 1)
        workers = sorted(spans[mode])
        for row, worker in enumerate(workers):
            for kind, a, b in spans[mode][worker]:
                ax.barh(row, max(b - a, 1e-4), left=a, height=0.6, lw=0,
                        color="#d62728" if kind == "compute" and worker == workers[-1]
                        else colours[kind])
        ax.axvline(budget, color="black", ls=":", lw=1)
        ax.set_yticks(range(len(workers)))
        ax.set_yticklabels([f"worker {w}" + (" (slow)" if w == workers[-1] else "")
                            for w in workers], fontsize=8)
        ax.set_title(f"{mode}: {applied[mode]} gradients applied", fontsize=9)
        ax.set_xlim(0, budget * 1.15)
        if i == len(modes) - 1:
            ax.set_xlabel("seconds (dotted: the budget; blue/red: computing, grey: waiting)")
    fig.subplots_adjust(left=0.16, right=0.98, bottom=0.16, top=0.92, hspace=0.6)
    return fig
