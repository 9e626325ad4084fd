"""Lesson 08 (sharded data parallelism): who holds what under each ZeRO stage and the memory
calculator (§1), ZeRO-3's step on a timeline (§4), memory and traffic counted against the
formulas (§5).
"""

from __future__ import annotations

from typing import Sequence

from .common import new_figure

__all__ = ["zero_holdings_figure", "zero_calculator_figure", "zero3_timeline_figure",
           "zero_memory_figure", "zero_tradeoff_figure"]


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


def zero3_timeline_figure(events, layer_names: Sequence[str] | None = None):
    """ZeRO-3's step, one row per layer, from recorded calls: ``events`` is
    [(layer, kind, start_ms, end_ms)] with kind "all-gather (forward)", "all-gather
    (backward)", "reduce-scatter" or "free"
    (:func:`dpcourse.zero_experiments.zero3_timeline_worker`).
    Bars for the collectives; a green band where the layer's full weights exist outside a
    collective (from a gather's end to the layer's next free: the layer computes in it; in the
    backward the weights are freed before the reduce-scatter, as FSDP2 does), with a green
    marker above it, since a band can be narrower than a tick; a black tick where they are
    freed."""
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
                ax.barh(y, start - held_from, left=held_from, height=0.5, color="#2ca02c",
                        label=label, zorder=2)
                # a band can be a few pixels wide beside collectives of milliseconds: a
                # green marker above it says where it is, whatever its width
                ax.plot([(held_from + start) / 2], [y + 0.38], marker="v", color="#2ca02c",
                        markersize=6, zorder=3, linestyle="none",
                        label="a band's place" if "mark" not in labelled else None)
                labelled.add("mark")
                held_from = None
            if kind in colours:
                label = kind if kind not in labelled else None
                labelled.add(kind)
                ax.barh(y, end - start, left=start, height=0.5, color=colours[kind], label=label)
                if kind.startswith("all-gather"):
                    held_from = end
            elif kind == "free":
                ax.plot([start, start], [y - 0.3, y + 0.3], color="black", lw=0.8, zorder=2.5,
                        label="freed" if "free" not in labelled else None)
                labelled.add("free")
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels(list(reversed(names)))
    ax.set_xlabel("milliseconds into the step (rank 0)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_ylim(-0.6, len(layers) - 0.4 + 0.25)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3,
              frameon=False)
    fig.subplots_adjust(left=0.16, right=0.98, bottom=0.38 if len(layers) < 4 else 0.28,
                        top=0.95)
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
