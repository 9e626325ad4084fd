"""Lesson 11's figures: where data parallelism ends, who holds which shard of a tensor-parallel
MLP, the pipeline's Gantt chart (measured beside the ideal), the bubble explorer, the 2-D mesh
and the planner's configurations."""

from __future__ import annotations

from .common import new_figure

__all__ = [
    "memory_wall_figure",
    "noise_scale_figure",
    "tp_shards_figure",
    "pipeline_gantt_figure",
    "bubble_figure",
    "mesh_2d_figure",
    "planner_figure",
]

_RANK_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f"]


def memory_wall_figure(ns, state_gb, activation_gb, gpu_gb: float, title: str,
                       working_gb: float = 0.0):
    """One stacked bar per N, on a linear axis: ZeRO-3's model state per GPU (falls as 1/N),
    the activations of one sequence (flat) and ZeRO-3's working set (``working_gb``, flat) on
    top, each bar labelled with its total — the sum that has to fit — against the GPU's
    memory (dashed). Drawn in lesson 11, §1."""
    fig = new_figure(6.8, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.55
    xs = list(range(len(ns)))
    layers = [(state_gb, "#1f77b4", "model state (ZeRO-3: 16Ψ/N)"),
              (activation_gb, "#ff7f0e", "activations at batch 1 (do not shard)")]
    if working_gb:
        layers.append(([working_gb] * len(xs), "#d62728",
                       "ZeRO-3's working set (two layers' weights, one's gradient)"))
    bottom = [0.0] * len(xs)
    for values, colour, label in layers:
        ax.bar(xs, values, width, bottom=bottom, color=colour, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in zip(xs, bottom):
        ax.text(x, total, f"{total:.0f} GB", ha="center", va="bottom", fontsize=8)
    ax.axhline(gpu_gb, color="k", ls="--", lw=1, label=f"the GPU's memory ({gpu_gb:.1f} GB)")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"N={n}" for n in ns])
    ax.set_ylabel("GB per GPU")
    ax.set_ylim(0, 1.25 * max(max(bottom), gpu_gb))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.1, top=0.9)
    return fig


def noise_scale_figure(b_simple: float, per_rank: int, ranks):
    """Steps to a given loss, relative to the fewest possible, against the global batch β:
    S/S_min = 1 + B_noise/β (McCandlish et al. 2018) evaluated with the measured simple noise
    scale ``b_simple`` standing in for B_noise (labelled as such), with the global batches of
    ``ranks`` data-parallel ranks of ``per_rank`` examples marked. Drawn in lesson 11, §1."""
    import numpy as np

    fig = new_figure(6.8, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    bs = np.logspace(0, np.log10(max(ranks) * per_rank * 4), 200)
    ax.plot(bs, 1 + b_simple / bs, color="#1f77b4",
            label="steps / fewest steps = 1 + B_simple/β\n(B_simple standing in for B_noise)")
    perfect = bs[0] * (1 + b_simple / bs[0]) / bs
    keep = perfect >= 0.9
    ax.plot(bs[keep], perfect[keep], color="#7f7f7f", ls=":",
            label="perfect scaling (steps ∝ 1/β)")
    for n in ranks:
        b = n * per_rank
        ax.plot([b], [1 + b_simple / b], "o", color="#d62728")
        ax.annotate(f"N={n}", (b, 1 + b_simple / b), textcoords="offset points", xytext=(4, 6),
                    fontsize=8)
    ax.axvline(b_simple, color="#2ca02c", ls="--", lw=1)
    ax.text(b_simple, 1 + b_simple / 4, f" B_simple ≈ {b_simple:.0f}", color="#2ca02c",
            fontsize=8, va="center")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("global batch β (examples)")
    ax.set_ylabel("steps / fewest steps")
    ax.legend(fontsize=8, loc="upper right")
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.14, top=0.95)
    return fig


def tp_shards_figure(d: int, h: int, world_size: int, answer: bool = False):
    """The MLP's two weight matrices in Megatron's layout (Y = GeLU(X·A)·B, A is d × h, B is
    h × d) and each rank's slice: A cut by columns, B by rows. With ``answer`` (lab 11's answer:
    a PNG cannot wait behind a click in every viewer, so the lesson draws it without), also
    where the biases go (the first one's slice with A's columns, the second whole on every rank,
    added once after the all-reduce) and, below, one rank's forward (left to right) and backward
    (right to left) with every tensor marked R (replicated), S (this rank's slice) or P
    (partial: a term of a sum over the ranks), and what f and g do on each pass.
    Drawn in lesson 11, §2."""
    if not answer:
        fig = new_figure(8.0, 3.6)
        _draw_shards(fig.add_subplot(1, 1, 1), d, h, world_size, biases=False)
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.99)
        return fig
    fig = new_figure(10.0, 7.0)
    _draw_shards(fig.add_axes((0.1, 0.5, 0.8, 0.49)), d, h, world_size, biases=True)
    _draw_placements(fig.add_axes((0.01, 0.01, 0.98, 0.45)))
    return fig


def _draw_shards(ax, d: int, h: int, world_size: int, biases: bool):
    from matplotlib.patches import Rectangle

    unit = 3.0 / max(d, h)
    top = 3.0
    x_w, a_x, b_x = 0.5, 1.6, 6.2
    # X: tokens x d, the same on every rank
    ax.add_patch(Rectangle((0.0, top - d * unit), x_w, d * unit, fc="#dddddd", ec="k"))
    # who holds X whole, and what the GeLU needs, are lab 11's: labelled only in the answer
    ax.text(x_w / 2, top + 0.15, "X\n(every rank)" if biases else "X", ha="center",
            va="bottom", fontsize=8)
    ax.annotate("", xy=(a_x - 0.1, top - d * unit / 2), xytext=(x_w + 0.1, top - d * unit / 2),
                arrowprops=dict(arrowstyle="->"))
    ax.text((x_w + a_x) / 2, top - d * unit / 2 + 0.1, "f", ha="center", va="bottom",
            fontsize=10, style="italic")
    for r in range(world_size):   # A: d x h, cut into column blocks
        ax.add_patch(Rectangle((a_x + r * h * unit / world_size, top - d * unit),
                               h * unit / world_size, d * unit, fc=_RANK_COLOURS[r % 8],
                               ec="k", alpha=0.75))
    ax.text(a_x + h * unit / 2, top + 0.15, f"A ({d} × {h}): column-parallel\nrank r keeps "
            f"{h // world_size} columns" + (" (+ that slice of b₁)" if biases else ""),
            ha="center", va="bottom", fontsize=8)
    ax.text(a_x + h * unit / 2, top - d * unit - 0.15,
            "→ GeLU on each rank's slice (no communication)" if biases else "→ GeLU",
            ha="center", va="top", fontsize=8)
    for r in range(world_size):   # B: h x d, cut into row blocks
        ax.add_patch(Rectangle((b_x, top - (r + 1) * h * unit / world_size), d * unit,
                               h * unit / world_size, fc=_RANK_COLOURS[r % 8], ec="k",
                               alpha=0.75))
    ax.text(b_x + d * unit / 2, top + 0.15, f"B ({h} × {d}): row-parallel\nrank r keeps "
            f"{h // world_size} rows", ha="center", va="bottom", fontsize=8)
    g_x = b_x + d * unit + 0.2
    ax.annotate("", xy=(g_x + 0.9, top - 1.2), xytext=(g_x, top - 1.2),
                arrowprops=dict(arrowstyle="->"))
    ax.text(g_x + 0.45, top - 1.1, "g", ha="center", va="bottom", fontsize=10, style="italic")
    # what g does is lab 11's first question: drawn only in the answer's figure
    ax.text(g_x + 0.45, top - 1.35, "all-reduce:\nY = Σ Y_r" if biases else "Y\n(how: lab 11)",
            ha="center", va="top", fontsize=8)
    if biases:
        ax.add_patch(Rectangle((g_x + 1.0, top - 1.45), 0.5, 0.5, fc="#bbbbbb", ec="k"))
        ax.text(g_x + 1.25, top - 0.85, "+ b₂\n(whole, once)", ha="center", va="bottom",
                fontsize=8)
    for r in range(world_size):
        ax.add_patch(Rectangle((r * 1.3, -0.45), 0.25, 0.2, fc=_RANK_COLOURS[r % 8], ec="k",
                               alpha=0.75))
        ax.text(r * 1.3 + 0.32, -0.35, f"rank {r}", va="center", fontsize=8)
    ax.set_xlim(-0.1, g_x + 1.7)
    ax.set_ylim(-0.6, top + 0.75)
    ax.set_aspect("equal")
    ax.axis("off")


def _draw_placements(ax):
    from matplotlib.patches import FancyBboxPatch, Patch

    colours = {"R": "#dddddd", "S": "#9ecae1", "P": "#fdae6b"}
    fwd = [("X", "R"), ("X", "R"), ("Z_r = X·A_r", "S"), ("H_r = GeLU(Z_r)", "S"),
           ("Y_r = H_r·B_r", "P"), ("Y = Σ Y_r", "R"), ("Y + b₂", "R")]
    fwd_ops = [("f: identity", True), ("·A_r", False), ("GeLU", False), ("·B_r", False),
               ("g: all-reduce", True), ("+ b₂ (once)", False)]
    bwd = [("∂L/∂X", "R"), ("Σ_r ∂L/∂Z_r·A_rᵀ", "P"), ("∂L/∂Z_r", "S"), ("∂L/∂H_r", "S"),
           ("∂L/∂Y_r = ∂L/∂Y", "R"), ("∂L/∂Y", "R"), ("∂L/∂out", "R")]
    bwd_ops = [("f: all-reduce", True), ("·A_rᵀ", False), ("GeLU′", False), ("·B_rᵀ", False),
               ("g: identity", True), ("", False)]
    step, w, hgt = 1.6, 1.25, 0.55
    for row, (tensors, ops, y, arrow) in enumerate(((fwd, fwd_ops, 1.6, "->"),
                                                    (bwd, bwd_ops, 0.0, "<-"))):
        for i, (name, kind) in enumerate(tensors):
            ax.add_patch(FancyBboxPatch((i * step, y), w, hgt, boxstyle="round,pad=0.02",
                                        fc=colours[kind], ec="k", lw=0.8))
            ax.text(i * step + w / 2, y + hgt / 2, f"{name}\n[{kind}]", ha="center",
                    va="center", fontsize=7)
        for i, (op, comm) in enumerate(ops):
            x0, x1 = i * step + w, (i + 1) * step
            ax.annotate("", xy=(x1, y + hgt / 2), xytext=(x0, y + hgt / 2),
                        arrowprops=dict(arrowstyle=arrow, color="#d62728" if comm else "k",
                                        lw=2 if comm else 1))
            if op:
                ax.text((x0 + x1) / 2, y + hgt + 0.08, op, ha="center", va="bottom",
                        fontsize=7, color="#d62728" if comm else "k",
                        fontweight="bold" if comm else "normal")
    ax.text(-0.2, 1.6 + hgt / 2, "forward", ha="right", va="center", fontsize=8)
    ax.text(-0.2, hgt / 2, "backward", ha="right", va="center", fontsize=8)
    ax.text(2 * step + w / 2, -0.25, "weight gradients: ∂L/∂A_r = Xᵀ·∂L/∂Z_r [S], "
            "∂L/∂B_r = H_rᵀ·∂L/∂Y [S], ∂L/∂b₂ [R] — no communication",
            ha="left", va="top", fontsize=7)
    ax.legend(handles=[Patch(fc=c, ec="k", label=lab) for lab, c in (
        ("R: replicated", colours["R"]), ("S: this rank's slice", colours["S"]),
        ("P: partial (a sum still to do)", colours["P"]))],
        fontsize=7, loc="upper center", ncol=3, bbox_to_anchor=(0.5, 1.02), frameon=False)
    ax.set_xlim(-1.3, 6 * step + w + 0.1)
    ax.set_ylim(-0.6, 2.75)
    ax.axis("off")


def _gantt(ax, events, stages: int, title: str):
    for stage, kind, m, start, end in events:
        colour = _RANK_COLOURS[m % 8]
        ax.barh(stage, end - start, left=start, height=0.8, color=colour,
                alpha=0.55 if kind == "F" else 0.95, edgecolor="k", lw=0.4)
        if end - start > 0:
            ax.text((start + end) / 2, stage, f"{kind}{m}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(stages))
    ax.set_yticklabels([f"stage {k}" for k in range(stages)])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)


def pipeline_gantt_figure(measured, ideal, stages: int, m: int, measured_bubble: float,
                          ideal_bubble: float, schedule: str = "GPipe"):
    """Two Gantt charts of one pipeline step, one row per stage, F = forward, B = backward
    of micro-batch i (colour): on top as measured (milliseconds), below as played with fixed
    times (forward 1, backward 2). Drawn in lesson 11, §3."""
    fig = new_figure(8.0, 4.6)
    ax1 = fig.add_subplot(2, 1, 1)
    _gantt(ax1, [(s, k, i, a * 1e3, b * 1e3) for s, k, i, a, b in measured], stages,
           f"{schedule}, K={stages}, M={m}: measured — idle share {measured_bubble:.0%}")
    ax1.set_xlabel("ms", fontsize=8)
    ax2 = fig.add_subplot(2, 1, 2)
    _gantt(ax2, ideal, stages,
           f"ideal (forward 1, backward 2, no communication) — idle share {ideal_bubble:.0%}")
    ax2.set_xlabel("time slots", fontsize=8)
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.09, top=0.94, hspace=0.55)
    return fig


def bubble_figure(stages: int = 4, micro_batches: int = 4, schedule: str = "gpipe"):
    """The ideal Gantt chart of one step for K stages and M micro-batches
    (``pipeline_parallel.simulate_timeline``), with the bubble (K−1)/(M+K−1) and the most
    micro-batches a stage holds at once. Drawn in lesson 11, §3."""
    from dpcourse import pipeline_parallel as pp

    events = pp.simulate_timeline(stages, micro_batches, schedule)
    bubble = pp.measured_bubble(events)
    peak = max(pp.peak_in_flight(pp.SCHEDULES[schedule](stages, micro_batches, k))
               for k in range(stages))
    fig = new_figure(8.0, 1.2 + 0.45 * stages)
    ax = fig.add_subplot(1, 1, 1)
    _gantt(ax, events, stages,
           f"{schedule}, K={stages}, M={micro_batches}: bubble {bubble:.0%} = (K−1)/(M+K−1) = "
           f"{pp.ideal_bubble(stages, micro_batches):.0%}; stage 0 holds up to {peak} "
           "micro-batches")
    ax.set_xlabel("time slots (forward 1, backward 2)", fontsize=8)
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.5 / (1.2 + 0.45 * stages) + 0.12,
                        top=0.85)
    return fig


def _held_block(full: tuple, tp_shape: tuple, local: tuple, tp_rank: int, dp_rank: int):
    """Where a rank's pieces of one weight sit in the plain weight, from the run's shapes: the
    tensor-parallel slice (the dimension whose size shrank, offset by the tp coordinate) and,
    inside it, FSDP2's shard (its dimension 0, offset by the dp coordinate). Each as
    (row0, rows, col0, cols)."""
    cut = next(d for d in range(2) if tp_shape[d] != full[d])
    start = [0, 0]
    start[cut] = tp_rank * tp_shape[cut]
    tp_box = (start[0], tp_shape[0], start[1], tp_shape[1])
    shard_box = (start[0] + dp_rank * local[0], local[0], start[1], local[1])
    return tp_box, shard_box


def mesh_2d_figure(results, d: int, h: int):
    """The 2 × 2 mesh as it ran: one panel per rank at its (dp, tp) coordinates, drawing the
    plain MLP's two weights (W1 of h × d, W2 of d × h) with the block the rank holds during
    its forward and backward (its tensor-parallel slice, light) and the part FSDP2 keeps
    between steps (dark) — both placed from the run's own shapes and coordinates; between the
    panels, the group each collective runs in and the bytes it moved in the last step.
    Drawn in lesson 11, §4."""
    from matplotlib.patches import Rectangle

    fig = new_figure(8.0, 5.6)
    by_coords = {tuple(r["coords"]): (rank, r) for rank, r in enumerate(results)}
    scale = 1.0 / max(d, h)
    for (i, j), (rank, r) in sorted(by_coords.items()):
        ax = fig.add_axes([0.04 + 0.5 * j, 0.53 - 0.47 * i, 0.40, 0.36])
        x0 = 0.0
        for name, full in (("up.weight", (h, d)), ("down.weight", (d, h))):
            tp_shape, local = r["held"][name]
            tp_box, shard_box = _held_block(full, tp_shape, local, j, i)
            height, width = full[0] * scale, full[1] * scale
            ax.add_patch(Rectangle((x0, 0), width, height, fill=False, ec="k", lw=0.8))
            for (r0, nr, c0, nc), alpha in ((tp_box, 0.25), (shard_box, 0.85)):
                ax.add_patch(Rectangle((x0 + c0 * scale, height - (r0 + nr) * scale),
                                       nc * scale, nr * scale, fc=_RANK_COLOURS[rank],
                                       alpha=alpha, lw=0))
            label = "W1" if name == "up.weight" else "W2"
            ax.text(x0 + width / 2, height + 0.03, f"{label} {full[0]}×{full[1]}: "
                    f"{local[0]}×{local[1]} kept", ha="center", fontsize=7)
            x0 += width + 0.15
        ax.set_xlim(-0.05, x0)
        ax.set_ylim(-0.05, 1.15)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"rank {rank}  (dp {i}, tp {j})", fontsize=9)
    last = {rank: r["traffic"][-1] for rank, r in enumerate(results)}

    def moved(rank, dim, op):
        return sum(out for dm, o, _, _, out in last[rank] if dm == dim and o == op)

    for i in range(2):                       # a row of the mesh: one tensor-parallel group
        ranks = [by_coords[(i, j)][0] for j in range(2)]
        fig.text(0.5, 0.53 - 0.47 * i + 0.18, f"tp group {ranks}\nall-reduce\n"
                 f"{moved(ranks[0], 'tp', 'all_reduce')} B", ha="center", va="center",
                 fontsize=7, color="#d62728")
    for j in range(2):                       # a column: one data-parallel (FSDP2) group
        ranks = [by_coords[(i, j)][0] for i in range(2)]
        fig.text(0.24 + 0.5 * j, 0.495, f"dp group {ranks}: all-gather "
                 f"{moved(ranks[0], 'dp', 'all_gather')} B, reduce-scatter "
                 f"{moved(ranks[0], 'dp', 'reduce_scatter')} B", ha="center", va="center",
                 fontsize=7, color="#1f77b4")
    fig.text(0.5, 0.015, "light: the rank's tensor-parallel slice, whole during its forward and "
             "backward;  dark: the part FSDP2 keeps between steps", ha="center", fontsize=7)
    return fig


def planner_figure(rows, labels, gpu_gb: float, cluster):
    """The planner's choice, part by part: for each configuration in ``rows`` (``labels``
    name them), the memory per GPU it computed (model states, activations, ZeRO-3's gathered
    layers) beside the GPU's size, and its step estimate split into compute, the pipeline's
    fill and drain, and each dimension's transfers at its link's speed (the parts add up to
    ``time_s``). Drawn in lesson 11, §5."""
    from ..planner import within_nodes

    fig = new_figure(8.4, 4.4)
    ax_mem, ax_time = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ys = list(range(len(rows)))[::-1]
    g = cluster.gpus_per_node
    for y, r in zip(ys, rows):
        left = 0.0
        for key, colour, name in (("state_bytes", "#1f77b4", "model states"),
                                  ("activation_bytes", "#ff7f0e", "activations"),
                                  ("working_bytes", "#2ca02c", "gathered layers (ZeRO-3)")):
            shown = any(row[key] for row in rows)   # no legend entry for a part no row has
            ax_mem.barh(y, r[key] / 1e9, left=left, color=colour,
                        label=name if y == ys[0] and shown else None)
            left += r[key] / 1e9
        n = r["tp"] * r["pp"] * r["dp"]
        pp_link = cluster.intra_bw if within_nodes(r["tp"] * r["pp"], g) else cluster.inter_bw
        dp_link = cluster.intra_bw if within_nodes(n, g) else cluster.inter_bw
        parts = (("compute", r["compute_s"], "#7f7f7f"),
                 ("pipeline fill and drain", r["compute_s"] * r["idle_over_work"], "#c7c7c7"),
                 ("tp transfers", r["tp_bytes"] / r["tp_link"], "#d62728"),
                 ("pp transfers", r["pp_bytes"] / pp_link, "#9467bd"),
                 ("dp transfers", r["dp_bytes"] / dp_link, "#8c564b"))
        left = 0.0
        for name, seconds, colour in parts:
            ax_time.barh(y, seconds, left=left, color=colour, label=name if y == ys[0]
                         else None)
            left += seconds
    ax_mem.axvline(gpu_gb, color="k", ls="--", lw=1)
    ax_mem.text(gpu_gb, ys[0] + 0.6, f"{gpu_gb:.0f} GB ", fontsize=7, va="center", ha="right")
    for ax in (ax_mem, ax_time):
        ax.set_yticks(ys)
        ax.set_ylim(-0.7, len(rows) - 0.1)
        ax.grid(True, axis="x", alpha=0.3)
    ax_mem.set_yticklabels(labels, fontsize=7)
    ax_time.set_yticklabels([])
    ax_mem.set_xlabel("memory per GPU (GB)")
    ax_time.set_xlabel("estimated seconds per step")
    ax_mem.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    ax_time.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.subplots_adjust(left=0.25, right=0.98, bottom=0.3, top=0.96, wspace=0.08)
    return fig
