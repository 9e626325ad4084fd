"""Lesson 02 (`nn.DataParallel`, taken apart): who holds what in one DataParallel step (§4), the
same step on a clock, per device, recorded from a run (§4), and the traffic through device 0
against a ring's rank ("Why it is slow"; also its explorer).
"""

from __future__ import annotations

from typing import Sequence

from .common import new_figure

__all__ = ["dp_step_figure", "record_dp_step", "dp_timeline_figure",
           "traffic_both_ways_figure"]

# The pieces of one step, in the order they run; "forward" and "backward" run on every device,
# the others on device 0 alone.
STEP_PHASES = ("scatter", "replicate", "forward", "gather", "loss", "loss + gather backward",
               "backward", "reduce onto device 0", "optimizer step")
_PHASE_COLOURS = {"scatter": "#9fc5e8", "replicate": "#f6b26b", "forward": "#93c47d",
                  "gather": "#6fa8dc", "loss": "#e06666", "loss + gather backward": "#ea9999",
                  "backward": "#38761d", "reduce onto device 0": "#cc0000",
                  "optimizer step": "#8e7cc3"}


def dp_step_figure(chunk_sizes: Sequence[int], n_params: int):
    """Who holds what in one step of lesson 02's copy-by-copy DataParallel (``dp.data_parallel``;
    the real class on NCCL broadcasts and reduces with collectives): one column per device, one row per move
    (scatter, replicate, parallel_apply, gather + loss, backward's reduce onto device 0), arrows for what
    crosses between devices (the input's chunks, the weights, the outputs, the gradients).
    ``chunk_sizes`` and ``n_params`` come from the run being drawn.

    Shown in lesson 02, §4."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    n = len(chunk_sizes)
    batch = sum(chunk_sizes)
    rows = ["1. scatter X", "2. replicate W", "3. parallel_apply", "4. gather + loss",
            "5. backward: reduce"]
    fig = new_figure(1.9 * n + 2.4, 4.6)
    ax = fig.add_axes([0.0, 0.0, 1.0, 0.92])
    ax.set_xlim(-2.2, 1.9 * n)
    ax.set_ylim(-len(rows) - 0.1, 1.15)
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
        ax.text(1.9 * c + 0.9, 0.85, f"device {c}", ha="center", fontsize=9, weight="bold")
    for r, label in enumerate(rows):
        ax.text(-2.1, -r, label, ha="left", va="center", fontsize=8.5)
    for c, size in enumerate(chunk_sizes):
        box(c, 0, f"X[{sum(chunk_sizes[:c])}:{sum(chunk_sizes[:c + 1])}]\n{size} samples",
            colours["data"])
        if c:  # the input's chunks leave device 0, which holds the batch, over the top
            ax.add_patch(FancyArrowPatch((0.9, 0.33), (1.9 * c + 0.9, 0.33),
                                         connectionstyle="arc3,rad=-0.05", arrowstyle="-|>",
                                         mutation_scale=9, color="#3d85c6", lw=0.9))
        box(c, 1, f"copy of W\n{n_params:,} numbers" if c else f"W (original)\n{n_params:,}",
            colours["weights"])
        box(c, 2, f"forward on\n{size} samples", colours["compute"])
        arrow(c, 2, 0, 3, "#1f77b4")  # outputs travel to device 0
        if c:  # weights leave device 0, over the top of the row
            ax.add_patch(FancyArrowPatch((0.9, -1 + 0.33), (1.9 * c + 0.9, -1 + 0.33),
                                         connectionstyle="arc3,rad=-0.18", arrowstyle="-|>",
                                         mutation_scale=9, color="#e69138", lw=0.9))
    box(0, 3, f"logits of all {batch}\nmean loss", colours["dev0"])
    box(0, 4, f"grad W from the\n{n} replicas' grads", colours["dev0"])
    for c in range(1, n):
        box(c, 4, f"grad of copy {c}\n-> device 0", colours["weights"])
        ax.add_patch(FancyArrowPatch((1.9 * c + 0.9, -4 - 0.33), (0.9, -4 - 0.33),
                                     connectionstyle="arc3,rad=-0.18", arrowstyle="-|>",
                                     mutation_scale=9, color="#cc0000", lw=0.9))
    fig.suptitle(f"One step of dp.data_parallel (copies one by one) on {n} devices, batch "
                 f"{batch}: everything passes through device 0", fontsize=10)
    return fig


def record_dp_step(module, X, y, devices, optimizer) -> dict:
    """Run one training step of lesson 02's DataParallel (``dp.scatter``, ``dp.replicate``,
    ``dp.parallel_apply``, ``dp.gather``, the cross-entropy loss, ``backward``,
    ``optimizer.step()``) and record when each piece ran, and for which device.

    What runs in the caller's thread is timed around the call and belongs to device 0, which
    does it alone. A replica's forward is timed by hooks on the replica (start and end, in its
    own thread); its backward node by node (a pre-hook and a hook on each autograd node of that
    replica's part of the graph), and the reduce onto device 0 is the run of the broadcast's
    backward node (``dp.Broadcast.backward``). The hooks live on the replicas and on this step's
    graph, which are dropped after the step. Returns ``{"chunk_sizes", "spans", "threads"}``:
    ``spans`` a list of ``(device, phase, start_ms, end_ms)`` in ms since the step began (a
    device's backward is several spans when the autograd engine interleaved the replicas),
    ``threads`` how many Python threads ran the forwards and the backward's nodes.

    Shown in lesson 02, §4.
    """
    import threading
    import time

    import torch.nn.functional as F

    from dpcourse import dp

    devs = list(devices)
    if not devs:
        raise ValueError("record_dp_step needs at least one device")
    t0 = time.perf_counter()
    spans: list[tuple[int, str, float, float]] = []

    def now() -> float:
        return (time.perf_counter() - t0) * 1e3

    def on_device0(phase, fn):
        start = now()
        result = fn()
        spans.append((0, phase, start, now()))
        return result

    optimizer.zero_grad(set_to_none=True)
    chunks = on_device0("scatter", lambda: dp.scatter(X, devs))
    replicas = on_device0("replicate", lambda: dp.replicate(module, devs[:len(chunks)]))
    forward: dict[int, list[float]] = {i: [] for i in range(len(replicas))}
    threads: dict[str, set] = {"forward": set(), "backward": set()}

    def forward_starts(i):
        def hook(module, args):  # returns None: the replica's input is left as it is
            forward[i].append(now())
            threads["forward"].add(threading.current_thread())
        return hook

    for i, replica in enumerate(replicas):  # the replicas are dropped after the step
        replica.register_forward_pre_hook(forward_starts(i))
        replica.register_forward_hook(lambda m, args, out, i=i: forward[i].append(now()))
    outputs = dp.parallel_apply(replicas, chunks)
    spans += [(i, "forward", *forward[i]) for i in range(len(replicas))]
    out = on_device0("gather", lambda: dp.gather(outputs, devs[0]))
    loss = on_device0("loss", lambda: F.cross_entropy(out, y))

    # The backward: a pre-hook and a post-hook on every autograd node of each replica's part of
    # the graph time that node, for that device; the broadcast's node is the reduce onto device 0.
    runs: list[tuple[int, float, float]] = []   # (device, start, end) of one node
    started: dict = {}                          # a node -> (device, start) while it runs

    def backward_starts(node, i):
        def hook(grad_outputs):  # returns None: the gradients are left as they are
            started[node] = (i, now())
            threads["backward"].add(threading.current_thread())
        return hook

    reduce: list[float] = []
    broadcast = None
    for i, o in enumerate(outputs):
        todo, seen = [o.grad_fn], set()
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if type(node).__name__ == "BroadcastBackward":  # dp.Broadcast: shared by all
                broadcast = node
                continue
            node.register_prehook(backward_starts(node, i))
            node.register_hook(lambda gi, go, node=node: runs.append((*started.pop(node),
                                                                        now())))
            todo.extend(f for f, _ in node.next_functions)
    if broadcast is not None:
        broadcast.register_prehook(lambda g: reduce.append(now()))
        broadcast.register_hook(lambda gi, go: reduce.append(now()))
    start = now()
    loss.backward()
    first = min(r[1] for r in runs)
    spans.append((0, "loss + gather backward", start, first))
    runs.sort(key=lambda r: r[1])
    merged: list[list] = []   # a device's consecutive nodes, with no other device's in between
    for device, a, b in runs:
        if merged and merged[-1][0] == device:
            merged[-1][2] = b
        else:
            merged.append([device, a, b])
    spans += [(device, "backward", a, b) for device, a, b in merged]
    if reduce:
        spans.append((0, "reduce onto device 0", reduce[0], reduce[-1]))
    on_device0("optimizer step", optimizer.step)
    return {"chunk_sizes": [c.shape[0] for c in chunks], "spans": spans,
            "threads": {k: len(v) for k, v in threads.items()}}


def dp_timeline_figure(record: dict):
    """A step recorded by :func:`record_dp_step`, drawn from its spans. Left: one lane per
    device, a bar where the device worked (grey where it had nothing to do; a bar shorter than
    0.4% of the axis is drawn that wide so that it shows). Right: device 0's solo pieces, each
    bar its measured length: the time every other device waited."""
    spans = record["spans"]
    n = len(record["chunk_sizes"])
    end = max(s[3] for s in spans)
    fig = new_figure(10.0, 1.9 + 0.5 * n)
    ax = fig.add_axes([0.09, 0.3, 0.55, 0.58])
    side = fig.add_axes([0.80, 0.3, 0.18, 0.58])
    seen = set()
    for device in range(n):
        ax.barh(n - 1 - device, end, left=0, height=0.6, color="#eeeeee", zorder=0)
    for device, phase, start, stop in spans:
        ax.barh(n - 1 - device, max(stop - start, end * 0.004), left=start, height=0.6,
                color=_PHASE_COLOURS[phase], lw=0, label=None if phase in seen else phase)
        seen.add(phase)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"device {n - 1 - y}" for y in range(n)], fontsize=8)
    ax.set_xlim(0, end * 1.01)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlabel("ms since the step began (grey: nothing to do)", fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    order = [p for p in STEP_PHASES if p in seen]
    by_label = dict(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend([by_label[p] for p in order], order, fontsize=7, ncol=5, loc="lower left",
               bbox_to_anchor=(0.01, 0.0), frameon=False)
    solo = [(phase, stop - start) for device, phase, start, stop in spans
            if device == 0 and phase not in ("forward", "backward")]
    side.barh(range(len(solo))[::-1], [d for _, d in solo],
              color=[_PHASE_COLOURS[p] for p, _ in solo])
    side.set_yticks(range(len(solo))[::-1])
    side.set_yticklabels([p for p, _ in solo], fontsize=7)
    side.set_xlabel("ms", fontsize=8)
    side.tick_params(axis="x", labelsize=7)
    side.set_title(f"device 0 alone: {sum(d for _, d in solo):.1f} ms", fontsize=8.5)
    ax.set_title(f"One recorded step of dp.data_parallel on {n} devices, batch "
                 f"{sum(record['chunk_sizes'])}", fontsize=9.5)
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
