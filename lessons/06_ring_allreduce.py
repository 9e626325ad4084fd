# %% [markdown]
# # Lesson 06 — Ring AllReduce, from paper to wire
#
# **Prerequisites:** lesson 03 (collectives, all-reduce); lesson 02's traffic count.
#
# **You will be able to:**
# - run a ring all-reduce step by step and say what each worker holds after each step;
# - count what each worker sends, 2(N−1)K/N bytes for a gradient of K bytes (lesson 03's K
#   values × 4; half its sent + received count), and compare it with a parameter server, a
#   tree and Rabenseifner's halving-doubling under the α-β cost model;
# - measure α and β here, test them on a held-out world size, and predict GPU clusters'
#   all-reduce times from published link speeds;
# - build a ring from point-to-point messages, and say when a naive send-then-receive ring
#   deadlocks.
#
# **Time:** about 45 minutes to read and run (the cost-model explorer invites longer).
#
# **Lab:** [lab06_ring_allreduce](../labs/lab06_ring_allreduce.ipynb) — the ring, simulated then
# real.
#
# Every data-parallel step ends the same way: each of the N workers holds its own gradient, and
# all of them need the **sum** (or the average). That operation is *all-reduce*. DDP calls it
# once per gradient bucket; MirroredStrategy hands a step's gradients to one batched call of
# its cross-device ops — by default TF's own collective all-reduce, a ring on CPUs (lesson 05
# counted it). How it is done decides whether adding workers makes training faster or just
# busier.
#
# The plan: **run** a ring in a simulator (§1); **count** what it sends against four other
# algorithms (§2); **measure** α (latency) and β (seconds per byte) here (§3); **build** a real
# ring from point-to-point messages and train with it to DDP's very weights (§4).
#
# Library: `dpcourse.ring`, `dpcourse.viz`, `dpcourse.bench` (`python -m dpcourse.bench
# allreduce`: the full benchmark).

# %% tags=["parameters"]
# Knobs (papermill can override them). world_size=None: the profile's default.
data_name = "shapes10"
n_train = 2000
epochs = 1
per_rank_batch = 32
lr = 0.05
world_size = None
fit_world_sizes = (2, 4)  # the alpha-beta measurement
fit_sizes_kib = (1, 4, 16, 64, 256, 1024, 4096, 16384)  # 1 KiB .. 16 MiB (the bench goes to 64)
fit_reps = 3  # timed repetitions per size, at least ...
fit_max_reps = 10  # ... and at most (small sizes get more: they are quick and noisy)

# %%
import numpy as np
import torch

from dpcourse import bench, devices, launch, ring, viz
from dpcourse.checks import claim

# NBVAL_IGNORE_OUTPUT
# Why: the number of ranks depends on the hardware profile (2 on a CPU).
profile = devices.choose_profile(world_size=world_size)
world_size = profile.world_size
print("ranks for the training run:", world_size)

# %% [markdown]
# ## 1. The ring, step by step
#
# Put the N workers on a ring: worker i sends only to worker i+1 and receives only from i−1.
# Cut every worker's array into N chunks. Number the steps t = 1, 2, …, 2(N−1) through both
# phases (t = 0 is the start), as the trace, the library's ring and lab 06 do. At step t,
# worker i sends **chunk (i + 1 − t) mod N** to its right neighbour:
#
# * **reduce-scatter**, steps t = 1 … N−1: the neighbour *adds* the chunk to its own copy. Each
#   chunk travels around the ring collecting one more worker's contribution per step; after
#   step N−1 worker i holds the **complete sum of chunk (i + 1) mod N**.
# * **all-gather**, steps t = N … 2(N−1): the chunk sent is a finished one (at step N, worker i
#   sends chunk (i + 1) mod N, the one it completed), and the neighbour *overwrites* its copy.
#   After step 2(N−1) everyone has every finished chunk.
#
# Every link is busy in every step, and every message is only K/N long. Here are four workers
# with four numbers each (worker w holds 10w + 1, 10w + 2, ...):

# %%
N = 4
arrays = [np.arange(1, 5) + 10.0 * w for w in range(N)]
trace = ring.simulate_ring(arrays)
for step in range(len(trace.steps)):
    print(trace.describe(step))
print("result on every worker:", trace.result[0])

# %%
total = np.sum(arrays, axis=0)
claim("every worker ends with the elementwise sum",
      all(np.array_equal(buf, total) for buf in trace.result))
claim("it took 2(N−1) steps", len(trace.steps) - 1 == 2 * (N - 1))
claim("after the reduce-scatter, worker i owns the complete chunk (i + 1) mod N",
      all(trace.steps[N - 1].contributions[i, (i + 1) % N] == N for i in range(N)))
claim("at every step t = 1 … 2(N−1), worker i sent chunk (i + 1 − t) mod N to worker i + 1",
      all((tr.src, tr.dst, tr.chunk) == (i, (i + 1) % N, (i + 1 - t) % N)
          for t in range(1, len(trace.steps))
          for i, tr in enumerate(trace.steps[t].transfers)))

# %% [markdown]
# **▶ The simulator's code — open after your lab passes** (the folded cell below:
# `ring.simulate_ring`, which every trace, count and claim of §1 and §2 ran: lab 06's first
# part, whose checks hold your simulator to the same sums).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ring.simulate_ring,
              folded="▶ The simulator's code (lab 06's answer; §1–§2's claims ran it) — open "
                     "after your lab passes")

# %% [markdown]
# Step through it. The colour of a chunk says how many workers' numbers it already sums (pale:
# its own only; dark: all N); arrows are the messages of that step, labelled with their chunk.
# With a live kernel the slider below redraws the ring; the figure under it shows every step.

# %%
stepper = viz.ring_stepper(trace)

# %% [markdown]
# ## 2. What it costs: 2(N−1)K/N bytes per worker
#
# Each worker sends N−1 chunks in the reduce-scatter and N−1 in the all-gather, each K/N of
# the K bytes: **2(N−1)K/N**. The count grows with N (K at N = 2, 1.75K at N = 8) but stays
# **under 2K, a bound independent of N**. When N does not divide the length, the chunks differ
# by one element, and each worker's count is within one element per step of the formula.
#
# **▶ How the simulator counts** (click the folded cell below: `RingTrace.elements_sent` adds
# up every transfer a worker made; `bytes_sent` multiplies by the item size).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ring.RingTrace.elements_sent, ring.RingTrace.bytes_sent,
              folded="▶ code: ring.RingTrace.elements_sent, ring.RingTrace.bytes_sent")

# %%
checked = exact = 0
rng = np.random.default_rng(0)
for n in range(2, 17):
    for length in (n, 3 * n, 3 * n + 1, 100, 997, 4096):
        arrs = [rng.standard_normal(length).astype(np.float32) for _ in range(n)]
        tr = ring.simulate_ring(arrs)
        assert all(np.allclose(b, np.sum(arrs, axis=0), atol=1e-4) for b in tr.result)
        k = length * 4  # bytes
        sent = tr.bytes_sent()
        assert sent == ring.ring_bytes_per_worker(length, n, itemsize=4)   # its code: §2, folded
        # within one element per step of 2(N-1)K/N, and exactly that when N divides the length
        assert all(abs(s - 2 * (n - 1) * k / n) <= 2 * (n - 1) * 4 for s in sent)
        if length % n == 0:
            assert all(s == 2 * (n - 1) * k // n for s in sent)
            exact += 1
        checked += 1
claim(f"bytes per worker: the simulator's count == ring.ring_bytes_per_worker in all {checked} "
      f"cases (N = 2..16); == 2(N−1)K/N exactly in the {exact} where N divides the length; "
      f"within one element per step of it in the other {checked - exact}",
      checked == 90 and 0 < exact < checked)

# %% [markdown]
# ### Five ways to all-reduce, under the α-β model
#
# A **step** that moves b bytes over a link takes **α + bβ**: α is the fixed cost of a step
# (software, synchronisation, the wire's latency), β the seconds per byte (1/bandwidth). Five
# ways to all-reduce K bytes over N workers:
#
# * **naive**: every worker sends its whole array to worker 0, which adds them and sends the
#   sum back to each worker, one message at a time;
# * **parameter server**: one separate, unsharded machine; all N workers push their K bytes to
#   it at once, then pull the K-byte sum, all through its one link;
# * **ring**: §1;
# * **binomial tree**: a reduce in ⌈log₂N⌉ rounds (in each, half of the workers still holding
#   a partial sum send all K bytes of it to a partner, which adds), then a broadcast of the sum
#   back down the same rounds;
# * **Rabenseifner's algorithm** (MPICH's choice for long messages; MPICH is an MPI library),
#   for N = p a power of two: a reduce-scatter (§1) by *recursive halving* in the
#   order Thakur, Rabenseifner and Gropp draw it (in round 1 each worker swaps half its array
#   with the partner p/2 away and adds the half it keeps; in round 2 half of that half with the partner p/4 away, …), then an
#   all-gather by *recursive doubling*, the same rounds backwards. A worker sends (p−1)K/p in
#   each phase, 2(p−1)K/p in all — the ring's bytes — in 2log₂p steps, the tree's count. For
#   other N, the N − p workers above the largest power of two p first hand their whole array to
#   a partner and get the result back: one more K-byte step at each end. MPICH's code takes the
#   partners nearest first and folds the even ranks below 2(N − p) onto their right
#   neighbours: the same cost.

# %% [markdown]
# A step is one message per link, so α is a message's cost, except at the server: its link
# takes N messages a step, priced at one α, as if they went at once at full rate, without
# *incast* (N senders jamming one link) — the server's best case (one by one: Nα a step). The
# *critical path* is the chain of steps that must follow one another: the time pays α per
# step and β per byte on it. The table counts bytes two ways: links are *full duplex* (a
# bandwidth each way). The naive way, the server and the tree receive everything, *then* send
# it, so their time pays for both directions in turn; in a ring and in Rabenseifner's exchanges
# every worker sends and receives at once, so it pays for one. Per direction (the busiest-link
# column) the ring's link carries under 2K, the server's NK. The costs (`ring.cost`; its code is
# folded below):
#
# | algorithm | steps (α terms) | bytes the time pays for (critical path) | busiest link, one direction | time |
# |---|---|---|---|---|
# | naive: all to worker 0 and back, one by one | 2(N−1) | 2(N−1)K | (N−1)K | 2(N−1)(α + Kβ) |
# | parameter server (separate server), its link taking N messages at once | 2 | 2NK | NK | 2α + 2NKβ |
# | ring | 2(N−1) | 2(N−1)K/N | 2(N−1)K/N | 2(N−1)α + 2(N−1)/N·Kβ |
# | binomial tree: reduce, then broadcast | 2⌈log₂N⌉ | 2⌈log₂N⌉K | ⌈log₂N⌉K | 2⌈log₂N⌉(α + Kβ) |
# | Rabenseifner, N = p a power of two | 2log₂p | 2(p−1)K/p | 2(p−1)K/p | 2log₂p·α + 2(p−1)/p·Kβ |
# | Rabenseifner, other N (p < N the largest power of two) | 2log₂p + 2 | 2(p−1)K/p + 2K | 2(p−1)K/p + K | the line above + 2(α + Kβ) |

# %% [markdown]
# How good can an all-reduce get? Chan et al. (2007, Sources) prove,
# for this model with a worker sending one message and receiving one at a time, that any
# all-reduce needs at least **⌈log₂N⌉ steps** (a step can at most double the number of
# workers' inputs a result depends on) and at least **2(N−1)/N·Kβ** of transfer time. The ring
# meets the bandwidth bound exactly and misses the latency bound, 2(N−1) steps against
# ⌈log₂N⌉. So the ring is "bandwidth-optimal, latency-suboptimal", held below against the
# simulators' counts up to N = 64 (at 1024, arithmetic only).
# The lesson's other algorithms take 2⌈log₂N⌉ steps or more (the server fewer, by taking N messages at once).
# *Recursive doubling* meets the latency bound, for N a power of two: in each of log₂N rounds every
# worker swaps its whole array with a partner and adds, log₂N(α + Kβ), half the tree's time —
# MPICH's all-reduce for short messages (Thakur et al.).
#
# The ring's bandwidth term is bounded by 2Kβ whatever N; its latency term grows with N
# without bound. The binomial tree's
# latency term grows only as log N, but it sends the *whole* message in each of its rounds, so
# its bandwidth term is 2⌈log₂N⌉Kβ (the figure's "binomial tree (unpipelined)": its message is not
# *pipelined*, cut into segments that travel one behind another, §4; NCCL's tree pipelines,
# folded below). So, in the model, of all five: at N a power of two Rabenseifner's never
# loses to the ring or the tree; at other N the ring wins big messages (Rabenseifner's then pays
# two extra K-byte steps); the tree never wins (against only the naive way and the ring, it
# wins small messages on many workers); the server may, if N pushes cost one α. Real parameter servers shard: TF's
# `ParameterServerStrategy` puts whole variables on its S servers round robin (splitting one
# only with a `variable_partitioner`), so about NK/S per link when the variables are many and
# alike (it trains asynchronously by default, lesson 09; the NK/S per link is a synchronous
# server's); with a shard on every worker, each sends K/N to each of the N − 1 others twice:
# 2(N−1)K/N, the ring's bytes (arithmetic). With an illustrative α = 10 µs and 10 GB/s links,
# 100 MB on 8 workers:

# %%
alpha_demo, beta_demo = 10e-6, 1 / 10e9
print(f"{'algorithm':>16} {'steps':>6} {'critical-path MB':>16} {'ms':>8}")
for alg in ring.COST_MODELS:
    c = ring.cost(alg, 8, 100e6, alpha_demo, beta_demo)
    print(f"{alg:>16} {c.steps:>6} {c.critical_path_bytes / 1e6:>16.1f} {c.seconds * 1e3:>8.2f}")

# %% [markdown]
# **▶ The cost model's code** (click the folded cell below: `ring.cost`, the table's formulas;
# `ring.ring_bytes_per_worker`, the exact count checked above; `ring.simulate_rabenseifner`).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ring.cost, ring.ring_bytes_per_worker, ring.simulate_rabenseifner,
              folded="▶ code: cost, ring_bytes_per_worker, simulate_rabenseifner")

# %% [markdown]
# Rabenseifner's algorithm, run: four workers, eight numbers each (worker w holds 10w + 0, …,
# 10w + 7), through `ring.simulate_rabenseifner`, which records each round when given a list.
# In the halving rounds a worker's part — the elements it still sums — halves; in the doubling
# rounds its complete part doubles, until every worker holds the whole sum.

# %%
rab_rounds = []
arrays_rab = [np.arange(8, dtype=np.float32) + 10 * w for w in range(4)]
result_rab, sent_rab = ring.simulate_rabenseifner(arrays_rab, rab_rounds)
print("start: every worker holds elements [0, 8) of its own array")
for round_no, rd in enumerate(rab_rounds, 1):
    held = "; ".join(f"w{i}↔w{i ^ rd['distance']} → [{lo}, {hi})"
                     for i, (lo, hi) in enumerate(rd["parts"]))
    print(f"round {round_no} ({rd['phase']}, partners {rd['distance']} apart, each sends "
          f"{rd['sent'][0]} elements): {held}")
viz.show(viz.rabenseifner_figure(rab_rounds, 8),
         "Rabenseifner's all-reduce on 4 workers, 8 elements: the shaded cells are the part each "
         "worker still sums (blue, halving: partners 2 then 1 apart) or holds complete (green, "
         "doubling: partners 1 then 2 apart) after each round.")
claim("Rabenseifner, N = 4, 8 elements: the halving leaves each worker a different quarter "
      "(2 elements), and the doubling ends with the whole sum on every worker",
      sorted(rab_rounds[1]["parts"]) == [(0, 2), (2, 4), (4, 6), (6, 8)]
      and all(part == (0, 8) for part in rab_rounds[-1]["parts"])
      and all(np.array_equal(r, np.sum(arrays_rab, axis=0)) for r in result_rab),
      rounds=rab_rounds)
claim("each worker sent 4 + 2 elements in the halving and 2 + 4 in the doubling: "
      "12 = 2(p−1)/p × 8, the ring's count, in 2log₂4 = 4 rounds",
      [rd["sent"] for rd in rab_rounds] == [[4] * 4, [2] * 4, [2] * 4, [4] * 4]
      and sent_rab == [12 * 4] * 4, sent=sent_rab)

# %%
import math

big = {alg: ring.cost(alg, 8, 100e6, alpha_demo, beta_demo).seconds for alg in ring.ALGORITHMS}
small = {alg: ring.cost(alg, 64, 1e3, alpha_demo, beta_demo).seconds
         for alg in ("naive", "ring", "tree")}
claim("under the model, 100 MB on 8 workers: of all but Rabenseifner's, the ring is the fastest",
      min(big, key=big.get) == "ring")
claim("1 KB on 64 workers, of the naive way, the ring and the tree: the binomial tree is fastest",
      min(small, key=small.get) == "tree")
ring_path = [ring.cost("ring", n, 100e6, 0, 1).critical_path_bytes for n in (2, 8, 64, 1024)]
ps_path = [ring.cost("parameter-server", n, 100e6, 0, 1).critical_path_bytes for n in (2, 8, 64, 1024)]
claim("bytes on the critical path: the ring's under 2K at any N; the server's 2NK, at least 2K",
      max(ring_path) < 2 * 100e6 <= min(ps_path))
claim("and the server's grows linearly with N", ps_path[-1] == 1024 * ps_path[0] / 2)
powers_of_two, sizes_k = (2, 4, 8, 16, 64, 1024), (1e3, 1e5, 1e8)
rab = {(n, k): ring.cost("rabenseifner", n, k, alpha_demo, beta_demo) for n in powers_of_two
       for k in sizes_k}
claim("N a power of two: Rabenseifner sends the ring's bytes in the tree's number of steps",
      all(c.critical_path_bytes == ring.cost("ring", n, k, 0, 1).critical_path_bytes
          and c.steps == ring.cost("tree", n, k, 0, 1).steps for (n, k), c in rab.items()))
claim("so, under the model, at those N it is never slower than either (1 kB … 100 MB)",
      all(c.seconds <= min(ring.cost(a, n, k, alpha_demo, beta_demo).seconds
                           for a in ("ring", "tree")) + 1e-15 for (n, k), c in rab.items()))
sim = {n: ring.simulate_rabenseifner([np.full(64, w, np.float32) for w in range(n)])
       for n in (4, 6, 8)}  # K = 256 bytes; worker w holds w. Below: p, and K more where N != p
claim("Rabenseifner's, run on arrays: every worker ends with the sum; the busiest sends 2(p−1)K/p "
      "at N = 4 and 8, 2(p−1)K/p + K at N = 6 (ring.cost's critical path less the K it took in)",
      all(all((r == n * (n - 1) / 2).all() for r in res) and max(sent) == 2 * (p - 1) * 256 / p + x
          == ring.cost("rabenseifner", n, 256, 0, 1).critical_path_bytes - x
          for (n, (res, sent)), (p, x) in zip(sim.items(), [(4, 0), (4, 256), (8, 0)])))
six = {a: ring.cost(a, 6, 100e6, alpha_demo, beta_demo) for a in ("ring", "rabenseifner")}
claim("N = 6, 100 MB: the two extra K-byte steps make Rabenseifner slower than the ring "
      f"({six['rabenseifner'].seconds * 1e3:.1f} ms against {six['ring'].seconds * 1e3:.1f} ms)",
      six["rabenseifner"].seconds > six["ring"].seconds)
runs = {n: ring.simulate_ring([np.ones(4 * n, np.float32)] * n) for n in range(2, 65)}
claim("simulated, N = 2 … 64 (K = 16N bytes): each worker sent the bound 2(N−1)/N·K, in "
      "2(N−1) steps, more than the bound ⌈log₂N⌉",
      all(tr.bytes_sent() == [2 * (n - 1) * 16] * n and len(tr.steps) - 1 == 2 * (n - 1)
          > math.ceil(math.log2(n)) for n, tr in runs.items()))
raben = {p: ring.simulate_rabenseifner([np.ones(4 * p, np.float32)] * p)[1]
         for p in (2, 4, 8, 16, 32, 64)}
claim("Rabenseifner's, run at N = p = 2 … 64: each worker sent the same bound, 2(p−1)/p·K",
      all(sent == [2 * (p - 1) * 16] * p for p, sent in raben.items()))
claim("arithmetic on ring.cost's formula (nothing run): at N = 1024, 2046 steps against 10",
      (ring.cost("ring", 1024, 1, 1, 0).steps, math.ceil(math.log2(1024))) == (2046, 10))
tiny8 = {alg: ring.cost(alg, 8, 1e3, alpha_demo, beta_demo).seconds for alg in ring.COST_MODELS}
tiny8_serverless = {a: t for a, t in tiny8.items() if a != "parameter-server"}
best8, best8_serverless = min(tiny8, key=tiny8.get), min(tiny8_serverless, key=tiny8_serverless.get)
NAMES = {"naive": "the naive way", "parameter-server": "the parameter server", "ring": "the ring",
         "tree": "the binomial tree", "rabenseifner": "Rabenseifner's algorithm"}
viz.show(viz.cost_figure(alpha_demo, beta_demo),
         f"under the α-β model with α = 10 µs and 10 GB/s links, all five algorithms (time on a "
         f"log scale; left, one flat step per whole N: Rabenseifner's jumps after each power of "
         f"two): for big messages the ring's time levels off in N (its bandwidth term stays under "
         f"2Kβ), while the naive way and the server grow. Right, for 1 KB at N = 8, of all five, "
         f"{NAMES[best8]} is the cheapest ({ring.cost(best8, 8, 1e3, 0, 0).steps} steps, only if "
         f"its one link takes N pushes for one α: no incast); of the four without a server, "
         f"{NAMES[best8_serverless]} ({ring.cost(best8_serverless, 8, 1e3, 0, 0).steps} steps).")

# %% [markdown]
# ## 3. α and β of this machine, and which algorithm wins where
#
# We time `dist.all_reduce` on float32 tensors from 1 KiB to 16 MiB with 2 and 4 ranks
# (gloo over TCP; on one machine its traffic stays on the loopback interface) and fit the ring
# model t = 2(N−1)α + 2(N−1)/N·Kβ by least squares on
# *relative* error (a 1 KiB point counts as much as a 16 MiB one). The formula is a **model** of
# gloo: gloo's C++ is compiled into torch, not installed as source. Its public source
# (`gloo/allreduce.cc`, function `ring`) implements a segmented ring — a reduce-scatter then an
# all-gather. It cuts K into max(⌈K / 1 MiB⌉, 2N) segments (`kMaxSegmentSize`), rounded up to a
# multiple of N, pipelined; a step sends 1/N of them. Up to K = 2N MiB a step is two of gloo's
# messages, and the **α fitted here is a cost per ring step**, what the model's 2(N−1)α needs; above
# that a step is more messages (8 at 16 MiB on 2 ranks), whose extra cost lands in β.
#
# The formula leaves out two things of a small shared machine:
#
# * **Other programs.** Anything else the machine runs can slow a repetition, so we fit each
#   size's **fastest** repetition, the least disturbed. (It also times §4's ring, taking turns
#   with gloo's; the fit uses gloo's.)
# * **Ranks sharing cores.** With more ranks than cores, ranks take turns on them, so every
#   message and copy takes about N / cores times as long. The model with a *contention term*
#   multiplies the whole formula by max(1, N / C), with C the cores this process may use —
#   still two parameters, α and β.
#
# We fit both, plus one (α, β) per N (lowest squared relative error on the measured N,
# unable to predict another), and print each one's relative error |predicted − measured| /
# measured — asymmetric: a model k× too fast scores 1 − 1/k, under 100% however large k is —
# as median, max and root mean square (rms), the one the fits minimise; median and max can
# favour either model.

# %%
# NBVAL_IGNORE_OUTPUT
# Why: timings depend on the machine and its load; the claims about them are
# asserted in the next cell instead.
import os

cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
fit_sizes = [k * 1024 for k in fit_sizes_kib]
table = []  # one bench.AllreduceRow per (N, size): both implementations, rep by rep
for n in fit_world_sizes:
    per_rank = launch.spawn(bench.measure_allreduce, n, fit_sizes, fit_reps, 1,
                            max_reps=fit_max_reps, backend="gloo", timeout=300)
    table += bench.summarize_allreduce(per_rank, n, fit_sizes)  # each rep: the slowest rank
ns = np.array([r.world_size for r in table], dtype=float)
ks = np.array([r.nbytes for r in table], dtype=float)
t_fastest = np.array([r.all_reduce_min_s for r in table])  # dist.all_reduce, fastest rep

# %% [markdown]
# Each timed call starts after a barrier; a repetition's time is its **slowest rank's**. The
# table of "How fast is it?" uses **medians**.
#
# **▶ The measurement's code (optional, folded below): `bench.measure_allreduce`,
# `bench.summarize_allreduce`.**

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(bench.measure_allreduce, bench.summarize_allreduce,
              folded="▶ code: bench.measure_allreduce, bench.summarize_allreduce")

# %% [markdown]
# The fit, its errors, α and β. The model has no term for the additions (Thakur et al. and
# Chan et al. add γ per byte), so the fitted β also pays gloo adding each received segment on
# the CPU (`opts.reduce` in its `ring`, Sources): an *effective* β, not a link's.

# %%
# NBVAL_IGNORE_OUTPUT
# Why: timings depend on the machine and its load; the claims are in the next cell.
plain = ring.fit_alpha_beta(ns, ks, t_fastest)
fit = ring.fit_alpha_beta(ns, ks, t_fastest, cores=cores)  # with the contention term
per_n = ring.fit_alpha_beta_per_n(ns, ks, t_fastest)
errors = {"one alpha, beta (plain ring model)": plain.relative_errors,
          f"with the contention term (C = {cores} cores)": fit.relative_errors,
          "one alpha, beta per N": np.concatenate([f.relative_errors for f in per_n.values()])}
rms = {name: float(np.sqrt(np.mean(err ** 2))) for name, err in errors.items()}
print("relative error of each model over the", len(t_fastest), "points:")
for name, err in errors.items():
    print(f"  {name:>42}: median {np.median(err):.0%}, max {err.max():.0%}, rms {rms[name]:.0%}")
print(f"the contention model: alpha = {fit.alpha * 1e6:.1f} us per ring step, "
      f"1/beta = {fit.bandwidth / 1e9:.2f} GB/s (effective: additions included)")
viz.show(viz.fit_figure(fit), "the fastest measured all-reduce times (points) against the α-β "
                              "model with its contention term (lines), for 2 and 4 ranks on "
                              "this machine: where the points leave the lines, the model misses.")

# %%
claim("the fit found a positive α and β", fit.alpha > 0 and fit.beta > 0)
claim("α is a sane latency: between 0.1 µs and 100 ms per ring step", 1e-7 < fit.alpha < 1e-1,
      alpha=fit.alpha)
claim("1/β (effective) is a sane bandwidth: between 1 MB/s and 1 TB/s", 1e6 < fit.bandwidth < 1e12,
      bandwidth=fit.bandwidth)
claim("with the contention term, half the measured points are within 50% of the model "
      "(median relative error < 50%)", np.median(fit.relative_errors) < 0.5,
      errors=fit.relative_errors)
claim("one (α, β) per N has the lowest rms relative error (what each fit minimises)",
      all(rms["one alpha, beta per N"] <= r * (1 + 1e-9) for r in rms.values()), rms=rms)

# %% [markdown]
# **▶ The fit's code** (click the folded cell below: `ring.fit_alpha_beta`, least squares on
# relative error, with the contention term; `ring.fit_alpha_beta_per_n`; and
# `ring.AlphaBetaFit`, whose `predict` every error and prediction here uses).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ring.fit_alpha_beta, ring.fit_alpha_beta_per_n, ring.AlphaBetaFit,
              folded="▶ code: fit_alpha_beta, fit_alpha_beta_per_n, AlphaBetaFit")

# %%
# NBVAL_IGNORE_OUTPUT
# Why: computed from this run's timings.
e_plain, e_shared = np.median(plain.relative_errors), np.median(fit.relative_errors)
if cores >= max(fit_world_sizes):
    print(f"This machine gives every rank a core ({cores} cores), so the contention term "
          f"changes nothing here: median error {e_shared:.0%}.")
else:
    change = ("lowered" if e_shared < 0.9 * e_plain else
              "raised" if e_shared > 1.1 * e_plain else "did not clearly change")
    print(f"This run: the contention term {change} the median error "
          f"({e_plain:.0%} without it, {e_shared:.0%} with it); its largest error is "
          f"{fit.relative_errors.max():.0%}, at N = {int(ns[fit.relative_errors.argmax()])}, "
          f"{bench.format_size(int(ks[fit.relative_errors.argmax()]))}.")

# %% [markdown]
# The median errors move with the machine's load: hence the claim's loose bound, 50%. The
# model describes the fastest repetitions, not the medians of §4's table (typical ones,
# scheduling delays on shared cores included).
#
# ### Using the model on machines we do not have here
#
# Plug into the model **published link bandwidths** (their
# inverse is a link's β: the wire alone, no additions) — and
# an assumed α of 10 µs — to *predict* how long one all-reduce of ResNet-50's gradients (25.6 M float32 values, about 102 MB) takes on
# 8 GPUs with a ring (NCCL may pick another algorithm on such servers, folded below, so these
# are ring predictions, not what a server does):
#
# * NVLink 4 (H100 SXM) — NVIDIA's direct GPU-to-GPU link inside one server: 900 GB/s per GPU
#   in both directions together, so 450 GB/s each way;
# * PCIe 4.0 x16 — the ordinary expansion bus a GPU sits on: about 32 GB/s each way;
# * InfiniBand NDR — a network between servers: 400 Gb/s = 50 GB/s per port (NIC); a server
#   has one, or one per GPU.

# %%
k_resnet50 = 25.6e6 * 4
links = {"NVLink 4 (450 GB/s)": 450e9, "PCIe 4.0 x16 (32 GB/s)": 32e9,
         "InfiniBand NDR (50 GB/s)": 50e9}
for name, bw in links.items():
    c = ring.cost("ring", 8, k_resnet50, 10e-6, 1 / bw)
    print(f"predicted ring all-reduce of 102 MB on 8 GPUs over {name}: {c.seconds * 1e3:.2f} ms")

# %% [markdown]
# NVLink's prediction is well under a millisecond; over PCIe or a network, several milliseconds
# (how much of it a step pays: lesson 07, overlap). *If one link speed covers the
# whole ring*, the bandwidth term 2(N−1)/N·K/B barely changes from 8 to 1024 GPUs — it tends to
# 2K/B — while the latency term 2(N−1)α grows linearly. That condition is the model's:
# `ring.cost` prices every step with one β (its code: the folded cell of §2), while a real
# ring's step waits for its slowest link. 1024 GPUs are at least 128 eight-GPU servers, so the
# ring crosses the network, and what sets B there is each server's **network bandwidth** (its
# NICs × their speed) against a GPU's NVLink: NCCL runs several rings at once (*channels*), each
# new one starting at the next NIC, and prices them at channels × per-channel network bandwidth
# (Sources). With one 50 GB/s NIC per server, B is 9× below NVLink and the bandwidth term about
# ten times the one-server NVLink figure; with a NIC per GPU (400 GB/s a server), about 1.3
# times (computed below). Within one link speed, at large N latency is what rings pay.

# %%
# NBVAL_IGNORE_OUTPUT
# Why: uses the fitted (hardware-dependent) numbers of this machine.
n0 = min(fit_world_sizes)  # held out: fit on the smallest N alone, predict the others' points
held = ring.fit_alpha_beta(ns[ns == n0], ks[ns == n0], t_fastest[ns == n0], cores=cores)
miss = np.abs(held.predict(ns[ns > n0], ks[ns > n0]) / t_fastest[ns > n0] - 1)
if miss.size:  # the bar, fixed before any run: §3's claim, median relative error under 50%
    slow = sorted({float(held.slowdown(n)) for n in ns[ns > n0]} - {1.0})  # max(1, N/C) > 1
    print(f"fitted on N = {n0} alone, the model predicts this run's larger N with a median error "
          f"of {np.median(miss):.0%} (max {miss.max():.0%}): " + ("within §3's loose 50% bar (a "
          "coarse check, not a confirmation)" if np.median(miss) < 0.5 else "outside §3's loose "
          f"50% bar") + (f"; those predictions include the contention factor max(1, N / {cores}) "
          f"up to {slow[-1]:g}: the check is of it as much as of 2(N−1)" if slow else "") + ".")
t_here = float(fit.predict(8, k_resnet50))  # the contention term included: 8 ranks, `cores` cores
print(f"the same all-reduce predicted for 8 ranks on this machine ({cores} cores): "
      f"{t_here * 1e3:.0f} ms, an extrapolation: the fit saw N = {fit_world_sizes}; predict "
      f"multiplies by max(1, 8 / {cores}) = {max(1, 8 / cores):g}")

# %%
p8 = ring.cost("ring", 8, k_resnet50, 10e-6, 1 / 450e9).seconds
p1024 = ring.cost("ring", 1024, k_resnet50, 10e-6, 1 / 450e9)
claim("predicted: under 1 ms on NVLink 4", p8 < 1e-3, p8=p8)
claim("predicted: PCIe takes several times longer",
      ring.cost("ring", 8, k_resnet50, 10e-6, 1 / 32e9).seconds > 5 * p8)
claim("at 1024 GPUs the ring's critical path (one direction of each link) still carries under 2K",
      p1024.critical_path_bytes < 2 * k_resnet50)
nvlink, nic = 450e9, 50e9  # across servers B is the slower of NVLink and the server's NICs
bw_term = {name: ring.cost("ring", n, k_resnet50, 0, 1 / bw).seconds   # α = 0: bandwidth term only
           for name, n, bw in (("8, NVLink", 8, nvlink), ("1024, NVLink", 1024, nvlink),
                               ("1024, 1 NIC a server", 1024, min(nvlink, 1 * nic)),
                               ("1024, 8 NICs a server", 1024, min(nvlink, 8 * nic)))}
times_8 = {name: t / bw_term["8, NVLink"] for name, t in bw_term.items()}
print("the ring's bandwidth term, 102 MB: " + "; ".join(
    f"N = {name}: {t * 1e3:.2f} ms ({times_8[name]:.2f}×)" for name, t in bw_term.items()))
claim("arithmetic on ring.cost (one β for every step): with one link speed, 8 → 1024 GPUs raises "
      "the bandwidth term by under 15 %; across servers with one 50 GB/s NIC each it is 9 to "
      "11 × the 8-GPU NVLink term, with one per GPU (8 × 50 GB/s) 1.2 to 1.4 ×",
      times_8["1024, NVLink"] < 1.15 and 9 < times_8["1024, 1 NIC a server"] < 11
      and 1.2 < times_8["1024, 8 NICs a server"] < 1.4, bw_term=bw_term)

# %% [markdown]
# Under this model the ring does not win everywhere. Its bandwidth term is as small as any
# all-reduce's can be (the bound of §2), but its latency term 2(N−1)α grows linearly, faster
# than the tree's 2⌈log₂N⌉α and far faster than the parameter server's two rounds. Compare
# first all but Rabenseifner's: where the ring is the cheapest of those, it is the cheapest
# **up to** some N, and small messages push that N down.
# `ring.ring_cheapest_up_to` searches N = 2 … 128: "up to N = n" means the cheapest at *every*
# N from 2 to n; *censored*, still the cheapest at 128 (a wider search finds where it stops).
# Then put Rabenseifner's back.
#
# **▶ The search's code** (click the folded cell below: `ring.cheapest`, ties going to the ring,
# and the searches over N).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ring.cheapest, ring.ring_cheapest_up_to, ring.cheapest_by_n,
              folded="▶ code: ring.cheapest, ring.ring_cheapest_up_to, ring.cheapest_by_n")

# %%
four = ring.ALGORITHMS  # the naive way, the parameter server, the ring, the binomial tree
upto_big = ring.ring_cheapest_up_to(k_resnet50, 10e-6, 1 / 32e9, n_max=128, algorithms=four)
upto_small = ring.ring_cheapest_up_to(1e5, 10e-6, 1 / 32e9, n_max=128, algorithms=four)
upto_wide = ring.ring_cheapest_up_to(k_resnet50, 10e-6, 1 / 32e9, n_max=5000, algorithms=four)


def beats_the_ring(upto, nbytes):
    """Who is cheapest right after the ring stops, with the server's assumption if it is the server."""
    alg = ring.cheapest(upto.n + 1, nbytes, 10e-6, 1 / 32e9, algorithms=four)
    return NAMES[alg] + (" (only if its link takes N pushes for one α: no incast)"
                         if alg == "parameter-server" else "")


print(f"α = 10 µs, PCIe, of all but Rabenseifner's: the ring is the cheapest for K = 100 kB up "
      f"to N = {upto_small} (from N = {upto_small.n + 1}, the cheapest of these four: "
      f"{beats_the_ring(upto_small, 1e5)}); for K = 102 MB up to N = {upto_big}; searched up to "
      f"N = {upto_wide.n_max}, up to N = {upto_wide} (from N = {upto_wide.n + 1}, the cheapest "
      f"of these four: {beats_the_ring(upto_wide, k_resnet50)})")
print("pushes priced one by one (2Nα + 2NKβ > the naive way's 2(N−1)(α + Kβ)): the server never "
      "wins; of naive, ring, tree: for 100 kB the ring is cheapest up to N = " + str(
          ring.ring_cheapest_up_to(1e5, 10e-6, 1 / 32e9, 128, ("naive", "ring", "tree"))))
claim("searched up to 128, the answer for 102 MB is censored (the ring still wins at 128); "
      "searched up to 5000 it is not",
      upto_big.censored and upto_big.n == 128 and not upto_wide.censored and upto_wide.n > 128,
      upto_big=upto_big, upto_wide=upto_wide)
claim("of all but Rabenseifner's, at a fixed α and β, a smaller K stops the ring being the "
      "cheapest at a smaller N",
      upto_small.n is not None and not upto_small.censored and upto_small.n < upto_wide.n,
      upto_small=upto_small, upto_wide=upto_wide)
claim("from N = 4 to 128, the ring's latency term 2(N−1)α exceeds the tree's 2⌈log₂N⌉α",
      all(2 * (n - 1) > 2 * math.ceil(math.log2(n)) for n in range(4, 129)))

five = ring.cheapest_by_n(k_resnet50, 10e-6, 1 / 32e9, n_max=128)  # all five of ring.cost
print("of all five, K = 102 MB, N = 2 … 128: the cheapest is "
      + "; ".join(f"{NAMES[a]} at N = {ring.spans(ns)}" for a, ns in five.items()))
at128 = {a: ring.cost(a, 128, k_resnet50, 10e-6, 1 / 32e9).seconds
         for a in ("ring", "rabenseifner")}
print(f"at N = 128: the ring {at128['ring'] * 1e3:.2f} ms, Rabenseifner's "
      f"{at128['rabenseifner'] * 1e3:.2f} ms")
powers = [n for n in range(4, 129) if n & (n - 1) == 0]
claim("of all five, for 102 MB: Rabenseifner's is the cheapest at every power of two from 4 to "
      "128 (the ring's bytes in fewer steps) …", five.get("rabenseifner") == powers,
      rabenseifner=five.get("rabenseifner"))
claim("… and the ring at every other N from 2 to 128 (there Rabenseifner's two extra K-byte "
      "steps cost more than the ring's extra latency)",
      five.get("ring") == [n for n in range(2, 129) if n not in powers], ring=five.get("ring"))

# %% [markdown]
# So for big messages, of all five, the model picks Rabenseifner's at every power of two. Why
# then do torch's gloo backend and NCCL (NVIDIA's GPU collectives, DDP's backend there) use a ring?
# gloo's `allreduce` offers a ring (its default, which torch uses) and BCube (a scheme for
# server-centric networks); its
# halving-doubling is a separate, older class torch does not call. NCCL rings among other
# choices (the folded cell below). The model gives every pair of workers a link of its own at full speed. Where links
# are shared — GPUs on one PCIe bus,
# servers behind network switches — some of Rabenseifner's rounds, in either order, pair
# workers far apart, whose messages cross links other pairs use at the same time, a cost the
# model does not see; a ring only uses its neighbours' links, in an order that can follow the
# wiring, its segments pipeline (the timeline after lab 06), and NCCL runs several at once
# (channels, above).
#
# **▶ What NCCL actually chooses (optional, click the folded cell below)**

# %% [markdown]
# <details><summary>▶ open</summary>
#
# For each call NCCL's *tuner* (its own cost model of the message size and the machine's
# topology) picks one of several algorithms:
#
# * **ring**, as here;
# * **tree**: not §2's binomial tree. It cuts the message into small segments and pipelines them
#   up the tree (adding), then down, so its bandwidth term stays close to the ring's. Across
#   servers it is a *double binary tree* over the servers (two trees, each carrying half of the
#   data, so every server sends and receives at full speed); inside a server the GPUs form a
#   **chain**.
#   NCCL's estimate of its depth is (GPUs per server − 1) + log₂(servers): on a single 8-GPU
#   server, a chain of 8 GPUs, depth 7;
# * where the hardware can add, algorithms that leave the addition to it: **NVLS** on servers
#   whose GPUs are joined by an *NVSwitch* (a switch chip that links every GPU of the server to
#   every other at full NVLink speed) that supports *SHARP* (NVIDIA's in-switch reduction: the
#   switch adds what passes through it); **NVLS_TREE**, NVLS inside servers and a tree across
#   them; and **CollNet**, where the network's own switches add.
#
# On an NVSwitch server every pair of GPUs does have a full-speed path, so the shared-link
# argument above does not hold there — and NCCL can leave the adding to the switch.
# Sources: NCCL's tuner and topology code (at the end).
#
# </details>

# %% [markdown]
# Try it yourself: drag K down to a few kilobytes and raise α, and watch the ring lose N after
# N; then raise K again.

# %%
# The sliders start at this machine's fitted α and β (§3); the curves come from ring.cost.
import ipywidgets as widgets

cost_explorer = viz.explorer(
    viz.cost_vs_n_figure,
    {"n_max": widgets.IntSlider(value=16, min=4, max=128, description="N up to",
                                continuous_update=False),
     "nbytes": widgets.FloatLogSlider(value=k_resnet50, base=10, min=3, max=10,
                                      description="K (bytes)", continuous_update=False),
     "alpha": widgets.FloatLogSlider(value=fit.alpha, base=10, min=-7, max=-1,
                                     description="α (s)", continuous_update=False),
     "beta": widgets.FloatLogSlider(value=fit.beta, base=10, min=-13, max=-6,
                                    description="β (s/B)", continuous_update=False)},
    caption="all-reduce time of the five algorithms against N at the chosen K, under the α and "
            "β fitted to this machine in §3 (a core per rank: no contention term); the shading "
            "and the title's second line say which is the cheapest at each N.",
    description="cost-model explorer (N, K, α, β)")

# %% [markdown]
# **▶ `viz.explorer`: where `drawn_with` comes from** (folded below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(viz.explorer, folded="▶ code: viz.explorer")

# %%
drawn = cost_explorer.drawn_with  # the values its static figure above was drawn with
claim("the explorer's figure is drawn with the α and β fitted and printed in §3",
      (drawn["alpha"], drawn["beta"]) == (fit.alpha, fit.beta), drawn_with=drawn,
      alpha=fit.alpha, beta=fit.beta)

# %% [markdown]
# ## 4. A real ring over `torch.distributed`
#
# A ring's messages are *point-to-point*: one rank to one other, not a collective every rank
# joins. `torch.distributed` has two kinds. Blocking: `dist.send(tensor, dst)` returns once the
# message has gone (it is `isend` followed by `wait()`; on gloo that always means waiting until
# the receiver has posted its `recv`, Sources), and `dist.recv(buffer, src)` returns once it has
# arrived. `recv` allocates nothing: it fills the tensor you pass, so you allocate
# one of the sender's size and dtype first. Non-blocking: `dist.isend` and `dist.irecv` return
# at once with a *work* object; its `wait()` returns when the message has gone or arrived, and
# only then may you change the sent tensor or read the received one. Two ranks, one blocking
# message from rank 0 to rank 1, then a non-blocking exchange both ways:

# %%
def ping(rank, world_size):
    import torch.distributed as dist

    other = 1 - rank
    got, sender = None, None
    if rank == 0:                                     # blocking, one message: 0 -> 1
        dist.send(torch.arange(4.0), dst=1)
    else:
        got = torch.empty(4)                          # the sender's size and dtype
        sender = dist.recv(got, src=0)                # returns the sender's rank
    mine, theirs = torch.full((2,), 10.0 * rank), torch.empty(2)
    works = [dist.isend(mine, dst=other), dist.irecv(theirs, src=other)]   # both at once
    for work in works:
        work.wait()                                   # now theirs is filled, mine reusable
    return got if got is None else got.tolist(), sender, theirs.tolist()


pinged = launch.spawn(ping, 2, backend="gloo", timeout=60)
claim("blocking: rank 1's recv filled its own buffer with rank 0's tensor, and named rank 0",
      pinged[1][:2] == ([0.0, 1.0, 2.0, 3.0], 0), pinged=pinged)
claim("non-blocking: after wait(), each rank's irecv buffer holds the other rank's tensor",
      pinged[0][2] == [10.0, 10.0] and pinged[1][2] == [0.0, 0.0], pinged=pinged)

# %% [markdown]
# `dpcourse.ring.ring_allreduce(tensor, op="sum" | "average")` runs the simulator's two phases,
# step for step, on real processes: it flattens the tensor and cuts it with the same chunking.
# Every message goes to rank+1 or comes from rank−1, and the order of the calls matters: if
# every rank first called a blocking `dist.send` and only then `dist.recv`, each send waits for
# a receive nobody has posted yet — a deadlock. With gloo, this course's backend, it hangs even
# on a tiny tensor: lab 06 part 4 runs exactly this mistake (12 elements, 3 ranks) and stops it
# with a timeout. On other transports the mistake is harder to notice: MPI libraries send
# small messages *eagerly* (copied into a buffer at the receiver, so a blocking send returns
# before any receive is posted), so there such a ring
# works on tiny tensors and hangs on big ones. Correct code relies on neither. How to order a
# step's messages so that no rank can wait forever, and a step's transfers do not go one after
# another around the ring, is lab 06's design decision;
# the library's answer is folded after the lab pointer.
#
# The library's ring is also pipelined: it cuts each chunk larger than its segment size (4 MiB
# by default) into segments, so that the wire and the additions work at the same time. At that
# default this lesson's chunks travel whole, except the 16 MiB tensor's on 2 ranks (two
# segments); gloo always cuts a chunk into at least two segments (§3). Which messages the
# library's ring keeps in flight, and when, is lab 06's stretch; its answer is in the same fold.
#
# Is it right? Compare it with `dist.all_reduce` on random shapes and dtypes, on 2 and 4 ranks,
# whole chunks and chunks cut into small segments. These claims, the training and the timings
# below run the library's ring, folded (the lab's answer); the lab's checks hold your ring to
# the same sums:

# %%
def compare_with_all_reduce(rank, world_size, trials):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)  # the same shapes on every rank ...
    values = torch.Generator().manual_seed(rank + 1)  # ... and different values
    dtypes = [torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16]
    same = []
    for i in range(trials):
        shape = tuple(int(d) for d in torch.randint(1, 40, (int(torch.randint(1, 4, (1,),
                                                                           generator=g)),),
                                                    generator=g))
        dtype = dtypes[i % len(dtypes)]
        x = (torch.randn(shape, generator=values) * 100).to(dtype)
        builtin = x.clone()
        dist.all_reduce(builtin)
        # Segments of 4 MiB (default: 1 a chunk here), then a third of a rank's bytes (2 or more)
        for seg in (4 << 20, max(1, x.numel() * x.element_size() // (3 * world_size))):
            mine = ring.ring_allreduce(x.clone(), segment_bytes=seg)
            if dtype.is_floating_point:
                # A different order of N additions: equal up to a few roundings of that dtype.
                tol = 4 * world_size * torch.finfo(dtype).eps * float(x.abs().max().double())
                same.append(torch.allclose(mine.double(), builtin.double(), rtol=0, atol=tol))
            else:
                same.append(torch.equal(mine, builtin))  # integers: exactly equal
    return same


for n in (2, 4):
    agree = launch.spawn(compare_with_all_reduce, n, 15, backend="gloo", timeout=120)
    print(f"{n} ranks: ring_allreduce == dist.all_reduce in "
          f"{sum(map(sum, agree))} of {n * 30} rank-tensors × segment sizes")
    claim(f"{n} ranks: the real ring equals dist.all_reduce on every tensor, whole chunks "
          "(one segment) and cut into several segments", all(all(a) for a in agree))

# %% [markdown]
# ### Training with it: the same weights as DDP
#
# Data parallelism only needs the *average* of the gradients. So train a SmallCNN twice on the
# same shards from the same initial weights: once with DDP, once with a plain loop that packs all
# gradients into one flat buffer (like one DDP bucket), averages it with our ring and unpacks it.
# Both must end with the same weights — up to float rounding: the two add the gradients in a
# different order, and they divide at different times. DDP divides each rank's gradient by N
# *before* summing (with no comm hook its C++ reducer multiplies each gradient by 1/N as it
# copies it into the bucket; with a hook registered the reducer does not divide, and torch's
# Python `allreduce_hook` does `div_` first itself); our ring sums
# first and divides the sum by N at the end. With 2 ranks they can still come out bit for bit
# equal: a + b = b + a, and halving a *normal* floating-point number only lowers its exponent,
# so a/2 + b/2 and (a + b)/2 round the same sum the same way. That holds while no value halves
# into the *subnormal* range (in float32 below 2⁻¹²⁶ ≈ 1.2e-38, where the exponent cannot go
# lower and halving drops a bit) and a + b does not overflow; the cell below shows both sides.
# So "bit for bit" below is measured on this run's gradients, not guaranteed for every run.

# %%
rng_h = np.random.default_rng(1)
a_h, b_h = (rng_h.standard_normal(100_000).astype(np.float32) * 1e-3 for _ in range(2))
claim("float32, 100 000 normal pairs: a/2 + b/2 == (a + b)/2 bit for bit",
      np.array_equal(a_h / 2 + b_h / 2, (a_h + b_h) / 2))
tiny = np.float32(1.4e-45)  # the smallest positive float32, a subnormal
claim("but for a = b = 1.4e-45 (subnormal): a/2 + b/2 = 0, while (a + b)/2 = 1.4e-45",
      tiny / 2 + tiny / 2 == 0 and (tiny + tiny) / 2 == tiny)

# %%
def train_both_ways(rank, world_size, data_name, n_train, epochs, per_rank_batch, lr):
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse import data, models

    torch.set_num_threads(1)
    ds = data.load(data_name, n_train=n_train, n_test=10, seed=0)
    X, y = data.to_torch(ds.x_train, ds.y_train).tensors

    def run(average_with_ring):
        torch.manual_seed(0)  # same initial weights on every rank, both runs
        model = models.SmallCNN(width=16)
        net = model if average_with_ring else DDP(model)
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        loss_fn = nn.CrossEntropyLoss()
        for epoch in range(epochs):
            idx = torch.as_tensor(data.shard_indices(len(X), rank, world_size, seed=0,
                                                     epoch=epoch, drop_last=True))
            for start in range(0, len(idx) - per_rank_batch + 1, per_rank_batch):
                b = idx[start:start + per_rank_batch]
                opt.zero_grad()
                loss_fn(net(X[b]), y[b]).backward()
                if average_with_ring:
                    params = [p for p in model.parameters() if p.grad is not None]
                    flat = torch.cat([p.grad.reshape(-1) for p in params])
                    ring.ring_allreduce(flat, op="average")
                    for p, g in zip(params, flat.split([p.numel() for p in params])):
                        p.grad.copy_(g.view_as(p))
                opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    with_ring, with_ddp = run(True), run(False)
    dist.barrier()
    return max((with_ring[k] - with_ddp[k]).abs().max().item() for k in with_ring)


diffs = launch.spawn(train_both_ways, world_size, data_name, n_train, epochs, per_rank_batch,
                     lr, backend="gloo", timeout=300)
claim("training with the ring ends with DDP's weights (to 1e-5), on every rank", max(diffs) < 1e-5,
      diffs=diffs)
if world_size == 2:
    claim("with two ranks, bit for bit", max(diffs) == 0.0, diffs=diffs)

# %% [markdown]
# ### How fast is it?
#
# The measurement above timed our ring too (same sizes, same ranks). `dist.all_reduce` is
# gloo's compiled C++; ours is Python issuing 2(N−1) steps of messages. The table reports *bus
# bandwidth* in MB/s as nccl-tests (NVIDIA's benchmark for collectives) defines it,
# busbw = (K / t)·2(N−1)/N — the rate each link must sustain — so numbers for different N
# compare; "ring÷built-in" divides
# the two busbw medians (higher is better for the ring). Each repetition timed both, a *pair*
# that saw the same machine; the last column is the ratio pair by pair: median, quartiles
# [q1–q3] and range. The two ratio columns can disagree on a row (a ratio of medians is not the
# median of the ratios): the verdicts under the table read the last column only, calling a
# difference when q1 > 1 (the ring) or q3 < 1 (the built-in), and "no clear difference"
# otherwise; one verdict per size, never pooled. With each verdict the cell below prints how
# many pairs had to agree (2 of 3 is weak evidence).
#
# **▶ The table's and the verdicts' helpers** (click the folded cell below: the busbw columns
# and their ratio, the repetitions per size, the quartiles).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(bench.bus_bandwidth, bench.AllreduceRow, bench.format_table, bench.reps_for,
              bench.quartiles,
              folded="▶ code: bus_bandwidth, AllreduceRow, format_table, reps_for, quartiles")

# %% [markdown]
# **▶ The table and this run's verdicts, their code** (folded below; its output shows the
# table, then each size's verdict and what this run's numbers show).

# %% jupyter={"source_hidden": true}
# NBVAL_IGNORE_OUTPUT
# Why: timings depend on the machine and its load.
print(bench.format_table(table, busbw_unit="MB/s"))


def pairs_needed(n_pairs):
    """The fewest of n_pairs ratios above 1 that can make bench.quartiles' q1 exceed 1 (the
    rest just under 1, these far above); by symmetry the same count below 1 makes q3 < 1."""
    return next(m for m in range(1, n_pairs + 1)
                if bench.quartiles([1 - 1e-9] * (n_pairs - m) + [1e9] * m)[0] > 1)


verdicts = {}  # (ranks, size) -> verdict
for n in fit_world_sizes:
    by_verdict = {}  # each size's verdict, from its own row's quartiles as the table shows them
    for r in (r for r in table if r.world_size == n):
        q1, q3 = round(r.ratio_q1, 2), round(r.ratio_q3, 2)
        verdict = ("the ring was faster" if q1 > 1 else
                   "the built-in was faster" if q3 < 1 else "no clear difference")
        verdicts[n, r.nbytes] = verdict
        pairs = bench.reps_for(r.nbytes, fit_reps, fit_max_reps)
        need = "" if verdict == "no clear difference" else \
            f" ({pairs_needed(pairs)} of {pairs} pairs needed)"
        by_verdict.setdefault(verdict, []).append(bench.format_size(r.nbytes) + need)
    print(f"This run, {n} ranks: " + "; ".join(f"{v} at {', '.join(sizes)}"
                                              for v, sizes in by_verdict.items()) + ".")
wins = [(n, k) for (n, k), v in verdicts.items() if v == "the ring was faster" and k >= 2**18]
if wins:
    print("From 256 KiB up, ours was faster at "
          f"{', '.join(f'{bench.format_size(k)} ({n} ranks)' for n, k in wins)}."
          " This run does not isolate why.")
else:
    print("This run: ours was not clearly faster at any size from 256 KiB up.")
one_kib = {r.world_size: r for r in table if r.nbytes == 2**10}
if cores < max(fit_world_sizes) and len(one_kib) > 1:
    lo_n, hi_n = min(one_kib), max(one_kib)
    model_ratio = float(fit.predict(hi_n, 2**10) / fit.predict(lo_n, 2**10))  # §3's fit, C cores

    def against_model(ratio):
        """This run's time ratio (hi_n over lo_n ranks) against the contention model's."""
        return ("less than" if ratio < model_ratio / 1.5 else
                "more than" if ratio > model_ratio * 1.5 else "about the same as")

    took = {name: (getattr(one_kib[lo_n], attr), getattr(one_kib[hi_n], attr))
            for name, attr in (("the built-in", "all_reduce_s"), ("ours", "ring_s"))}
    seen = {against_model(t_hi / t_lo) for t_lo, t_hi in took.values()}
    print("A 1 KiB all-reduce (median) took " + "; ".join(
        f"{t_lo * 1e3:.2f} ms with {lo_n} ranks and {t_hi * 1e3:.2f} ms with {hi_n} for {name} "
        f"(×{t_hi / t_lo:.1f}: {against_model(t_hi / t_lo)} the contention model's "
        f"×{model_ratio:.1f})" for name, (t_lo, t_hi) in took.items()) + ". " + (
        f"The model (2(N−1) ring steps, slowed by N/{cores} once ranks outnumber the cores) "
        "matches both ratios to within ×1.5."
        if seen == {"about the same as"} else
        "Where a ratio is off the model's, something the model lacks (how the ranks were "
        "scheduled, the rest of the machine's load) weighs on it.")
        + f" Only ratios are compared: fitted to the fastest repetitions, the model predicts "
        f"{float(fit.predict(lo_n, 2**10)) * 1e3:.2f} ms with {lo_n} ranks and "
        f"{float(fit.predict(hi_n, 2**10)) * 1e3:.2f} ms with {hi_n}; the times above are "
        "medians of each repetition's slowest rank, scheduling delays included: another quantity.")

# %% [markdown]
# For the full sweep (up to 64 MiB), run in a terminal:
#
# ```
# python -m dpcourse.bench allreduce --world-sizes 2 4
# python -m dpcourse.bench allreduce --json > allreduce.json
# ```
#
# ## Lab 06: the ring, simulated then real
#
# Open [lab06_ring_allreduce](../labs/lab06_ring_allreduce.ipynb): you write the reduce-scatter and
# the all-gather in the simulator — for finishing layouts §1 does not show, given as a
# parameter, so you derive which chunk goes where yourself — then the real ring from its
# contract, and in its stretch a segmented, pipelined reduce-scatter. Do it before reading on.

# %% [markdown]
# **▶ The reference answer — open after your lab passes** (click the folded cells below: why
# it cannot deadlock, then its code, which this lesson's claims ran).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# Every message is a `dist.isend` to rank+1 or a `dist.irecv` from rank−1; both return at once,
# and a rank waits on them only once both are posted: no rank blocks in a send.
#
# Blocking calls can do it too, if the ranks do not all call them in the same order; the order
# decides the speed. With gloo a send goes out only once its receiver has posted
# the receive (`Pair::send` in gloo's TCP transport, Sources). Let a single rank receive first
# and all the others send first: nothing deadlocks, but each step becomes a chain. Only the
# send into that one rank can complete; its sender then receives, which lets its own left
# neighbour's send go, and so on around the ring: N transfers one after another (computed below), about
# N(α + Kβ/N) per step instead of α + Kβ/N — the naive way's bandwidth term. Alternate instead: even ranks send first, odd ranks receive first. Every
# even rank's send meets a waiting receiver, then every odd rank's send does: two transfer
# times per step on even N; on odd N, where ranks N − 1 and 0 are both even, 2N/(N − 1) on
# average (three on N = 3, falling toward two as N grows; computed below).
#
# The pipelining (lab 06's stretch): a rank sends at step t+1 the chunk it received at step t,
# so a chunk larger than a segment (4 MiB by default) travels in segments, each forwarded once
# it has arrived (and been added, in the reduce-scatter) while the next are on their way. How
# far ahead to run is the stretch's decision; the library and gloo differ.
# The library posts a step's segment receives all at once and re-posts each for the next step
# once its segment is handled: **as many receives in flight as a chunk has segments**, into two
# chunk-sized buffers used in turn (*double buffering*); the all-gather receives in place. The
# buffers (`ring.receive_buffer`, folded below) are one per dtype and device, shared by every
# call and only grown: their 2K/N bytes stay allocated after a call. gloo keeps **two**
# segments in flight, each receive waited on two iterations after it was posted
# (`gloo/allreduce.cc`, Sources). More in flight keeps the wire
# busier; fewer holds less memory.
#
# </details>

# %% [markdown]
# **▶ Those counts, computed — open after your lab passes** (folded below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ring.blocking_ring_time, ring.blocking_ring_orders,
              folded="▶ The counts' code — open after your lab passes")
with viz.folded_output("▶ The counts — open after your lab passes"):
    for order, (per_step, derived) in ring.blocking_ring_orders((3, 4, 5, 16, 17)).items():
        claim(f"{order}, N = 3, 4, 5, 16, 17: the transfer times per step the folded text "
              f"above derives", per_step == derived, per_step=per_step, derived=derived)

# %% [markdown]
# **▶ The reference answer's code — open after your lab passes** (the folded cell below: `ring.chunk_bounds`, `ring.receive_buffer` and `ring.ring_allreduce`, which §4's claims and timings ran).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ring.chunk_bounds, ring.receive_buffer, ring.ring_allreduce,
              folded="▶ The reference answer's code (§4's claims ran it) — open after your "
                     "lab passes")

# %% [markdown]
# ### The pipelined ring as a timeline
#
# **▶ Open after your lab passes** (the folded text below: a model of where the time goes when
# each chunk travels in segments — it draws the idea of the stretch; its code, claims and figure
# follow, folded too).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# Where does the time go when a chunk travels in segments? `ring.pipeline_schedule` lays §1's
# transfers (the chunks `ring.simulate_ring` sends, step by step) on a time axis, under a
# model, not a measurement: a whole chunk takes one *transfer time* on a link and half of one
# to add; a link carries one segment at a time; a rank adds one segment at a time while its link
# goes on sending; and a rank forwards segment j of a chunk once that segment has arrived and, in
# the reduce-scatter, been added. Four ranks, each chunk sent whole, then in 4 segments.
#
# The model charges no per-message latency, so in it more segments are never slower. On a real
# link every segment pays §3's α, which bounds the number of segments: gloo's 1 MiB and the
# library's 4 MiB are two choices of that trade-off, not shown here.
#
# </details>

# %% [markdown]
# **▶ The timeline — open after your lab passes** (the folded cell below:
# `ring.pipeline_schedule`'s code, then the claims and the figure it draws).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ring.pipeline_schedule,
              folded="▶ The timeline's code — open after your lab passes")
N_PIPE, ADD = 4, 0.5  # ranks; time to add a whole chunk, in transfer times
timelines = {S: ring.pipeline_schedule(N_PIPE, S, transfer=1.0, add=ADD) for S in (1, 4)}


def waits_for_its_segment(slots):
    """Every segment a rank sends after step 1 left only once it had arrived there (and, in the
    reduce-scatter, been added), and it is the chunk that rank received the step before."""
    got = {(s.rank if s.kind == "add" else (s.rank + 1) % N_PIPE, s.step, s.segment): s
           for s in slots if s.kind == "add" or s.step >= N_PIPE}
    return all(s.start >= got[(s.rank, s.step - 1, s.segment)].end - 1e-12
               and s.chunk == got[(s.rank, s.step - 1, s.segment)].chunk
               for s in slots if s.kind == "send" and s.step > 1)


done = {S: max(s.end for s in slots) for S, slots in timelines.items()}
with viz.folded_output("▶ The timeline — open after your lab passes"):
    claim("in both timelines a segment leaves a rank only after it arrived there (and was added, "
          "in the reduce-scatter), and it is the chunk that rank received the step before",
          all(waits_for_its_segment(slots) for slots in timelines.values()))
    claim(f"whole chunks: 2(N−1) transfers and N−1 additions one after another, done at "
          f"{done[1]:g}; in 4 segments every addition hides under the next segment's transfer, "
          f"done at 2(N−1) = {done[4]:g}",
          done[1] == 2 * (N_PIPE - 1) + (N_PIPE - 1) * ADD and done[4] == 2 * (N_PIPE - 1))
first = next(s for s in timelines[4] if (s.kind, s.rank, s.step, s.segment) == ("add", 1, 1, 0))
onward = next(s for s in timelines[4] if (s.kind, s.rank, s.step, s.segment) == ("send", 1, 2, 0))
viz.show(viz.pipeline_figure(
    {"each chunk sent whole": timelines[1], "each chunk in 4 segments": timelines[4]}),
    caption=f"each row is one rank's link to its right neighbour; a box is a segment of a chunk "
            f"on it (chunk.segment), a grey bar under it that rank adding a segment it received. "
            f"Top: every step waits for its addition, and the links idle {ADD:g} of a "
            f"transfer time per reduce-scatter step. Bottom: segment j is added while segment "
            f"j + 1 is on the wire, so no link ever idles. Segment 0.0 reaches rank 1, is added there "
            f"by {first.end:g} and leaves again at {onward.start:g}: what now decides the time "
            f"is the link, not the addition (the dotted line: the all-gather starts). The model "
            f"charges no per-segment latency α, so more segments never cost more here.",
    folded="▶ The timeline's figure — open after your lab passes")

# %% [markdown]
# ## Summary
#
# - A ring all-reduce sends 2(N−1)K/N bytes per worker in 2(N−1) steps — bandwidth optimal,
#   bounded by 2K whatever N — at the price of a latency term that grows with N.
# - The α-β model, fitted to this machine's fastest all-reduces (with a contention term for
#   ranks that share cores), describes them within the error it prints — a median error under
#   50% on a loaded 2-core machine; published link bandwidths turn it into predictions for GPU
#   clusters.
# - A few dozen lines of point-to-point messages give a ring that equals `dist.all_reduce` and
#   trains to DDP's weights, once their order leaves no rank waiting forever and no step's
#   transfers in a chain (lab 06's design decision); cutting the chunks into segments lets the wire and the additions overlap.
#
# **Next:** [lesson 07](07_inside_ddp.ipynb) opens DDP itself: the hooks that launch these
# all-reduces while the backward runs, the buckets that make each message large enough to be
# worth its α, and communication hooks that send fewer bytes.
#
# ## Check yourself
#
# **▶ The quiz** — run the folded cell below and answer in the widget (or read its output,
# where the answers are folded).

# %% jupyter={"source_hidden": true}
from dpcourse import quizzes

viz.quiz(quizzes.questions("06"))

# %% [markdown]
# ## Sources that answer lab 06's stretch
#
# **▶ Open after lab 06's stretch passes** (click the folded cell below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# #### Sources (lab 06's stretch)
#
# - gloo, `gloo/allreduce.cc` (in the Sources below), `ring`: lines 220-231, a scratch buffer of `segmentBytes * 2`, "With two operations in flight we need two offsets"; lines 268-320, the reduce-scatter loop waits at iteration i for the receive posted at i − 2, so two segments are in flight.
#
# </details>

# %% [markdown]
# ## Sources
#
# Checked in the installed packages (paths relative to `site-packages`):
#
# - `torch/distributed/distributed_c10d.py` — `isend`, `irecv`: non-blocking point-to-point messages that return a work object to `wait()` on (`isend`: "Modifying `tensor` before the request completes causes undefined behavior"); `send`: "Send a tensor synchronously", by `isend` then `work.wait()`; `recv`: fills the tensor it is given ("Tensor to fill with received data") and returns the sender's rank; `all_reduce` (sum by default), `barrier`, `get_global_rank` (a group rank to the global rank `isend`/`irecv` take).
# - `torch/_torch_docs.py` — `tensor_split`: the first `size % sections` pieces are one element longer — the chunking of `ring.chunk_bounds` and NumPy's `array_split`.
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel`: gradients grouped in buckets (`bucket_cap_mb`), one all-reduce per bucket.
# - `torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py` — `allreduce_hook`: "Apply the division first", `tensor.div_(group_to_use.size())` before the all-reduce (DDP's default behaviour in Python form).
# - `torch/include/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp` — `createDefaultDevice`: "It tries to resolve this machine's hostname and bind to that address. If that fails … it falls back to binding to the loopback address"; `torch/lib/libtorch_cpu.so` (its strings, from `ProcessGroupGloo.cpp`): "Using the loopback address as fallback. Manually set the network interface to bind to with GLOO_SOCKET_IFNAME." `torch/distributed/rendezvous.py` — `_env_rendezvous_handler`: `MASTER_ADDR` (127.0.0.1 in `dpcourse.launch`) and `MASTER_PORT` make only the rendezvous store (`_create_c10d_store`).
# - `torch/include/torch/csrc/distributed/c10d/gloo/ProcessGroupGlooDetail.hpp` — `AsyncAllreduceWork::allreduce`, torch's gloo all-reduce: it fills a `gloo::AllreduceOptions` without choosing an algorithm (no `setAlgorithm`) and calls `gloo::allreduce`, so gloo runs its default (`gloo/allreduce.cc` below).
# - `tensorflow/python/distribute/parameter_server_strategy_v2.py` — `ParameterServerStrategyV2` (its docstring: variables made in its scope are "placed on parameter servers in a round-robin manner", or sharded across them with a `variable_partitioner`; and "By default, workers read and update these variables independently without synchronizing with each other. Under this configuration, it is known as asynchronous training."); `ParameterServerStrategyV2Extended._create_variable_round_robin`.
# - `tensorflow/python/distribute/mirrored_strategy.py` — `MirroredExtended._batch_reduce_to` and `_make_collective_ops_with_fallbacks`: a step's gradients go to the cross-device ops in one batched call; by default `CollectiveAllReduce` with `RING` on CPUs.
#
# Public documents (not in the installed files):
#
# - `reducer.cpp`, the DDP reducer's C++ source (c10d, github.com/pytorch/pytorch at ad78a7b, the revision stored here; compiled into torch, not installed as source) — `Reducer::mark_variable_ready_dense`: without a comm hook the gradient is copied into its bucket multiplied by 1/N (`at::mul_out`); with a hook, copied without division ("Note [DDP Communication Hook]").
# - NVIDIA nccl-tests, `doc/PERFORMANCE.md` (github.com/NVIDIA/nccl-tests): the definitions of algbw and busbw used in the table.
# - Sanders, Speck, Träff, "Two-tree algorithms for full bandwidth broadcast, reduction and scan" (Parallel Computing, 2009), and NVIDIA's NCCL 2.4 announcement: the double binary tree.
# - NCCL 2.30.7, the version installed beside torch (`nvidia_nccl_cu13-2.30.7`: the compiled library and its public headers, not its source); its source at github.com/NVIDIA/nccl, tag v2.30.7-1: `src/graph/connect.cc` — `ncclTopoPreset` (lines 53-62: inside a server a tree channel's `up` is the previous GPU of `treeIntra` and `down[0]` the next, a chain) and `connectTrees` (lines 138-176: the double tree `ncclGetDtree(nNodes, node, …)` over the servers, depth `nRanks / nNodes - 1 + log2i(nNodes)`); `src/graph/trees.cc` — `ncclGetDtree`; `src/device/all_reduce.h` — `runTreeUpDown` and `runTreeSplit` (the tree all-reduce: a reduce pass up the tree, `FanAsymmetric<NCCL_MAX_TREE_ARITY, 1>`, then a broadcast pass down, `FanAsymmetric<1, NCCL_MAX_TREE_ARITY>`); `src/graph/search.cc` — `ncclTopoSearchRecNet` (line 736: the search for a new channel tries the NICs from `nets[(graph->nChannels + i) % netCount]`, the next NIC for each new ring; a NIC is skipped when less than a channel's bandwidth is left on it, line 739, and each channel placed on it takes that much, lines 747-751); `src/graph/tuning.cc` — the tuner's bandwidth for a ring over more than two servers (line 306: `bw = bwInter`, the per-channel network bandwidth; line 324: `busBw = nChannels * bw`) and its latency model (line 416: the tree's all-reduce `2 * ((nRanks / nNodes - 1) * intraLat + log2i(nNodes) * interLat)`; line 298: PAT is skipped for all-reduce); `src/include/plugin/nccl_tuner.h` lines 27-34 — the algorithms Tree, Ring, CollNet Direct, CollNet Chain, NVLS, NVLS_TREE, PAT; `src/transport/nvls.cc` — "NVLink SHARP (NVLS)", enabled where the device reports `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`.
# - gloo, `gloo/allreduce.cc` (github.com/facebookincubator/gloo at cc44198, May 2025; vendored in PyTorch's `third_party/gloo`, compiled into torch, not installed as source): `ring`, the segmented ring all-reduce (lines 287-295: each received segment is added into the output on the rank's CPU, `reduceInputs` and `opts.reduce`, inside the loop; lines 209-218: `numSegments = roundUp(max(⌈K / maxSegmentBytes⌉, 2N), N)`, `numSegmentsPerRank = numSegments / N` a step, segments of at most `kMaxSegmentSize` = 1 MiB from `gloo/allreduce.h`; how many segments it keeps in flight: the folded bullet above this list); `allreduce`: `switch (opts.algorithm)` runs `ring` for `UNSPECIFIED` and `RING`, `bcube` for `BCUBE`; gloo also ships `gloo/allreduce_halving_doubling.h` (`AllreduceHalvingDoubling`, a separate older class that no header under `torch/include/torch/csrc/distributed/` names) and `gloo/allreduce_bcube.h`. `gloo/transport/tcp/pair.cc` — `Pair::send` (unbound buffer) sends the data only once the peer has announced a posted receive (`NOTIFY_RECV_READY`, handled in `Pair::handleRemotePendingRecv`: "sends cannot execute until the remote side is ready to receive"); otherwise the send waits in `localPendingSend_`.
# - Thakur, Rabenseifner, Gropp, "Optimization of collective communication operations in MPICH" (IJHPCA, 2005): ring, tree, Rabenseifner's reduce-scatter + all-gather (recursive halving and doubling, partners p/2 apart first; the extra step for N not a power of two) and their α-β costs; recursive doubling, lg p(α + nβ + nγ), MPICH's all-reduce for short messages; γ, the time per byte of the reduction's arithmetic.
# - MPICH's source (github.com/pmodels/mpich), `src/mpi/coll/allreduce/allreduce_intra_reduce_scatter_allgather.c`, `MPIR_Allreduce_intra_reduce_scatter_allgather` ("Rabenseifner's Algorithm"): halving from distance 1 (`mask = 0x1`, doubled each round), then the all-gather back from distance pof2/2 (`mask >>= 1`, halved each round); even ranks below 2·rem send to rank + 1.
# - Chan, Heimlich, Purkayastha, van de Geijn, "Collective communication: theory, practice, and experience" (Concurrency and Computation: Practice and Experience 19(13), 2007): the lower bounds of an all-reduce under the α-β model, ⌈log₂N⌉α for latency and 2(N−1)/N·Kβ for bandwidth; its cost model adds γ per byte for the additions.
