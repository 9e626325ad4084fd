"""Lesson 06 (ring all-reduce): the ring drawn step by step and its stepper (§1), the α-β cost
model of five algorithms (§2), the model fitted to this machine's measurements and the
cost-model explorer (§3); the segmented ring as a timeline (:func:`pipeline_figure`).
"""

from __future__ import annotations

import math
import textwrap
from typing import Sequence

import numpy as np

from .common import figure_to_png, new_figure, show
from .interactive import widget_with_fallback

__all__ = ["draw_ring_step", "ring_steps_figure", "ring_frames", "ring_stepper", "cost_figure",
           "fit_figure", "cost_vs_n_figure", "pipeline_figure", "rabenseifner_figure"]


_PHASE_COLOURS = {"start": "#555555", "reduce-scatter": "#1f77b4", "all-gather": "#2ca02c"}


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
                 caption: str = "every state of the ring: after N−1 reduce-scatter steps each "
                                "worker owns one complete chunk; N−1 all-gather steps later "
                                "every worker holds every complete chunk."):
    """Show an interactive stepper (play button, slider, "next" button) over the ring's steps,
    then — unless ``static=False`` — a static figure of every step. Returns the widget (None
    without ipywidgets). Every frame is rendered to PNG up front and swapped into an
    ``ipywidgets.Image`` as the slider moves.
    """
    n_states = len(trace.steps)

    def build(widgets):
        frames = ring_frames(trace)
        last = len(frames) - 1
        image = widgets.Image(value=frames[0], format="png")
        slider = widgets.IntSlider(value=0, min=0, max=last, description="step")
        play = widgets.Play(value=0, min=0, max=last, interval=900, description="play")
        widgets.jslink((play, "value"), (slider, "value"))
        label = widgets.Label(value=trace.describe(0))
        # A plain "next" button and a counter: the slider alone is fiddly to move by exactly
        # one step, and a browser test clicks this button by its name.
        # State 0 is the start (nothing sent yet); steps are numbered 1 … 2(N−1), as in the
        # trace and the figure titles.
        def counted(i):
            return f"start (0 / {last})" if i == 0 else f"step {i} / {last}"

        counter = widgets.Label(value=counted(0))
        counter.add_class("dpcourse-step-counter")
        next_button = widgets.Button(description="next", layout=widgets.Layout(width="70px"))

        def on_change(change):
            i = change["new"]
            image.value = frames[i]
            label.value = trace.describe(i)
            counter.value = counted(i)

        def on_next(_button):
            slider.value = min(slider.value + 1, last)  # stops at the last step

        slider.observe(on_change, names="value")
        next_button.on_click(on_next)
        box = widgets.VBox([widgets.HBox([play, slider, next_button, counter]), label, image])
        box.add_class("dpcourse-stepper")  # what the browser tests look for
        return box

    def every_state():
        if static:
            show(ring_steps_figure(trace), caption)

    return widget_with_fallback(
        build, every_state,
        placeholder=f"[interactive stepper over {n_states} ring states: run the notebook live "
                    f"to use it; all states are drawn below]")


def rabenseifner_figure(rounds: Sequence[dict], length: int):
    """Rabenseifner's rounds, as :func:`dpcourse.ring.simulate_rabenseifner` recorded them
    (its ``rounds`` list): one panel per round, each worker a row of ``length`` cells, the part
    it still reduces (halving) or holds complete (doubling) after that round shaded, the
    partners of the round named on the left."""
    n = len(rounds[0]["parts"])
    panels = [{"phase": "start", "distance": 0, "parts": [(0, length)] * n}] + list(rounds)
    fig = new_figure(2.0 * len(panels), 0.45 * n + 0.9)
    colours = {"start": "#bbbbbb", "halving": "#1f77b4", "doubling": "#2ca02c"}
    for k, rd in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        for w, (lo, hi) in enumerate(rd["parts"]):
            y = n - 1 - w
            ax.add_patch(_rect(0, y + 0.1, length, 0.8, "white", "#999999"))
            ax.add_patch(_rect(lo, y + 0.1, hi - lo, 0.8, colours[rd["phase"]], "black"))
            label = f"w{w}" if not rd["distance"] else f"w{w}↔w{w ^ rd['distance']}"
            ax.text(-0.3, y + 0.5, label, ha="right", va="center", fontsize=7)
        ax.set_xlim(-3.2, length + 0.2)
        ax.set_ylim(0, n)
        ax.axis("off")
        title = "start" if k == 0 else f"round {k}: {rd['phase']}\n(partners {rd['distance']} apart)"
        ax.set_title(title, fontsize=8)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.02, top=0.78, wspace=0.05)
    return fig


def _rect(x, y, w, h, face, edge):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, linewidth=0.6)


def cost_figure(alpha: float, beta: float, n_fixed: int = 8, nbytes_fixed: float = 100e6,
                ns: Sequence[int] = tuple(range(2, 65)),
                sizes: Sequence[float] = tuple(np.logspace(3, 9, 13)),
                algorithms: Sequence[str] | None = None):
    """Two panels: all-reduce time against N (at ``nbytes_fixed``) and against K (at
    ``n_fixed``), for each algorithm under the alpha-beta model (all five of
    ``ring.COST_MODELS`` unless ``algorithms`` names fewer). Both time axes are logarithmic, so
    a millisecond curve stays readable beside one of a second; Rabenseifner's is dashed, as it
    lies on the ring's wherever N is a power of two. Left, a cost exists only at whole N: each
    N in ``ns`` (by default 2 … 64) is a dot held flat from N − ½ to N + ½, not a line slanting
    to the next N, so Rabenseifner's jump of 2(α + Kβ) just after each power of two shows as a
    jump, not as a dip toward the ring between integers."""
    from dpcourse.ring import COST_MODELS, cost

    algorithms = algorithms or COST_MODELS
    fig = new_figure(10, 3.8)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    # The model's tree is the simple one (binomial, whole message per round), not NCCL's
    # pipelined double binary tree: say so on the figure.
    labels = {"tree": "binomial tree (unpipelined)"}
    for alg in algorithms:
        label = labels.get(alg, alg)
        style = "--" if alg == "rabenseifner" else "-"
        ax1.step(ns, [cost(alg, n, nbytes_fixed, alpha, beta).seconds for n in ns], style,
                 where="mid", marker=".", markersize=3, label=label)
        ax2.loglog(sizes, [cost(alg, n_fixed, k, alpha, beta).seconds for k in sizes], style,
                   label=label)
    ax1.set_yscale("log")
    ax1.set_xlabel("workers N")
    ax1.set_ylabel("seconds per all-reduce")
    ax1.set_title(f"K = {nbytes_fixed / 1e6:g} MB", fontsize=10)
    ax2.set_xlabel("bytes K")
    ax2.set_ylabel("seconds per all-reduce")
    ax2.set_title(f"N = {n_fixed}", fontsize=10)
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=len(algorithms),
               fontsize=8, frameon=False)  # one legend for both panels, below them
    fig.suptitle(f"alpha-beta model: alpha = {alpha * 1e6:g} us, 1/beta = {1 / beta / 1e9:g} GB/s",
                 fontsize=10)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.22, top=0.85, wspace=0.25)
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


def cost_vs_n_figure(alpha: float, beta: float, nbytes: float, n_max: int = 64):
    """Lesson 06's explorer: all-reduce time of every algorithm :func:`dpcourse.ring.cost`
    prices (Rabenseifner's included) against N (2..n_max) at K = ``nbytes``; the background of
    each N is shaded with the colour of the cheapest algorithm there, and the title says at
    which N each one is the cheapest (``ring.cheapest_by_n``: the same comparison as the
    lesson's sentences). Its α and β are written as lesson 06 prints the fit (α in µs to 0.1,
    1/β in GB/s to 0.01), so the figure can be read against that line. Each N's cost is a dot
    held flat over its shaded band (N ± ½), not a line slanting to the next N: costs exist only
    at whole N, and Rabenseifner's jumps just after each power of two."""
    from dpcourse.ring import COST_MODELS, cheapest_by_n, cost, spans

    ns = list(range(2, max(int(n_max), 3) + 1))
    times = {alg: [cost(alg, n, nbytes, alpha, beta).seconds for n in ns] for alg in COST_MODELS}
    fig = new_figure(6.5, 4.0)
    ax = fig.add_subplot(1, 1, 1)
    labels = {"tree": "binomial tree (unpipelined)"}
    colours = {}
    for alg in COST_MODELS:
        (line,) = ax.step(ns, times[alg], where="mid", marker=".", markersize=3,
                          label=labels.get(alg, alg))
        colours[alg] = line.get_color()
    where = cheapest_by_n(nbytes, alpha, beta, n_max=ns[-1])
    for alg, at in where.items():
        for n in at:
            ax.axvspan(n - 0.5, n + 0.5, color=colours[alg], alpha=0.12, lw=0)
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator

    # Often under a decade: label 1, 2 and 5 of each decade, as plain numbers.
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("workers N")
    ax.set_ylabel("seconds per all-reduce")
    best = "; ".join(f"{labels.get(a, a).split(' (')[0]} at N = {spans(at)}"
                     for a, at in where.items())
    ax.set_title(f"K = {nbytes / 1e6:.3g} MB, alpha = {alpha * 1e6:.1f} us, "
                 f"1/beta = {1 / beta / 1e9:.2f} GB/s\n"
                 + textwrap.shorten(f"cheapest: {best}", 120, placeholder=" …"), fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.subplots_adjust(left=0.14, right=0.97, bottom=0.12, top=0.87)
    return fig


def pipeline_figure(schedules: dict):
    """The segmented ring as a timeline: one panel per entry of ``schedules`` (title -> the
    :class:`dpcourse.ring.Slot` list of :func:`dpcourse.ring.pipeline_schedule`), one row per
    rank. On each row a box is a piece on that rank's link to rank + 1, coloured by its chunk
    and labelled chunk.piece (chunk alone when a chunk is one piece); the thin grey bar under
    it is that rank adding a piece it received. Dotted lines mark where the all-gather's
    first piece leaves."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    panels = list(schedules.items())
    n = 1 + max(s.rank for _, slots in panels for s in slots)
    end = max(s.end for _, slots in panels for s in slots)
    fig = new_figure(10, 1.0 + 1.25 * n * len(panels) / 2)
    for k, (title, slots) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, k + 1)
        segments = 1 + max(s.segment for s in slots)
        for s in slots:
            y = n - 1 - s.rank
            if s.kind == "send":
                ax.broken_barh([(s.start, s.end - s.start)], (y - 0.3, 0.6),
                               facecolors=cmap(s.chunk % 10), edgecolor="white", linewidth=0.8)
                label = f"{s.chunk}" if segments == 1 else f"{s.chunk}.{s.segment}"
                ax.text((s.start + s.end) / 2, y, label, ha="center", va="center", fontsize=7,
                        color="white")
            else:
                ax.broken_barh([(s.start, s.end - s.start)], (y - 0.45, 0.1), facecolors="#777777")
        gather = min(s.start for s in slots if s.kind == "send" and s.step >= n)
        ax.axvline(gather, color="#333333", linestyle=":", linewidth=1)
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"rank {r} -> {(r + 1) % n}" for r in reversed(range(n))],
                           fontsize=8)
        ax.set_xlim(0, end * 1.01)
        ax.set_ylim(-0.6, n - 0.4)
        total = max(s.end for s in slots)
        ax.set_title(f"{title}: done at {total:g}", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlabel("time, in transfer times of one whole chunk (grey bars: additions)")
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.1, top=0.93, hspace=0.55)
    return fig
