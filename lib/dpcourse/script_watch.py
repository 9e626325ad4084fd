"""Inside each rank of ``python -m dpcourse diagnose script.py``: what the learner's script does,
recorded. :class:`Watch` wraps a few torch calls for the time of the run — never the learner's
file — and writes one JSON line per event to a file per rank (samplers and loaders and what ran
while they were read, saves, barriers and small reductions, printed or logged losses, metrics
writers, optimizer steps, the process group's end); :func:`read_events` reads every rank's
file back. What the events mean is judged by :func:`dpcourse.script_checks.analyze`.

Shown in lesson 10, §5 (through :mod:`dpcourse.script_checks`, which re-exports these names).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import importlib.abc
import importlib.util
import json
import logging
import os
import re
import sys
import traceback
from pathlib import Path


# metrics writers that belong on one rank: module -> (its attribute that starts one, what it is).
# None of them is a course dependency: Watch wraps one only if the script imports it.
WRITERS = {"torch.utils.tensorboard": ("SummaryWriter", "a TensorBoard SummaryWriter"),
           "tensorboardX": ("SummaryWriter", "a tensorboardX SummaryWriter"),
           "wandb": ("init", "a wandb run (wandb.init)")}

# frames that are not the learner's: torch, this library, the runners between
_NOT_USER = (f"{os.sep}torch{os.sep}", f"{os.sep}dpcourse{os.sep}", "runpy.py",
             f"{os.sep}logging{os.sep}", f"{os.sep}threading.py",
             f"{os.sep}multiprocessing{os.sep}", f"{os.sep}concurrent{os.sep}", "<frozen")


def _where() -> str:
    """file:line of the innermost frame of the learner's own code — and, when that frame is
    inside one of the learner's functions, the line that called it ("x.py:16, called from
    x.py:25"): a barrier inside a helper is fixed where the helper is called."""
    mine = [f for f in traceback.extract_stack()[:-1]
            if not any(s in f.filename for s in _NOT_USER)]
    if not mine:
        return "?"
    inner = f"{Path(mine[-1].filename).name}:{mine[-1].lineno}"
    if len(mine) > 1 and mine[-1].name not in ("<module>", "main"):
        return f"{inner}, called from {Path(mine[-2].filename).name}:{mine[-2].lineno}"
    return inner


# --- inside each rank: what the script does -------------------------------------------------


class Watch:
    """Records, in one rank, the events :func:`analyze` needs, as JSON lines in ``path``.
    ``with watch.installed():`` wraps the torch calls for the block and restores them after."""

    def __init__(self, path, rank: int, world_size: int):
        self.path, self.rank, self.world_size = str(path), rank, world_size
        self._file = open(self.path, "a", buffering=1)
        self._reading = None       # the DataLoader being iterated, and its record
        self._seq = 0              # how many loader reads have started
        self._steps = 0
        self._printed = False
        self._reduced_at: set[str] = set()  # the lines whose all_reduce was recorded

    def event(self, kind: str, **data) -> None:
        self._file.write(json.dumps({"kind": kind, "rank": self.rank, **data}) + "\n")

    # each wrapper records, then calls torch's own function unchanged

    def _sampler_iter(self, real):
        watch = self

        def __iter__(sampler):
            import torch

            reading = watch._reading
            watch.event("sampler", id=id(sampler), epoch=int(getattr(sampler, "epoch", 0)),
                        shuffle=bool(getattr(sampler, "shuffle", False)),
                        drop_last=bool(getattr(sampler, "drop_last", False)),
                        replicas=int(getattr(sampler, "num_replicas", 1)),
                        seed=int(getattr(sampler, "seed", 0)), dataset=id(sampler.dataset),
                        size=len(sampler.dataset), grad=torch.is_grad_enabled(),
                        seq=reading["seq"] if reading else None, where=_where())
            return real(sampler)

        return __iter__

    def _set_epoch(self, real):
        watch = self

        def set_epoch(sampler, epoch):
            watch.event("set_epoch", id=id(sampler), epoch=int(epoch), where=_where())
            return real(sampler, epoch)

        return set_epoch

    def _loader_iter(self, real):
        watch = self

        def __iter__(loader):
            watch._close_reading()
            sampler = getattr(loader, "sampler", None)
            watch._seq += 1
            watch._reading = {"id": id(loader), "sampler": type(sampler).__name__,
                              "size": _len(getattr(loader, "dataset", None)),
                              "where": _where(), "backward": 0, "seq": watch._seq}
            return real(loader)

        return __iter__

    def _close_reading(self) -> None:
        if self._reading is not None:
            self.event("loader", **self._reading)
            self._reading = None

    def _backward(self, real):
        watch = self

        def backward(tensor, *args, **kwargs):
            if watch._reading is not None:
                watch._reading["backward"] += 1
            return real(tensor, *args, **kwargs)

        return backward

    def _save(self, real):
        watch = self

        def save(obj, f, *args, **kwargs):
            path = os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else None
            watch.event("save", path=path, prefixed=_module_prefixed(obj), where=_where())
            return real(obj, f, *args, **kwargs)

        return save

    def _reported(self, text: str) -> None:
        if re.search(r"\b(loss|acc(uracy)?)\b\D{0,20}\d", text, re.I):
            self.event("print", where=_where())

    def _print(self, real):
        watch = self

        def print_(*args, **kwargs):
            watch._reported(" ".join(map(str, args)))
            return real(*args, **kwargs)

        return print_

    def _log(self, real):
        watch = self

        def _log(logger, level, msg, args, *rest, **kwargs):
            try:
                watch._reported(str(msg) % args if args else str(msg))
            except Exception:  # a message its arguments do not fit: logging says so itself
                pass
            return real(logger, level, msg, args, *rest, **kwargs)

        return _log

    def _init(self, real):
        watch = self

        def init_process_group(*args, **kwargs):
            watch.event("init", where=_where())
            return real(*args, **kwargs)

        return init_process_group

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._steps += 1
        if self._steps == 1:
            digest = hashlib.sha256()
            for group in optimizer.param_groups:
                for p in group["params"]:
                    digest.update(p.detach().cpu().contiguous().numpy().tobytes())
            self.event("first_step", digest=digest.hexdigest(), where=_where())

    def _collective(self, call) -> None:
        if call.op == "barrier" or call.function == "monitored_barrier":
            self.event("barrier", where=_where())
            return
        if call.op in ("all_reduce", "reduce") and 0 < call.numel <= 4:
            self.event("small_reduce", where=_where())
        if call.function == "all_reduce":
            where = _where()
            if where not in self._reduced_at:  # once per line: a loop calls it every step
                self._reduced_at.add(where)
                self.event("reduce", where=where)

    def _writer(self, real, what: str):
        watch = self

        def start(*args, **kwargs):
            watch.event("writer", what=what, where=_where())
            return real(*args, **kwargs)

        return start

    def _wrap_writer(self, module_name: str, module, saved: list) -> None:
        """Wrap the writer ``module`` starts (a class's ``__init__``, or a function), to be
        put back from ``saved`` after the run."""
        attr, what = WRITERS[module_name]
        target = getattr(module, attr, None)
        if target is None:
            return
        if isinstance(target, type):  # a class: its __init__ starts the writer
            saved.append((target, "__init__", target.__init__))
            target.__init__ = self._writer(target.__init__, what)
        else:
            saved.append((module, attr, target))
            setattr(module, attr, self._writer(target, what))

    @contextlib.contextmanager
    def installed(self):
        import torch
        import torch.distributed as dist
        import torch.utils.data as data
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from .collectives import record_collectives

        patches = [(data.DistributedSampler, "__iter__",
                    self._sampler_iter(data.DistributedSampler.__iter__)),
                   (data.DataLoader, "__iter__", self._loader_iter(data.DataLoader.__iter__)),
                   (torch.Tensor, "backward", self._backward(torch.Tensor.backward)),
                   (torch, "save", self._save(torch.save)),
                   (builtins, "print", self._print(builtins.print)),
                   (logging.Logger, "_log", self._log(logging.Logger._log)),
                   (data.DistributedSampler, "set_epoch",
                    self._set_epoch(data.DistributedSampler.set_epoch)),
                   (dist, "init_process_group", self._init(dist.init_process_group))]
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        hook = register_optimizer_step_post_hook(self._after_step)
        writers: list = []  # what the metrics writers' wrappers replaced
        finder = _AfterImport(WRITERS, lambda name, module: self._wrap_writer(name, module,
                                                                             writers))
        error = False
        try:
            for owner, name, wrapper in patches:
                setattr(owner, name, wrapper)
            for name in WRITERS:  # imported before the script ran: wrap now, else on import
                if name in sys.modules:
                    self._wrap_writer(name, sys.modules[name], writers)
            sys.meta_path.insert(0, finder)
            with record_collectives(before=self._collective):
                yield self
        except BaseException:
            error = True
            raise
        finally:
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            for owner, name, original in [*saved, *reversed(writers)]:
                setattr(owner, name, original)
            hook.remove()
            self.finish(error)

    def finish(self, error: bool = False) -> None:
        """After the script: the last loader read, whether the group is still up, the steps,
        and whether the script ended with an exception (then what it never reached is not a
        finding)."""
        import torch.distributed as dist

        self._close_reading()
        self.event("end", initialized=dist.is_available() and dist.is_initialized(),
                   steps=self._steps, error=error)
        self._file.close()


class _AfterImport(importlib.abc.MetaPathFinder):
    """An import hook: when one of ``names`` is imported, ``patch(name, module)`` runs right
    after the module's own code, before the importer gets it."""

    def __init__(self, names, patch):
        self.names, self.patch, self._finding = set(names), patch, False

    def find_spec(self, name, path=None, target=None):
        if name not in self.names or self._finding:
            return None
        self._finding = True  # let the other finders answer for the real module
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        real_exec, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            real_exec(module)
            patch(name, module)

        spec.loader.exec_module = exec_module
        return spec


def _len(obj) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


def _module_prefixed(obj) -> bool:
    """True when ``obj`` is a state_dict (or holds one) whose keys all start with ``module.``:
    the DDP wrapper's, which a plain model will not load."""
    if not isinstance(obj, dict) or not obj:
        return False
    keys = [k for k in obj if isinstance(k, str)]
    if keys and len(keys) == len(obj) and all(k.startswith("module.") for k in keys):
        return True
    return any(_module_prefixed(v) for v in obj.values() if isinstance(v, dict))


# --- after the run: every rank's events together ---------------------------------------------


def read_events(directory, world_size: int) -> dict[int, list[dict]]:
    out = {}
    for r in range(world_size):
        p = Path(directory) / f"rank{r}.events"
        events = []
        for line in (p.read_text().splitlines() if p.exists() else []):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:   # a line cut short by a kill
                pass
        out[r] = events
    return out
