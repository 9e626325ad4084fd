"""Lesson 09 (beyond lockstep): traffic through a parameter server, a straggler under sync and
async training, loss against staleness, local SGD's loss and drift against H, and the large-batch
runs' test loss per epoch — in the lesson's order.
"""

from __future__ import annotations

import bisect
from typing import Sequence

from .common import new_figure

__all__ = ["ps_traffic_figure", "typical_window", "straggler_gantt_figure", "staleness_figure",
           "local_sgd_drift_figure", "local_sgd_figure", "large_batch_figure"]


def _finish(fig, ax, xlabel: str, ylabel: str, margins: dict, legend_size: int = 8):
    """The axes' labels, a light grid and the legend; the figure's margins."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.subplots_adjust(**margins)
    return fig


def ps_traffic_figure(numel: int, measured: dict, ns: Sequence[int] = range(2, 17)):
    """Elements sent + received per step, like for like: through a parameter server (2NK: NK
    out, NK in) against through one rank of a ring all-reduce (4(N-1)K/N: 2(N-1)K/N each way);
    ``measured = {N: elements counted at the server, sent + received}``.

    Shown in lesson 09, §1."""
    fig = new_figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    ns = list(ns)
    ax.plot(ns, [2 * n * numel / 1e3 for n in ns], "-", color="#d62728",
            label="parameter server: through the server, 2NK")
    ax.plot(ns, [4 * (n - 1) * numel / n / 1e3 for n in ns], "-", color="#1f77b4",
            label="ring all-reduce: through one rank, 4(N-1)K/N")
    ax.plot(list(measured), [v / 1e3 for v in measured.values()], "o", color="#d62728",
            label="counted at our server")
    ax.axhline(4 * numel / 1e3, color="#1f77b4", ls=":", lw=1,
               label="4K: the ring's bound, for any N")
    ax.set_ylim(bottom=0)   # linear: the server's line is straight, the ring's levels off
    return _finish(fig, ax, "workers N", "elements sent + received\nper step (thousands)",
                   dict(left=0.15, right=0.97, bottom=0.14, top=0.95))


def typical_window(row: list, budget: float, zoom: float = 0.02):
    """The ``zoom``-second window of one worker's spans (``row = [(kind, start, end), ...]``)
    (starting where one of its spans starts) whose computing share is within 2 points of the
    share over its whole run (its compute spans' durations over all its spans' durations), the
    one nearest the middle of the budget; if none is, the closest in share. Returns ``(start,
    share in the window, share over the run)``.

    Shown in lesson 09, §1."""
    row = sorted(row, key=lambda s: s[1])
    done = [0.0]                       # done[j]: computing before row[j] starts
    for kind, a, b in row:
        done.append(done[-1] + (b - a) * (kind == "compute"))
    starts = [a for _, a, _ in row]

    def computing_before(t):           # seconds of computing before time t
        j = max(0, bisect.bisect_right(starts, t) - 1)
        kind, a, b = row[j]
        return done[j] + (min(max(t - a, 0), b - a) if kind == "compute" else 0)

    run = done[-1] / sum(b - a for _, a, b in row)

    def share(t):                      # the computing share of the window from t
        return (computing_before(t + zoom) - computing_before(t)) / zoom

    candidates = [a for a in starts if a + zoom <= row[-1][2]] or [row[0][1]]
    close = [t for t in candidates if abs(share(t) - run) <= 0.02]   # within 2 points
    start = (min(close, key=lambda t: abs(t - budget / 2)) if close
             else min(candidates, key=lambda t: abs(share(t) - run)))
    return start, share(start), run


def straggler_gantt_figure(spans: dict, applied: dict, budget: float, zoom: float = 0.02):
    """One panel per mode (``spans[mode][worker] = [("compute" | "sleep" | "wait", start, end),
    ...]``, seconds from the mode's start): a row per worker, computing in colour (the slow
    worker in red), its injected sleep in pink, waiting in grey.
    ``applied[mode]``: the gradients the server applied, written in the panel's title.
    A computation narrower than 1.5 pixels and followed by a longer span (a fast worker's 0.7 ms
    before a long wait: 0.3 px) is drawn 1.5 px wide, on top, or antialiasing would erase it;
    a run of short spans is left as drawn, a blend of its colours. So a last panel (when
    ``zoom`` is not 0) shows ``zoom`` seconds of the last mode (boxed in its panel), where the
    short spans are many pixels wide: computing and waiting at their true widths. The window is
    a typical one: :func:`typical_window` over the first worker, computing there about the
    share it computes over the run (``fig.zoom_window = (start, window share, run share)``).

    Shown in lesson 09, §1."""
    modes = list(spans)
    panels = modes + [modes[-1]] * bool(zoom)   # the zoomed panel repeats the last mode
    fig = new_figure(8.5, 1.2 + 1.1 * len(panels) * max(len(v) for v in spans.values()) / 2)
    colours = {"compute": "#1f77b4", "sleep": "#f7c6c7", "wait": "#d9d9d9"}
    left, right = 0.16, 0.98
    z0 = 0.0                # where the zoomed window starts: a typical window of worker 1
    if zoom:
        fig.zoom_window = typical_window(spans[modes[-1]][min(spans[modes[-1]])], budget, zoom)
        z0 = fig.zoom_window[0]
    for i, mode in enumerate(panels):
        zoomed = i == len(modes)
        x0, shown = (z0, zoom) if zoomed else (0, budget * 1.15)   # the seconds the x axis spans
        tick = (0 if zoomed  # zoomed: no widening, every span at its true width
                else 1.5 * shown / (fig.get_figwidth() * fig.dpi * (right - left)))  # 1.5 px
        ax = fig.add_subplot(len(panels), 1, i + 1)
        workers = sorted(spans[mode])
        for row, worker in enumerate(workers):
            row_spans, ticks = spans[mode][worker], []
            for j, (kind, a, b) in enumerate(row_spans):
                colour = ("#d62728" if kind == "compute" and worker == workers[-1]
                          else colours[kind])
                ax.barh(row, max(b - a, 1e-4), left=a, height=0.6, lw=0, color=colour)
                after = row_spans[j + 1] if j + 1 < len(row_spans) else None
                if kind == "compute" and b - a < tick and (after is None
                                                           or after[2] - after[1] >= tick):
                    ticks.append((a, colour))
            for a, colour in ticks:
                ax.barh(row, tick, left=a, height=0.6, lw=0, color=colour)
        ax.set_yticks(range(len(workers)))
        ax.set_yticklabels([f"worker {w}" + (" (slow)" if w == workers[-1] else "")
                            for w in workers], fontsize=8)
        if zoomed:
            ax.set_title(f"{mode}, zoomed: the {1e3 * zoom:g} ms from {z0:.3f} s (boxed above),"
                         f" worker {workers[0]} computing {fig.zoom_window[1]:.0%} of it "
                         f"({fig.zoom_window[2]:.0%} over the run); true widths", fontsize=9)
            ax.locator_params(axis="x", nbins=5)
        else:
            ax.axvline(budget, color="black", ls=":", lw=1)
            ax.set_title(f"{mode}: {applied[mode]} gradients applied", fontsize=9)
            if zoom and mode == modes[-1]:
                ax.axvspan(z0, z0 + zoom, fill=False, ec="black", lw=0.8)
        ax.set_xlim(x0, x0 + shown)
        if i == len(panels) - 1:
            ax.set_xlabel("seconds (dotted: the budget; blue/red: computing, pink: the slow "
                          "worker's injected sleep, grey: waiting)")
    fig.subplots_adjust(left=left, right=right, bottom=0.16, top=0.92, hspace=0.6)
    return fig


def staleness_figure(taus: Sequence[int], losses: dict, aware: dict | None = None,
                     start_loss: float | None = None, cap: float = 3.0):
    """Test loss after a fixed budget against the staleness τ, one line per learning rate
    (``losses[lr] = [loss at each τ]``); a run off the scale (loss above ``cap``, inf or NaN)
    is drawn as an ✕ at the cap; a run that ended above its start is any point above the
    dotted line at ``start_loss``, ✕ included. ``aware[lr]``: the same with staleness-aware steps, dashed; a ``None``
    in it is a τ that was not run, left out of the line.

    Shown in lesson 09, §2."""
    fig = new_figure(6.5, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    colours = ["#2ca02c", "#1f77b4", "#d62728", "#9467bd", "#8c564b"]

    bad = []  # (τ, colour) of every run off the scale: drawn last, over every line

    def draw(values, colour, style, label):
        run = [(t, v) for t, v in zip(taus, values) if v is not None]
        ax.plot([t for t, _ in run], [min(v, cap) for _, v in run], style, color=colour,
                label=label)
        bad.extend((t, colour) for t, v in run if not v <= cap)

    for i, (lr, values) in enumerate(losses.items()):
        draw(values, colours[i % len(colours)], "o-", f"lr {lr:g}")
    for i, (lr, values) in enumerate((aware or {}).items()):
        j = list(losses).index(lr) if lr in losses else i
        draw(values, colours[j % len(colours)], "s--", f"lr {lr:g}, staleness-aware (lr/τ)")
    for t in dict.fromkeys(t for t, _ in bad):
        here = [c for u, c in bad if u == t]
        for k, colour in enumerate(here):      # several ✕ at one τ: side by side, not on top
            shift = k - (len(here) - 1) / 2
            x = t + 0.15 * shift if t < 1 else t * 1.12 ** shift
            ax.plot([x], [cap], "x", color=colour, ms=9, mew=2, zorder=5)
    if start_loss is not None:
        ax.axhline(start_loss, color="grey", ls=":", lw=1)
        ax.text(taus[0], start_loss, " loss at the start", fontsize=7, va="bottom", color="grey")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(list(taus))
    ax.set_xticklabels([str(t) for t in taus])
    if bad:  # room for the ✕ nudged right of the last τ
        ax.set_xlim(right=max(ax.get_xlim()[1], max(taus) * 1.25 if max(taus) >= 1 else 1.3))
    return _finish(fig, ax, "staleness τ (updates between a gradient's pull and its push)\n"
                   "(symlog axis: linear up to 1, logarithmic beyond)",
                   f"test loss after the budget\n(✕: above {cap:g} or blew up, drawn at {cap:g};"
                   "\nseveral at one τ side by side)",
                   dict(left=0.14, right=0.97, bottom=0.18, top=0.96), legend_size=7)


def local_sgd_drift_figure(hs: Sequence[int], losses: Sequence[float], start_loss: float,
                           drift: dict):
    """Left: the test loss after the budget against H, on an axis that includes the starting
    loss (a dashed line), so the spread is read against the progress made. Right: the drift
    measured at each average (``drift[h]``: one value per average, every H steps) against the
    step at which it was measured, one line per H.

    Shown in lesson 09, §3."""
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


def local_sgd_figure(hs: Sequence[int], losses: Sequence[float], averages: Sequence[int],
                     ddp_loss: float | None = None):
    """Left: test loss after the budget against H; right: the averages (all-reduces) that
    took, against H, on log axes. (The lesson now draws :func:`local_sgd_drift_figure`
    instead; tests/test_async_sgd.py still draws this one.)"""
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


def large_batch_figure(curves: dict, start_loss: float | None = None):
    """Test loss after each epoch, one line per run (``curves[label] = [loss per epoch]``);
    with ``start_loss``, every line starts from it at epoch 0 and a dotted line marks it.

    Shown in lesson 09, §4."""
    fig = new_figure(6.5, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    for label, losses in curves.items():
        xs, ys = list(range(1, len(losses) + 1)), list(losses)
        if start_loss is not None:
            xs, ys = [0] + xs, [start_loss] + ys
        ax.plot(xs, ys, "o-", label=label)
    if start_loss is not None:
        ax.axhline(start_loss, color="grey", ls=":", lw=1, label="loss at the start")
    epochs = max(len(losses) for losses in curves.values())
    ax.set_xticks(list(range(0 if start_loss is not None else 1, epochs + 1)))
    return _finish(fig, ax, "epoch", "test loss",
                   dict(left=0.11, right=0.97, bottom=0.13, top=0.96))
