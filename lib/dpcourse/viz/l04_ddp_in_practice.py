"""Lesson 04 (DDP in practice): a torchrun job killed and restarted from its last checkpoint,
against the uninterrupted run, and torchrun's agents, workers, stores and restart as their logs
record them (§3, "Checkpoints and fault tolerance"); DistributedSampler's index map, padding
and set_epoch (§4, "Evaluation and logging under DDP").
"""

from __future__ import annotations

from .common import new_figure

__all__ = ["restart_timeline_figure", "torchrun_log", "torchrun_figure", "sampler_slots",
           "sampler_index_map_figure"]


def restart_timeline_figure(total_steps: int, ckpt_every: int, fail_at: int, resumed: int):
    """Two attempts of one torchrun job against the optimizer step: checkpoints saved, the
    kill, the restart from the last checkpoint, and the uninterrupted run for comparison.
    The numbers are the run's own (parsed from its output by the lesson)."""
    fig = new_figure(8, 2.8)
    ax = fig.add_subplot(1, 1, 1)
    rows = {"uninterrupted run": 2, "attempt 0": 1, "attempt 1 (restart)": 0}
    end = min(total_steps, fail_at + 5)
    ax.barh(rows["uninterrupted run"], end, left=0, height=0.35, color="#999999")
    ax.barh(rows["attempt 0"], fail_at, left=0, height=0.35, color="#1f77b4")
    ax.barh(rows["attempt 1 (restart)"], end - resumed, left=resumed, height=0.35,
            color="#2ca02c")
    saved = [s for s in range(ckpt_every, fail_at + 1, ckpt_every)]
    ax.plot(saved, [rows["attempt 0"]] * len(saved), "v", color="black", ms=8,
            label="checkpoint saved (rank 0)")
    ax.plot([fail_at], [rows["attempt 0"]], "X", color="#d62728", ms=11, label="rank 1 killed")
    ax.annotate("", (resumed, rows["attempt 1 (restart)"] + 0.2),
                (resumed, rows["attempt 0"] - 0.2),
                arrowprops=dict(arrowstyle="-|>", color="black", lw=1))
    ax.text(resumed + 0.1, 0.5, f"reload step {resumed}", fontsize=8)
    # zoom on the steps that matter: the axis ends a few steps after the kill, and the text at
    # the right edge says where both runs end
    right = min(total_steps, fail_at + 5)
    ax.axvspan(resumed, fail_at, color="#d62728", alpha=0.12,
               label=f"steps {resumed + 1}-{fail_at}: computed twice")
    for row in (rows["uninterrupted run"], rows["attempt 1 (restart)"]):
        ax.text(right + 0.1, row, f"… step {total_steps}: same weights", fontsize=7.5,
                va="center")
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels(list(rows), fontsize=8)
    ax.set_xlabel("optimizer step")
    ax.set_xticks(range(0, right + 1, 2 if right <= 24 else 4))
    ax.set_xlim(0, right + 6)
    ax.set_ylim(-0.6, 2.6)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper center", ncol=3, bbox_to_anchor=(0.55, 1.25))
    fig.subplots_adjust(left=0.2, right=0.98, bottom=0.18, top=0.82)
    return fig


# --------------------------------------------------------------------------------------------
# torchrun: the agents, their workers, the stores, a restart (§3), from torchrun's own log
# --------------------------------------------------------------------------------------------

_RDZV_KEYS = ("restart_count", "master_addr", "master_port", "group_rank", "group_world_size",
              "local_ranks", "global_ranks", "global_world_sizes")


def torchrun_log(output: str) -> list[dict]:
    """The events of one torchrun agent, in order, read from its INFO log (run it with
    ``LOGLEVEL=INFO``): ``{"event": "config", "rdzv_endpoint", "max_restarts",
    "nproc_per_node"}`` from its launch configuration; ``{"event": "rendezvous", ...}`` for each
    "Rendezvous complete for workers" result (``restart_count``, ``master_addr``,
    ``master_port``, ``group_rank``, ``group_world_size``, and per worker ``local_ranks``,
    ``global_ranks``, ``global_world_sizes``: what it put in each worker's ``LOCAL_RANK``,
    ``RANK`` and ``WORLD_SIZE``); ``{"event": "failed", "local_rank", "exitcode"}`` for a
    worker that died; ``{"event": "restart", "attempts_left"}`` when it restarts the group;
    ``{"event": "finished"}`` when the group succeeded (the messages of torch's elastic
    agent, ``torch/distributed/elastic/agent/server/api.py``, and its launcher).
    Shown in lesson 04, §3."""
    import ast
    import re

    events: list[dict] = []
    lines = output.splitlines()
    config = {}
    for key in ("rdzv_endpoint", "max_restarts", "nproc_per_node"):
        m = re.search(rf"\]\s+{key}\s+:\s+(\S+)", output)
        if m:
            config[key] = m.group(1) if key == "rdzv_endpoint" else int(m.group(1))
    if config:
        events.append({"event": "config", **config})
    for k, line in enumerate(lines):
        if "Rendezvous complete for workers" in line:
            result = {}
            for follow in lines[k + 1:k + 1 + 2 * len(_RDZV_KEYS)]:
                m = re.search(r"\]\s+(\w+)=(.*)$", follow)
                if m and m.group(1) in _RDZV_KEYS:
                    value = m.group(2).strip()
                    result[m.group(1)] = (value if m.group(1) == "master_addr"
                                          else ast.literal_eval(value))
            missing = [key for key in _RDZV_KEYS if key not in result]
            if missing:
                raise ValueError(f"torchrun_log: a rendezvous result without {missing}")
            events.append({"event": "rendezvous", **result})
        elif m := re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", line):
            events.append({"event": "failed", "exitcode": int(m.group(1)),
                           "local_rank": int(m.group(2))})
        elif m := re.search(r"Worker group \w+\. (\d+)/\d+ attempts left; will restart", line):
            events.append({"event": "restart", "attempts_left": int(m.group(1))})
        elif "worker group successfully finished" in line:
            events.append({"event": "finished"})
    if not any(e["event"] == "rendezvous" for e in events):
        raise ValueError("torchrun_log: no 'Rendezvous complete for workers' in this output; "
                         "was torchrun run with LOGLEVEL=INFO in its environment?")
    return events


def _box(ax, x, y, w, h, text, fc, fontsize=7.5, ec="#444444", ls="-"):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=fc, ec=ec, lw=0.8,
                                ls=ls))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _workers_text(rdzv: dict, k: int) -> str:
    return (f"RANK={rdzv['global_ranks'][k]}\nLOCAL_RANK={rdzv['local_ranks'][k]}\n"
            f"WORLD_SIZE={rdzv['global_world_sizes'][k]}")


def torchrun_figure(nodes: list, restarted: list, killed: dict[int, int] | None = None):
    """Left: a job of several agents (``nodes``: one :func:`torchrun_log` per agent) — the
    rendezvous store the agents meet at, each agent (one per node) with the workers it started
    and the variables it gave them, and the workers' store (``MASTER_ADDR:MASTER_PORT``) that
    node 0's agent hosts. Right: one agent's log with a restart (``restarted``) — each attempt's
    workers, which ended, and what the agent did. Every number is read from the logs.

    An agent logs only one failure per attempt, the one with the earliest timestamp; a worker
    that wrote no error file gets ``int(time.time())``, whole seconds, so when a kill and the
    other worker's crash land in the same second the logged one is arbitrary. ``killed``
    (global rank -> step, read from the workers' own output) says which worker killed itself:
    given, the figure marks that worker from it, the others of that attempt as ended with the
    group, and writes the agent's one logged failure beside them."""
    fig = new_figure(10.5, 4.4)
    left = fig.add_axes([0.0, 0.0, 0.5, 0.9])
    right = fig.add_axes([0.52, 0.0, 0.48, 0.9])
    for ax in (left, right):
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 10)
        ax.axis("off")

    firsts = [(next(e for e in log if e["event"] == "rendezvous"), log) for log in nodes]
    firsts.sort(key=lambda pair: pair[0]["group_rank"])
    endpoint = next((e["rdzv_endpoint"] for _, log in firsts for e in log
                     if e["event"] == "config"), "?")
    _box(left, 2.0, 8.3, 6.0, 1.1, f"rendezvous (c10d) at --rdzv-endpoint {endpoint}\n"
         "the agents meet here and number the nodes", "#fff2cc")
    width = 9.6 / len(firsts)
    store = None   # where node 0's agent draws the workers' store
    workers = []   # the top-centre of every worker box
    for n, (rdzv, _) in enumerate(firsts):
        x = 0.2 + n * width
        _box(left, x, 0.6, width - 0.3, 6.4, "", "#f3f3f3")
        left.text(x + (width - 0.3) / 2, 6.55, f"node {rdzv['group_rank']}: torchrun agent\n"
                  f"group_rank {rdzv['group_rank']} of {rdzv['group_world_size']}",
                  ha="center", va="center", fontsize=8, weight="bold")
        left.annotate("", (5.0, 8.3), (x + (width - 0.3) / 2, 7.0),
                      arrowprops=dict(arrowstyle="<->", color="#b45f06", lw=0.9))
        k_workers = len(rdzv["global_ranks"])
        ww = (width - 0.5) / k_workers
        for k in range(k_workers):
            _box(left, x + 0.1 + k * ww, 3.4, ww - 0.1, 2.2, "worker\n" + _workers_text(rdzv, k),
                 "#d9ead3", fontsize=7)
            workers.append((x + 0.05 + (k + 0.5) * ww, 3.4))
        if rdzv["group_rank"] == 0:
            _box(left, x + 0.2, 1.0, width - 0.7, 1.5,
                 f"workers' store\nMASTER_ADDR:MASTER_PORT\n= {rdzv['master_addr']}:"
                 f"{rdzv['master_port']}", "#cfe2f3", fontsize=7)
            store = (x + 0.2 + (width - 0.7) / 2, 2.5)
    for top in workers if store else ():
        left.annotate("", store, top, arrowprops=dict(arrowstyle="-|>", color="#3d85c6", lw=0.8,
                                                      ls="--"))
    left.set_title(f"{len(firsts)} agents, one per node: the workers' identity is in their "
                   "environment", fontsize=9)

    right.set_title("one agent, a worker killed: the agent restarts the whole group",
                    fontsize=9)
    rounds = [e for e in restarted if e["event"] == "rendezvous"]
    y = 8.2
    for a, rdzv in enumerate(rounds):
        right.text(0.1, y + 0.9, f"attempt {rdzv['restart_count']} "
                   f"(TORCHELASTIC_RESTART_COUNT={rdzv['restart_count']}), workers' store "
                   f"port {rdzv['master_port']}", fontsize=7.5)
        after = restarted[restarted.index(rdzv) + 1:]
        stop = next((i for i, e in enumerate(after) if e["event"] == "rendezvous"), len(after))
        died = {e["local_rank"]: e["exitcode"] for e in after[:stop] if e["event"] == "failed"}
        ww = 9.6 / len(rdzv["global_ranks"])
        for k in range(len(rdzv["global_ranks"])):
            local, rank = rdzv["local_ranks"][k], rdzv["global_ranks"][k]
            if killed is not None and died:
                if rank in killed:
                    note, fc = (f"\nkilled itself after step {killed[rank]}\n(its own output)",
                                "#f4cccc")
                else:
                    note, fc = "\nended with the group", "#eeeeee"
            elif local in died:
                how = " (SIGKILL)" if died[local] == -9 else ""
                note, fc = f"\ndied: exit code {died[local]}{how}", "#f4cccc"
            elif died:
                note, fc = "\nstopped by the agent", "#eeeeee"
            else:
                note, fc = "", "#d9ead3"
            _box(right, 0.2 + k * ww, y - 1.7, ww - 0.3, 2.4, _workers_text(rdzv, k) + note, fc,
                 fontsize=7)
        if killed is not None and died:
            logged = next(e for e in after[:stop] if e["event"] == "failed")
            right.text(0.1, y - 2.2, "the agent logged one failure: local_rank "
                       f"{logged['local_rank']},\nexit code {logged['exitcode']} (the earliest, "
                       "timed to the second)", fontsize=6.5, va="center")
        restart = next((e for e in after[:stop] if e["event"] == "restart"), None)
        if restart is not None:
            right.annotate("", (5.0, y - 2.55), (5.0, y - 1.75),
                           arrowprops=dict(arrowstyle="-|>", color="black", lw=1))
            right.text(5.2, y - 2.2, "agent: stop every worker, rendezvous again\n"
                       f"({restart['attempts_left']} restart(s) were left)", fontsize=7,
                       va="center")
        if any(e["event"] == "finished" for e in after[:stop]):
            right.text(5.0, y - 2.2, "the group finished", fontsize=7.5, ha="center",
                       va="center", weight="bold")
        y -= 4.0
    return fig


# --------------------------------------------------------------------------------------------
# DistributedSampler's index map (§4)
# --------------------------------------------------------------------------------------------


def sampler_slots(dealt: dict, n: int) -> dict:
    """``dealt[epoch][rank]`` is the list of indices a ``DistributedSampler`` gave that rank in
    that epoch, for a data set of ``n`` samples. Returns ``{epoch: [[(index, padded), ...] per
    rank]}``: slot k of rank r is position k·R + r of the epoch's list, padded when that
    position is past the ``n`` real samples (the sampler appends the first ones again).

    Shown in lesson 04, §4.
    """
    slots = {}
    for epoch, per_rank in dealt.items():
        ranks = len(per_rank)
        if len({len(indices) for indices in per_rank}) != 1:
            raise ValueError(f"epoch {epoch}: the ranks got lists of different lengths; "
                             "DistributedSampler (without drop_last) gives every rank as many")
        slots[epoch] = [[(i, k * ranks + r >= n) for k, i in enumerate(indices)]
                        for r, indices in enumerate(per_rank)]
    return slots


def sampler_index_map_figure(dealt: dict, n: int):
    """One panel per epoch: a row per rank, a cell per slot with the sample index it reads, red
    where the slot is padding (:func:`sampler_slots`)."""
    from matplotlib.patches import Rectangle

    slots = sampler_slots(dealt, n)
    epochs = list(slots)
    ranks = len(slots[epochs[0]])
    per = len(slots[epochs[0]][0])
    fig = new_figure(3.3 * len(epochs) + 0.6, 0.45 * ranks + 1.1)
    for e, epoch in enumerate(epochs):
        ax = fig.add_axes([0.09 + e * 0.9 / len(epochs), 0.08, 0.88 / len(epochs) - 0.04, 0.7])
        for r, row in enumerate(slots[epoch]):
            for k, (i, padded) in enumerate(row):
                ax.add_patch(Rectangle((k, r), 0.95, 0.9, color="#e06666" if padded
                                       else "#6fa8dc", alpha=0.45 if padded else 0.3))
                ax.text(k + 0.47, r + 0.45, str(i), ha="center", va="center", fontsize=10)
        ax.set_xlim(0, per)
        ax.set_ylim(ranks, 0)
        ax.set_xticks([k + 0.47 for k in range(per)], [f"slot {k}" for k in range(per)],
                      fontsize=7)
        ax.set_yticks([r + 0.45 for r in range(ranks)],
                      [f"rank {r}" for r in range(ranks)] if e == 0 else [], fontsize=8)
        ax.tick_params(length=0)
        for edge in ax.spines.values():
            edge.set_visible(False)
        ax.set_title(f"set_epoch({epoch})", fontsize=9)
    fig.suptitle(f"DistributedSampler: {n} samples on {ranks} ranks, {per * ranks} slots "
                 "(red: padding)", fontsize=9.5)
    return fig
