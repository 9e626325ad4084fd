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

Imported by :mod:`dpcourse.checks.lab04`, where the lab calls it.
"""

from __future__ import annotations

import functools
import os
import tempfile

from dpcourse.checks import check_timeout, fail, passed, recorded, require_answer, run_ranks
from dpcourse.checks._lab04_fakecuda import FakeCuda
from dpcourse.checks._lab04_script import Lab04Config, _distance, _mistake

__all__ = ["check_resume", "RESUME_MISTAKES", "RESUME_FIXES", "RESUME_CFG", "RESUME_PLANS",
           "RESUME_PLAN_QUESTION", "resume_runs", "judge_resume_runs"]


# --- stretch: resume after a crash ---------------------------------------------------------

# 128 images: 2 steps per epoch; every mistake shows at the first step (the states compared at
# the crash, and the final weights), and each step of each run costs the learner's check time
RESUME_CFG = Lab04Config(epochs=3, n_train=128)
RESUME_DROPOUT = 0.3  # the stretch's model draws dropout masks: each rank from its own stream
# The resumed run and the uninterrupted one are the same 2-rank DDP computation (one thread per
# rank), so a right resume ends with bit-identical weights; the bound only absorbs a kernel
# that is not deterministic. Every resume mistake lands 1e-3 or more away.
RESUME_TOL = 1e-5
_CRASH_AFTER = 1  # the first run stops after epoch 1 of 0, 1, 2 (as if killed right then)

# The stretch's decision, recorded before the code: the least a resumed run must restore, on
# the check's loop (CPU, dropout, each rank seeded seed + 1 + rank), to continue bit for bit.
RESUME_PLAN_QUESTION = "the least a resume must restore to continue bit for bit (the check's loop)"
_W = "weights, optimizer state, epoch"
RESUME_PLANS = (
    _W,
    f"{_W}, the data order",
    f"{_W}, rank 0's random state",
    f"{_W}, each rank's random state",
    f"{_W}, each rank's random state, the data order",
)

RESUME_MISTAKES = {  # the cause; what to change is in RESUME_FIXES (the second meeting)
    "wrapper_keys": "The checkpoint holds the DDP wrapper's weights (their keys start with "
                    "'module.'), though the task says to save the unwrapped weights: a plain "
                    "model, for evaluation or a run without DDP, cannot load them.",
    "no_optimizer": "The optimizer's state was not restored: SGD's momentum restarted from zero "
                    "after the crash.",
    "optimizer_rank0": "The optimizer's state was restored on rank 0 only: the other ranks' "
                       "momentum restarted from zero, and every rank steps its own copy of the "
                       "weights with its own optimizer, so the ranks drift apart.",
    "repeat_epoch": "The resumed run repeated the epoch it had already finished.",
    "from_zero": "The resumed run started again at epoch 0 (with the saved weights).",
    "no_weights": "The resumed run continued from fresh weights.",
    "weights_rank0": "The weights were restored on rank 0 only: the other ranks continued from "
                     "fresh weights. DDP copies rank 0's weights to the others when it wraps "
                     "the model, not when you load them later.",
    "no_rng": "The ranks' random state was not restored: after the crash, dropout drew masks "
              "the uninterrupted run never drew, so the weights differ.",
    "rng_rank0": "After the resume rank 1's random generator held rank 0's state at the crash, "
                 "not the state rank 1 itself had: from then on rank 1 draws the dropout masks "
                 "rank 0 draws, which the uninterrupted run never did.",
}
RESUME_FIXES = {
    "wrapper_keys": "Save model.module.state_dict().",
    "no_optimizer": "Save optimizer.state_dict() and load it back.",
    "optimizer_rank0": "Load the optimizer's state on every rank.",
    "repeat_epoch": "Return the first epoch still to do, the saved epoch + 1.",
    "from_zero": "Return the first epoch still to do, the saved epoch + 1.",
    "no_weights": "Load the saved model weights (model.module.load_state_dict(...)).",
    "weights_rank0": "Load the weights on every rank.",
    "no_rng": "Save each rank's random number generator state and restore it.",
    "rng_rank0": "Each rank has a random stream of its own: make the one file hold every "
                 "rank's random state, and each rank restore its own.",
}


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


def _same(a, b) -> bool:
    import torch

    if a is None or b is None:
        return a is None and b is None
    return all(x is not None and y is not None and x.shape == y.shape and torch.equal(x, y)
               for x, y in zip(a, b)) and len(a) == len(b)


def _wrapper_keys(state) -> bool:
    """True if the checkpoint holds a state_dict saved from the DDP wrapper ('module.' keys)."""
    if isinstance(state, dict):
        if any(isinstance(k, str) and k.startswith("module.") for k in state):
            return True
        return any(_wrapper_keys(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(_wrapper_keys(v) for v in state)
    return False


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


def _reveal_plan(plan, first, second, whole, cfg) -> None:
    """Compare the learner's recorded plan with the least the runs showed a resume needs."""
    import torch

    from dpcourse.checks import reveal

    last = cfg.epochs - 1
    moved = [not torch.equal(r["crashed"]["rng"], r["seeded"]) for r in first]
    own = not torch.equal(first[0]["crashed"]["rng"], first[1]["crashed"]["rng"])
    same_order = all(a["orders"].get(last) == b["orders"].get(last)
                     for a, b in zip(second, whole))
    needed = _W
    if any(moved):
        needed += ", each rank's random state" if own else ", rank 0's random state"
    if not same_order:
        needed += ", the data order"
    reveal(plan, needed, close=plan.value == needed, explanation=(
        f"The weights and the optimizer's momentum are the same on every rank, and the epoch "
        f"says where to start. The check's model has dropout, and each rank was seeded "
        f"{cfg.seed} + 1 + rank: at the crash the ranks' generators had moved from their seeded "
        f"start ({', '.join('yes' if m else 'no' for m in moved)}) and differed from each other "
        f"({'yes' if own else 'no'}), so each rank needs its own state back; rank 0's alone "
        f"makes rank 1 draw rank 0's masks. The data order needs nothing saved: "
        f"DistributedSampler shuffles with seed + epoch, and set_epoch({last}) dealt "
        f"{'the same' if same_order else 'other'} indices in the resumed run as in the "
        f"uninterrupted one. On GPUs, dropout on CUDA tensors draws from the GPU's own "
        f"generator: that state is part of 'each rank's random state' there."))


def _gpu_states(states) -> str:
    return ", ".join(f"GPU {i}: seed {seed}, offset {offset}"
                     for i, (seed, offset) in enumerate(states))


_CUDA_FIX = ("save each rank's torch.cuda.get_rng_state_all() beside its CPU state (in the list "
             "that reaches rank 0) and give each rank its own back with "
             "torch.cuda.set_rng_state_all(...).")


def _judge_cuda(first: list, second: list) -> None:
    """Fail unless every rank's stand-in GPUs (:mod:`dpcourse.checks._lab04_fakecuda`) hold,
    after the resume, the states that rank's GPUs had at the crash: on GPUs, dropout draws
    from each device's own generator, which torch.get_rng_state does not hold. The check
    stood them in behind torch.cuda's random-state functions while the learner's code ran."""
    __tracebackhide__ = True
    missing = [what for called, what in
               (((any(r["save_got"] for r in first) or any(r["save_got"] for r in second)),
                 "save_training_state reads"),
                (any(r["resume_set"] for r in second), "resume_training_state restores"))
               if not called]
    if missing:
        fail(f"On these CPU ranks your resume is exact. But {' and '.join(missing)} no state of "
             f"CUDA's generators (torch.cuda's get_rng_state / set_rng_state or their _all "
             f"forms; the check stood in {len(first)} GPUs on each rank behind those functions "
             f"while your code ran, and it never called them): on GPUs, dropout on a CUDA "
             f"tensor draws its masks from the generator of the GPU it runs on, one per device, "
             f"not from the CPU generator that torch.get_rng_state holds, so a resumed GPU run "
             f"would draw masks the uninterrupted run never drew.", fix=_CUDA_FIX)
    crashed = [r["crashed"]["cuda"] for r in first]
    wrong = [rank for rank, r in enumerate(second) if r["resumed"]["cuda"] != crashed[rank]]
    if not wrong:
        return
    rank = wrong[0]
    got = second[rank]["resumed"]["cuda"]
    donors = [other for other in range(len(first)) if other != rank and got == crashed[other]]
    if donors:
        fail(f"After the resume rank {rank}'s CUDA generators held rank {donors[0]}'s states "
             f"at the crash ({_gpu_states(got)}), not the ones rank {rank} itself had "
             f"({_gpu_states(crashed[rank])}): the check stood in {len(first)} GPUs on each "
             f"rank, seeded as torch.manual_seed seeds them and moved by each step's dropout on "
             f"the rank's own GPU. On GPUs, rank {rank} would from then on draw the dropout "
             f"masks rank {donors[0]} draws, which the uninterrupted run never did.",
             fix=_CUDA_FIX)
    fail(f"After the resume rank {rank}'s CUDA generators held {_gpu_states(got)}, not the "
         f"states they had at the crash ({_gpu_states(crashed[rank])}; seeded: "
         f"{_gpu_states(first[rank]['cuda_seeded'])}): the check stood in {len(first)} GPUs on "
         f"each rank, moved by each step's dropout on the rank's own GPU. On GPUs, rank {rank} "
         f"would draw dropout masks the uninterrupted run never drew.", fix=_CUDA_FIX)


_ATOMIC_FIX = ("write the checkpoint to a temporary file in the same folder and, once it is "
               "complete, os.replace it over path (one step, which a crash cannot split): "
               "dpcourse.ddp_practice.save_checkpoint does this.")


def _judge_atomic(crash: dict, in_place: list) -> None:
    """Fail if a save stopped halfway left no readable checkpoint at the path, or if rank 0
    rewrote the checkpoint where it stood (the same inode before and after, new contents)."""
    __tracebackhide__ = True
    if not crash.get("skipped") and not crash["same"] and not crash["readable"]:
        if crash["left"] is None:
            after, how = ("there was no file at path at all",
                          "the old file was deleted before the new one was complete")
        else:
            after = (f"the file at path held {crash['left']:,} bytes that torch.load cannot "
                     f"read")
            how = ("the old file was deleted before the new one was complete"
                   if crash["deleted"] else
                   "the old file was emptied and written again where it stood"
                   if crash["same_file"] else
                   "the old file was gone before the new one was complete")
        fail(f"A crash while saving destroys your checkpoint: the check let "
             f"save_training_state write a complete checkpoint ({crash['size']:,} bytes, epoch "
             f"0), then stopped its next save halfway, as a crash or a full disk would (the "
             f"file system refused writes past {crash['limit']:,} bytes). Afterwards "
             f"{after}, and epoch 0's complete checkpoint was gone: {how}, so a job killed "
             f"in that moment restarts from nothing (lesson 04, §3).", fix=_ATOMIC_FIX)
    if in_place:
        epoch, inode = in_place[0]
        fail(f"Rank 0's save at the end of epoch {epoch} rewrote the checkpoint where it stood: "
             f"the file at path was the same file (inode {inode}) before and after, with new "
             f"contents, so while it was being written it held part of a checkpoint, and a "
             f"crash in that moment leaves none to restart from (lesson 04, §3).",
             fix=_ATOMIC_FIX)


def _judge_first_run(first: list, ckpt: str) -> None:
    __tracebackhide__ = True
    import torch

    if first[0]["start"] != 0:
        fail(f"with no checkpoint yet, resume_training_state returned {first[0]['start']}: "
             f"where no file exists yet, so no epoch has been done.",
             fix="return 0 when the file does not exist (a fresh start).")
    for rank, r in enumerate(first[1:], 1):
        if r["writes"]:
            fail(f"rank {rank} wrote a file ({os.path.basename(r['writes'][0])}): ranks "
                 f"writing one file race, and that one file must hold what every rank needs.",
                 fix="only rank 0 writes, and only the one file at path.")
    if not first[0]["writes"]:
        fail("rank 0 saved nothing, so a crash would lose every finished epoch.",
             fix="save the checkpoint at the end of each epoch when is_main is true.")
    if not os.path.exists(ckpt):
        fail(f"no file at the path save_training_state was given ({os.path.basename(ckpt)}), "
             f"where resume_training_state will look.", fix="save the checkpoint there.")
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
    except Exception:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
    if _wrapper_keys(state):
        _mistake(RESUME_MISTAKES, RESUME_FIXES, "wrapper_keys")


def _judge_resume(first: list, second: list, cfg: Lab04Config) -> None:
    """The resumed run's own state against the crash: where it started, its weights, its
    momentum, its random state."""
    __tracebackhide__ = True
    cause = _resume_cause(first, second)
    if cause is not None:
        fail(cause[0], fix=cause[1])


def _mistaken(key: str) -> tuple:
    return RESUME_MISTAKES[key], RESUME_FIXES[key]


def _resume_cause(first: list, second: list):
    """(sentence, fix) of the first mistake the resumed run's own state shows, or None: what
    :func:`_judge_resume` refuses, without raising (the batch skips the runs it needs no more)."""
    starts = {r["start"] for r in second}
    if len(starts) != 1:
        return (f"after the crash the ranks would resume at different epochs {sorted(starts)}, "
                f"so their collectives would no longer pair up.",
                "make every rank read the same checkpoint.")
    start = starts.pop()
    if start == _CRASH_AFTER:
        return _mistaken("repeat_epoch")
    if start == 0:
        if not _same(second[0]["resumed"]["weights"], first[0]["crashed"]["weights"]):
            return ("After the crash the run started from scratch (epoch 0, fresh weights), "
                    "though the checkpoint file existed.",
                    "when the file exists, load it in resume_training_state and return the "
                    "first epoch still to do.")
        return _mistaken("from_zero")
    if start != _CRASH_AFTER + 1:
        return (f"after a crash at the end of epoch {_CRASH_AFTER}, resume_training_state "
                f"returned {start}, which is not the first epoch still to do.",
                f"return the first epoch still to do, {_CRASH_AFTER + 1}.")
    crashed = [r["crashed"] for r in first]
    for what, everywhere, rank0 in (("weights", "no_weights", "weights_rank0"),
                                    ("momentum", "no_optimizer", "optimizer_rank0")):
        wrong = [rank for rank, r in enumerate(second)
                 if not _same(r["resumed"][what], crashed[rank][what])]
        if wrong:
            return _mistaken(rank0 if 0 not in wrong else everywhere)
    import torch

    rng_wrong = [rank for rank, r in enumerate(second)
                 if not torch.equal(r["resumed"]["rng"], crashed[rank]["rng"])]
    if rng_wrong:
        if 0 not in rng_wrong and all(torch.equal(second[r]["resumed"]["rng"], crashed[0]["rng"])
                                      for r in rng_wrong):
            return _mistaken("rng_rank0")
        return _mistaken("no_rng")
    return None


def _judge_uninterrupted(second: list, whole: list, cfg: Lab04Config) -> None:
    """The resumed run's end against the uninterrupted run's."""
    __tracebackhide__ = True
    got, want = second[0]["weights"], whole[0]["weights"]
    d = _distance(got, want)
    if d > RESUME_TOL:
        fail(f"every rank resumed with its weights, momentum and random state, but the final "
             f"weights differ from an uninterrupted run by up to {d:.3g}.",
             fix="does resume_training_state change anything else (the learning rate, the "
                 "model)?")
    if second[0]["epochs"] != [cfg.epochs - 1]:
        fail(f"the weights are right, but the resumed run trained epochs "
             f"{second[0]['epochs']}, where only epoch {cfg.epochs - 1} was left to do.",
             fix="start the loop at the epoch resume_training_state returns.")
