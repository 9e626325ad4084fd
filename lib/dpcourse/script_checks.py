"""Run-time checks of a learner's own training script: the bug zoo turned on their code.

``python -m dpcourse diagnose script.py`` runs a torchrun-style script on N local ranks
(:func:`dpcourse.detectors.diagnose`). Inside each rank, :class:`Watch` wraps a few torch calls
for the time of the run — never the learner's file — and writes what it saw, one JSON line per
event, to a file per rank: each DistributedSampler and DataLoader iteration (with the epoch,
whether gradients were on, how many backward passes ran while it was being read), every
``torch.save`` (path, and whether the keys carry DDP's ``module.`` prefix), every barrier and
small reduction, every printed or logged loss, every metrics writer created (a TensorBoard
``SummaryWriter``, a ``wandb.init``), the line of every ``all_reduce``, the optimizer steps (a
hash of the parameters after the first one), and whether the process group was destroyed. After the run, :func:`analyze` reads
every rank's events together and returns :class:`Finding` s: what is wrong, at which
``file:line`` of the learner's script, what to write instead, and the lesson that teaches it.
:func:`unused_reductions` reads the script's text for an ``all_reduce`` whose result nothing
reads afterwards; ``analyze`` reports one only where the run called it on every rank.

:func:`explain_failure` turns the errors torch raises for the commonest mistakes (a GPU-only
script on a machine without GPUs, a sampler next to ``shuffle=True``) into the same kind of
sentence, and :func:`cpu_fallback` is what ``diagnose --cpu`` installs to run such a script on
the CPU (NCCL as gloo, CUDA moves kept on the CPU) — it can then say whether the rest of the
script is right, not whether it runs on GPUs.

The recording side (:class:`Watch`, :func:`read_events`) is :mod:`dpcourse.script_watch`; this
module judges what it recorded, and explains the failures.

Shown in lesson 10, §5; tested on a corpus of scripts in tests/scripts/diagnose/.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .script_watch import WRITERS, Watch, read_events

__all__ = ["Finding", "Watch", "analyze", "unused_reductions", "explain_failure",
           "failure_line", "cpu_fallback", "SEVERITY", "WRITERS"]


SEVERITY = {0: "wrong results", 1: "wasted work or a trap", 2: "misleading output"}
@dataclass
class Finding:
    """One mistake found in a run: ``check`` names it, ``severity`` orders the report (0: the
    results are wrong, 1: work wasted or a trap, 2: output that misleads), ``where`` is the
    learner's file:line, ``message`` says what is wrong and what to write instead, ``lesson``
    where the course teaches it, ``ranks`` where it was seen."""

    check: str
    severity: int
    where: str
    message: str
    lesson: str
    ranks: list[int] = field(default_factory=list)

    def line(self) -> str:
        ranks = (f" (rank{'s' * (len(self.ranks) > 1)} {', '.join(map(str, self.ranks))})"
                 if self.ranks else "")
        return f"[{self.check}] {self.where}{ranks}: {self.message} — {self.lesson}"


def unused_reductions(source: str) -> list[tuple[int, str]]:
    """(line, name) of each ``all_reduce(name)`` in ``source`` whose result nothing reads: in
    the function (or module) that calls it, ``name`` is read nowhere else, and every value it
    is given is a new tensor (``torch.tensor``, ``torch.zeros`` ..., ``.clone()``, arithmetic),
    so the reduction cannot reach any other tensor through shared memory either (a name bound to
    ``loss.detach()`` or ``p.grad`` can: those are never reported)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    scopes = [tree] + [n for n in ast.walk(tree)
                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    scope_of: dict[int, ast.AST] = {}
    for scope in scopes:  # the innermost scope wins: scopes are walked outermost first
        for node in ast.walk(scope):
            if node is not scope:
                scope_of[id(node)] = scope
    out = []
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Name)
                and (getattr(call.func, "attr", None) == "all_reduce"
                     or getattr(call.func, "id", None) == "all_reduce")):
            continue
        name, scope = call.args[0].id, scope_of.get(id(call), tree)
        reads, values = 0, []
        for node in ast.walk(scope):
            if isinstance(node, ast.Name) and node.id == name and node is not call.args[0]:
                reads += isinstance(node.ctx, ast.Load)
            elif isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
                reads += 1  # shared with another scope: not ours to judge
            elif isinstance(node, ast.AugAssign) and getattr(node.target, "id", None) == name:
                reads += 1  # total += x reads total
            elif isinstance(node, ast.Assign):
                values += _bound_values(node, name)
            elif name in _other_bindings(node):
                values.append(None)  # bound some other way: cannot tell what it shares
        if reads == 0 and values and all(_fresh(v) for v in values):
            out.append((call.lineno, name))
    return sorted(set(out))


def _other_bindings(node) -> set[str]:
    """Names ``node`` binds other than by a plain assignment: a for or with target, an
    annotated or := assignment, a parameter, an import, an exception's name."""
    if isinstance(node, ast.arg):
        return {node.arg}
    if isinstance(node, ast.ExceptHandler):
        return {node.name} if node.name else set()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    targets = {ast.For: lambda n: [n.target], ast.AsyncFor: lambda n: [n.target],
               ast.With: lambda n: [i.optional_vars for i in n.items if i.optional_vars],
               ast.AsyncWith: lambda n: [i.optional_vars for i in n.items if i.optional_vars],
               ast.AnnAssign: lambda n: [n.target], ast.NamedExpr: lambda n: [n.target],
               ast.comprehension: lambda n: [n.target]}.get(type(node))
    if targets is None:
        return set()
    return {n.id for t in targets(node) for n in ast.walk(t) if isinstance(n, ast.Name)}


def _bound_values(assign: ast.Assign, name: str) -> list:
    """The expressions an assignment binds to ``name`` (None where it cannot tell)."""
    out = []
    for target in assign.targets:
        if isinstance(target, ast.Name) and target.id == name:
            out.append(assign.value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for i, elt in enumerate(target.elts):
                if isinstance(elt, ast.Name) and elt.id == name:
                    same_shape = (isinstance(assign.value, (ast.Tuple, ast.List))
                                  and len(assign.value.elts) == len(target.elts))
                    out.append(assign.value.elts[i] if same_shape else None)
    return out


_NEW_TENSOR = {"tensor", "zeros", "ones", "full", "empty", "zeros_like", "ones_like",
               "full_like", "empty_like", "rand", "randn", "arange", "stack", "cat"}


def _fresh(value) -> bool:
    """True when ``value`` always makes a new tensor, sharing memory with nothing."""
    if isinstance(value, ast.BinOp):
        return True
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
        owner = value.func.value
        if value.func.attr == "clone":
            return True
        return (value.func.attr in _NEW_TENSOR and isinstance(owner, ast.Name)
                and owner.id == "torch")
    return False


def analyze(events: dict[int, list[dict]], world_size: int,
            script: str | None = None) -> list[Finding]:
    """The mistakes every rank's events show, most serious first, each said once. ``script``,
    the path of the script that ran, lets it also read the text (:func:`unused_reductions`)."""
    found: dict[str, Finding] = {}

    def add(check, severity, where, message, lesson, rank):
        f = found.setdefault(check, Finding(check, severity, where, message, lesson))
        if rank not in f.ranks:
            f.ranks.append(rank)

    synced = any(e["kind"] == "init" for es in events.values() for e in es)
    for rank, es in events.items():
        # a sampler read counts as training when backward ran while its loader was read (a
        # peek such as next(iter(loader)) does not); reads of the same data set with the same
        # seed count together, also across sampler objects rebuilt every epoch
        trained_reads = {e.get("seq") for e in es if e["kind"] == "loader" and e["backward"] > 0}
        by_sampler: dict[int, list[dict]] = {}
        by_data: dict[tuple, list[dict]] = {}
        for e in es:
            if e["kind"] == "sampler":
                by_sampler.setdefault(e["id"], []).append(e)
                if e["grad"] and e["shuffle"] and e.get("seq") in trained_reads:
                    by_data.setdefault((e.get("dataset"), e.get("seed")), []).append(e)
        set_calls = [e for e in es if e["kind"] == "set_epoch"]
        for reads in by_data.values():
            epochs = [e["epoch"] for e in reads]
            if len(epochs) > len(set(epochs)):
                again = next(e for i, e in enumerate(reads) if e["epoch"] in epochs[:i])
                objects = len({e["id"] for e in reads})
                elsewhere = [c for c in set_calls if c["id"] not in {e["id"] for e in reads}]
                why = (f"{objects} DistributedSamplers were built over it, each starting at "
                       f"epoch 0" if objects > 1 else "this DistributedSampler's epoch never "
                       "changed between them")
                if elsewhere:
                    why += (f"; set_epoch was called on another sampler ({elsewhere[0]['where']})")
                add("set_epoch", 0, again["where"],
                    f"the training data was read {len(epochs)} times in the same shuffled order "
                    f"(epoch {again['epoch']} each time): {why} — call set_epoch(epoch) on the "
                    f"training loader's sampler before each epoch's loop",
                    "lesson 03, DistributedSampler and set_epoch; lesson 10, bug 8", rank)
        for iters in by_sampler.values():
            for e in iters:
                pad = -e["size"] % e["replicas"]
                if not e["grad"] and pad and not e["drop_last"]:
                    add("eval_sampler", 0, e["where"],
                        f"a DistributedSampler reads the evaluation set: it pads {e['size']} "
                        f"examples to {e['size'] + pad} by repeating {pad}, so a metric summed "
                        f"over ranks counts them twice — evaluate the whole set on each rank, or "
                        f"shard it without padding and sum counts",
                        "lesson 04, §4 Evaluation and logging under DDP", rank)
        for e in es:
            if (e["kind"] == "loader" and world_size > 1 and e["backward"] >= 2
                    and e["sampler"] != "DistributedSampler"):
                add("no_sampler", 0, e["where"],
                    f"this DataLoader trains without a DistributedSampler ({e['sampler']}): every "
                    f"rank reads every example, so the ranks repeat each other's work — pass "
                    f"sampler=DistributedSampler(dataset) and drop shuffle=True",
                    "lesson 03, DistributedSampler and set_epoch", rank)
            if e["kind"] == "save" and e.get("prefixed"):
                add("module_prefix", 1, e["where"],
                    "the saved state_dict's keys start with 'module.' (the DDP wrapper's): a "
                    "plain model will not load it — save model.module.state_dict()",
                    "lesson 04, §3 Checkpoints and fault tolerance", rank)

    # across ranks
    ends = [e for es in events.values() for e in es if e["kind"] == "end"]
    finished = len(ends) == world_size and not any(e.get("error") for e in ends)
    if finished and any(e["initialized"] for e in ends):
        found["destroy"] = Finding(
            "destroy", 1, "end of script",
            "the script ends with its process group still up: call "
            "dist.destroy_process_group() at the end (torch warns, and some backends hang or "
            "leak at exit without it)", "lesson 04, §1 The whole script",
            sorted(e["rank"] for e in ends if e["initialized"]))
    if world_size > 1 and finished and not synced:
        found["no_init"] = Finding(
            "no_init", 0, "the whole script",
            "the script never calls dist.init_process_group: each rank trains its own copy "
            "and none of them knows about the others — set up the group, give each rank its "
            "shard (DistributedSampler) and wrap the model in DDP",
            "lesson 03, Processes, ranks, rendezvous; lesson 04, §1 The whole script",
            list(range(world_size)))
    saves: dict[str, list[tuple[int, str]]] = {}
    for rank, es in events.items():
        for e in es:
            if e["kind"] == "save" and e["path"]:
                saves.setdefault(e["path"], []).append((rank, e["where"]))
    for path, who in saves.items():
        ranks = sorted({r for r, _ in who})
        if len(ranks) > 1:
            f = found.setdefault("save_race", Finding(
                "save_race", 0, who[0][1],
                f"{len(ranks)} ranks torch.save to the same file ({Path(path).name}): the "
                f"writes race and the file can be torn — save from rank 0 only (if rank == 0:), "
                f"then dist.barrier() before anyone loads it",
                "lesson 04, §3 Checkpoints and fault tolerance; lesson 10, bug 10"))
            f.ranks = ranks
    digests = {r: e["digest"] for r, es in events.items() for e in es if e["kind"] == "first_step"}
    if len(digests) == world_size and len(set(digests.values())) > 1:
        where = next(e["where"] for e in events[0] if e["kind"] == "first_step") \
            if any(e["kind"] == "first_step" for e in events[0]) else "?"
        f = found.setdefault("replicas", Finding(
            "replicas", 0, where,
            "after the first optimizer step the ranks hold different weights: the replicas "
            "started apart (a per-rank seed with no broadcast, or a checkpoint loaded on one "
            "rank after DDP's constructor) or stepped with different gradients (gradients not "
            "averaged) — start every replica from the same weights (DDP's constructor copies "
            "rank 0's; load a checkpoint on every rank) and average the gradients (DDP, or "
            "all_reduce then divide)",
            "lesson 10, bugs 4 and 5; lesson 03, Averaging gradients"))
        f.ranks = sorted(digests)
    steps = max((e["steps"] for es in events.values() for e in es if e["kind"] == "end"),
                default=0)
    barriers = {r: [e for e in es if e["kind"] == "barrier"] for r, es in events.items()}
    if steps >= 3 and barriers.get(0) and len(barriers[0]) >= steps:
        found["barrier"] = Finding(
            "barrier", 1, barriers[0][0]["where"],
            f"{len(barriers[0])} barriers in {steps} steps: a barrier on every step makes every "
            f"rank wait for the slowest each time and buys nothing — the gradient all-reduce "
            f"already keeps the ranks in step; keep barriers for checkpoints and setup",
            "lesson 04, §1 The whole script (a barrier at the end, not per step)",
            sorted(barriers))
    unused: set[str] = set()  # lines whose all_reduce nothing reads
    if script is not None and Path(script).is_file():
        reduced_at = [{e["where"].split(",")[0] for e in es if e["kind"] == "reduce"}
                      for es in events.values()]
        name = Path(script).name
        for line, tensor in unused_reductions(Path(script).read_text(errors="replace")):
            here = f"{name}:{line}"
            if world_size > 1 and reduced_at and all(here in r for r in reduced_at):
                unused.add(here)
                found.setdefault("unused_reduce", Finding(
                    "unused_reduce", 1, here,
                    f"this all_reduce sums {tensor} over the ranks, and nothing reads "
                    f"{tensor} afterwards: each call makes every rank wait for the slowest "
                    f"and changes no result (a reduced loss that is never printed?) — use the "
                    f"reduced value, or remove the collective",
                    "lesson 04, §4 Evaluation and logging under DDP",
                    list(range(world_size))))
    printers = sorted(r for r, es in events.items() if any(e["kind"] == "print" for e in es))
    # a loss reduced for the log: a small all_reduce on rank 0 whose result is read
    reduced = any(e["kind"] == "small_reduce" and e["where"].split(",")[0] not in unused
                  for e in events.get(0, []))
    if synced and world_size > 1 and printers == list(range(world_size)):
        where = next(e["where"] for e in events[0] if e["kind"] == "print")
        found["log_every_rank"] = Finding(
            "log_every_rank", 2, where,
            f"every rank prints (or logs) a loss or accuracy: the output holds {world_size} "
            f"lines for each one meant, in no fixed order, and "
            + ("each rank's copy is the same all-reduced value" if reduced else
               "each is one rank's shard only, none the global batch's")
            + " — print on one rank (if rank == 0:)"
            + ("" if reduced else ", after all-reducing the sum and the count"),
            "lesson 04, §4 Evaluation and logging under DDP", printers)
    writers: dict[str, dict[int, str]] = {}
    for rank, es in events.items():
        for e in es:
            if e["kind"] == "writer":
                writers.setdefault(e["what"], {}).setdefault(rank, e["where"])
    for what, at in writers.items():
        if world_size > 1 and len(at) > 1:
            f = found.setdefault("writer_every_rank", Finding(
                "writer_every_rank", 2, at[min(at)],
                f"{len(at)} ranks each start {what}: each writes its own log of its own shard, "
                f"so the dashboard shows {len(at)} runs (or one whose curve jumps between "
                f"ranks), none of them the global batch's — start it on rank 0 only (if rank "
                f"== 0:) and log values all-reduced first",
                "lesson 04, §4 Evaluation and logging under DDP"))
            f.ranks = sorted(at)
    if synced and world_size > 1 and printers == [0] and not reduced:
        where = next(e["where"] for e in events[0] if e["kind"] == "print")
        found["rank0_loss"] = Finding(
            "rank0_loss", 2, where,
            "rank 0 prints (or logs) a loss or accuracy of its own shard only: it is not the global "
            "batch's — all_reduce the sum and the count first (or say 'rank 0's' when printing)",
            "lesson 04, §4 Evaluation and logging under DDP", [0])
    return sorted(found.values(), key=lambda f: (f.severity, f.check))


# --- errors torch raises, said in one sentence -----------------------------------------------

_FAILURES = [
    (r"ProcessGroupNCCL is only supported with GPUs|NCCL.*no GPUs found",
     "the script asks for the NCCL backend, which needs a GPU per rank, and this machine has "
     "none: use init_process_group('gloo') on a CPU, or no backend at all (torch then picks "
     "per device), and drop .cuda() and device_ids — or run diagnose --cpu to try the rest of "
     "the script as it is", "lesson 03, Processes, ranks, rendezvous; lesson 04, §10"),
    (r"Torch not compiled with CUDA|Found no NVIDIA driver|No CUDA GPUs are available|"
     r"CUDA driver initialization failed|invalid device ordinal",
     "the script moves tensors or the model to CUDA, and this machine has no GPU: use "
     "torch.device('cuda', local_rank) only when torch.cuda.is_available(), else the CPU — or "
     "run diagnose --cpu", "lesson 04, §10 Debugging (the first failures on a GPU machine)"),
    (r"device_ids and output_device arguments only work with single-device",
     "DDP was given device_ids for a model on the CPU: pass device_ids=[local_rank] only for a "
     "model on that GPU, and nothing for a CPU model",
     "lesson 04, §1 The whole script"),
    (r"mutually exclusive with shuffle",
     "the DataLoader is given a sampler and shuffle=True: with a DistributedSampler the sampler "
     "shuffles (shuffle=True is its default, reseeded by set_epoch) — drop the loader's "
     "shuffle", "lesson 03, DistributedSampler and set_epoch"),
    (r"Missing key\(s\) in state_dict.*Unexpected key\(s\) in state_dict: \"module\.",
     "the checkpoint's keys carry DDP's 'module.' prefix: save model.module.state_dict(), or "
     "strip the prefix before load_state_dict", "lesson 04, §3 Checkpoints and fault tolerance"),
]


def failure_line(traceback_text: str, script: str) -> str | None:
    """``name.py:N`` of the innermost frame of ``script`` in a formatted traceback: the line of
    the learner's script where the error was raised, and, when that line is inside one of the
    script's functions, the line that called it (None when no frame is the script's)."""
    target, name = os.path.realpath(script), Path(script).name
    frames = [(int(n), func) for f, n, func in
              re.findall(r'File "([^"]+)", line (\d+), in (\S+)', traceback_text or "")
              if os.path.realpath(f) == target]
    if not frames:
        return None
    (line, func), called = frames[-1], frames[-2][0] if len(frames) > 1 else None
    if called is not None and func not in ("<module>", "main"):
        return f"{name}:{line}, called from {name}:{called}"
    return f"{name}:{line}"


def explain_failure(error: str) -> tuple[str, str] | None:
    """(sentence, lesson) for an error a rank raised that is one of the common mistakes."""
    for pattern, sentence, lesson in _FAILURES:
        if re.search(pattern, error or "", re.S):
            return sentence, lesson
    return None


# --- diagnose --cpu: a GPU-only script tried on the CPU ---------------------------------------


@contextlib.contextmanager
def cpu_fallback():
    """For the block, in this rank: ``init_process_group('nccl')`` uses gloo; ``.cuda()`` and
    ``.to('cuda…')`` keep tensors and modules on the CPU; ``torch.cuda.set_device`` does
    nothing; DDP ignores ``device_ids``/``output_device`` for a CPU model. What it cannot tell:
    anything about the GPUs themselves — NCCL's own errors, memory, CUDA streams and speed."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    def on_cpu(device) -> bool:
        return device is not None and "cuda" in str(device)

    real = {"init": dist.init_process_group, "tcuda": torch.Tensor.cuda,
            "mcuda": torch.nn.Module.cuda, "tto": torch.Tensor.to, "mto": torch.nn.Module.to,
            "set_device": torch.cuda.set_device, "ddp": DistributedDataParallel.__init__,
            "current_device": torch.cuda.current_device}

    def init_process_group(backend=None, *args, **kwargs):
        if backend is not None and "nccl" in str(backend):
            backend = "gloo"
        return real["init"](backend, *args, **kwargs)

    def tensor_to(self, *args, **kwargs):
        args = tuple("cpu" if on_cpu(a) else a for a in args)
        if on_cpu(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return real["tto"](self, *args, **kwargs)

    def module_to(self, *args, **kwargs):
        args = tuple("cpu" if on_cpu(a) else a for a in args)
        if on_cpu(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return real["mto"](self, *args, **kwargs)

    def ddp_init(self, module, device_ids=None, output_device=None, *args, **kwargs):
        return real["ddp"](self, module, None, None, *args, **kwargs)

    patches = [(dist, "init_process_group", init_process_group),
               (torch.Tensor, "cuda", lambda self, *a, **k: self),
               (torch.nn.Module, "cuda", lambda self, *a, **k: self),
               (torch.Tensor, "to", tensor_to), (torch.nn.Module, "to", module_to),
               (torch.cuda, "set_device", lambda *a, **k: None),
               (torch.cuda, "current_device", lambda: 0),
               (DistributedDataParallel, "__init__", ddp_init)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, fn in patches:
            setattr(owner, name, fn)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def as_dicts(findings: list[Finding]) -> list[dict]:
    return [asdict(f) for f in findings]
