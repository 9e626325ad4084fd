# %% [markdown]
# # 10 · The bug zoo: broken distributed programs, their detectors and their fixes
#
# **Prerequisites:** lesson 03 (ranks, collectives, averaging gradients by hand) and lesson 04
# (torchrun scripts, DDP in practice, its section on hangs and `TORCH_DISTRIBUTED_DEBUG`).
#
# **You will be able to:**
# - recognise the classic distributed bugs by their symptoms: a hang, replicas that drift
#   apart, a NaN everywhere, an epoch that repeats, a crash at the second step, a port taken;
# - diagnose each one from the outside with a detector from `dpcourse.detectors` — a
#   collective trace per rank, a timeout report naming the stuck ranks and their call, weight
#   checksums across ranks, the first non-finite value — on the zoo and on your own scripts
#   (`python -m dpcourse diagnose script.py`);
# - use the tools PyTorch has, knowing what each does on gloo and on NCCL:
#   `dist.monitored_barrier`, `TORCH_DISTRIBUTED_DEBUG=DETAIL` (and what it costs), the
#   `timeout` of `init_process_group`, the flight recorder, `NCCL_DEBUG=INFO`, a stack dump
#   of a hung rank;
# - fix each bug, and prove the fix by a run: for most bugs, the same detector staying quiet.
#
# **Time:** about 75 minutes to read and run.
#
# **Lab:** [lab10_bug_hunt](../labs/lab10_bug_hunt.ipynb) — five broken scripts whose bugs are
# not among this lesson's (some put an earlier lesson's rule to a new case): name each bug and
# fix it.
#
# Every program below really runs, on 2 gloo ranks, under a short time limit: a hang costs a
# few seconds, and `spawn` then kills every rank's process tree (lesson 00 checks that none
# is left). The broken programs live
# in `dpcourse.bugzoo`, one small function each, with the bug marked `# BUG` and its fix behind
# `fixed=True`.

# %% tags=["parameters"]
world_size = 2        # ranks of every run (the zoo's bugs need 2 or more)
hang_timeout = 4.0    # seconds a program may run before it counts as hung

# %%
import inspect
import math
import mmap
import os
import re
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from dpcourse import bugzoo, collectives, detectors, launch, script_checks, viz
from dpcourse.checks import claim

torch.set_num_threads(1)

# %% [markdown]
# ## 1. What the course adds: a trace that outlives a hung rank, compared across ranks
# First the symptom. The classic bug (bug 1, section 2 shows its code): rank 0 logs the global
# loss, and the all-reduce sits inside its `if rank == 0`. Run as it is, under `hang_timeout`:

# %%
try:
    launch.spawn(bugzoo.partial_collective, world_size, False, backend="gloo",
                 timeout=hang_timeout, show_output=False)
except launch.LaunchTimeoutError as err:
    symptom = err
print(str(symptom).split(". ")[0] + ".")
claim("run plainly, bug 1 only times out, naming the rank that never finished, not its call "
      "or line",
      symptom.pending == [0] and "all_reduce" not in str(symptom) and ".py" not in str(symptom))
viz.show_code(launch.LaunchTimeoutError, folded="▶ launch.LaunchTimeoutError: its whole message")

# %% [markdown]
# A rank's own error says little when the bug is that the ranks disagree. PyTorch's
# cross-rank tool, `torchfrtrace` (installed with torch), merges every rank's dump of the
# *flight recorder* (each process's record of its last collectives, section 2) and names the
# ranks missing from a collective. But the recorder lives in the process's memory: NCCL dumps
# it on a timeout, an NCCL error or a stuck watchdog; otherwise a process reads its own
# (`_dump_fr_trace`, section 2) or the experimental `start_debug_server` writes it out (Sources).
#
# What the course adds, in `dpcourse.detectors`, is **the collective trace**: on every rank,
# each `dist.<collective>` call as it starts, with the line of your code that made it, and when
# it returns, written to a file at once, so it survives a rank that hangs and gets killed; and a
# comparison of the ranks. A rank counts as *stuck* only in a call that blocks until its
# partners arrive, as gloo's blocking calls do. A call with `async_op=True`, and an NCCL call
# once its *communicator* (the connections between the ranks' GPUs) exists, returns at once: the
# trace shows what each rank called, from which line, not which one waits.

# %% [markdown]
# `detectors.diagnose(fn, world_size, *args, timeout=...)` runs a worker (or a script) on N
# ranks under that trace (its code is shown after bug 1), with
# `faulthandler.dump_traceback_later` armed to write each rank's
# Python stack just before the time limit, and reports: finished, hung (which ranks, in which
# call, at which line) or failed.

# %% [markdown]
# ## 2. Bugs that hang
# ### Bug 1: a collective that only some ranks call
# The classic: log the global loss on rank 0 only — and put the all-reduce inside the `if`.

# %%
viz.show_code(bugzoo.partial_collective)

# %%
partial = detectors.diagnose(bugzoo.partial_collective, world_size, False, timeout=hang_timeout)
print(partial.report())
claim("the broken program hangs and rank 0 is named as the stuck rank",
      partial.status == "hang" and partial.pending == [0])
claim("the trace says where: rank 0 is stuck in all_reduce, which rank 1 never called",
      partial.trace.stuck[0]["op"] == "all_reduce" and partial.trace.calls[1] is None)
partial_fixed = detectors.diagnose(bugzoo.partial_collective, world_size, True,
                                   timeout=hang_timeout)
print(partial_fixed.report())
claim("fixed (every rank calls it): it finishes, and the detector stays quiet", partial_fixed.ok)

# %% [markdown]
# Where that report comes from: as each collective starts, `trace_collectives` writes the line
# that called it (`caller_line`), and another line when the call returns; `read_traces` marks a
# call done only if its end line was written, `compare_traces` finds the first call where the
# ranks differ (calls, like steps in this lesson, are numbered from 0: call #3 is a rank's
# fourth) and calls a rank whose last call is not done *stuck*; `user_frames` keeps your
# frames of the `faulthandler` stack dump (**▶ folded**: open it to read the code):

# %%
viz.show_code(detectors.trace_collectives, detectors.compare_traces, detectors.caller_line,
              detectors.read_traces, detectors.user_frames,
              folded="▶ The trace's code: trace_collectives, compare_traces, caller_line, "
                     "read_traces, user_frames")

# %% [markdown]
# The trace writes its lines from the `before` and `after`
# hooks of `collectives.record_collectives`, a recorder that wraps each `dist.<collective>`
# function for a `with` block, and `Recorder.run`, which each wrapped call goes through:
# `before` as the call starts, `after` once it returns, and any call made meanwhile (the
# monitored barrier that `monitor=` puts in `before`, below) passes unrecorded (**▶ folded
# below**; it sees only calls through those functions). Then `diagnose`'s plumbing: the launch,
# the time limit, the report's wording, and section 5's checks on scripts.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(collectives.record_collectives, collectives.Recorder.run,
              folded="▶ The recorder: record_collectives, Recorder.run")
viz.show_code(detectors.diagnose_worker, detectors.diagnose, detectors.TraceReport,
              detectors.Diagnosis,
              folded="▶ diagnose's plumbing: diagnose_worker, diagnose, TraceReport, Diagnosis")

# %% [markdown]
# **`dist.monitored_barrier` names the rank that never came.** Put one before the collective
# you suspect: rank 0 waits there for every other rank and, at the barrier's timeout, raises
# with the list of ranks that did not arrive (with `wait_all_ranks=True`, all of them, not
# just the first). `diagnose(..., monitor=2)` puts a 2-second one before every collective.
# It needs a CPU backend in the group: gloo,
# or in an NCCL job the gloo of a `"cpu:gloo,cuda:nccl"` group (lesson 00; Sources).

# %%
partial_mon = detectors.diagnose(bugzoo.partial_collective, world_size, False,
                                 timeout=3 * hang_timeout, monitor=2)
print(partial_mon.error.split(": ", 1)[1])
absent = ", ".join(str(r) for r in range(1, world_size))   # every rank but 0 skips the call
claim(f"with a monitored barrier, rank 0 raises after 2 s naming rank(s) {absent}, which never "
      "came", partial_mon.status == "failed"
      and f"Ranks {absent} failed to pass monitoredBarrier in 2000 ms" in partial_mon.error)

# %% [markdown]
# **`TORCH_DISTRIBUTED_DEBUG=DETAIL` does that before every collective, for you.** With the
# debug level DETAIL, `init_process_group` wraps the group in a `ProcessGroupWrapper`
# (`_create_process_group_wrapper` in `torch.distributed.distributed_c10d`), which owns a second, gloo, group. Before
# each collective it runs a monitored barrier on that helper group (with the process group's
# `timeout`) and then compares the collective's fingerprint — its op, the shapes and dtypes of
# its tensors — across the ranks. On bug 1 (group timeout 2 s) the missing rank is named:

# %%
partial_detail = detectors.diagnose(bugzoo.partial_collective, world_size, False,
                                    timeout=3 * hang_timeout, debug_detail=True, group_timeout=2)
print(partial_detail.error.split(": ", 1)[1])
claim(f"with DETAIL, bug 1's all_reduce raises on rank 0, naming rank(s) {absent}",
      partial_detail.status == "failed" and f"Ranks {absent} failed to pass monitoredBarrier"
      in partial_detail.error)

# %% [markdown]
# Those checks are collectives themselves, on every call. How much do they cost? The same
# all-reduces on two groups of the same ranks, one created at the default debug level and one
# under DETAIL, timed in turn (the fastest of 15 short rounds of 40 calls: other work on the
# machine only ever adds time, and with many short rounds some of them run undisturbed even on
# a busy machine), for a one-element tensor (the cost is all latency) and for 64 Ki elements.


# %%
def detail_cost(rank, world_size, calls=40, rounds=15, sizes=(1, 1 << 16)):
    import time

    import torch.distributed as dist

    plain = dist.new_group(list(range(world_size)))
    dist.set_debug_level(dist.DebugLevel.DETAIL)       # groups created now are wrapped
    checked = dist.new_group(list(range(world_size)))
    dist.set_debug_level(dist.DebugLevel.OFF)
    out = {}
    for numel in sizes:
        x = torch.ones(numel)
        times = {"plain": [], "DETAIL": []}
        for _ in range(rounds):
            for name, group in (("plain", plain), ("DETAIL", checked)):
                dist.barrier()
                t = time.perf_counter()
                for _ in range(calls):
                    dist.all_reduce(x, group=group)
                times[name].append((time.perf_counter() - t) / calls)
        out[numel] = {k: min(v) for k, v in times.items()}
    return out


cost = launch.spawn(detail_cost, world_size, backend="gloo", timeout=120)[0]

# %%
# NBVAL_IGNORE_OUTPUT
# Why: times depend on this machine and its load.
for numel, t in cost.items():
    print(f"all_reduce of {numel:>6,} float32: plain {t['plain'] * 1e6:7.0f} µs, with DETAIL "
          f"{t['DETAIL'] * 1e6:7.0f} µs ({t['DETAIL'] / t['plain']:.1f}×)")

# %%
slow = cost[1]["DETAIL"] / cost[1]["plain"]
claim("DETAIL makes a one-element all_reduce at least 1.5× slower here (a barrier and a "
      "fingerprint exchange before each call): a debugging setting, not a production one",
      slow >= 1.5, ratio=slow)

# %% [markdown]
# The process group's own `timeout` turns the same hang into an error on the stuck rank —
# on **gloo**, which is what runs here: the blocked call raises after 2 s instead of gloo's
# default 30 minutes. That default follows the backend *string*: only a bare `"nccl"` group
# gets NCCL's 10 minutes; `"cpu:gloo,cuda:nccl"`, which an NCCL job uses for monitored
# barriers, gets 30 (`_get_default_timeout`, claimed below). Pass `timeout=` yourself.


# %%
def with_group_timeout(rank, world_size, seconds):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
    return bugzoo.partial_collective(rank, world_size)


try:
    launch.spawn(with_group_timeout, world_size, 2, timeout=30, show_output=False)
except launch.RankFailedError as e:
    group_timeout = e
print(f"rank {group_timeout.rank} failed:",
      group_timeout.summary.split("] ")[-1].split(" for ")[0])
claim("on gloo, with timeout=2 s, rank 0 raises 'Timed out' itself, in the call",
      group_timeout.rank == 0 and "Timed out" in group_timeout.summary)
from datetime import timedelta

from torch.distributed import constants
from torch.distributed.distributed_c10d import Backend, _get_default_timeout

thirty = [_get_default_timeout(Backend(b)) for b in ("gloo", "cpu:gloo,cuda:nccl")]
claim('with no timeout=, "gloo" and "cpu:gloo,cuda:nccl" both wait 30 minutes; NCCL\'s 10 '
      'go only to a bare "nccl" group (where this torch has NCCL)',
      thirty == [timedelta(minutes=30)] * 2 and (constants.default_pg_nccl_timeout is None
      or _get_default_timeout(Backend("nccl")) == timedelta(minutes=10)), defaults=thirty)

# %% [markdown]
# **On NCCL the same hang looks different, depending on whether the communicator exists.**
# NCCL forms it lazily, at the first collective on a GPU tensor (unless `init_process_group` got a
# `device_id`). If bug 1's all-reduce *is* that first collective, rank 0 blocks inside it while
# the communicator forms, and the group's timeout has no queued work to fire on (the communicator
# is made before the work is queued: Sources). Once the communicator exists, a collective only
# queues work on the GPU and returns; Python blocks later, where it needs the result (a
# `.item()`). A watchdog thread fires at the timeout and, by default, takes the whole process down
# (`TORCH_NCCL_ASYNC_ERROR_HANDLING=3`). Only with `TORCH_NCCL_BLOCKING_WAIT=1`, or
# `work.wait(timeout)`, does `wait()` raise in your code, as gloo does. Drawn from torch's source
# (Sources), not measured; no GPU here:

# %%
viz.show(viz.timeout_behaviour_figure(),
         "A diagram, not a measurement: where the error surfaces when a partner never joins. "
         "gloo raises inside the call; NCCL with its communicator formed returns at once and the "
         "watchdog tears the process down at the timeout; NCCL's first collective blocks inside "
         "the call while the communicator forms; with TORCH_NCCL_BLOCKING_WAIT=1 (or "
         "work.wait(timeout)), wait() raises.")

# %% [markdown]
# ### Bug 2: collectives in different orders
# Rank 0 all-reduces then broadcasts; rank 1 broadcasts then all-reduces. Each waits for a
# partner in a call the other is not making: with gloo, as run here, both ranks hang.

# %%
viz.show_code(bugzoo.collective_order)

# %%
order = detectors.diagnose(bugzoo.collective_order, world_size, False, timeout=hang_timeout)
print(order.report())
claim("every rank hangs, rank 0 and the others in different collectives at call #0",
      order.pending == list(range(world_size)) and order.trace.index == 0
      and {c["op"] for c in order.trace.stuck.values()} == {"all_reduce", "broadcast"})
order_fixed = detectors.diagnose(bugzoo.collective_order, world_size, True, timeout=hang_timeout)
claim("fixed (one order everywhere): no hang, no mismatch", order_fixed.ok)

# %% [markdown]
# `TORCH_DISTRIBUTED_DEBUG=DETAIL` catches this one *before* it hangs: each collective is first
# checked across the ranks, and the mismatch is an error at once.

# %%
detail = detectors.diagnose(bugzoo.collective_order, world_size, False, timeout=hang_timeout,
                            debug_detail=True)
# (which rank reports first varies from run to run: print the stable part)
print(detail.status + ":", detail.error.split(". Rank")[0].split(": ", 1)[1] + ".")
ops = sorted(op for op in ("ALLREDUCE", "BROADCAST") if op in detail.error)
print("the fingerprints it compared name:", ops)
claim("with DETAIL the mismatch is an error, not a hang",
      detail.status == "failed" and "Detected mismatch between collectives" in detail.error)
claim("and it names the two operations", ops == ["ALLREDUCE", "BROADCAST"])

# %% [markdown]
# **The flight recorder** is on by default in this torch: every process keeps its last 2000
# collectives (`TORCH_FR_BUFFER_SIZE` changes the size, 0 turns it off) in a ring buffer,
# which `_dump_fr_trace` returns (a private API: `torchfrtrace` reads the files NCCL dumps).
# Each entry has a `state` and a `retired` flag
# (set when the backend drops the work from its pending list: on gloo, as run here, when the
# work finishes, a moment after the call returns; on NCCL, "a retired but not completed event
# has timed out", says the recorder's header), and the dump a `pg_status`:
# the last collective enqueued and the last completed. After the fixed bug 2's two calls,
# rank 0 reads its recorder while its third all-reduce, issued with `async_op=True`, is still
# pending (a thread blocked in the call could not read it). On gloo the states
# stay "scheduled", but "retired" tells you where a rank stopped. (On NCCL, the watchdog marks
# an entry completed when the GPU work's end event has fired. It can mark one started only where a
# start event was recorded, and ProcessGroupNCCL records start events only with
# `TORCH_NCCL_ENABLE_TIMING=1`, `TORCH_NCCL_DESYNC_DEBUG`, or `TORCH_DISTRIBUTED_DEBUG=DETAIL`
# (which turns desync debugging on): otherwise an NCCL entry goes
# from scheduled to completed, and a collective that never finishes stays "scheduled".)
#
# **▶ The run** (folded): `flight_recorder`, the worker that reads rank 0's recorder.


# %% jupyter={"source_hidden": true}
def flight_recorder(rank, world_size):
    import pickle
    import time

    import torch
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    bugzoo.collective_order(rank, world_size, fixed=True)   # calls 1 and 2, on every rank
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        store.wait(["dumped"])            # join call 3 only once rank 0 has read its recorder
        dist.all_reduce(torch.ones(1))
        return None
    work = dist.all_reduce(torch.ones(1), async_op=True)     # call 3: pending, rank 1 not in it
    for _ in range(200):                  # (a call is retired a moment after it returns)
        dump = pickle.loads(c10d._dump_fr_trace(True, True, False))
        if all(e["retired"] for e in dump["entries"][:2]):
            break
        time.sleep(0.05)
    store.set("dumped", "1")
    work.wait()
    return ([(e["profiling_name"], e["collective_seq_id"], e["state"], e["retired"])
             for e in dump["entries"]], dump["pg_status"]["0"])


entries, pg_status = launch.spawn(flight_recorder, world_size, backend="gloo", timeout=30)[0]

# %%
claim("no flight-recorder variable is set here: what follows is the default",
      not any(v in os.environ for v in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")))
print("rank 0's entries (name, seq, state, retired or not):",
      *[f"{n} {q} {st} {'retired' if r else 'NOT retired'}" for n, q, st, r in entries],
      sep="\n  ")
print("pg_status: last_enqueued_collective", pg_status["last_enqueued_collective"],
      "(last_completed_collective, which varies, is in the claim below)")
claim("by default, on gloo, the flight recorder holds the three collectives, in order",
      [e[:2] for e in entries] == [("gloo:all_reduce", 1), ("gloo:broadcast", 2),
                                   ("gloo:all_reduce", 3)])
claim("their states all stay \"scheduled\"", {e[2] for e in entries} == {"scheduled"})
claim("but the pending call 3 (async_op=True) is the one entry not retired, and pg_status "
      "agrees: call 3 is the last enqueued, not completed",
      [e[3] for e in entries] == [True, True, False]
      and pg_status["last_enqueued_collective"] == 3 > pg_status["last_completed_collective"],
      pg_status=pg_status)

# %% [markdown]
# ### Bug 3: rank-dependent control flow
# Early stopping decided by each rank on *its own* loss: rank 1 leaves the loop at step 2, rank 0
# goes on and waits for rank 1 in the next all-reduce — for as long as rank 1's process stays
# alive (what changes when it exits comes after the tools' table). The same happens with a
# `break` on a rank's own data, a rank that has fewer batches (uneven shards), or an
# `if loss.item() > x: continue` before a collective.

# %%
viz.show_code(bugzoo.early_stop)

# %%
early = detectors.diagnose(bugzoo.early_stop, world_size, False, timeout=hang_timeout)
print(early.report())
claim(f"rank 0 is stuck in all_reduce call #3, which rank {world_size - 1} never made (it had "
      "returned)",
      early.pending == list(range(world_size - 1)) and early.trace.index == 3
      and early.trace.calls[world_size - 1] is None and early.trace.stuck[0]["op"] == "all_reduce")
early_mon = detectors.diagnose(bugzoo.early_stop, world_size, False, timeout=3 * hang_timeout,
                               monitor=2)
print("with a monitored barrier:", early_mon.error.split(": ", 1)[1])
claim(f"a monitored barrier before each collective names rank {world_size - 1}, the rank that left",
      f"Ranks {world_size - 1} failed to pass monitoredBarrier" in (early_mon.error or ""))
early_fixed = detectors.diagnose(bugzoo.early_stop, world_size, True, timeout=hang_timeout)
claim("fixed (the decision is all-reduced): all ranks stop at the same step",
      early_fixed.ok and len(set(early_fixed.results)) == 1, results=early_fixed.results)

# %%
viz.show(viz.collective_traces_figure({"bug 1: a collective on rank 0 only": partial.traces,
                                       "bug 2: two orders": order.traces,
                                       "bug 3: rank-dependent early stop": early.traces}),
         "Each box is a collective a rank called; a red edge, one it never returned from. The "
         "shaded column is the first call where the ranks disagree: the bug is there.")

# %% [markdown]
# Rank 0 is the one that reports in a monitored barrier: the others send to rank 0 and wait
# for its answer. Had rank 0 been the rank that left, what would they say? Below, rank 0
# returns at once and rank 1 calls `monitored_barrier(timeout=2 s)` in a group whose own
# timeout is 3 s:


# %%
def rank0_left(rank, world_size):
    import datetime
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    if rank == 0:
        return None                       # rank 0 never reaches the barrier
    start = time.perf_counter()
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=2), wait_all_ranks=True)
        return "passed", time.perf_counter() - start
    except RuntimeError as e:
        return str(e), time.perf_counter() - start


left_message, left_after = launch.spawn(rank0_left, world_size, timeout=60, show_output=False)[1]
print(left_message.split("\n")[0])
claim("the other ranks do not stay silent: rank 1's error names rank 0 (\"received errors while "
      "waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank.\")",
      left_message.startswith("Rank 1 successfully reached monitoredBarrier, but received errors "
                              "while waiting for send/recv from rank 0. Please check rank 0 logs "
                              "for faulty rank."))
claim("and it comes at the group's timeout (3 s), not the barrier's (2 s): rank 1 waits on its "
      "own send/recv, and only rank 0 enforces the barrier's timeout",
      left_after >= 2.9, seconds=round(left_after, 1))
so = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
with open(so, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as library:
    found = [library.find(part) >= 0 for part in (
        b" successfully reached monitoredBarrier, but received errors while waiting",
        b" for send/recv from rank 0. Please check rank 0 logs for faulty rank.")]
claim("the message is the installed libtorch_cpu.so's own (ProcessGroupGloo::monitoredBarrier)",
      all(found), library=so.name)

# %% [markdown]
# Rank 0 had returned, but its process was alive (under `spawn`, below). With the default group
# timeout, rank 1 would wait 30 minutes (gloo): the names come sooner from rank 0's
# side, or from the course's trace and stack dump.
#
# **The tools PyTorch gives you, and where each works** (the ones that run on gloo ran above):
#
# | tool | what it does | here (CPU, gloo) |
# |---|---|---|
# | `dist.monitored_barrier(timeout=..., wait_all_ranks=True)` | a barrier in which rank 0 waits for every other rank and, at the timeout, raises naming the ranks that never arrived; each other rank waits for rank 0's answer, up to the group's timeout (run above) | a group with a CPU backend: gloo, or `"cpu:gloo,cuda:nccl"` in an NCCL job; bugs 1 and 3 above |
# | `TORCH_DISTRIBUTED_DEBUG=DETAIL` (or `dist.set_debug_level` before the group is created) | wraps each process group in a `ProcessGroupWrapper` with a gloo helper group: before **every** collective the ranks pass a monitored barrier and compare the call's fingerprint (op, shapes, dtypes); a missing rank or a mismatch becomes an error naming them. It costs time on every call | works: bugs 1 and 2 above, with its cost measured |
# | `init_process_group(..., timeout=timedelta(seconds=...))` | how long a collective may wait (default: 10 min for a bare `"nccl"` group, 30 min for any other string, `"cpu:gloo,cuda:nccl"` included, claimed above: pass it yourself). **gloo**: the blocked call raises. **NCCL**, communicator formed: the call returned at once; the watchdog tears the process down at the timeout (`TORCH_NCCL_ASYNC_ERROR_HANDLING`, default 3); `wait()` raises only with `TORCH_NCCL_BLOCKING_WAIT=1` or `work.wait(timeout)` | gloo: bug 1 above; NCCL: the figure above |
# | `TORCH_DIST_NAN_CHECK=1` (any backend; NCCL also reads `TORCH_NCCL_NAN_CHECK`), off by default | a collective first checks its input; the rank holding a NaN raises "NaN found in input tensor." | works: bug 7 below |
# | the flight recorder | **on by default** (above). On NCCL dumped on a timeout, an NCCL error or a watchdog without heartbeat (`TORCH_NCCL_DUMP_ON_TIMEOUT`, `TORCH_NCCL_ENABLE_MONITORING`: on by default, `ProcessGroupNCCL.cpp`) to `TORCH_FR_DUMP_TEMP_FILE` (older name `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`) plus the rank, by default `~/.cache/torch/comm_lib_trace_rank_<rank>` (`$XDG_CACHE_HOME/torch/…` when set; checked below), merged with `torchfrtrace` | records on gloo too, with which calls finished (bug 2 above); the automatic dump is NCCL-only |
# | `NCCL_DEBUG=INFO` (`NCCL_DEBUG_SUBSYS=ALL` for more) | NCCL prints its set-up: interfaces, rings, transports, and its errors — the first thing to read when NCCL hangs at start-up on a cluster | GPU only: nothing to show here |
# | `py-spy dump --pid PID` | the Python stack of a running process, from outside (it pauses the process while it reads, unless `--nonblocking`; it needs ptrace permission, which containers often withhold): the line a hung rank waits on | not a course dependency; `pip install py-spy` on your own machine. The course uses Python's built-in `faulthandler` instead (`diagnose`, section 1) |

# %% [markdown]
# **▶ Those file names, searched in the library** (folded):

# %% jupyter={"source_hidden": true}
with open(so, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as library:
    fr_names = {name: library.find(name.encode()) >= 0 for name in (
        "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "XDG_CACHE_HOME",
        "comm_lib_trace_r", "nccl_trace_rank_")}
claim("libtorch_cpu.so (FlightRecorder.cpp's DebugInfoWriter) holds TORCH_FR_DUMP_TEMP_FILE, "
      "its older name TORCH_NCCL_DEBUG_INFO_TEMP_FILE, XDG_CACHE_HOME and 'comm_lib_trace_r' "
      "(the start of the default prefix 'comm_lib_trace_rank_'), and no 'nccl_trace_rank_'",
      fr_names == {"TORCH_FR_DUMP_TEMP_FILE": True, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": True,
                   "XDG_CACHE_HOME": True, "comm_lib_trace_r": True, "nccl_trace_rank_": False},
      found=fr_names)

# %% [markdown]
# **A hang needs a peer whose connections stay open.** Every hang in this section in which a
# rank had returned (bugs 1 and 3) waited on its process, which still ran: `spawn` keeps a
# finished rank alive, its connections open, until every rank has finished (lesson 00: after
# handing back its result, each rank waits on `release_conn.recv_bytes()` in
# `launch.worker_entry`), so that it is the time limit that names the stuck ranks. A peer that
# is alive but elsewhere — busy, in another collective (bug 2), in a loop that went on to
# evaluation — leaves a gloo rank waiting until the group's timeout. But a script's rank that
# leaves the loop usually reaches the end of the program and **exits**: its connections close,
# and a gloo rank waiting on it fails within seconds, long before the timeout, with gloo's
# "Connection closed by peer". Bug 3 once more, as two plain Python processes (no `spawn`),
# each running `init_process_group` (timeout 60 s), `bugzoo.early_stop` and then the end of
# its program (**▶ folded**: the script and the two processes):

# %% jupyter={"source_hidden": true}
exit_script = """
import datetime, time
import torch.distributed as dist
from dpcourse import bugzoo
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, start = dist.get_rank(), time.perf_counter()
try:
    print(f"rank {rank}: left the loop at step", bugzoo.early_stop(rank, dist.get_world_size()))
except RuntimeError as err:
    print(f"rank {rank}: after {time.perf_counter() - start:.1f} s,", str(err).splitlines()[0])
"""    # ...and then each process reaches the end of its program and exits
exit_port = str(launch.free_port())
exit_runs = [subprocess.Popen([sys.executable, "-c", exit_script], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=exit_port,
                                       RANK=str(r), WORLD_SIZE="2"))
             for r in range(2)]
exit_out = [run.communicate(timeout=120)[0] for run in exit_runs]

# %%
exit_lines = [next(line for line in out.splitlines() if line.startswith(f"rank {r}:"))
              for r, out in enumerate(exit_out)]
for line in exit_lines:   # (the seconds and the peer's port change from run to run)
    print(re.sub(r"after [\d.]+ s", "after … s", re.sub(r"\]:\d+", "]:<port>", line)))
exit_after = float(re.search(r"after ([\d.]+) s", exit_lines[0]).group(1))
claim("rank 1 left the loop and its program ended; rank 0, waiting in the next all_reduce, "
      "failed with gloo's 'Connection closed by peer' within 20 s (the time rank 1's process "
      "takes to exit), far before the 60 s timeout",
      exit_lines[1].startswith("rank 1: left the loop") and "Connection closed by peer"
      in exit_lines[0] and exit_after < 20, seconds=exit_after)

# %% [markdown]
# So on gloo, on one machine, once the group is formed a hang means that every rank's process
# is still running (a rank that dies before `init_process_group` completes leaves its peers
# waiting in the rendezvous until the store's timeout): a rank whose process exits makes its
# peers fail within seconds, each with an error that says only that the peer left (the bug
# is still to be found in the rank that left: it made fewer calls). That takes the exited
# rank's operating system closing its connections: gloo raises
# "Connection closed by peer" when a read finds the end of the stream. A node that loses power
# or its network (lesson 04 runs several nodes) closes nothing: its peers wait out the timeout.
# This machine has no GPU, so what NCCL does when a peer's process exits is not measured here;
# the bound the course can state for NCCL is the watchdog's timeout (the figure above).

# %% [markdown]
# ## 3. Bugs that run on — to a wrong answer, or a crash far from the cause
# These are worse: nothing hangs, the loss may even look fine, and only bug 9 crashes, at the
# second step, far from its cause. Most need a detector that compares the ranks. All seven
# (bugs 4 to 10) run, broken and fixed, in **one** launch (`bugzoo.zoo_worker`), with extra
# runs for bugs 6 and 9; each returns what its detector needs. They share one small model and
# each rank's own batches (different per rank, the same on every run):

# %%
viz.show_code(bugzoo.mlp, bugzoo.small_batches)

# %% [markdown]
# **▶ `zoo_worker`, the one launch**: plumbing that runs each
# program broken and fixed and returns the results by name.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(bugzoo.zoo_worker, folded="▶ zoo_worker, the one launch")

# %%
workdir = Path(tempfile.mkdtemp(prefix="bugzoo-"))
zoo = launch.spawn(bugzoo.zoo_worker, world_size, str(workdir), backend="gloo", timeout=60)
pairs = [k for k, v in zoo[0].items() if isinstance(v, dict) and set(v) == {False, True}]
singles = [k for k in zoo[0] if k not in pairs]
print(f"ran {len(pairs)} programs × (broken, fixed): {', '.join(pairs)}; and {len(singles)} "
      f"single runs: {', '.join(singles)}; on {len(zoo)} ranks")
claim("one program per bug 4 to 10, and bug 9's first step alone",
      len(pairs) == 7 + 1 and "unused_first_grads" in pairs, pairs=pairs)

# %% [markdown]
# The detector for replicas: a **checksum** of every parameter and buffer, sent back by each
# rank, compared across ranks with no tolerance: replicas kept in sync are bit-identical (lesson
# 03), so their checksums agree to the last bit when every rank sums the same way (with one
# exception, folded after the lab pointer). Weighted by position, so tensors with equal sums
# but values in other places still differ. It is summed on the tensor's own device (CPU for
# MPS, which lacks float64), a chunk at a time, so a GPU model needs no CPU copy.
# Lab 10's stretch asks you for a detector of your own, `replicas_in_sync(model)`.

# %%
viz.show_code(detectors.state_checksums, detectors.compare_checksums)
layer = torch.nn.Linear(64, 64)
before = detectors.state_checksums(layer)
with torch.no_grad():
    layer.weight[0, 0] += 1e-3          # the first position: weight 1 in the checksum
claim("a change of 1e-3 in one weight of a 64×64 layer, at its first position, is caught",
      detectors.compare_checksums([before, detectors.state_checksums(layer)]) == ["weight"])

# %% [markdown]
# **▶ `average_gradients`, what the fixed programs call**: lesson
# 03's hand-made averaging, the simple way (it skips missing gradients, so it is not lab 03
# part 1's answer) — open it after lab 03 passes.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(bugzoo.average_gradients,
              folded="▶ bugzoo.average_gradients — open after lab 03 passes")

# %% [markdown]
# ### Bug 4: a checkpoint resumed on one rank only
# Resuming an earlier run: rank 0 loads the checkpoint ("it is the rank that saved it"), once
# the model is wrapped in DDP. DDP makes the replicas equal once, in its constructor
# (`_sync_module_states`, from rank 0; skipped with `init_sync=False`, lesson 03), and never
# compares the parameters again (it copies them again only at the end of a `Join` context,
# `_sync_final_model`). The load comes after it: rank 0 trains from the checkpoint, the other
# ranks from fresh weights. Averaging the
# gradients applies the *same* update to *different* weights, so they stay different forever,
# and DDP never complains. Any change of the weights on some ranks after the wrapper is built
# does the same.

# %%
viz.show_code(bugzoo.resume_on_one_rank)

# %%
resume = {f: [r["resume"][f] for r in zoo] for f in (False, True)}
differ = [detectors.compare_checksums(step) for step in zip(*resume[False])]
print("broken: tensors that differ across ranks at the start:", differ[0])
claim("broken: the replicas differ from the start and at every step", all(differ))
claim("fixed (every rank loads it): the checksums agree at every step",
      not any(detectors.compare_checksums(step) for step in zip(*resume[True])))

# %% [markdown]
# ### Bug 5: the loss averaged instead of the gradients
# All-reduce the loss, divide by N, backward: the *logged* loss is the global mean, so the
# curve looks right. But the other ranks' losses were computed with *their* replicas: this
# rank's weights enter the mean only through its own term, so backward yields its own gradient
# / N, nothing of the others', and the replicas drift apart. `dist.all_reduce` has no autograd
# rule (torch warns once, printed below), but a differentiable one would not help: its
# backward sums the ranks' 1/N into 1, and each rank steps with its own gradient (run below).
# Average the gradients, not the loss.

# %%
viz.show_code(bugzoo.averaged_loss)

# %%
avg = {f: [r["averaged_loss"][f] for r in zoo] for f in (False, True)}
logged = [r["logged_loss"] for r in avg[False]]
grad_differ = detectors.compare_checksums([r["grads"][0] for r in avg[False]])
print("broken: gradients that differ across ranks at step 0:", grad_differ)
print("torch's warning at the backward:", avg[False][0]["warnings"][0].split(". ")[0] + ".")
own_gap = max(max(r["grad_minus_own_over_n"]) for r in avg[False])
claim("broken: at every step, on every rank, the gradient is exactly the rank's own gradient / N "
      "(computed before the all_reduce)", own_gap == 0.0, gap=own_gap)
claim("broken: every rank logs the same loss, so the log looks healthy",
      max(max(step) - min(step) for step in zip(*logged)) < 1e-6)
claim("but the gradients differ across ranks, and so do the weights after the first step",
      grad_differ and detectors.compare_checksums([r["weights"][1] for r in avg[False]]))
claim("fixed (average the gradients): gradients and weights agree at every step",
      not any(detectors.compare_checksums(s) for s in zip(*[r["weights"] for r in avg[True]]))
      and not any(detectors.compare_checksums(s) for s in zip(*[r["grads"] for r in avg[True]])))


# %% [markdown]
# **▶ Bug 5 with `torch.distributed.nn.functional.all_reduce`, differentiable** (folded
# below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(bugzoo.averaged_loss_differentiable,
              folded="▶ Bug 5 with a differentiable all_reduce")

# %%
diff_ar = launch.spawn(bugzoo.averaged_loss_differentiable, world_size, backend="gloo")
claim("differentiable all_reduce: the gradient is exactly the rank's own (N times bug 5's), "
      "and the weights still differ across ranks after one step",
      max(max(r["grad_minus_own"]) for r in diff_ar) == 0.0
      and detectors.compare_checksums([r["weights"][1] for r in diff_ar]))

# %% [markdown]
# **▶ The figure's code** (folded below): each rank's checksums summed per step, and the step
# where bug 5's replicas part.

# %% jupyter={"source_hidden": true}
def totals(runs):
    """One number per rank per step: the sum of a rank's checksums."""
    return [[sum(c.values()) for c in run] for run in runs]


bug5 = totals([r["weights"] for r in avg[False]])
gaps = [max(step) - min(step) for step in zip(*bug5)]
first = min(i for i, g in enumerate(gaps) if g > 0)
parts = (first, gaps[first], gaps[first + 1])
claim(f"bug 5's replicas first differ after step {first - 1}, by {gaps[first]:.2f} in the "
      f"checksum sum, {gaps[first + 1] / gaps[first]:.0f}× more after step {first}",
      first == 1 and gaps[first + 1] > 5 * gaps[first], gaps=gaps)


viz.show(viz.replica_checksums_figure({
    "bug 4: checkpoint loaded on rank 0 only": {"broken": totals(resume[False]),
                                                "fixed": totals(resume[True])},
    "bug 5: loss averaged, not gradients": {"broken": totals([r["weights"] for r in avg[False]]),
                                            "fixed": totals([r["weights"] for r in avg[True]])},
}), "Weight checksums per rank against the steps taken (x = 0: the start; after step k, "
    f"x = k + 1). Broken: one line per rank, apart from the start (bug 4) or, for bug 5, after "
    f"step {parts[0] - 1} (by {parts[1]:.2f}, barely visible) and clearly after step {parts[0]} "
    f"(by {parts[2]:.2f}). Fixed (grey, dashed): the ranks draw one line.")

# %% [markdown]
# ### Bug 6: BatchNorm statistics that differ per rank
# The gradients are averaged, so the weights agree; but BatchNorm's running mean and variance
# are *buffers*, updated from each rank's own batches. They differ per rank, and so do the
# checkpoints and, unless DDP copies the buffers first (below), the evaluations. The detector
# names exactly which tensors differ.
#
# **The real fix, `nn.SyncBatchNorm`**, computes the statistics over the global batch: it
# gathers every rank's mean, inverse std and count, normalizes with the global statistics, and
# updates the running ones from them (`torch.batch_norm_gather_stats_with_counts` in
# `SyncBatchNorm.forward`). In training mode inside an initialised process group (even of one
# rank) it accepts only CUDA, HPU, XPU or a PrivateUse1 device and raises for CPU input.
#
# **How `running_var` moves:** by `momentum` (0.1 by default; 1 in the comparison below, which
# makes it the batch's) toward each batch's *unbiased* variance.
#
# **The fix here, on CPU, averages the running statistics after each step**: the ranks then
# agree and the detector goes quiet, but that is not what one process with the global batch
# would hold (run below). The ranks' running means average to the global mean (equal
# batches); not so the variances. For N ranks of n samples the global batch's unbiased variance
# is (the mean of the ranks' biased variances + the variance of their means) · Nn/(Nn − 1): the
# plain average of the ranks' unbiased variances misses the means' spread and divides by n − 1,
# not Nn − 1, so it can land above the global value or below.
#
# **DDP's buffer sync.** DDP's `forward_sync_buffers=True` (the default; it replaces
# `broadcast_buffers`, deprecated since 2.13) copies rank 0's buffers to every rank at the
# *start* of each forward here (not of one after a `no_grad` or `no_sync()` forward: lesson 03)
# — then BatchNorm updates them from each rank's own batch, so after the last step, when the
# checkpoint is written, the ranks differ again (run below).

# %%
viz.show_code(bugzoo.batchnorm_stats)

# %%
bn_broken = detectors.compare_checksums([r["batchnorm"][False] for r in zoo])
print("broken: tensors that differ across ranks:", bn_broken)
claim("broken: only the running statistics differ — every weight agrees",
      bn_broken == ["1.running_mean", "1.running_var"])
claim("fixed: nothing differs", detectors.compare_checksums([r["batchnorm"][True] for r in zoo])
      == [])

# One BatchNorm step per rank on rank 0's and rank 1's first batches (momentum 1: the running
# statistics become that batch's), buffers averaged, against one BatchNorm on both batches.
per_rank = [bugzoo.small_batches(r, 1)[0][0] for r in range(world_size)]
bns = [torch.nn.BatchNorm1d(4, momentum=1.0) for _ in range(world_size + 1)]
for bn, x in zip(bns, per_rank + [torch.cat(per_rank)]):
    bn(x)
avg_mean = sum(bn.running_mean for bn in bns[:-1]) / world_size
avg_var = sum(bn.running_var for bn in bns[:-1]) / world_size
print("averaged running_var:", [round(v, 3) for v in avg_var.tolist()])
print("global   running_var:", [round(v, 3) for v in bns[-1].running_var.tolist()])
bn = torch.nn.BatchNorm1d(4)  # momentum 0.1; running_var starts at 1
bn(per_rank[0])
claim("default momentum: running_var = 0.9 · 1 + 0.1 · the batch's unbiased variance",
      torch.allclose(bn.running_var, 0.9 + 0.1 * per_rank[0].var(0), atol=1e-6))
claim("averaged running means equal the global batch's mean (to float rounding)",
      torch.allclose(avg_mean, bns[-1].running_mean, atol=1e-6))
claim("but averaged running variances are not the global batch's variance: here above it in "
      "some features, below it in others",
      not torch.allclose(avg_var, bns[-1].running_var, rtol=1e-3)
      and (avg_var > bns[-1].running_var).any() and (avg_var < bns[-1].running_var).any(),
      gap=round((avg_var - bns[-1].running_var).abs().max().item(), 3))
n = len(per_rank[0])
pooled = sum((n - 1) / n * bn.running_var + (bn.running_mean - avg_mean) ** 2
             for bn in bns[:-1]) / world_size * (world_size * n) / (world_size * n - 1)
claim("the global batch's running_var is the mean of the ranks' biased variances plus the "
      "variance of their means, times Nn/(Nn−1) (to float rounding)",
      torch.allclose(pooled, bns[-1].running_var, atol=1e-6))
viz.show_code(bugzoo.batchnorm_ddp)

# %%
bn_ddp = detectors.compare_checksums([r["batchnorm_ddp"] for r in zoo])
claim("under DDP (forward_sync_buffers=True), after the last step the running statistics still "
      f"differ across ranks: {bn_ddp}", bn_ddp == ["1.running_mean", "1.running_var"])

# %% [markdown]
# ### Bug 7: a NaN on one rank spreads to all
# One corrupted sample (an `inf`) reaches rank 1 at step 3. Its loss stays finite (tanh turns
# the inf into ±1; printed below), but its gradient is NaN; the all-reduce sums it into every
# rank's gradient, and from then on every rank's weights are NaN. Looking at any single rank after the fact, you cannot tell where it started,
# unless torch's own check was on (it is off by default): with `TORCH_DIST_NAN_CHECK=1` (any
# backend; NCCL also reads `TORCH_NCCL_NAN_CHECK`), a collective first checks its input, and
# the rank holding a NaN raises "NaN found in input tensor." (all_reduce, run below). The
# detector looks at each rank's *local* values — here the gradient norm, before the reduction — and
# names the first. The fix skips the step on every rank when any rank's gradient is non-finite:
# `all_ranks_finite` gives every rank one verdict. That code, part of lab 10's stretch, is folded
# after the lab pointer.

# %%
viz.show_code(bugzoo.nan_on_one_rank, detectors.first_nonfinite)

# %%
local = [r["nan"][False]["local_grad_norm"] for r in zoo]
origin = detectors.first_nonfinite(local)
print(f"first non-finite local gradient: step {origin[0]}, rank(s) {origin[1]}")
bad_loss = zoo[1]["nan"][False]["local_loss"][3]
claim(f"rank 1's own loss at step 3 is finite ({bad_loss:.3f}): no inf or NaN in its loss",
      math.isfinite(bad_loss))
claim("the detector names rank 1, step 3 — where the inf was injected", origin == (3, [1]))
claim("broken: after that step every rank's local gradient is NaN",
      all(math.isnan(v) for r in local for v in r[origin[0] + 1:]))
fixed_local = [r["nan"][True]["local_grad_norm"] for r in zoo]
claim("fixed (all ranks skip a step when any rank's gradient is non-finite): only the bad "
      "batch's own gradient is non-finite, and the weights stay finite",
      detectors.first_nonfinite(fixed_local) == (3, [1])
      and detectors.first_nonfinite([r[4:] for r in fixed_local]) is None
      and all(math.isfinite(v) for v in zoo[0]["nan"][True]["eval_loss"]))


# %%
def nan_checked(rank, world_size):
    import os

    import torch
    import torch.distributed as dist

    os.environ["TORCH_DIST_NAN_CHECK"] = "1"     # read when the group is created
    dist.init_process_group("gloo")
    dist.all_reduce(torch.tensor([float("nan") if rank == 1 else 1.0]))


try:
    launch.spawn(nan_checked, world_size, timeout=30, show_output=False)
except launch.RankFailedError as e:
    nan_error = e
print(f"rank {nan_error.rank} failed:", nan_error.summary.splitlines()[0])
claim("with TORCH_DIST_NAN_CHECK=1, on gloo, the rank whose input holds the NaN (rank 1) is the "
      "one that raises, in its all_reduce", nan_error.rank == 1
      and "NaN found in input tensor" in nan_error.summary and "all_reduce" in nan_error.failures[1])

# %%
viz.show(viz.nan_spread_figure(local, {"broken": zoo[0]["nan"][False]["eval_loss"],
                                       "fixed": zoo[0]["nan"][True]["eval_loss"]}, origin),
         "Left: rank 1's local gradient is the first NaN (step 3); from step 4 every rank's is. "
         "Right: the broken model is NaN from step 3 on; the fixed one skips that step and "
         "trains on.")

# %% [markdown]
# ### Bug 8: a forgotten `set_epoch`
# `DistributedSampler` draws a new order each epoch only when told the epoch, by
# `sampler.set_epoch(epoch)` (lesson 03). Forget it and every epoch deals the same order, and
# nothing warns at run time (only the class's docstring does). What the run below shows is the
# order; what it costs training depends on the data, and is not measured here.

# %%
viz.show_code(bugzoo.forgotten_set_epoch, detectors.repeated_epoch_orders)

# %%
for rank, r in enumerate(zoo):
    print(f"rank {rank}, broken, epochs 0-2:", r["set_epoch"][False])
claim("broken: on every rank, epochs 1 and 2 repeat epoch 0's order",
      all(detectors.repeated_epoch_orders(r["set_epoch"][False]) == [1, 2] for r in zoo))
claim("fixed: no epoch repeats", all(detectors.repeated_epoch_orders(r["set_epoch"][True]) == []
                                     for r in zoo))
claim("and in every epoch the ranks together still see every sample",
      all(set().union(*(r["set_epoch"][True][e] for r in zoo)) == set(range(16))
          for e in range(3)))

# %% [markdown]
# ### Bug 9: an unused parameter
# A parameter that no forward touches (a head not used this step, a leftover layer) never gets a
# gradient, so iteration 0's single bucket never completes: the first backward returns with no
# all-reduce, each rank keeping its own gradients (below), and a loop's first `opt.step()`
# pulls the replicas apart; DDP fails only at the *next* forward.
# Torch's error (printed whole below) lists the indices of the parameters that got no
# gradient; with `TORCH_DISTRIBUTED_DEBUG=INFO` (or DETAIL) it also names them. The course's
# detector runs one forward/backward in one process, no DDP needed, and lists the same names.
# Fix: remove the parameter, or `find_unused_parameters=True` (a graph walk every step), or,
# when the same parameters are unused at every step **and** the graph is trained the same way
# every step (no control flow that depends on the iteration), `static_graph=True` (its
# docstring's two conditions; DDP then need not search the graph in every iteration).

# %%
viz.show_code(bugzoo.TwoHeads, bugzoo.unused_parameter, bugzoo.unused_first_step,
              detectors.unused_parameters)

# %%
print("broken, DDP's whole message on rank 0:\n" + zoo[0]["unused"][False])
print("\nwith TORCH_DISTRIBUTED_DEBUG=INFO, its last lines:\n"
      + "\n".join(zoo[0]["unused_info"].splitlines()[-2:]))
print("\nfixed:", zoo[0]["unused"][True])
claim("broken: DDP fails at the second iteration on every rank",
      all("Expected to have finished reduction" in r["unused"][False] for r in zoo))
first = [detectors.compare_checksums([r["unused_first_grads"][f] for r in zoo]) for f in (0, 1)]
claim("broken, before that error: after the first backward the ranks' gradients differ (no "
      "all-reduce ran); fixed, they agree", first == [["body.weight", "head_a.weight"], []])


def indices_line(message):
    """The numbers on the line of DDP's message that lists the parameters without a gradient."""
    return next((line.split(": ", 1)[1].split() for line in message.splitlines()
                 if line.startswith("Parameter indices which did not receive grad")), None)


claim("its message lists the indices of the parameters without a gradient (4 and 5: head_b's)",
      all(indices_line(r["unused"][False]) == ["4", "5"] for r in zoo))
claim("with INFO it names them", all("head_b.bias, head_b.weight" in r["unused_info"] for r in zoo))
claim("fixed with find_unused_parameters=True: it runs", all(r["unused"][True] == "ok" for r in zoo))
unused = detectors.unused_parameters(bugzoo.TwoHeads(), torch.randn(3, 4))
print("unused parameters:", unused)
claim("the detector names head_b's weight and bias", unused == ["head_b.weight", "head_b.bias"])
claim("and finds none in a model that uses all its parameters",
      detectors.unused_parameters(torch.nn.Linear(4, 2), torch.randn(3, 4)) == [])

# %% [markdown]
# ### Bug 10: every rank writes the same checkpoint
# `torch.save(model.state_dict(), "checkpoint.pt")` on every rank: N writers race on one file.
# `torch.save` opens the path and writes the zip archive in place (no temporary file, no
# rename), so the writers' bytes can interleave, on a local disk as on a shared file system,
# and a reader can meet a torn file (read in the source, not shown: here the ranks save equal
# weights, so nothing looks wrong); the detector sees the race, not its damage.
# The detector wraps `torch.save` on each rank and reports paths written by more than one
# rank. Fix: rank 0 writes (atomically: lesson 04), the others wait at a barrier.

# %%
viz.show_code(bugzoo.same_checkpoint, detectors.record_saves, detectors.duplicate_writers)

# %%
clash = detectors.duplicate_writers([r["checkpoint"][False] for r in zoo])
print("broken:", {Path(p).relative_to(workdir).as_posix(): ranks for p, ranks in clash.items()})
claim("broken: one path, written by every rank",
      list(clash.values()) == [list(range(world_size))])
claim("fixed: no path has two writers",
      detectors.duplicate_writers([r["checkpoint"][True] for r in zoo]) == {})

# %% [markdown]
# ## 4. A port already in use
# `MASTER_PORT=29500` hard-coded, and a previous run (or another user) still holds it: rank 0
# cannot start the rendezvous store. The detector `port_owner` says whether a port is free and,
# where the OS allows, which process listens on it. Fix: a free port per launch (what
# `launch.spawn` does; `torchrun --standalone` picks one too, and so does plain torchrun on one
# node given no endpoint, no master port and no rendezvous backend), or stop the squatter.

# %%
viz.show_code(bugzoo.port_in_use, detectors.port_owner)

# %%
squatter = socket.socket()
squatter.bind(("127.0.0.1", 0))
squatter.listen()
port = squatter.getsockname()[1]
owner = detectors.port_owner(port)
claim("the detector sees the port taken, by this notebook's own process",
      owner is not None and owner["pid"] in (os.getpid(), None))
try:
    launch.spawn(bugzoo.port_in_use, world_size, port, timeout=20, show_output=False)
except launch.RankFailedError as e:
    port_error = e
print(f"rank {port_error.rank} failed:", port_error.summary.split(", ")[-2:])
claim("rank 0 fails at once with EADDRINUSE", port_error.rank == 0
      and "EADDRINUSE" in port_error.summary)
squatter.close()
claim("once the squatter is gone, the port is free", detectors.port_owner(port) is None)

# %% [markdown]
# ## 5. On your own scripts: `python -m dpcourse diagnose`
# Section 2's trace, hang report and stack dumps work on a torchrun-style script (on gloo; the
# stuck-call report needs blocking calls, section 1), with one difference: a rank whose script
# ends stays alive until every rank is done, so a peer waiting on it shows here as a HANG, where
# under torchrun it fails within seconds ("Connection closed by peer", section 2). Two of
# `diagnose()`'s options do not carry over: the command has no monitored barrier (`monitor=`),
# and a script sets up its own group, so give its `init_process_group` the `timeout`
# (`group_timeout=` is for worker functions).
# `diagnose` starts it on N local ranks with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT set, traces
# its collectives, bounds it with `--timeout`, and dumps the stuck ranks' stacks. Options go
# before the script; `--detail` adds `TORCH_DISTRIBUTED_DEBUG=DETAIL`, `--json` prints the
# report for tools, and `--cpu` runs a script written for GPUs (NCCL, `.cuda()`, `device_ids`)
# on a machine without them, NCCL as gloo and CUDA moves kept on the CPU — it can then tell
# whether the rest of the script is right, not whether it runs on GPUs. The exit code is 0 only
# for a clean, consistent run with nothing found (`ok = result.ok`, `Diagnosis.ok` from
# section 2), so it fits in a CI job. On lab 10's own scripts (their docstring starts "Lab 10, bug N") it withholds its findings.
#
# **▶ The command** (folded): `diagnose_script`, what `python -m dpcourse diagnose` runs.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
import dpcourse.__main__ as dpcourse_cli

viz.show_code(dpcourse_cli.diagnose_script, folded="▶ The command: diagnose_script")

# %%
script = Path(tempfile.mkdtemp(prefix="diagnose-")) / "train_hang.py"
script.write_text('''import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
weights = torch.zeros(4)
for step in range(3):
    grad = torch.ones(4)
    dist.all_reduce(grad)
    weights -= 0.1 * grad
    if rank == 0 and step == 1:
        break  # rank 0 stops early: rank 1's next all_reduce waits, here until the timeout
               # (under torchrun it fails within seconds)
print("done", rank)
''')
cli = subprocess.run([sys.executable, "-m", "dpcourse", "diagnose", "--timeout",
                      str(hang_timeout), str(script)], capture_output=True, text=True, timeout=120)
print(cli.stdout.replace(str(script), "train_hang.py"))
claim("the command exits with 1 and reports the hang", cli.returncode == 1 and "HANG" in cli.stdout)
claim("naming rank 1, its all_reduce and the script's line 9",
      "rank 1 is stuck in all_reduce (call #2) at train_hang.py:9" in cli.stdout)

# %% [markdown]
# Most bugs do not hang. So inside each rank `diagnose` also watches what the script does
# (`dpcourse.script_watch`: wrappers around a few torch calls, put back after the run; your
# file is never edited): every DistributedSampler and DataLoader read, `torch.save`, barrier,
# printed or logged loss, metrics writer (TensorBoard, wandb) started, `all_reduce` and its
# line, the first optimizer step, and whether the group was destroyed. After the run it
# reads all ranks' records together (`script_checks.analyze`). `Watch.installed` sets each
# wrapper in place of the torch function and puts the original back in its `finally` (folded
# further down). Below:
# one wrapper (`set_epoch`'s) and the part of `analyze` that makes the `set_epoch` finding;
# after the `rank0_loss` rule below, the three other rules the script further down fires.
#
# One finding reads **text** instead: `Watch._reported` (called by the `print` and `logging`
# wrappers) counts a line as a printed loss when a regular expression finds the word `loss`,
# `acc` or `accuracy` and, within 20 non-digits, a digit; `rank0_loss` fires when only rank 0
# printed one and rank 0 made no small all-reduce (≤ 4 elements) that it reads. A heuristic:
# `train_loss=0.3` escapes it (run below: the pattern wants a word boundary, `\b`, before
# `loss`, and `_` is a word character, so there is none between `train_` and `loss`), and a
# small all-reduce of something else silences it.

# %%
analyze_lines = inspect.getsource(script_checks.analyze).splitlines()


def excerpt(first, last):  # analyze's lines from the one with `first` to the next with `last`
    begin = next(i for i, line in enumerate(analyze_lines) if first in line)
    end = next(i for i, line in enumerate(analyze_lines) if last in line and i > begin)
    return textwrap.dedent("\n".join(analyze_lines[begin:end + 1]))


viz.show_code(script_checks.Watch._set_epoch,
              "# script_checks.analyze, the set_epoch finding (es: one rank's events)\n"
              + excerpt("# a sampler read counts as training", "lesson 10, bug 8"),
              script_checks.Watch._reported,
              "# script_checks.analyze, the rank0_loss finding (synced: the script called\n"
              "# init_process_group; unused: all_reduce lines whose result nothing reads)\n"
              + excerpt("printers = sorted(", "for e in events.get(0, [])") + "\n"
              + excerpt("printers == [0] and not reduced", "[0])"))
# the three other rules the run below fires, as analyze writes them
viz.show_code("# script_checks.analyze, the module_prefix finding (per rank; a 'save' event's\n"
              "# prefixed: the saved state_dict's keys start with 'module.')\n"
              + excerpt('e["kind"] == "save" and e.get("prefixed")',
                        '"lesson 04, §3 Checkpoints and fault tolerance", rank)'),
              "# script_checks.analyze, the save_race finding (across ranks)\n"
              + excerpt("saves: dict[str,", "f.ranks = ranks"),
              "# script_checks.analyze, the barrier finding (steps: optimizer steps taken)\n"
              + excerpt("steps = max((e", "sorted(barriers))"))
probe = script_checks.Watch(os.devnull, 0, 1)       # one rank's recorder, writing nowhere
heard = []
probe.event = lambda kind, **where: heard.append(kind)
for text in ("epoch 1 loss 0.512", "train_loss=0.3", "train loss=0.3"):
    heard.append(text)
    probe._reported(text)
probe._file.close()
claim("a heuristic on text: 'epoch 1 loss 0.512' and 'train loss=0.3' count as a printed loss, "
      "'train_loss=0.3' (no word boundary before 'loss') does not",
      heard == ["epoch 1 loss 0.512", "print", "train_loss=0.3", "train loss=0.3", "print"],
      heard=heard)

# %% [markdown]
# **▶ The wrappers behind these rules** (folded below): `Watch.installed` puts them in place
# and registers an optimizer-step post-hook, `_after_step`, whose count of steps `finish`
# writes as `steps` (what the barrier rule compares rank 0's barrier count with); `Watch._sampler_iter` notes each
# sampler read (its epoch, shuffle, seed, data set, whether gradients are on, and which loader
# read it), `_loader_iter` and `_backward` count the backward calls during each loader read
# (`analyze` counts a read as training when there was one); `Watch._collective` notes a
# `small_reduce` for an all-reduce of 1 to 4 elements; `Watch._save` notes `prefixed`, which
# `module_prefix` reads.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
from dpcourse import script_watch

viz.show_code(script_checks.Watch.installed, script_checks.Watch._after_step,
              script_checks.Watch.finish,
              script_checks.Watch._sampler_iter, script_checks.Watch._loader_iter,
              script_checks.Watch._close_reading, script_checks.Watch._backward,
              script_checks.Watch._collective, script_checks.Watch._save,
              inspect.getsource(script_watch._module_prefixed),
              folded="▶ The wrappers: Watch.installed and what it puts in place")

# %% [markdown]
# Here is a script a learner could have written from a blog post, ported to the CPU — it runs to
# the end on every rank (the report's first line), and it has five of the mistakes this course
# teaches:

# %%
script = Path(tempfile.mkdtemp(prefix="diagnose-")) / "train_blog.py"
script.write_text('''import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=8, sampler=sampler)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for inputs, labels in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        dist.barrier()                     # keep the workers together
    if rank == 0:
        print(f"epoch {epoch} loss {loss.item():.3f}")
torch.save(model.state_dict(), "checkpoint.pt")
dist.destroy_process_group()
''')
cli = subprocess.run([sys.executable, "-m", "dpcourse", "diagnose", "--timeout", "60",
                      str(script)], capture_output=True, text=True, timeout=180,
                     cwd=script.parent)
print(cli.stdout.replace(str(script), "train_blog.py"))
found = sorted(re.findall(r"\[(\w+)\] train_blog.py:(\d+)", cli.stdout))
claim("diagnose names five mistakes at their lines: no set_epoch (16), a barrier every step (21), "
      "rank 0's own loss printed (23), every rank saving one file (24) with DDP's module. keys (24)",
      found == sorted([("set_epoch", "16"), ("barrier", "21"), ("rank0_loss", "23"),
                       ("save_race", "24"), ("module_prefix", "24")]) and cli.returncode == 1,
      found=found)
claim("and the script itself ran to the end on both ranks",
      "finished: all 2 ranks returned" in cli.stdout)

# %% [markdown]
# ## Lab 10
# Open [lab10_bug_hunt](../labs/lab10_bug_hunt.ipynb): five broken torchrun scripts with five
# bugs that are not among this lesson's (the lab numbers them 1 to 5 too: its bug 5 is not the
# zoo's). For each, find the line and work out, from the script's own
# lines, the number its question asks for (what the script does) before any option is shown,
# then name it, fix it, and let the check run your fix under torchrun; the stretch
# has you write a replicas-in-sync detector, True exactly for bit-identical replicas, with one
# verdict on every rank.
#
# One tool from single-device training that the lab meets: **gradient clipping**.
# `torch.nn.utils.clip_grad_norm_(params, max_norm)` computes one 2-norm over all the
# gradients it is given (as if they were one vector), then multiplies every one of them in
# place by `max_norm / (norm + 1e-6)` clamped to at most 1; it returns the norm it measured.
#
# **▶ The reference answer — open after your lab passes**: the
# stretch's idea, run on two weight vectors.
#
# <details><summary>▶ open</summary>
#
# Replicas in sync give equal checksums; the converse does not hold: equal checksums are strong
# evidence, not proof, of equal bits.
# What a checksum misses: changes that cancel in its weighted sum (run below), a change
# below the float64 sum's rounding (about 1e-16 of the checksum), and bits that a sum of values
# cannot tell apart: −0.0 and +0.0 add alike. And one thing it sees that is not there: a NaN is
# never equal to itself, so replicas holding the same NaN read as different (run below).
#
# </details>

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(bugzoo.checksum_collision,
              folded="▶ The run's code — open after your lab passes")
with viz.folded_output("▶ Its claim — open after your lab passes"):
    collision = bugzoo.checksum_collision()
    claim("the run gives what the folded text above says", collision == (False, []),
          collision=collision)
    zeros = [torch.nn.Linear(2, 1, bias=False) for _ in range(2)]
    with torch.no_grad():
        zeros[0].weight.copy_(torch.tensor([[0.0, 1.0]]))
        zeros[1].weight.copy_(torch.tensor([[-0.0, 1.0]]))
    signed = detectors.compare_checksums([detectors.state_checksums(m) for m in zeros])
    claim("−0.0 against +0.0: other bits, the same checksum", signed == []
          and not torch.equal(zeros[0].weight.view(torch.int32), zeros[1].weight.view(torch.int32)))
    with torch.no_grad():
        zeros[0].weight[0, 0] = float("nan")
    same_nan = detectors.state_checksums(zeros[0])
    claim("the same NaN on both: the same bits, checksums that differ",
          detectors.compare_checksums([same_nan, same_nan]) == ["weight"])

# %% [markdown]
# **▶ The reference answer — open after your lab passes**: bug 7's
# `all_ranks_finite`, one verdict on every rank.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(bugzoo.all_ranks_finite,
              folded="▶ The reference answer — open after your lab passes")

# %% [markdown]
# ## Summary
# | bug | symptom | detector | fix |
# |---|---|---|---|
# | a collective on some ranks only | hang | `diagnose`: stuck rank, its call and line; `monitored_barrier` or DETAIL: the rank that never came | every rank calls every collective |
# | collectives in different orders | hang (gloo, here) | trace mismatch; `TORCH_DISTRIBUTED_DEBUG=DETAIL` | one order on every rank |
# | rank-dependent control flow | hang after some steps | trace: one rank made more calls; `monitored_barrier`: the rank that left | decide together (all-reduce the decision) |
# | a checkpoint loaded on one rank after DDP's constructor | replicas never agree | weight checksums across ranks | every rank loads it |
# | loss averaged, not gradients | log looks fine, replicas drift | gradient / weight checksums | average the gradients |
# | BatchNorm statistics per rank | checkpoints and, without DDP's buffer sync, evaluations differ | buffer checksums | SyncBatchNorm (CUDA, HPU, XPU or PrivateUse1 input, in training); averaged buffers agree, but their variance is not the global batch's; DDP's buffer sync leaves them apart after the last step |
# | NaN on one rank | NaN everywhere | first non-finite *local* value; `TORCH_DIST_NAN_CHECK=1` | check finiteness together, skip together |
# | forgotten `set_epoch` | same order every epoch | repeated epoch orders | `sampler.set_epoch(epoch)` |
# | unused parameter | DDP fails at step 2 | `unused_parameters` | remove it; `static_graph=True` if the same parameters are unused at every step and no control flow depends on the iteration; else `find_unused_parameters=True` (a graph walk every step) |
# | every rank saves the checkpoint | racing writers | `record_saves` + `duplicate_writers` | rank 0 saves, barrier |
# | port already in use | EADDRINUSE at start | `port_owner` | a free port per launch |
#
# - A hang is a disagreement between ranks: find the first collective where their traces
#   differ, and the rank still inside a call. Bound every run with a timeout while you look.
# - The silent bugs need a comparison across ranks: checksums of weights, gradients and
#   buffers, or each rank's local values before a reduction.
# - Each detector fired on its bug above, and most stayed quiet on the fix. Two did not, by
#   design: bug 7's still names the bad batch's own gradient (the fix skips that step; nothing
#   is non-finite after it), and bug 9's still names `head_b`, which the fix
#   (`find_unused_parameters=True`) keeps: there the proof is that DDP runs.
#
# ## Check yourself
#
# **▶ The quiz** — run the folded cell below and answer in the widget (or read its output,
# where the answers are folded).

# %% jupyter={"source_hidden": true}
from dpcourse import quizzes

viz.quiz(quizzes.questions("10"))

# %% [markdown]
# ## Sources
# Every statement above about torch's internals was checked in the installed torch 2.14.1, or,
# where marked, in its upstream C++ source:
#
# - `torch/distributed/rendezvous.py` — `_create_c10d_store` (lines 205-222): under `env://`
#   rank 0 hosts the store (`is_master=start_daemon`, `start_daemon = rank == 0`), which by default waits
#   for every rank to connect (`wait_for_workers`, `torch/_C/_distributed_c10d.pyi` line 329):
#   a rank that dies before connecting leaves the others waiting until that timeout.
# - `torch/distributed/distributed_c10d.py` — `monitored_barrier`: it raises "monitored_barrier
#   requires a group with a CPU-capable backend (e.g. GLOO)" unless `torch.device("cpu")` is in
#   the group's `_device_types`, so a device-qualified group such as `"cpu:gloo,cuda:nccl"` is
#   accepted for its CPU backend (its comment says so), an NCCL-only group is not;
#   `torch/include/torch/csrc/distributed/c10d/ProcessGroup.hpp` —
#   `ProcessGroup::monitoredBarrier` calls the `c10d::monitored_barrier_` op on an empty CPU
#   tensor ("Default to using cpu implementation"), so the CPU backend serves it; rank 0
#   reports the ranks that did not arrive, the others block until rank 0 answers;
#   `wait_all_ranks` collects every missing rank.
# - `torch/distributed/distributed_c10d.py` — `_new_process_group_helper` and
#   `_create_process_group_wrapper`: with the debug level DETAIL, a gloo, NCCL, XCCL or UCC
#   group is wrapped in `_ProcessGroupWrapper` with a helper `ProcessGroupGloo` that has the
#   group's timeout.
# - `torch/include/torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp` — `ProcessGroupWrapper`,
#   `runCollectiveChecks`: the helper group does the monitored barrier and the fingerprint
#   comparison before the collective is dispatched to the wrapped backend.
# - `torch/lib/libtorch_cpu.so` — the flight recorder's dump file (upstream
#   `FlightRecorder.cpp`, `DebugInfoWriter::getWriter`, not in the wheel): the prefix comes
#   from `TORCH_FR_DUMP_TEMP_FILE` or, failing that, `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`, by
#   default `comm_lib_trace_rank_` in `$XDG_CACHE_HOME/torch` or `~/.cache/torch`, and the rank
#   is appended; the library's strings were found above (`nccl_trace_rank_` is not among them).
# - `torch/include/torch/csrc/distributed/c10d/FlightRecorder.hpp` — `FlightRecorder`'s
#   constructor: `max_entries_` from `TORCH_FR_BUFFER_SIZE` or `TORCH_NCCL_TRACE_BUFFER_SIZE`,
#   2000 by default; enabled when above 0; an entry's states `scheduled`, `started` and
#   `completed`, the last two set when a CPU thread discovers the GPU work started or ended;
#   `retired_` ("is this work entry no longer in the workMetaList_? a retired but not completed
#   event has timed out"), the `retired` key and
#   `pg_status_key`; `FlightRecorderDetail.hpp` — `FlightRecorder::retire_id` sets
#   `retired_ = true` when the backend retires the work, the dump writes it as `retired`,
#   `getPgStatus` writes `last_enqueued_collective`, `last_started_collective` and
#   `last_completed_collective`; each entry's `frames` (the calling stack) with
#   `includeStackTraces`; `torch/lib/libtorch_python.so` — `_dump_fr_trace`, its Python binding.
# - `ProcessGroupNCCL.cpp` (pytorch/pytorch, the source of the installed `libtorch_cuda.so`;
#   not shipped in the wheel) — `WorkNCCL::wait`: "In case of blockingWait or a timeout value is
#   specified by the user, we block the CPU thread"; the `HeartbeatMonitor` constructor:
#   `TORCH_NCCL_DUMP_ON_TIMEOUT` and `TORCH_NCCL_ENABLE_MONITORING` default to true; the
#   constructor's `desyncDebug_` is on with `TORCH_NCCL_DESYNC_DEBUG` or the DETAIL debug level;
#   `ProcessGroupNCCL::collective`: `getNCCLComm(key)` and, when none is cached,
#   `initNCCLComm(key, device, opType)` (forms the communicator, blocking by default) come
#   before `initWork(...)` builds the work and `workEnqueue(work)` hands it to the watchdog
#   (the installed `ProcessGroupNCCL.hpp` declares all four).
# - `torch/include/torch/csrc/distributed/c10d/NCCLUtils.hpp` — `NCCLComm::waitReady`, "a
#   blocking function": a collective needs its communicator ready; `ProcessGroupNCCL.hpp` —
#   `useNonblocking()`, the switch of nonblocking communicator creation, read from
#   `TORCH_NCCL_USE_COMM_NONBLOCKING` (the name is in `torch/lib/libtorch_cuda.so`; that it is
#   off by default is read from upstream `NCCLUtils.cpp`'s `nccl_use_nonblocking()`, which is
#   not installed); `torch/distributed/distributed_c10d.py` —
#   `init_process_group`'s `device_id` (eager communicator; otherwise "the normal lazy call").
# - `torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp` — `TORCH_NCCL_BLOCKING_WAIT`
#   (whether `wait()` blocks), `ErrorHandlingMode` and `TORCH_NCCL_ASYNC_ERROR_HANDLING` (tear
#   the process down on an error; the default, 3, is SkipCleanUp: its comment and the
#   `ErrorHandlingMode` enum), the `Watchdog` class, `TORCH_NCCL_DUMP_ON_TIMEOUT` (its comment:
#   it must be set with `TORCH_NCCL_ENABLE_MONITORING=1` and a trace buffer above 0),
#   `dumpOnTimeoutOrEx_` (dump "on exception including both watchdog timeout and nccl
#   errors"), `HeartbeatMonitor`'s thread (with no watchdog heartbeat it dumps debug info) and
#   `shouldDump_` (its three conditions),
#   `kProcessGroupNCCLDefaultTimeout` (10 minutes).
# - `torch-2.14.1.dist-info/entry_points.txt` — the `torchfrtrace` command,
#   `torch.distributed.flight_recorder.fr_trace:main`;
#   `torch/distributed/flight_recorder/components/builder.py` — `build_collectives` pairs the
#   ranks' entries in order ("within a group, the first collective must be the same on all
#   ranks"); `components/utils.py` — "Not all ranks joining collective" with `missing_ranks`;
#   `components/types.py` — `MatchState`: `COLLECTIVE_TYPE_MISMATCH`, `SIZE_OR_SYNTAX_MISMATCH`.
# - `torch/distributed/constants.py` — `default_pg_timeout` (30 minutes for gloo) and
#   `default_pg_nccl_timeout`; `torch/distributed/distributed_c10d.py` —
#   `_get_default_timeout(backend)`: `default_pg_nccl_timeout` only `if backend ==
#   Backend.NCCL`, `default_pg_timeout` for every other string, `"cpu:gloo,cuda:nccl"`
#   included; `init_process_group` calls it when given no `timeout` (claimed above).
# - `torch/distributed/distributed_c10d.py` — `_new_process_group_helper`: with
#   `TORCH_DIST_NAN_CHECK=1` ("Backend-agnostic NaN checking … ProcessGroupNCCL consumes
#   TORCH_NCCL_NAN_CHECK itself") it calls `NanCheckHook.attach(pg)`;
#   `torch/_C/_distributed_c10d.pyi` — `NanCheckHook`; `torch/lib/libtorch_cpu.so` — the
#   hook's code (upstream `hooks/NanCheckHook.cpp`, not installed) and its message "NaN found
#   in input tensor." (run under bug 7); `ProcessGroupNCCL.hpp` — `TORCH_NCCL_NAN_CHECK`,
#   `enableNanCheck_`.
# - `torch/distributed/debug/__init__.py` — `start_debug_server(..., dump_dir, dump_interval=60.0,
#   ...)`: experimental, needs Jinja2 and aiohttp; every rank starts a worker server, rank 0
#   the frontend, which with `dump_dir` dumps periodically; `torch/distributed/debug/_frontend.py`
#   — `PeriodicDumper._run` writes each enabled handler's dump to
#   `<name>_<timestamp>.txt` every `dump_interval`; `torch/distributed/debug/_debug_handlers.py`
#   — `StacksHandler.dump` (every rank's `dump_traceback`), `FlightRecorderHandler.dump` (every
#   rank's `fr_trace_json`, the nav link "FlightRecorder CPU", plus NCCL's,
#   `dump_nccl_trace_json` with `onlyactive=true`, where there is one); the default
#   `enabled_dumps` are `stacks`, `fr_trace` and `torchcomms_health_check`.
# - `lib/dpcourse/__main__.py` — `diagnose`'s options: `--nproc`, `--timeout`, `--detail`,
#   `--cpu`, `--json` (no monitored barrier, no group timeout); `lib/dpcourse/detectors.py` —
#   `diagnose`: `group_timeout` is for worker functions only.
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel.__init__` broadcasts rank
#   0's parameters and buffers (`_sync_module_states`) under `if init_sync:` (default True; its
#   docstring: with False "the user is required to ensure themselves that the weights are the
#   same on all ranks"); `forward_sync_buffers` (default True)
#   replaces `broadcast_buffers`, deprecated since 2.13 (docstring and the `FutureWarning` in
#   `__init__`); `_sync_final_model`: the only other place parameters are copied between
#   ranks, at the end of a `Join` context (`_DDPJoinHook.post_hook`);
#   `_check_sync_bufs_pre_fwd` and `_sync_buffers`: rank 0's buffers are broadcast at the start
#   of `forward`, before the module (and its BatchNorm) runs, when `will_sync_module_buffers`
#   (it needs `require_forward_param_sync`, which `_post_forward` sets to False after a
#   forward under `no_grad` or `no_sync()`);
#   `find_unused_parameters`; `static_graph` (its docstring, lines 743-749: the set of used and
#   unused parameters does not change, and "How the graph is trained will not change during the
#   whole training loop (meaning there is no control flow depending on iterations)"; no
#   per-iteration search).
# - `torch/nn/parallel/distributed.py` — `_BucketCapacityConfig.compute_bucket_size_limits`:
#   one initial bucket (`[sys.maxsize]`) unless `find_unused_parameters` without `static_graph`,
#   or a `bucket_cap_mb_list`; c10d's `reducer.cpp` (not installed) — `Reducer::autograd_hook`
#   marks ready the parameters in `unused_parameters_`, filled with `find_unused_parameters`
#   (`prepare_for_backward`) or, under `static_graph`, by the first backward's
#   `Reducer::delay_all_reduce` (lesson 03 measures it); `Reducer::mark_variable_ready`
#   finalizes only once every bucket is ready; `Reducer::ensure_prior_reduction_finished`
#   raises at the next forward.
# - `torch/lib/libtorch_cpu.so` — the reducer's unused-parameter error ("Parameter indices
#   which did not receive grad for rank", and with `TORCH_DISTRIBUTED_DEBUG` INFO or DETAIL
#   "Parameters which did not receive grad"): read with `strings`, and printed above.
# - `torch/distributed/distributed_c10d.py` — `monitored_barrier`'s docstring: "for non-zero
#   ranks, will block until a send/recv is processed from rank 0".
# - `torch/lib/libtorch_cpu.so` — `ProcessGroupGloo::monitoredBarrier` (its symbol and its
#   messages, found in the library above; the C++ source is not in the wheel): a non-zero rank
#   whose send/recv with rank 0 fails raises "… successfully reached monitoredBarrier, but
#   received errors while waiting for send/recv from rank 0. Please check rank 0 logs for faulty
#   rank."; run above, it came at the group's timeout, not the barrier's.
# - `torch/lib/libtorch_cpu.so` — gloo's TCP transport (`third_party/gloo/gloo/transport/tcp/
#   pair.cc`, compiled in; its source is not in the wheel): a read from a peer whose connection
#   closed raises "Connection closed by peer … This is typically caused by a remote worker
#   crashing." (both strings are in the library); upstream `Pair::read` raises it only when
#   `recv` returns 0 (end of stream: "Transition to CLOSED on EOF"); run above, with rank 1's
#   process exited. Without that end (a peer's machine gone), a receive waits as it does for a
#   live peer that never sends: until the group's timeout (bug 2 above).
#   `lib/dpcourse/launch.py` — `worker_entry`: under `spawn` a rank that returned waits on
#   `release_conn.recv_bytes()` until every rank is done, which is why the other hangs above
#   last until the time limit, and why `diagnose` (section 5, `diagnose_worker` in
#   `lib/dpcourse/detectors.py` runs the script with `runpy` inside such a rank) reports a peer
#   of a rank whose script ended as a HANG.
# - `torch/nn/modules/_functions.py` — `SyncBatchNorm.forward`: every rank's mean, inverse std
#   and count are gathered, and `torch.batch_norm_gather_stats_with_counts` computes the global
#   mean and inverse std and updates `running_mean` and `running_var` from them.
# - `torch/serialization.py` — `_open_zipfile_writer_file`: `torch.save` to a path opens a
#   `PyTorchFileWriter` on that path and writes in place.
# - `torch/lib/libtorch_cpu.so` — the warning printed under bug 5 (from
#   `autograd_not_implemented_fallback`): `c10d::allreduce_` has no autograd kernel; the
#   gradient passing straight through it is measured above.
# - `torch/distributed/nn/functional.py` — `all_reduce` and `_AllReduce`: the differentiable
#   all-reduce, whose `backward` all-reduces `grad_output` with the same op and group.
# - `torch/utils/data/distributed.py` — `DistributedSampler.__iter__` seeds its shuffle with
#   `seed + epoch`; `set_epoch`; neither warns when the epoch is never set (the class
#   docstring's `.. warning::` is the only warning).
# - `torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp` — the comments on
#   `TORCH_NCCL_ENABLE_TIMING` ("Enable recording start-events … end-events are recorded by
#   default") and on `enableTiming_` (start CUDA events only with timing, always with
#   `desyncDebug_`); `FlightRecorder.hpp` — an entry's `start_`/`end_` events and
#   `time_discovered_started_`.
# - `torch/optim/optimizer.py` — `register_optimizer_step_post_hook`: a hook run after every
#   optimizer's `step` (diagnose counts the steps and hashes the weights after the first).
# - `torch/nn/utils/clip_grad.py` — `clip_grad_norm_`: the total norm of all the gradients
#   "viewed as a single vector" (`_get_total_norm`), then `_clip_grads_with_norm_` multiplies
#   each by `max_norm / (total_norm + 1e-6)`, clamped to at most 1.
# - `torch/nn/modules/batchnorm.py` — `BatchNorm1d`'s docstring: a batch is normalized with
#   its biased variance, but `running_var` is updated with the unbiased one
#   (`torch.var(input, correction=1)`), as a moving average: `(1 − momentum) × x̂ + momentum ×
#   x_t`, `momentum` 0.1 by default; `_NormBase.reset_running_stats` starts `running_var` at 1.
# - `torch/nn/modules/batchnorm.py` — `SyncBatchNorm.forward`: in training mode with an
#   initialised process group it raises unless the input is on CUDA, HPU, XPU or the
#   PrivateUse1 backend, before it sets `need_sync = world_size > 1`.
# - `torch/distributed/distributed_c10d.py` — `all_reduce` (lines 3812-3915): with
#   `async_op=True` it returns the `Work` as soon as the backend has it (`if async_op: return
#   work`), otherwise it calls `work.wait()`; so a blocking gloo call returns only when the
#   collective has completed, and an `async_op=True` call returns at once (what the collective
#   trace's "returned" means, section 1). The other collectives follow the same pattern.
# - `torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp` — `ErrorHandlingMode`
#   (lines 160-177): `TearDown` and `SkipCleanUp` "tear down process" on an error (the NCCL row
#   of the timeout figure).
