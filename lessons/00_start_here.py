# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
# ---

# %% [markdown]
# # 00 · Start here
#
# **Prerequisites:** Python, and a PyTorch training loop you have written or read once.
#
# **You will be able to:**
# - find your way through the course: lessons, labs, solutions, and the library behind them;
# - run a lab check and read what it tells you when your code is wrong;
# - say which hardware profile your machine gets, and what that changes in later lessons;
# - start two cooperating processes from a notebook and get their results back.
#
# **Time:** about 20 minutes to read and run.
#
# **Lab:** none — lab 01 follows lesson 01.
#
# This course takes you from a single-device PyTorch training loop to data-parallel training
# on many devices — `nn.DataParallel`, DistributedDataParallel (DDP), TensorFlow's
# `MirroredStrategy` — and down to the ring AllReduce that moves the gradients; the last lesson
# shows where data parallelism ends and what comes after it. Every lesson runs on a CPU-only
# machine: that is where its stored outputs were made. The same code picks GPUs and NCCL when
# it finds them; the multi-GPU path is written but not yet run on a multi-GPU machine (where
# the course has run is in a folded note at the end of this lesson).
#
# **What is checked, and what is read.** Each line that starts with ✔ is a claim this run
# checked: a cell asserted it (and says "to within 1e-5" when floating-point sums in another
# order make the numbers differ in their last bits). If a ✔ claim stopped being true, the
# course would fail to build. Some statements cannot be measured on a CPU-only machine — what
# NCCL does on GPUs, what C++ code that is not installed does: the lesson then says it read
# them from the source
# (*read from source, not measured*) and names the file in its **Sources** section. Those are
# as good as the reading, not as a run.
#
# ## The course map
#
# | lesson | what you learn | what it proves by running | lab |
# |---|---|---|---|
# | [00 start here](00_start_here.ipynb) | the map, labs, your hardware profile | which profile this machine uses | – |
# | [01 single device](01_single_device.ipynb) | the loop: forward, loss, backward, step; throughput; AMP; seeds | loss falls, accuracy ≫ chance, AMP keeps accuracy | `train_one_epoch`, `evaluate` |
# | [02 data parallel](02_data_parallel.ipynb) | `nn.DataParallel`: scatter, replicate, parallel_apply, gather — and why it is slow | DP from scratch == the plain module | DP step by hand |
# | [03 DDP from first principles](03_ddp_first_principles.ipynb) | processes, ranks, collectives, averaging gradients, DDP, `DistributedSampler` | hand-averaged == DDP == one process on the global batch | `average_gradients` |
# | [04 DDP in practice](04_ddp_in_practice.ipynb) | torchrun, multi-node, checkpoints, faults, accumulation, AMP, debugging | a killed-and-restarted run ends with the same weights | script → torchrun DDP |
# | [05 MirroredStrategy](05_mirrored_strategy.ipynb) | TensorFlow's data parallelism, Keras `fit`, a custom loop, multi-worker | mirrored step == one replica on the global batch | loss scaling in a custom loop |
# | [06 ring AllReduce](06_ring_allreduce.ipynb) | the algorithm, its cost model fitted to your machine, a real ring | ring == sum; bytes per rank == 2(N−1)K/N | the ring, simulated then real |
# | [07 inside DDP](07_inside_ddp.ipynb) | hooks that all-reduce as gradients are ready, buckets, the overlap timeline, comm hooks (fp16, bf16, PowerSGD) | hooked and bucketed == DDP; one all-reduce per bucket | the bucketed, hook-driven wrapper |
# | [08 sharded data parallel](08_sharded_data_parallel.ipynb) | where the memory goes, ZeRO-1/2/3 from scratch, FSDP2, which stage fits | every stage and FSDP2 == DDP; bytes held == the formula | ZeRO-2, overlapped with the backward |
# | [09 beyond lockstep](09_beyond_lockstep.ipynb) | a parameter server, staleness, local SGD, large batches | sync PS == DDP; τ = 0 == SGD; H = 1 == DDP | the asynchronous worker loop |
# | [10 bug zoo](10_bug_zoo.ipynb) | eleven broken distributed programs, each run safely with its detector and fix | every detector fires on its bug; every fix is proven by a run (most detectors go quiet) | name and fix five bugs |
# | [11 beyond data parallel](11_beyond_data_parallel.ipynb) | why data parallelism ends (memory at batch 1, the critical batch size); tensor parallel (Megatron's MLP) from scratch and with `parallelize_module`; pipeline parallel (GPipe, the bubble, 1F1B); a 2-D mesh DP × TP; a planner | TP MLP == plain MLP; 2-D mesh == one device; the bubble measured against (K−1)/(M+K−1) | column/row-parallel layers |
#
# ## How the labs work
#
# Each lab (in `labs/`) is a notebook with a few `# TODO` holes, each followed by a **check
# cell**. Fill a hole, run its check: it prints one line starting with ✔ when your code is
# right, or stops with a `LabCheckError` whose one sentence names the mistake — "gradients from
# earlier batches leaked into each step", not just "wrong". The labs are generated from the
# published solutions in `solutions/`, so the two never drift apart.
#
# The lessons state their facts the same way: each claim prints one line starting with ✔,
# computed on this run, or stops the notebook with a `ClaimError` that names the claim and the
# numbers it was judged on. You will never see a bare `True` printed as proof.
#
# Here is the mechanism on a toy: a check that wants the mean of a list.

# %%
from dpcourse.checks import LabCheckError, claim, fail, passed


def check_mean(mean_fn):
    """A miniature lab check: compare with the right answer, name the usual mistake."""
    data = [1.0, 2.0, 3.0, 6.0]
    got = mean_fn(data)
    if got == sum(data):
        fail("you returned the sum: divide by the number of items.")
    if got != sum(data) / len(data):
        fail(f"mean_fn gave {got}, the mean is {sum(data) / len(data)}.")
    return passed("mean_fn is right.")


check_mean(lambda xs: sum(xs) / len(xs))
try:
    check_mean(lambda xs: sum(xs))
except LabCheckError as err:
    print("LabCheckError:", err)

# %% [markdown]
# ## Your machine: the three hardware profiles
#
# From lesson 03 on, one training program runs as several cooperating processes, called
# *ranks* (numbered 0, 1, …), which exchange tensors through a *backend*: the library that moves
# the tensors between them, **gloo** (CPU tensors; GPU tensors only in part: lesson 03's
# appendix) or **NCCL** (NVIDIA's, GPU tensors only).
# Which backend the ranks use, and on which devices, depends on the machine. The lessons never ask
# you to edit a cell to match your hardware. `dpcourse.devices` looks at the machine and picks
# one of three profiles:
#
# | profile | when | single-device lessons | multi-rank cells that follow the profile (for example 03's core comparison, 04's torchrun scripts) | TensorFlow (05) |
# |---|---|---|---|---|
# | `cpu` | no GPU (laptop, Binder, CI) | CPU | 2 processes over **gloo** on the CPU | CPU split into 2 logical devices |
# | `one-gpu` | one GPU | CUDA | 2 processes over gloo **on the CPU**; the GPU serves the single-device lessons (NCCL, by default, refuses two ranks on one GPU) | GPU split into 2 logical GPUs |
# | `multi-gpu` | 2+ GPUs | CUDA | **NCCL**, one GPU per rank | 2 of the real GPUs |
#
# Many multi-rank cells do not follow the profile: they run gloo on the CPU on every machine,
# so that what they print is the same everywhere — lesson 03's internals sections, lesson 06,
# the bug zoo (10) and lesson 11. Each lesson's opening says which of its cells are which.
#
# Every profile starts **2 ranks**, even with 8 GPUs, so that what a lesson prints and proves
# is the same on every machine; a lesson's parameters cell (`world_size = 4`) asks for more.
#
# Instructors can force a profile with the environment variable `DPCOURSE_PROFILE` (for
# example to rehearse the CPU path on a GPU server). `python -m dpcourse doctor` prints the
# report below from a terminal. Its output depends on your machine, so this cell is not
# compared by the course's tests.

# %%
# NBVAL_IGNORE_OUTPUT
# Why: versions, CPU count and GPUs differ from machine to machine.
from dpcourse.__main__ import doctor

_ = doctor()  # (keep its return code out of the output)

# %% [markdown]
# What the lessons rely on is not the exact report but a few rules, checked here: the profile
# follows the number of GPUs (`choose_profile`, asked about this machine's report with 0, 1, 2
# and 8 GPUs), NCCL is chosen only when every rank can own a GPU (`backend_for`), and
# everything needed for the CPU path (gloo) is present.

# %%
import dataclasses
import os
from unittest import mock

from dpcourse import devices, viz

viz.show_code(devices.hardware_report, devices.choose_profile, devices.backend_for,
              folded="▶ devices.hardware_report, choose_profile and backend_for: the facts and "
                     "rules these claims test")
report = devices.hardware_report()
profile = devices.choose_profile(report)


def profile_for(gpus):
    """The profile this machine would get with ``gpus`` GPUs and DPCOURSE_PROFILE unset."""
    with_gpus = dataclasses.replace(report, gpus=["a GPU"] * gpus, nccl=gpus > 0)
    with mock.patch.dict(os.environ):
        os.environ.pop("DPCOURSE_PROFILE", None)
        return devices.choose_profile(with_gpus)


by_gpus = {n: profile_for(n) for n in (0, 1, 2, 8)}
for n, p in by_gpus.items():   # what choose_profile returned: the inputs of the claims below
    print(f"{n} GPU(s): profile {p.name}, {p.world_size} ranks over {p.backend} on "
          f"{p.rank_device}, single-device code on {p.device}")
claim("the profile follows the GPU count: 0 → cpu, 1 → one-gpu, 2 and 8 → multi-gpu",
      [p.name for p in by_gpus.values()] == ["cpu", "one-gpu", "multi-gpu", "multi-gpu"])
claim("one-gpu: its 2 ranks run over gloo on the CPU, the GPU serves single-device code",
      (by_gpus[1].world_size, by_gpus[1].backend, by_gpus[1].rank_device, by_gpus[1].device)
      == (2, "gloo", "cpu", "cuda"), one_gpu=by_gpus[1])
claim("this machine got the profile its GPU count gives, or the one DPCOURSE_PROFILE names",
      profile.name == (os.environ.get("DPCOURSE_PROFILE") or profile_for(report.gpu_count).name),
      profile=profile.name, gpus=report.gpu_count)
claim("gloo is available, so the CPU path of every lesson can run", report.gloo)
picked = {(gpus, nccl): devices.backend_for(2, gpu_count=gpus, nccl=nccl)
          for gpus, nccl in ((0, True), (1, True), (2, True), (4, False))}
print("backend_for(2 ranks): " + "; ".join(f"{gpus} GPUs, NCCL {'built' if nccl else 'absent'}: "
                                           f"{b}" for (gpus, nccl), b in picked.items()))
claim("NCCL is chosen only when every rank can own a GPU",
      picked == {(0, True): "gloo", (1, True): "gloo", (2, True): "nccl", (4, False): "gloo"})

# %% [markdown]
# ## Running many processes from a notebook
#
# From lesson 03 on, cells start several processes ("ranks") that work together. They talk
# through a *process group*: the set of processes that take part in collective operations
# (such as the `all_reduce` below) together, created by `torch.distributed.init_process_group`
# (here `spawn` calls it for us) with a backend (gloo or NCCL, as above). Starting them from
# a notebook has traps — a function defined in a cell cannot normally be sent to another process
# (below: why, and how `spawn` gets round it), ranks print on top of each other, and a rank that
# crashes can leave the others waiting: up to the group's timeout (30 minutes by default on
# gloo), unless the crashed rank's process exits and closes its connections. `dpcourse.launch.spawn` deals with all of them:
# it returns each rank's result, prints each rank's output after the run with a `[rank k]`
# prefix, turns a crash in any rank into one error naming it, and stops a hang at a timeout. A
# first taste — two processes each contribute a number and both receive the sum.

# %%
from dpcourse import launch


def hello(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([10.0 * (rank + 1)])
    dist.all_reduce(t)  # every rank ends with the sum over all ranks
    print(f"I am rank {rank} of {world_size}; the sum is {t.item():.0f}")
    return t.item()


results = launch.spawn(hello, 2, backend="gloo", timeout=60)
print("results, in rank order:", results)
claim("both ranks received the sum 10 + 20", results == [30.0, 30.0], results=results)
viz.show(viz.spawn_figure(len(results), "gloo"), "a helper with torch imported once (the "
         "forkserver) starts each rank; the ranks meet at a key-value server rank 0 runs (the "
         "store), return results on a pipe, exit on the notebook's word.")

# %% [markdown]
# How did `hello`, defined in this notebook, reach two new processes? A process that starts
# fresh receives the function as bytes. Python's `pickle` writes a function as its module and
# name only (`__main__.hello`), and the new process's `__main__` is not this notebook, so it
# cannot find it; `spawn` sends it with **cloudpickle**, which writes the function's code
# itself. Each way, into a fresh interpreter:

# %%
import pickle
import subprocess
import sys

import cloudpickle


def loads_in_fresh_process(payload):
    """Unpickle ``payload`` in a new Python process: 'ok' or the error's first line."""
    done = subprocess.run([sys.executable, "-c", "import pickle, sys; "
                           "pickle.loads(sys.stdin.buffer.read()); print('ok')"],
                          input=payload, capture_output=True, timeout=60)
    return done.stdout.decode().strip() or done.stderr.decode().strip().splitlines()[-1]


by_name, by_value = loads_in_fresh_process(pickle.dumps(hello)), \
    loads_in_fresh_process(cloudpickle.dumps(hello))
print("pickle:     ", by_name)
print("cloudpickle:", by_value)
claim("a fresh process cannot load a notebook function pickled by name, but loads it pickled "
      "by value (cloudpickle)",
      "hello" in by_name and by_name != "ok" and by_value == "ok",
      by_name=by_name, by_value=by_value)
import inspect

claim("and cloudpickle is what spawn sends: launch.spawn pickles (fn, args, kwargs, backend) with "
      "cloudpickle.dumps, and each rank's entry point loads them with cloudpickle.loads",
      "cloudpickle.dumps((fn, args, kwargs, backend))" in inspect.getsource(launch.spawn)
      and "cloudpickle.loads(payload)" in inspect.getsource(launch.worker_entry))

# %% [markdown]
# (Running on GPUs? The optional appendix "NCCL and GPUs", before the Summary, is for you.)

# %% [markdown]
# **When a rank fails.** Here rank 1 raises while rank 0 is busy for 30 s. `spawn` stops rank 0,
# and the notebook gets one `RankFailedError` whose first line names the failed rank and its
# error (the rest of the message is that rank's traceback). A rank that never finishes — as when
# it waits in a collective another rank never calls — is stopped at the timeout with a
# `LaunchTimeoutError`. One difference from a script: under `spawn` a rank whose function has
# returned does not exit; it keeps its process and connections until every rank has finished,
# so a rank still waiting on it hangs until that timeout, which then names it. (In a script,
# the finished rank's process would exit, and a peer waiting on it over gloo fails within
# seconds, long before the timeout: lesson 10 runs both.)

# %%
import datetime
import tempfile
import time

import psutil

pid_dir = tempfile.mkdtemp()  # each rank below leaves a file named by its process id


def rank1_crashes(rank, world_size, pid_dir):
    import time

    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    if rank == 1:
        raise ValueError("rank 1 found a bad batch")
    time.sleep(30)  # rank 0 would be busy much longer than the crash takes to report


def never_finishes(rank, world_size, pid_dir):
    import time

    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    time.sleep(600)


t0 = time.perf_counter()
try:
    launch.spawn(rank1_crashes, 2, pid_dir, timeout=60)
except launch.RankFailedError as err:
    crash_lines = str(err).splitlines()
crash_s = time.perf_counter() - t0
print("\n".join(crash_lines[:2]))
claim("rank 1's error came back as one RankFailedError naming rank 1 and its ValueError, in "
      "under 25 s: rank 0's 30 s sleep was cut short",
      crash_lines[0].startswith("rank 1 of 2 failed: ValueError") and crash_s < 25,
      crash_s=crash_s)

t0 = time.perf_counter()
try:
    launch.spawn(never_finishes, 2, pid_dir, timeout=3)
except launch.LaunchTimeoutError as err:
    hang_message = str(err)
hang_s = time.perf_counter() - t0
print(hang_message.split(". ")[0] + ".")
claim("two ranks that never finish were stopped by the 3 s timeout: spawn raised after 3 s or "
      "more and in under 30 s, not after their 600 s",
      "never finished within 3 s" in hang_message and 3 <= hang_s < 30, hang_s=hang_s)
rank_pids = [int(name) for name in os.listdir(pid_dir)]
claim("and nothing is left running: none of the 4 rank processes of these two launches exists",
      len(rank_pids) == 4 and not any(psutil.pid_exists(pid) for pid in rank_pids),
      pids=rank_pids)
entry = inspect.getsource(launch.worker_entry)
print("worker_entry's lines the next claim reads, in order:", *[line.strip() for line in
      entry.splitlines() if "result_conn.send_bytes(" in line or "release_conn.recv_bytes(" in line],
      sep="\n    ")
claim("a rank that returned stays alive: after sending its result (result_conn.send_bytes), "
      "worker_entry waits for the parent's word that every rank is done "
      "(release_conn.recv_bytes())",
      0 < entry.find("result_conn.send_bytes(message)") < entry.find("release_conn.recv_bytes()"))
from torch.distributed import constants

claim("torch.distributed.constants.default_pg_timeout is 30 minutes",
      constants.default_pg_timeout == datetime.timedelta(minutes=30),
      timeout=str(constants.default_pg_timeout))

# %% [markdown]
# **▶ The launch code these claims rest on** (click the folded cell below): `launch.spawn`,
# whose `finally` kills every rank's process tree, finished or not (that is what stopped rank 0
# long before its 30 s), with `launch.kill_tree`: `os.killpg` on the rank's process group (each
# rank made its own with `os.setsid()` in `worker_entry`), then each descendant, listed before
# the first kill; `launch.wait_for_ranks`, which polls the ranks' result pipes, stops
# 1.5 s after the first error or at the timeout, and raises `RankFailedError` or
# `LaunchTimeoutError`; and `launch.worker_entry`, what each rank runs (the last claim but one
# reads it).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(launch.spawn, launch.kill_tree, launch.wait_for_ranks, launch.worker_entry,
              folded="▶ launch.spawn, kill_tree, wait_for_ranks and worker_entry")

# %% [markdown]
# ## Appendix: NCCL and GPUs (optional)
#
# For readers who will run on GPUs; the CPU path of the later lessons does not need it. What
# the `one-gpu` row rests on: NCCL, by default, refuses two ranks on one GPU. The rest (a group
# with one backend per device type, NCCL's lazy connection, the switch that lifts the one-GPU
# rule; lessons 03 and 10 point back here) is folded below, each part with the run that
# checks it.

# %% [markdown]
# <details><summary>▶ open</summary>
#
# A group has one backend **per device type**, not necessarily one backend: torch's
# `init_process_group` accepts `"cpu:gloo,cuda:nccl"`, and then collectives on CPU tensors go
# through gloo and those on GPU tensors through NCCL, in the same group; every rank passes the
# same string. The first cell below asks for that pair. A torch built without NCCL (the
# CPU-only wheel, Binder's) refuses it before NCCL is reached; a torch built with NCCL, on a
# machine without GPUs, refuses it in NCCL's constructor; the cell shows which error this
# machine gives. With GPUs the group forms at once, because NCCL sets
# up its *communicator* (the connections between the ranks' GPUs that its collectives run
# over) only when the first collective on a GPU tensor needs it, unless `init_process_group`
# is given a `device_id` (its docstring says so). The third run uses the same
# `device:backend` form with the CPU's entry alone. This is c10d at work —
# torch.distributed's C++ core ("c10" is torch's core library, "d" for distributed), whose
# process groups the lessons use from lesson 03 on.
#
# </details>
#
# **▶ The first run:** ask for `"cuda:nccl,cpu:gloo"` (the same pair) on this machine.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
# NBVAL_IGNORE_OUTPUT
# (why: what it prints depends on whether this machine has GPUs; the claim holds on each)
def ask_for_nccl(rank, world_size):
    import os

    import torch.distributed as dist

    # The rendezvous store, made here (rank 0 hosts it) so that it outlives a failed
    # init_process_group: rank 0 failing first must not close it under a rank still using it.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, rank == 0)
    try:
        # NCCL named first: the backends are made in this order, so without a GPU the call
        # fails before gloo connects the ranks (a rank that failed after gloo had connected
        # could close it under a rank still connecting).
        dist.init_process_group("cuda:nccl,cpu:gloo", store=store, rank=rank,
                                world_size=world_size)
        outcome = "a group with NCCL for cuda tensors was formed"
        dist.destroy_process_group()
    except (ValueError, RuntimeError) as err:   # no GPU: ValueError; no NCCL in torch: RuntimeError
        outcome = f"{type(err).__name__}: {err}"
    store.set(f"tried {rank}", "")                  # every rank has finished trying ...
    store.wait([f"tried {r}" for r in range(world_size)])
    store.set(f"left {rank}", "")                   # ... and has stopped waiting for the others
    if rank == 0:
        store.wait([f"left {r}" for r in range(world_size)])
    return outcome


nccl_here = launch.spawn(ask_for_nccl, 2, timeout=60)
import torch.distributed as dist

with viz.folded_output("▶ The first run"):
    print("rank 0:", nccl_here[0])
    if not dist.is_nccl_available():   # a torch built without NCCL, such as the CPU-only wheel
        claim("this torch was built without NCCL: init_process_group with NCCL for cuda "
              "tensors fails on every rank with distributed_c10d's \"doesn't have NCCL built in\"",
              all("RuntimeError: Distributed package doesn't have NCCL built in" in r
                  for r in nccl_here), nccl_here=nccl_here)
    elif report.gpu_count == 0:
        claim("on this machine without GPUs, init_process_group with NCCL for cuda tensors "
              "fails on every rank with ProcessGroupNCCL's error",
              all("only supported with GPUs" in r for r in nccl_here), nccl_here=nccl_here)
    else:
        claim("on this machine with GPUs, the same call forms the group on every rank (no "
              "collective on a cuda tensor has run, so NCCL has connected nothing yet)",
              all(r == "a group with NCCL for cuda tensors was formed" for r in nccl_here),
              nccl_here=nccl_here)

# %% [markdown]
# <details><summary>▶ open</summary>
#
# Two ranks on **one** GPU are another case: NCCL itself refuses them by default, which is why
# the `one-gpu` profile runs its two ranks over gloo (*read from source, not measured*: no run
# here puts two ranks on one GPU). It is a default, not a law — the refusal's message, which
# the run below finds in the installed NCCL library, names the switch that lifts it — but two
# ranks sharing one GPU's memory and compute teach nothing about scaling, so the course keeps one GPU
# per NCCL rank.
#
# </details>
#
# **▶ The second run:** look for that message in the installed NCCL library.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
import importlib.util
import mmap
from pathlib import Path

nccl_spec = importlib.util.find_spec("nvidia.nccl")
with viz.folded_output("▶ The second run"):
    if nccl_spec is None:
        print("(this torch was installed without NCCL's wheel: nothing to look into)")
    else:
        nccl_lib = Path(list(nccl_spec.submodule_search_locations)[0]) / "lib" / "libnccl.so.2"
        with open(nccl_lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as lib:
            message = (b"Multiple Ranks are using the same GPU/Partition. "
                       b"Set NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this configuration.")
            found = lib.find(message) >= 0
        claim("the installed NCCL library holds the message \"Multiple Ranks are using the same "
              "GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this configuration.\", "
              "which names the variable that lifts the refusal", found, library=str(nccl_lib))


# %% [markdown]
# **▶ The third run:** a group made with the `device:backend` form, the CPU's entry alone.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
def backend_per_device(rank, world_size):
    import torch
    import torch.distributed as dist

    dist.init_process_group("cpu:gloo", rank=rank, world_size=world_size)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # a CPU tensor: this goes through the group's backend for "cpu"
    cpu_backend = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
    seen = (str(dist.get_backend()), cpu_backend, t.item())
    dist.destroy_process_group()
    return seen


per_device = launch.spawn(backend_per_device, 2, timeout=60)
with viz.folded_output("▶ The third run"):
    print("each rank's (group backend, backend for cpu tensors, sum):", per_device)
    claim("a group made with the device:backend string 'cpu:gloo' sends CPU tensors through "
          "gloo (ProcessGroupGloo) on both ranks, and all_reduce gave 1 + 2",
          per_device == [("cpu:gloo", "ProcessGroupGloo", 3.0)] * 2, per_device=per_device)

# %% [markdown]
# ## Summary
#
# - Lessons prove what they say: every ✔ line is a claim computed on this run, and what they
#   could only read in torch's source is marked so and cited; labs check your code and name
#   your mistake in one sentence.
# - `dpcourse.devices` picks one of three profiles (`cpu`, `one-gpu`, `multi-gpu`); the lessons
#   are written to give the same checked results on each, and NCCL is used only when every
#   rank owns a GPU. The stored outputs come from the `cpu` profile; the multi-GPU path's tests
#   have not yet been run on a multi-GPU machine.
# - `dpcourse.launch.spawn` runs ranks from a notebook: results come back in rank order, a
#   crash or a hang becomes one clear error, and nothing is left running.
# - Every lesson from 01 on has a *parameters* cell, so it can be re-run at a bigger scale with
#   [papermill](https://papermill.readthedocs.io) without editing it, e.g.
#   `papermill lessons/01_single_device.ipynb out.ipynb -p dataset cifar10 -p epochs 10`.
#
# Next: open `01_single_device.ipynb`.
#
# ## Check yourself
#
# **▶ The quiz** — run the folded cell below and answer in the widget (or read its output,
# where the answers are folded).

# %% jupyter={"source_hidden": true}
from dpcourse import quizzes, viz

viz.quiz(quizzes.questions("00"))

# %% [markdown]
# **▶ For maintainers and the curious: where the course has run, and how its outputs are
# tested** (a folded note: click to open).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# Every lesson runs on a CPU-only machine: that is where its stored outputs were made and where
# the tests run them. On one NVIDIA H100, but under that machine's older torch 2.11,
# `python -m dpcourse doctor --run` ran every lesson and solution: most matched their stored
# outputs, and lesson 03 and lab 08 failed on names newer than 2.11 (the README's "What has run
# where" has the full record; `dpcourse.versions.TRIED` keeps it too). The multi-GPU path
# (NCCL, one GPU per rank) is written and has its own tests (`tests/test_gpu.py`,
# `doctor --run`), but they have not yet been run on a multi-GPU machine. The continuous
# integration re-runs every notebook and compares every output except those marked
# `# NBVAL_IGNORE_OUTPUT` (timings and hardware, each with its reason).
#
# </details>

# %% [markdown]
# ## Sources
#
# Statements about PyTorch in this lesson, checked in the installed torch 2.14.1 (paths
# relative to `site-packages`):
#
# - `torch/distributed/distributed_c10d.py` — `init_process_group`: the backend argument, and
#   `BackendConfig`, which parses a single name (`"gloo"`: every device type it supports) or
#   `"<device_type>:<backend>,..."` pairs (`"cpu:gloo,cuda:nccl"`) into one backend per device
#   type.
# - `torch/distributed/distributed_c10d.py` — `Backend.default_device_backend_map` (`"cpu":
#   gloo`, `"cuda": nccl`) and `Backend.backend_capability` (gloo: cpu and cuda; nccl: cuda
#   only). Both list device types, not collectives: which collectives gloo runs on GPU tensors,
#   and when it moves them through the CPU's memory (without GPUDirect), is lesson 03's (a
#   claim there, and its Sources).
# - `torch/distributed/distributed_c10d.py` — `_create_nccl_process_group` first raises
#   `RuntimeError("Distributed package doesn't have NCCL built in")` when
#   `is_nccl_available()` is false (a torch built without NCCL, such as the CPU-only wheel),
#   else builds `ProcessGroupNCCL`, whose constructor raises "ProcessGroupNCCL is only
#   supported with GPUs, no GPUs found!" on a machine without GPUs (shown above with
#   `"cuda:nccl,cpu:gloo"`: `_new_process_group_helper` makes the backends in the string's
#   order, so NCCL's refusal comes before gloo connects; the claim there follows the build).
#   `init_process_group`'s docstring, `device_id`: only with it is NCCL's communicator formed
#   at once "rather than the normal lazy call" (the `eager_connect_single_device` call near the
#   end of `_new_process_group_helper`). `ProcessGroup._get_backend(device)` (used in the same
#   file, e.g. in `_get_process_group_uid`; the appendix's third run calls it): the backend
#   serving one device type in a group.
# - `torch/distributed/rendezvous.py` — `_env_rendezvous_handler` (the `env://` default, reading
#   MASTER_ADDR and MASTER_PORT) calls `_create_c10d_store`, where `start_daemon = rank == 0`:
#   rank 0 hosts the `TCPStore` the ranks meet at (the figure above).
# - `torch/multiprocessing/spawn.py` — `spawn`: its `fn` "must be defined at the top level of a
#   module so it can be pickled and spawned": pickled by name, as a notebook cell's function is
#   (`__main__.hello`), it is looked up in the child's `__main__`, which is not the notebook:
#   the notebook's `__main__` has neither a file nor a module name the child could re-import
#   (Python's own `multiprocessing/spawn.py`, `get_preparation_data`, passes
#   `init_main_from_name` only when `__main__.__spec__` names a module, `init_main_from_path`
#   only when it has a `__file__`); hence
#   `dpcourse.launch.spawn` ships it with cloudpickle (`lib/dpcourse/launch.py`: `spawn`'s
#   `cloudpickle.dumps`, `worker_entry`'s `cloudpickle.loads(payload)` in each rank, both found
#   by a claim above; its processes start by `forkserver`; the claim before them shows pickle by
#   name failing where cloudpickle's by-value copy loads; `worker_entry` sends a rank's result,
#   then waits on `release_conn.recv_bytes()` until every rank is done, also found by a claim
#   and shown folded). `start_processes` also offers
#   `start_method="fork"`, whose children inherit the parent's functions.
# - `torch/distributed/constants.py` — `default_pg_timeout` (`_DEFAULT_PG_TIMEOUT`, 30
#   minutes, claimed) and `default_pg_nccl_timeout` (10 minutes);
#   `torch/distributed/distributed_c10d.py` — `_get_default_timeout(backend)`: the NCCL one for
#   NCCL, `default_pg_timeout` for every other backend (gloo), when `init_process_group` is
#   given no `timeout` (its docstring: the timeout "for operations executed against the process
#   group"). gloo's TCP transport: a peer whose process exits closes its
#   sockets, and the waiting rank fails within seconds ("Connection closed by peer", lesson 10).
# - `nvidia/nccl/lib/libnccl.so.2` (NCCL 2.30.7, the `nvidia-nccl-cu13` wheel torch depends on) —
#   NCCL's refusal of two ranks on one GPU is a check inside the NCCL library, not in torch's
#   Python; its error reads "Multiple Ranks are using the same GPU/Partition. Set
#   NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this configuration." (the appendix's folded "second run"
#   checks only that this message is in the installed library; that NCCL refuses by default
#   and the variable lifts the refusal is read from the message, not run): a default, not an
#   absolute rule. (Older NCCL releases said "Duplicate GPU detected".)
