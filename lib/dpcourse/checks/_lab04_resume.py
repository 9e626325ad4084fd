"""Lab 04's stretch: resume after a crash. ``check_resume`` trains a model with dropout, each
rank drawing from its own random stream, "crashes" it after epoch 1 and resumes it with the
learner's ``save_training_state`` and ``resume_training_state``; it compares each rank's weights,
momentum and generator state after the resume with what that rank had at the crash, so a mistake
is named by its cause (the optimizer or the weights restored on rank 0 only, rank 0's generator
state given to every rank ...), refuses a checkpoint holding the DDP wrapper's weights or a file
written by another rank, and compares the final weights with an uninterrupted run. Then it
stops one save halfway (a file-size limit, as a crash or a full disk stops a write) and refuses
a save that leaves no readable checkpoint at the path, and one that rewrote the checkpoint in
its own file (the same inode before and after): lesson 04 §3's non-atomic save. The ranks have
no GPU, so torch.cuda's random-state functions act on stand-in GPUs while the learner's code
runs (:mod:`dpcourse.checks._lab04_fakecuda`), and each rank must get its own GPUs' states back.

Imported by :mod:`dpcourse.checks.lab04`, where the lab calls it. The judges that read the runs
(and the mistakes they name) are in :mod:`dpcourse.checks._lab04_resume_judge`.
"""

from __future__ import annotations

import functools
import os
import tempfile

from dpcourse.checks import check_timeout, fail, passed, recorded, require_answer, run_ranks
from dpcourse.checks._lab04_fakecuda import FakeCuda
from dpcourse.checks._lab04_resume_judge import (_CRASH_AFTER, RESUME_FIXES, RESUME_MISTAKES,
                                                 RESUME_PLAN_QUESTION, RESUME_PLANS,
                                                 _judge_atomic, _judge_cuda, _judge_first_run,
                                                 _judge_resume, _judge_uninterrupted,
                                                 _resume_cause, _reveal_plan)
from dpcourse.checks._lab04_script import Lab04Config

__all__ = ["check_resume", "RESUME_MISTAKES", "RESUME_FIXES", "RESUME_CFG", "RESUME_PLANS",
           "RESUME_PLAN_QUESTION", "resume_runs", "judge_resume_runs"]


# --- stretch: resume after a crash ---------------------------------------------------------

# 128 images: 2 steps per epoch; every mistake shows at the first step (the states compared at
# the crash, and the final weights), and each step of each run costs the learner's check time
RESUME_CFG = Lab04Config(epochs=3, n_train=128)
RESUME_DROPOUT = 0.3  # the stretch's model draws dropout masks: each rank from its own stream


def _resume_worker(rank, world_size, save_fn, resume_fn, ckpt, stop_after, cfg):
    """One rank of the stretch's DDP training (dropout, each rank its own random stream), with
    the learner's save and resume around it (``None``: the uninterrupted reference run)."""
    __tracebackhide__ = True
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from dpcourse import models

    torch.set_num_threads(1)
    writes = _WriteLog(os.path.dirname(ckpt))
    real_save = torch.save

    def logged_save(obj, f, *a, **k):
        # a path, or a file opened by name; not a buffer in memory (all_gather_object pickles
        # into one). torch.save to a path opens it in C++, where no audit event reports it.
        name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        if isinstance(name, (str, os.PathLike)):
            writes.append(str(name))
        return real_save(obj, f, *a, **k)

    train_set = _train_set(cfg.n_train, cfg.seed)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.global_batch // world_size, sampler=sampler,
                        drop_last=True)
    torch.manual_seed(cfg.seed)
    model = DDP(models.SmallCNN(width=cfg.width, dropout=RESUME_DROPOUT))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    torch.manual_seed(cfg.seed + 1 + rank)  # each rank draws its own dropout masks
    seeded = torch.get_rng_state()
    # stand-in GPUs (world_size per rank, this rank's own current), seeded as manual_seed would
    gpus = FakeCuda(world_size, rank, cfg.seed + 1 + rank)
    cuda_seeded = gpus.states()
    start = 0
    resume_set = False
    if resume_fn is not None:
        real_set_rng = torch.random.set_rng_state

        def guarded_set_rng(new_state):
            # torch 2.14 reads a CPU generator state from the start of its storage: a row of a
            # stacked tensor (storage offset > 0) crashed the process (SIGSEGV) when tried
            if torch.is_tensor(new_state) and new_state.storage_offset() != 0:
                raise ValueError(f"torch.set_rng_state was given a view into a larger tensor "
                                 f"(storage offset {new_state.storage_offset()}), which crashes "
                                 f"torch: pass a tensor of its own (.clone())")
            return real_set_rng(new_state)

        torch.set_rng_state = torch.random.set_rng_state = guarded_set_rng
        try:
            with gpus.installed(resume_fn):
                start = resume_fn(ckpt, model, opt)
        finally:
            torch.set_rng_state = torch.random.set_rng_state = real_set_rng
        resume_set = gpus.set
        if isinstance(start, torch.Tensor) and start.numel() == 1:
            start = int(start.item())
        if not isinstance(start, int) or isinstance(start, bool):
            return {"error": f"resume_training_state returned {type(start).__name__}, not the "
                             f"epoch to start at (an int)"}
    resumed = _snapshot(model, opt, gpus)
    epochs_run, crashed, orders = [], None, {}
    save_got = False
    in_place = []  # (epoch, inode): rank 0's save rewrote the file where it stood
    torch.save = logged_save
    try:
        for epoch in range(start, cfg.epochs):
            sampler.set_epoch(epoch)
            orders[epoch] = list(sampler)
            for X, y in loader:
                loss = torch.nn.functional.cross_entropy(model(X), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                gpus.draw()  # on a GPU, dropout's masks come from this rank's GPU's generator
            epochs_run.append(epoch)
            if save_fn is not None:
                before = _identity(ckpt)
                gpus.got = False
                with writes, gpus.installed(save_fn):
                    save_fn(ckpt, model, opt, epoch, rank == 0)
                save_got = save_got or gpus.got
                after = _identity(ckpt)
                if rank == 0 and after is not None and after != before:
                    writes.append(ckpt)  # the file changed, however rank 0 wrote it
                    if before is not None and after[:2] == before[:2]:
                        in_place.append((epoch, after[1]))
            dist.barrier()  # rank 0's file is complete before anyone "crashes"
            if epoch == stop_after:
                crashed = _snapshot(model, opt, gpus)
                break
    finally:
        torch.save = real_save
    return {"start": start, "epochs": epochs_run, "writes": list(writes), "resumed": resumed,
            "crashed": crashed, "seeded": seeded, "orders": orders, "in_place": in_place,
            "cuda_seeded": cuda_seeded, "save_got": save_got, "resume_set": resume_set,
            "weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}


@functools.lru_cache(maxsize=4)
def _train_set(n_train: int, seed: int):
    """The runs' training images (the same in every run: made once per process, which a batch
    of runs shares; nothing writes into them)."""
    from dpcourse import data

    ds = data.load("shapes10", n_train=n_train, n_test=10, seed=seed)
    return data.to_torch(ds.x_train, ds.y_train)


def _identity(path):
    """(device, inode, size, mtime) of ``path``, or None where there is no file: a file
    replaced by a rename gets another inode; one rewritten where it stands keeps its own."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class _WriteLog(list):
    """The files a rank writes in ``folder`` while the block runs: opened for writing (by
    Python: open, os.open, tempfile) or the target of a rename, read from Python's audit
    events. The hook stays installed (audit hooks cannot be removed) but records only inside
    the block; the rank's process ends with the run."""

    _WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def __init__(self, folder: str):
        import sys

        super().__init__()
        self.folder = os.path.realpath(folder)
        self.armed = False
        sys.addaudithook(self._hook)

    def __enter__(self):
        self.armed = True
        return self

    def __exit__(self, *exc):
        self.armed = False

    def _inside(self, path) -> str | None:
        try:
            path = os.fsdecode(path)
        except TypeError:
            return None  # a file descriptor
        full = os.path.realpath(path)
        return full if os.path.dirname(full) == self.folder else None

    def _hook(self, event, args):
        if not self.armed:
            return
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writing = (any(c in mode for c in "wax+") if isinstance(mode, str)
                       else isinstance(flags, int) and bool(flags & self._WRITE))
            full = self._inside(path) if writing else None
        elif event in ("os.rename", "os.replace", "shutil.copyfile", "shutil.move"):
            full = self._inside(args[1]) if len(args) > 1 else None
        else:
            return
        if full is not None:
            self.armed = False  # list.append runs no audit event; this guards against re-entry
            try:
                self.append(full)
            finally:
                self.armed = True


def _crash_worker(rank, world_size, save_fn, folder, cfg):
    """A crash in the middle of a save, on one rank: the learner's ``save_training_state``
    writes a complete checkpoint (epoch 0), then saves again (epoch 1) while the file system
    refuses every write past half of that checkpoint's size (RLIMIT_FSIZE, with SIGXFSZ
    ignored, so the write raises instead of killing the process), as a crash or a full disk
    stops a write halfway. Returns what was at ``path`` afterwards."""
    __tracebackhide__ = True
    import signal

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse import models

    try:
        import resource
    except ImportError:  # not a POSIX system: the crash cannot be injected here
        return {"skipped": True}
    torch.set_num_threads(1)
    X, y = _train_set(cfg.global_batch, cfg.seed).tensors
    torch.manual_seed(cfg.seed)
    model = DDP(models.SmallCNN(width=cfg.width, dropout=RESUME_DROPOUT))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    torch.nn.functional.cross_entropy(model(X), y).backward()
    opt.step()  # momentum buffers exist, as in a real checkpoint
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "ckpt.pt")
    gpus = FakeCuda(world_size, rank, cfg.seed + 1 + rank)  # as in the runs: GPUs to read
    with gpus.installed(save_fn):
        save_fn(path, model, opt, 0, True)
    if not os.path.exists(path):
        return {"skipped": True}  # judged elsewhere: no file at path
    with open(path, "rb") as f:
        complete = f.read()
    before = _identity(path)
    removed = []  # os.remove / os.unlink of the checkpoint itself during the stopped save

    def hook(event, args):
        if event == "os.remove" and args and removed is not None:
            try:
                if os.path.realpath(os.fsdecode(args[0])) == os.path.realpath(path):
                    removed.append(True)
            except TypeError:
                pass

    import sys

    sys.addaudithook(hook)
    limit = max(1, len(complete) // 2)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    raised = None
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with gpus.installed(save_fn):
            save_fn(path, model, opt, 1, True)
    except Exception as exc:  # the write that the "crash" stopped
        raised = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    left = None
    if os.path.exists(path):
        with open(path, "rb") as f:
            left = f.read()
    readable = False
    if left is not None:
        try:
            torch.load(path, map_location="cpu", weights_only=False)
            readable = True
        except Exception:
            readable = False
    after = _identity(path)
    deleted, removed = bool(removed), None  # the hook records nothing more
    return {"size": len(complete), "limit": limit, "left": None if left is None else len(left),
            "same": left == complete, "readable": readable, "raised": raised,
            "deleted": deleted, "same_file": after is not None and after[:2] == before[:2]}


def _snapshot(model, opt, gpus) -> dict:
    """What a resume must restore on a rank: its weights, its momentum, its random state (the
    CPU generator's, and its stand-in GPUs' as (seed, offset) pairs)."""
    import torch

    momentum = [opt.state.get(p, {}).get("momentum_buffer") for p in model.parameters()]
    return {"weights": [p.detach().clone() for p in model.parameters()],
            "momentum": [None if m is None else m.detach().clone() for m in momentum],
            "rng": torch.get_rng_state(), "cuda": gpus.states()}


@recorded
def check_resume(save_training_state, resume_training_state, plan=None,
                 timeout: float | None = None) -> None:
    """Stretch: train 3 epochs on 2 ranks (dropout, each rank its own random stream), "crash"
    after epoch 1, run again: with your ``save_training_state`` and ``resume_training_state``
    every rank must continue exactly where it stopped (its weights, its momentum, its random
    state), the second run must do only epoch 2 and end within 1e-5 of the weights of an
    uninterrupted run; a right resume ends bit for bit with them (``timeout``: 90 s per run, or
    ``DPCOURSE_CHECK_TIMEOUT`` if more).
    A save stopped halfway (on one rank, by a file-size limit) must leave the previous
    checkpoint readable, and no save may rewrite the checkpoint in its own file.
    Meanwhile torch.cuda's random-state functions act on stand-in GPUs on each rank
    (:mod:`dpcourse.checks._lab04_fakecuda`), which each step's dropout moves on the rank's own
    GPU: after the resume every rank must hold its own GPUs' states from the crash.
    ``plan``: the learner's :func:`~dpcourse.checks.predict` of :data:`RESUME_PLAN_QUESTION`, compared once the code passes with what the runs showed.
    Each run is launched only when the judgement reaches it: a mistake the resumed run's own
    state names needs neither the uninterrupted run nor the stopped save."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, 90.0)
    for fn, name in ((save_training_state, "save_training_state"),
                     (resume_training_state, "resume_training_state")):
        require_answer(fn, name)
    with tempfile.TemporaryDirectory(prefix="dpcourse-lab04-resume-") as tmp:
        pair = [(save_training_state, resume_training_state, tmp)]
        first = _launch_runs("first", pair, timeout)[0]
        _no_error(first)
        _judge_first_run(first, os.path.join(tmp, "ckpt.pt"))
        # every later run is launched only when the judgement reaches it: a mistake named by
        # the resumed run's own state needs no uninterrupted run, nor a stopped save
        judge_resume_runs(first, lambda: _launch_runs("second", pair, timeout)[0],
                          lambda: _launch_runs("whole", pair, timeout)[0],
                          lambda: _launch_runs("crash", pair, timeout)[0], plan)


# each run of the stretch, as its sentences name it
_RUNS = {"first": "first run", "second": "run after the crash", "whole": "uninterrupted run",
         "crash": "stopped save"}


def _run_args(kind: str, save_fn, resume_fn, folder: str) -> tuple:
    """The ``_resume_worker`` (or ``_crash_worker``) arguments of run ``kind`` for one pair."""
    cfg = RESUME_CFG
    ckpt = os.path.join(folder, "ckpt.pt")
    if kind == "first":
        return save_fn, resume_fn, ckpt, _CRASH_AFTER, cfg
    if kind == "second":
        return save_fn, resume_fn, ckpt, None, cfg
    if kind == "whole":  # it saves too (elsewhere), so whatever saving does, both runs do
        return save_fn, None, os.path.join(folder, "uninterrupted.pt"), None, cfg
    return save_fn, os.path.join(folder, "crash"), cfg


def _resume_jobs(rank, world_size, jobs):
    """:func:`_resume_worker` for each job in turn, in one process group."""
    return [_resume_worker(rank, world_size, *job) for job in jobs]


def _crash_jobs(rank, world_size, jobs):
    """:func:`_crash_worker` for each job in turn, in one process."""
    return [_crash_worker(rank, world_size, *job) for job in jobs]


def _launch_runs(kind: str, pairs, timeout: float) -> list:
    """Run ``kind`` (first, second, whole or crash) for every (save, resume, folder) of
    ``pairs``, one after another in ONE launch; a list per pair of the ranks' results (the
    crash run's one result). The check passes one pair; the tests pass many (a launch costs
    more than the training it runs). A pair whose code raises or deadlocks stops the launch."""
    __tracebackhide__ = True
    jobs = [_run_args(kind, *pair) for pair in pairs]
    if not jobs:
        return []
    when = _RUNS[kind]
    if kind == "crash":
        per_rank = run_ranks(
            _crash_jobs, 1, jobs, timeout=timeout * len(jobs),
            hang=lambda exc: f"save_training_state did not finish within {timeout:g} s on one "
                             f"rank",
            failed=lambda exc: fail(f"your code raised in a run on one rank, where the check "
                                    f"stops a save halfway: {exc.summary}"))
        return list(per_rank[0])
    world_size = RESUME_CFG.world_size
    per_rank = run_ranks(
        _resume_jobs, world_size, jobs, timeout=timeout * len(jobs),
        hang=lambda exc: f"a run did not finish within {timeout:g} s: does a function "
                         f"call a collective (e.g. dist.barrier) on some ranks only?",
        failed=lambda exc: fail(f"your code raised on rank {exc.rank} in the {when}: "
                                f"{exc.summary}"))
    return [[per_rank[r][j] for r in range(world_size)] for j in range(len(jobs))]


def _no_error(run: list) -> None:
    __tracebackhide__ = True
    for r in run:
        if "error" in r:
            fail(r["error"] + ".")


def judge_resume_runs(first: list, second, whole, crash, plan=None) -> None:
    """Everything :func:`check_resume` judges once the first run passed: ``second``, ``whole``
    and ``crash`` are the other runs' results, or functions that launch them when the
    judgement needs them (the check launches each only then; the tests hand in a batch's)."""
    __tracebackhide__ = True
    cfg = RESUME_CFG
    second = second() if callable(second) else second
    _no_error(second)
    _judge_resume(first, second, cfg)
    whole = whole() if callable(whole) else whole
    _no_error(whole)
    _judge_uninterrupted(second, whole, cfg)
    crash = crash() if callable(crash) else crash
    _judge_atomic(crash, first[0]["in_place"])
    _judge_cuda(first, second)
    passed("resume after a crash: every rank continued with its own weights, momentum and "
           "random state, trained only the last epoch and ended with the weights of an "
           "uninterrupted run; a save stopped halfway left the previous checkpoint readable. "
           "Run on CPUs, with 2 stand-in GPUs on each rank behind torch.cuda's random-state "
           "functions: each rank got back the CUDA generator states it had at the crash")
    if plan is not None:
        _reveal_plan(plan, first, second, whole, cfg)


def resume_runs(pairs, folder: str, timeout: float = 90.0) -> list:
    """The tests' batch: every run of :func:`check_resume` for each (save, resume) of ``pairs``,
    in four launches in all (first runs, runs after the crash, uninterrupted runs, stopped
    saves), each pair in its own subfolder of ``folder``. For pairs whose first run passes
    and whose code raises nowhere; returns per pair a dict of ``first``, ``second``, ``whole``,
    ``crash`` for :func:`judge_resume_runs`."""
    __tracebackhide__ = True
    triples = []
    for i, (save_fn, resume_fn) in enumerate(pairs):
        sub = os.path.join(folder, f"pair{i}")
        os.makedirs(sub, exist_ok=True)
        triples.append((save_fn, resume_fn, sub))
    runs = {"first": _launch_runs("first", triples, timeout)}
    for run, (_, _, sub) in zip(runs["first"], triples):
        _no_error(run)
        _judge_first_run(run, os.path.join(sub, "ckpt.pt"))
    runs["second"] = _launch_runs("second", triples, timeout)
    # as in check_resume, a pair whose resumed run names its mistake needs no more runs; an
    # uninterrupted run depends on the save alone (no resume): one per save function
    later = [i for i, (first, second) in enumerate(zip(runs["first"], runs["second"]))
             if not any("error" in r for r in second) and _resume_cause(first, second) is None]
    saves = list({id(triples[i][0]): i for i in reversed(later)}.values())
    whole = dict(zip(saves, _launch_runs("whole", [triples[i] for i in saves], timeout)))
    crash = dict(zip(later, _launch_runs("crash", [triples[i] for i in later], timeout)))
    by_save = {id(triples[i][0]): whole[i] for i in saves}
    return [{"first": runs["first"][i], "second": runs["second"][i],
             "whole": by_save.get(id(triples[i][0])) if i in later else None,
             "crash": crash.get(i)} for i in range(len(triples))]
