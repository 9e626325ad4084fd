"""Check for lab 04: a metric that is not a mean (macro-F1), evaluated inside a torchrun DDP
script so that it equals one process.

``check(path)`` does two things:

1. It takes ``evaluate_f1`` (and the given ``macro_f1(y_true, y_pred)``, which defines the
   number) out of the learner's script and calls it on 2 ranks with 301 test images and on 3
   ranks with 302 (neither splits evenly), with a model whose forward counts the images each
   rank evaluates, its mode and whether autograd is on; each rank calls it a second time on a
   test set 4 times larger while the collectives it calls are recorded. Every rank must return
   one process's macro-F1 of the whole test set, each image evaluated exactly once over all
   ranks, in eval mode without autograd, send no more for the larger set, pass at most 2
   numbers per class (+2) into its collectives (which two is the learner's decision: true
   positives and predicted + true, or true positives and errors ...), and pass only tensors
   that would live on ``device`` on a GPU (followed by ``_lab04_exchange``). When it does
   not, the sentence names the mistake: ranks that return their own shard's number, images
   counted twice (a second pass over one rank's share, or shares that overlap:
   DistributedSampler's padding is named only where one image is on two ranks), images
   skipped, a rank left idle while another evaluates everything, every rank evaluating
   everything, the ranks' F1 scores averaged or summed, the ranks' per-class precisions and recalls
   averaged, the accuracy instead of F1, the labels or
   predictions themselves gathered (what is sent grows with the test set), the confusion
   matrix or three counts per class (over the budget), two counts that give only the
   precision or only the recall, a tensor made on the host (NCCL would refuse it). Counts averaged with ``ReduceOp.AVG`` pass, and the ✔ says why.
2. It runs the whole script under torchrun (2 processes) and compares the weights it writes to
   ``--out`` with one process trained on the global batch, and the F1 it saved with one
   process's F1 of those weights. A script that fails under torchrun is reported with the
   child's own exception (the rank torchrun names as the root cause), not the agent's
   ``ChildFailedError``. The training part of the script is given; if a learner breaks it, we
   replay the plausible wrong conversions in one process and name the one whose weights the
   script reproduced:

* no DistributedSampler: every rank reads the same batches, so the global batch is halved;
* the per-rank batch left at the global batch: the global batch is multiplied by N;
* the per-rank batch written as ``global_batch // 2`` (right on 2 ranks only);
* the learning rate multiplied by the world size (the global batch did not change);
* ``sampler.set_epoch`` forgotten: every epoch repeats epoch 0's order;
* the sampler's seed left at its default: the data order ignores ``--seed``;
* ``drop_last`` removed: a short last batch the single-device script never takes (3 ranks);
* no DDP wrapper: rank 0 trained alone on its half of the data.

Saving on every rank is caught directly: the check records every ``torch.save`` per rank; a
checkpoint saved from the DDP wrapper (``module.`` keys) is refused, since the plain model that
evaluation and resuming build cannot load it.

``check_prediction`` compares the learner's prediction of the mean of 2 ranks' macro-F1 (a model
that is always right, the test set split by class) with the measured 0.5, and says why. ``check_resume`` (the stretch) trains a model
with dropout, each rank drawing from its own random stream, "crashes" it after epoch 1 and
resumes it; it compares each rank's weights, momentum and generator state after the resume with
what that rank had at the crash (so a mistake is named by its cause: the optimizer or the
weights restored on rank 0 only, rank 0's generator state given to every rank ...), refuses a
checkpoint holding the DDP wrapper's weights or a file written by another rank, and compares
the final weights with an uninterrupted run.
Used in solutions/lab04_ddp_in_practice.py; tests in tests/test_lab04_checks.py.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from dpcourse.checks import (check_timeout, fail, passed, recorded, require_answer, run_ranks,
                             timed_out)

__all__ = ["Lab04Config", "CONFIGS", "F1_RUNS", "reference_weights", "run_script", "judge",
           "check_f1", "f1_note", "check", "check_prediction", "check_resume", "MISTAKES",
           "F1_MISTAKES", "RESUME_MISTAKES", "F1_FIXES", "RESUME_FIXES", "MISTAKE_FIXES",
           "AVG_NOTE", "NUM_CLASSES"]


@dataclass(frozen=True)
class Lab04Config:
    """The lab's run: small enough for a 2-core CPU, long enough to tell mistakes apart."""

    n_train: int = 256
    epochs: int = 2
    global_batch: int = 64
    lr: float = 0.05
    seed: int = 0
    width: int = 8
    world_size: int = 2

    def script_args(self, out: str) -> list[str]:
        return ["--n-train", str(self.n_train), "--epochs", str(self.epochs),
                "--global-batch", str(self.global_batch), "--lr", str(self.lr),
                "--seed", str(self.seed), "--width", str(self.width), "--out", out]

    def describe(self) -> str:
        return (f"{self.world_size} ranks, --seed {self.seed}, --global-batch "
                f"{self.global_batch}")


# The lab's run, then one that changes what a hard-coded answer would freeze: the world size
# (3: 48 // 3 = 16 per rank; 256 samples do not split evenly, so drop_last matters), the seed
# and the global batch.
CONFIGS = (Lab04Config(), Lab04Config(world_size=3, seed=1, global_batch=48))


# name -> the sentence the learner reads when their weights match that wrong answer (its cause;
# MISTAKE_FIXES says what to change, shown when the same mistake comes back)
MISTAKES = {
    "same_data": "Every rank trained on the same batches, so the ranks' averaged gradient is "
                 "one shard's gradient and half the data is never seen.",
    "batch_not_divided": "Each rank used the global batch, so the global batch grew world_size "
                         "times.",
    "batch_fixed_two": "The per-rank batch is global_batch // 2, right on 2 ranks only.",
    "lr_scaled": "The learning rate was multiplied by the world size, but the global batch did "
                 "not change (DDP averages the gradients).",
    "no_set_epoch": "Every epoch repeated the first epoch's order: DistributedSampler shuffles "
                    "with seed + its epoch, and its epoch stayed 0.",
    "sampler_seed_ignored": "The data order ignores --seed: DistributedSampler shuffles with "
                            "its own seed (0 by default).",
    "no_drop_last": "Each rank took a short last batch that the single-device script drops.",
    "no_ddp": "Rank 0 trained alone on its half of the data, its gradients never averaged "
              "with the other rank's.",
}
MISTAKE_FIXES = {
    "same_data": "Use a DistributedSampler (with num_replicas=world_size and rank=rank) so each "
                 "rank reads its own shard.",
    "batch_not_divided": "Give the DataLoader per_rank_batch = global_batch // world_size.",
    "batch_fixed_two": "Divide by world_size.",
    "lr_scaled": "Keep lr as it is.",
    "no_set_epoch": "Call sampler.set_epoch(epoch) at the start of each epoch.",
    "sampler_seed_ignored": "Pass seed=args.seed to the DistributedSampler.",
    "no_drop_last": "Keep drop_last=True in the DataLoader.",
    "no_ddp": "Wrap the model in DistributedDataParallel.",
}


@functools.lru_cache(maxsize=4)
def _load_lab_data(cfg: Lab04Config):
    from dpcourse import data

    ds = data.load("shapes10", n_train=cfg.n_train, n_test=10, seed=cfg.seed)
    return data.to_torch(ds.x_train, ds.y_train).tensors


def reference_weights(cfg: Lab04Config = Lab04Config(), variant: str = "correct") -> dict:
    """The weights one process gets for the right answer (``"correct"``) or for a mistake
    (a fresh copy; computed once per config and variant)."""
    __tracebackhide__ = True
    return {k: v.clone() for k, v in _reference_weights(cfg, variant).items()}


@functools.lru_cache(maxsize=16)
def _reference_weights(cfg: Lab04Config, variant: str) -> dict:
    """Everything happens in this process on the whole data: a DDP run on N ranks with
    DistributedSampler reads, at each step, the union of the ranks' batches, which is a
    contiguous slice of the epoch's permutation (seeded with seed + epoch).
    """
    __tracebackhide__ = True
    import torch

    if variant != "correct" and variant not in MISTAKES:
        raise ValueError(f"unknown variant {variant!r}: 'correct' or one of {sorted(MISTAKES)}")
    model, opt = _fresh(cfg, lr=cfg.lr * cfg.world_size if variant == "lr_scaled" else cfg.lr)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels as one torchrun worker (OMP_NUM_THREADS=1)
    try:
        for epoch in range(cfg.epochs):
            _train_epoch(model, opt, cfg, epoch, variant)
    finally:
        torch.set_num_threads(prev)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fresh(cfg: Lab04Config, lr: float | None = None):
    import torch

    from dpcourse import models

    torch.manual_seed(cfg.seed)
    model = models.SmallCNN(width=cfg.width)
    return model, torch.optim.SGD(model.parameters(), lr=cfg.lr if lr is None else lr,
                                  momentum=0.9)


def _train_epoch(model, opt, cfg: Lab04Config, epoch: int, variant: str = "correct") -> None:
    """One epoch of the N-rank DDP run, in one process (or of a mistake's run)."""
    __tracebackhide__ = True
    import torch
    import torch.nn.functional as F

    X, y = _load_lab_data(cfg)
    n, ws = len(y), cfg.world_size
    per_rank = {"batch_not_divided": cfg.global_batch,
                "batch_fixed_two": cfg.global_batch // 2}.get(variant, cfg.global_batch // ws)
    order_seed = 0 if variant == "sampler_seed_ignored" else cfg.seed
    g = torch.Generator()
    g.manual_seed(order_seed + (0 if variant == "no_set_epoch" else epoch))
    order = torch.randperm(n, generator=g)
    if variant == "same_data":  # one replica's sampler: all of it, on every rank
        steps = [order[i:i + per_rank] for i in range(0, n - per_rank + 1, per_rank)]
    else:
        # DistributedSampler pads the order to a multiple of N with its first indices; rank r
        # reads positions r, r + N, ...; so at step s the ranks together read the contiguous
        # positions [s * N * per_rank, (s + 1) * N * per_rank).
        per_rank_samples = -(-n // ws)
        order = torch.cat([order, order[:per_rank_samples * ws - n]])
        if variant == "no_ddp":  # rank 0 alone, on its shard
            order, width = order[0::ws], per_rank
        else:
            width = per_rank * ws
        full = per_rank_samples // per_rank
        count = full + (variant == "no_drop_last" and per_rank_samples % per_rank > 0)
        steps = [order[s * width:(s + 1) * width] for s in range(count)]
    for idx in steps:
        loss = F.cross_entropy(model(X[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


_RUNNER = '''\
# Written by dpcourse.checks.lab04: runs a learner's script and records who calls torch.save.
import os, runpy, sys
import torch

_save = torch.save

def _logged_save(obj, f, *args, **kwargs):
    with open(os.environ["DPCOURSE_SAVE_LOG"] + "." + os.environ.get("RANK", "0"), "a") as log:
        log.write(str(getattr(f, "name", f)) + "\\n")
    return _save(obj, f, *args, **kwargs)

torch.save = _logged_save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
# The script finished: leave without interpreter shutdown, where gloo + DDP now and then abort
# a process that has done all its work. A script that ends with dist.destroy_process_group(),
# or with nothing at all, is then judged on its weights alone.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''


class _ScriptExit(BaseException):
    pass


def _spawn_worker(rank, world_size, script, args, log):
    """One rank of a torchrun-like run inside dpcourse.launch.spawn (fast, for the tests)."""
    import runpy

    import torch

    os.environ["DPCOURSE_SAVE_LOG"] = log
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    real_save, real_exit = torch.save, os._exit

    def logged_save(obj, f, *a, **k):
        with open(f"{log}.{rank}", "a") as fh:
            fh.write(str(getattr(f, "name", f)) + "\n")
        return real_save(obj, f, *a, **k)

    def fake_exit(code=0):
        raise _ScriptExit(code)

    torch.save, os._exit = logged_save, fake_exit
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except _ScriptExit as e:
        code = e.args[0] if e.args else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        torch.save, os._exit = real_save, real_exit
    if code:
        raise RuntimeError(f"the script exited with code {code}")
    return code


_ERROR_LINE = re.compile(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:")


def _last_error_line(text: str) -> str:
    """The exception a torchrun child raised, not the agent's ``ChildFailedError`` that wraps
    it: the last error line printed by the rank torchrun names as the root cause (else by any
    rank), prefixed with that rank; the root cause's exit code if it printed none."""
    root = re.search(r"Root Cause.*?\brank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)(?:[^\n]*\((\w+)\))?",
                     text, re.S)
    want = root.group(1) if root else None
    found = None
    for line in text.splitlines():
        m = re.match(r"^\[rank (\d+)\]\s*(?:\[rank\d+\]:\s*)?(.*)$", line)
        if not m or (want is not None and m.group(1) != want):
            continue
        body = m.group(2).strip()
        if _ERROR_LINE.match(body) and "ChildFailedError" not in body:
            found = f"rank {m.group(1)}: {body}"
    if found:
        return found
    if root:
        signal = f" ({root.group(3)})" if root.group(3) else ""
        return f"rank {root.group(1)} exited with code {root.group(2)}{signal}"
    for line in reversed(text.splitlines()):
        line = line.strip()
        if _ERROR_LINE.match(line) and "ChildFailedError" not in line:
            return line
    return "see the output above"


def run_script(path, cfg: Lab04Config = Lab04Config(), launcher: str = "torchrun",
               timeout: float = 120.0):
    """Run the learner's script on ``cfg.world_size`` ranks.

    Returns ``(weights or None, {rank: [paths saved]}, output, saved f1 or None)``; calls
    ``fail`` if it crashed
    or hung. ``launcher="spawn"`` runs the same script in ``dpcourse.launch.spawn`` ranks (same
    environment variables, no torchrun), which the tests use because it starts in a second.
    """
    __tracebackhide__ = True
    import torch

    from dpcourse import launch

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no script at {path}: run the cell that writes it first")
    source = path.read_text()
    if "NotImplementedError" in source:
        line = next(i for i, s in enumerate(source.splitlines(), 1) if "NotImplementedError" in s)
        raise NotImplementedError(f"{path.name} still has a TODO (line {line}): replace each "
                                  f"`raise NotImplementedError` in it, then run this check.")
    if launcher not in ("torchrun", "spawn"):
        raise ValueError(f"launcher must be 'torchrun' or 'spawn', got {launcher!r}")
    with tempfile.TemporaryDirectory(prefix="dpcourse-lab04-") as tmp:
        out = os.path.join(tmp, "final.pt")
        log = os.path.join(tmp, "saves")
        args = cfg.script_args(out)
        if launcher == "torchrun":
            runner = os.path.join(tmp, "runner.py")
            Path(runner).write_text(_RUNNER)
            env = {"DPCOURSE_SAVE_LOG": log}
            try:
                result = launch.torchrun(runner, str(path.resolve()), *args,
                                         nproc_per_node=cfg.world_size, timeout=timeout,
                                         env=env, echo=False, check=False)
            except launch.LaunchTimeoutError:
                fail(timed_out(f"Your script did not finish within {timeout:g} s under "
                               f"torchrun: a rank is probably waiting in a collective the other "
                               f"rank never calls", timeout))
            output = result.output
            if result.returncode != 0:
                print("\n".join(output.splitlines()[-25:]))
                fail(f"Your script failed under torchrun ({_last_error_line(output)}).")
        else:
            run_ranks(_spawn_worker, cfg.world_size, str(path.resolve()), args, log,
                      backend=None, timeout=timeout,
                      hang=lambda e: f"Your script did not finish within {timeout:g} s: a rank "
                                     f"is probably waiting in a collective the other rank never "
                                     f"calls",
                      failed=lambda e: fail(f"Your script failed on rank {e.rank} "
                                            f"({e.summary})."))
            output = ""
        saves = {}
        for r in range(cfg.world_size):
            p = Path(f"{log}.{r}")
            saves[r] = p.read_text().split() if p.exists() else []
        weights, f1 = None, None
        if os.path.exists(out):
            try:
                state = torch.load(out, map_location="cpu", weights_only=True)
            except Exception as exc:
                fail(f"The file your script wrote to --out cannot be loaded ({type(exc).__name__}"
                     f").", fix="save a dict of tensors with save_checkpoint or torch.save.")
            weights = _model_weights(state)
            if isinstance(state, dict):
                f1 = state.get("f1")
    return weights, saves, output, f1


def _model_weights(state) -> dict:
    __tracebackhide__ = True
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    if not isinstance(state, dict):
        fail(f"--out should hold the model's state_dict (or {{'model': state_dict}}), got a "
             f"{type(state).__name__}.")
    if any(isinstance(k, str) and k.startswith("module.") for k in state):
        fail("The saved weights come from the DDP wrapper: their keys start with 'module.', so "
             "the plain model that evaluation and resuming build cannot load them "
             "(load_state_dict fails on every key).", fix="save model.module.state_dict().")
    return state


def _distance(a: dict, b: dict) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].shape == b[k].shape
               else float("inf") for k in a)


def judge(weights, saves: dict, cfg: Lab04Config = Lab04Config(), tol: float = 1e-4) -> None:
    """Nothing if the weights are the reference's; else fail with the sentence that names the
    mistake."""
    __tracebackhide__ = True
    where = "" if cfg == CONFIGS[0] else f"On {cfg.describe()}: "
    others = sorted(r for r, paths in saves.items() if r != 0 and paths)
    if others:
        fail(f"Rank {others[0]} called torch.save too: ranks writing one file at once race and "
             f"can leave it half-written.", fix="save only where is_main is true (rank 0).")
    if weights is None:
        fail("Your script wrote no weights to --out, where the check reads them.",
             fix="on rank 0, save the model's state_dict there (model.module.state_dict() under "
                 "DDP).")
    ref = reference_weights(cfg)
    if set(weights) != set(ref):
        fail(f"The saved weights have keys {sorted(weights)[:3]}..., not those of "
             f"SmallCNN(width={cfg.width}).", fix="save model.module.state_dict().")
    d = _distance(weights, ref)
    if d <= tol:
        return
    for name, sentence in MISTAKES.items():
        if _distance(weights, reference_weights(cfg, name)) <= tol:
            fail(where + sentence, fix=MISTAKE_FIXES[name])
    fail(f"{where}your final weights differ from the reference by up to {d:.3g}, and match none "
         f"of the usual mistakes.",
         fix="compare your script with the single-device one line by line (does it use a "
             "number that holds only on 2 ranks or for the default arguments?).")


# --- the lab: macro-F1 over a test set split across the ranks --------------------------------

# (world size, test images): 301 on 2 ranks and 302 on 3 ranks split unevenly, so
# DistributedSampler pads both with a repeated image; large enough that every class is right
# on every rank, so the ranks' precisions and recalls averaged differ from their F1 averaged.
F1_RUNS = ((2, 301), (3, 302))
NUM_CLASSES = 10  # shapes10's classes, the script's NUM_CLASSES
_F1_TOL = 1e-6  # float32 arithmetic in an answer is fine; every mistake is 1e-3 or more away

F1_MISTAKES = {  # the cause; what to change is in F1_FIXES (shown on the second meeting)
    "mean_of_f1": "The ranks' F1 scores were averaged: F1 is a ratio of counts, not a mean over "
                  "images, so the mean of the shards' F1 is not the F1 of the whole set.",
    "sum_of_f1": "The ranks' F1 scores were added up (an all_reduce of the F1 itself): that is "
                 "world_size times a mean of the shards' F1, not the F1 of the whole set.",
    "mean_of_pr": "The ranks' precisions and recalls were averaged: each is a fraction over a "
                  "different number of images on each rank (the images it predicted as the "
                  "class, the images truly of it), so the mean of the ranks' fractions is not "
                  "the whole set's.",
    "accuracy": "That number is the accuracy, not the macro-F1 that macro_f1 defines (the mean "
                "over the 10 classes of each class's F1).",
    "precision_only": "That number is the mean over the classes of each class's precision (its "
                      "true positives over the images predicted as it), not of its F1: the "
                      "counts you exchanged say nothing of the images truly of each class, "
                      "which its recall is made of.",
    "recall_only": "That number is the mean over the classes of each class's recall (its true "
                   "positives over the images truly of it: the balanced accuracy), not of its "
                   "F1: the counts you exchanged say nothing of the images predicted as each "
                   "class, which its precision is made of.",
}
F1_FIXES = {
    "mean_of_f1": "Add up over the ranks the counts that F1 is made of, then compute F1 once "
                  "from the sums.",
    "sum_of_f1": "Add up the counts that F1 is made of instead, then compute F1 once.",
    "mean_of_pr": "Add up over the ranks what each fraction is made of, then compute precision, "
                  "recall and F1 once.",
    "accuracy": "Compute each class's F1 from the whole test set's counts and average them.",
    "precision_only": "F1 = 2PR/(P + R) needs both fractions: exchange per-class counts from "
                      "which precision and recall both follow (two per class are enough).",
    "recall_only": "F1 = 2PR/(P + R) needs both fractions: exchange per-class counts from which "
                   "precision and recall both follow (two per class are enough).",
}

# What a rank may send must not grow with the test set: the check calls evaluate_f1 a second
# time on a test set this many times larger and compares the bytes (pickled objects may vary
# by a few bytes with the values they hold, e.g. a larger int).
_GROWTH = 4
_GROWTH_SLACK = 64

def _f1_of(confusion) -> float:
    """macro-F1 of a confusion matrix, as the lab's given macro_f1 computes it."""
    import torch

    confusion = confusion.double()
    tp = confusion.diagonal()
    den = 2 * tp + (confusion.sum(0) - tp) + (confusion.sum(1) - tp)
    f1 = torch.where(den > 0, 2 * tp / den.clamp(min=1), torch.zeros_like(tp))
    return float(f1.mean())


def _f1_model(seed: int = 0):
    """A small fixed CNN whose predictions spread over the 10 classes (all F1 variants differ)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 5, stride=4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 7 * 7, 10))


@functools.lru_cache(maxsize=4)
def _f1_data(n_test: int):
    from dpcourse import data

    ds = data.load("shapes10", n_train=10, n_test=n_test, seed=7)
    return data.to_torch(ds.x_test, ds.y_test).tensors


def _namespace(source: str, filename: str = "train_lab.py") -> dict:
    """The imports, constants and functions of the learner's script, without running its main
    part (everything under ``if __name__ == "__main__":`` and other statements are left out)."""
    import ast

    tree = ast.parse(source, filename)
    keep = [node for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef,
                                 ast.Assign, ast.AnnAssign))]
    ns: dict = {"__name__": "train_lab"}
    exec(compile(ast.Module(body=keep, type_ignores=[]), filename, "exec"), ns)
    return ns


def _f1_worker(rank, world_size, source, n_test):
    """One rank: the learner's evaluate_f1 on its share, with a model that counts its inputs and
    sees whether it runs in training mode or under autograd; then once more on a test set
    _GROWTH times larger, to measure whether what the rank sends grows with the test set."""
    import torch
    from torch.utils.data import TensorDataset

    from dpcourse.checks._lab04_exchange import ExchangeSpy, WhereTensorsLive, mark
    from dpcourse.collectives import record_collectives

    torch.set_num_threads(1)
    model = _f1_model()
    seen = {"images": 0, "training": False, "grad": False, "indices": []}
    X0, _ = _f1_data(n_test)
    index_of = {x.numpy().tobytes(): i for i, x in enumerate(X0)}  # which image the model saw

    def count(module, inputs, output):
        batch = inputs[0]
        seen["images"] += int(batch.shape[0])
        seen["training"] |= module.training
        seen["grad"] |= torch.is_grad_enabled()
        if seen["indices"] is not None:
            try:
                found = [index_of.get(x.detach().cpu().float().numpy().tobytes())
                         for x in batch]
            except Exception:  # an input the check cannot read back: count images only
                found = [None]
            seen["indices"] = None if None in found else seen["indices"] + found

    model.register_forward_hook(count)
    device = torch.device("cpu")
    for t in [*model.parameters(), *model.buffers()]:
        mark(t, True)  # the model lives on `device`, as the script puts it there
    sent = []
    spy = ExchangeSpy(rank)
    # The learner's module is built inside the recording, so even a name imported from
    # torch.distributed (from torch.distributed import all_reduce) is the recorded one.
    with record_collectives(before=spy.before) as calls:
        ns = _namespace(source)
        for n in (n_test, _GROWTH * n_test):
            X, y = _f1_data(n)
            before = len(calls)
            with WhereTensorsLive(device):
                value = ns["evaluate_f1"](model, TensorDataset(X, y), rank, world_size, device)
            sent.append(sum(c.nbytes for c in calls[before:]))
            if n == n_test:
                first, first_seen = value, dict(seen)
                exchange = {"numbers": spy.numbers, "off_device": spy.off_device,
                            "averaged": spy.averaged}
                seen["indices"] = None  # the larger set's images are not looked up
    value = first
    if torch.is_tensor(value) and value.numel() == 1:
        value = float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {"error": f"evaluate_f1 returned {type(value).__name__}, not a number (a float)"}
    return {"value": float(value), **first_seen, "sent": sent, **exchange}


def _f1_variants(n_test: int, world_size: int) -> dict:
    """One process's macro-F1 of the lab's test set, and the numbers each mistake gives."""
    import torch
    from torch.utils.data import DistributedSampler, TensorDataset

    X, y = _f1_data(n_test)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _f1_model().eval()
        with torch.no_grad():
            pred = model(X).argmax(1)
    finally:
        torch.set_num_threads(prev)

    def confusion(idx):
        idx = torch.as_tensor(list(idx), dtype=torch.long)
        return torch.bincount(y[idx] * 10 + pred[idx], minlength=100).view(10, 10)

    n, N = n_test, world_size
    shardings = {
        "strided": [range(r, n, N) for r in range(N)],
        "contiguous": [range(r * n // N, (r + 1) * n // N) for r in range(N)],
        "chunks": [range(r * -(-n // N), min(n, (r + 1) * -(-n // N))) for r in range(N)],
    }
    ds = TensorDataset(X, y)
    for shuffle in (True, False):
        shardings[f"sampler_{shuffle}"] = [
            list(DistributedSampler(ds, num_replicas=N, rank=r, shuffle=shuffle)) for r in range(N)]
    whole = confusion(range(n)).double()
    tp = whole.diagonal()
    out = {"correct": _f1_of(confusion(range(n))),
           "accuracy": float((pred == y).double().mean()),
           "precision_only": float((tp / whole.sum(0).clamp(min=1)).mean()),
           "recall_only": float((tp / whole.sum(1).clamp(min=1)).mean()),
           "mean_of_f1": [], "sum_of_f1": [], "mean_of_pr": []}
    for shards in shardings.values():
        f1s = [_f1_of(confusion(s)) for s in shards]
        out["mean_of_f1"].append(sum(f1s) / N)
        out["sum_of_f1"].append(sum(f1s))
        out["mean_of_pr"].append(_f1_of_mean_pr([confusion(s) for s in shards]))
    return out


def _f1_of_mean_pr(confusions) -> float:
    """macro-F1 from the ranks' per-class precision and recall averaged over the ranks (0 where
    a rank's fraction is undefined, as macro_f1 sets it)."""
    import torch

    def pr(c):
        c = c.double()
        tp = c.diagonal()
        return (torch.where(c.sum(0) > 0, tp / c.sum(0).clamp(min=1), 0.0),
                torch.where(c.sum(1) > 0, tp / c.sum(1).clamp(min=1), 0.0))

    fractions = [pr(c) for c in confusions]
    p = sum(f[0] for f in fractions) / len(fractions)
    r = sum(f[1] for f in fractions) / len(fractions)
    return float(torch.where(p + r > 0, 2 * p * r / (p + r).clamp(min=1e-300), 0.0).mean())


def _overcount(results: list, n_test: int, total: int) -> str:
    """The cause of more forwards than images, from the images each rank's model saw: the
    same image twice on one rank (a second pass over the share), or on two ranks (shares that
    overlap, e.g. DistributedSampler's padding); only the counts when the images are unknown."""
    from collections import Counter

    head = f"the ranks ran the model on {total} images for {n_test}"
    lists = [r.get("indices") for r in results]
    if any(idx is None for idx in lists):
        return head + ", so some images were counted more than once."
    per_rank = [Counter(idx) for idx in lists]
    for rank, c in enumerate(per_rank):
        again = sorted(i for i, k in c.items() if k > 1)
        if again:
            times = max(c.values())
            return (head + f": rank {rank} evaluated {len(again)} of its {len(c)} images more "
                           f"than once (up to {times} times; image {again[0]} among them), so "
                           f"its forwards counted them again: a second pass over the same "
                           f"share, not an overlap between ranks.")
    ranks_of = Counter(i for c in per_rank for i in c)
    shared = sorted(i for i, k in ranks_of.items() if k > 1)
    who = [r for r, c in enumerate(per_rank) if shared[0] in c]
    padding = len(shared) < len(results) and len({len(c) for c in per_rank}) == 1
    why = (": every share has the same length, which for a set that does not split evenly "
           "means repeated images (DistributedSampler pads the shares that way)"
           if padding else ": the ranks' shares overlap")
    return (head + f": {len(shared)} image(s) were evaluated on more than one rank (image "
                   f"{shared[0]} on ranks {who[0]} and {who[1]}){why}, so they were counted "
                   f"twice.")


def judge_f1(results: list, n_test: int) -> str:
    """The ✔'s note ("" or :data:`AVG_NOTE`) if every rank returned one process's macro-F1,
    each image evaluated once in eval mode without autograd, sending at most 2 numbers per
    class (plus 2) whatever the test set's size, from tensors on ``device``; else fail with the
    sentence that names the mistake."""
    __tracebackhide__ = True
    N = len(results)
    where = f"On {N} ranks with {n_test} test images: "
    for r in results:
        if "error" in r:
            fail(where + r["error"] + ".")
    if any(r["training"] for r in results):
        fail(where + "the model ran in training mode, where dropout and BatchNorm behave "
                     "differently from test time.", fix="call model.eval() before evaluating.")
    if any(r.get("grad") for r in results):
        fail(where + "the model's forward ran with autograd on, so it built a graph and kept "
                     "every layer's activations for a backward that never comes.",
             fix="evaluate under torch.no_grad() (or torch.inference_mode()).")
    values = [r["value"] for r in results]
    if max(values) - min(values) > _F1_TOL:
        fail(where + f"the ranks returned different numbers ({', '.join(f'{v:.4f}' for v in values)}"
                     f"): each returned its own share's result, not the whole test set's.",
             fix="make the ranks combine what they counted before the F1 is computed.")
    images = [r["images"] for r in results]
    total = sum(images)
    if all(i == n_test for i in images) and N > 1:
        fail(where + f"every rank evaluated all {n_test} images: the work was not split.",
             fix="give each rank only its share of the images and combine what the ranks "
                 "counted.")
    idle = [r for r, i in enumerate(images) if i == 0]
    if idle and N > 1 and n_test >= N:
        busy = ", ".join(f"rank {r} {i}" for r, i in enumerate(images) if i)
        fail(where + f"rank {idle[0]} ran the model on no image ({busy} of the {n_test}): the "
                     f"contract has each rank evaluate its own share, so the job takes as long "
                     f"as one process and the idle rank's accelerator waits.",
             fix="give every rank a share of the test set (about len(test_set) / world_size "
                 "images each) and combine what the ranks counted.")
    if total > n_test:
        fail(where + _overcount(results, n_test, total),
             fix="split the indices yourself so that each image is on exactly one rank (the "
                 "shares may differ by one), and run the model once per image.")
    if total < n_test:
        fail(where + f"the ranks evaluated only {total} of the {n_test} images: the rest never "
                     f"reached the metric.",
             fix="count every image once (no drop_last, and the remainder goes to some "
                 "rank).")
    sent = [r.get("sent", [0, 0]) for r in results]
    grown = [s for s in sent if s[1] > s[0] + _GROWTH_SLACK]
    if grown:
        small, big = grown[0]
        fail(where + f"what a rank sends grows with the test set ({small} bytes for {n_test} "
                     f"images, {big} for {_GROWTH * n_test}): the labels or predictions "
                     f"themselves travel between the ranks.",
             fix="exchange a summary whose size does not depend on the number of images, from "
                 "which the macro-F1 follows.")
    _judge_budget(results, where)
    want = _f1_variants(n_test, N)
    got = values[0]
    if abs(got - want["correct"]) > _F1_TOL:
        for name in ("mean_of_f1", "sum_of_f1", "mean_of_pr"):
            if any(abs(got - v) <= _F1_TOL for v in want[name]):
                _mistake(F1_MISTAKES, F1_FIXES, name, where)
        for name in ("accuracy", "precision_only", "recall_only"):
            if abs(got - want[name]) <= _F1_TOL:
                _mistake(F1_MISTAKES, F1_FIXES, name, where)
        fail(where + f"your macro-F1 {got:.6f} differs from one process's {want['correct']:.6f} "
                     f"(macro_f1 of the whole test set's labels and predictions), and matches "
                     f"none of the usual mistakes.",
             fix="compute F1 once, from counts added up over every rank's images.")
    off = next((r["off_device"] for r in results if r.get("off_device")), None)
    if off:
        fail(where + f"{off} is not on `device`: it was made without device= (or moved off "
                     f"it) and never moved there. Here every rank computes on the CPU, so gloo "
                     f"took it; on GPUs the group is NCCL's, which only moves GPU memory, and "
                     f"this call raises (RuntimeError: No backend type associated with device "
                     f"type cpu).",
             fix="make the tensor you exchange on the device (torch.zeros(..., device=device)), "
                 "or move it there with .to(device) before the collective.")
    return AVG_NOTE if any(r.get("averaged") for r in results) else ""


# The contract: what a rank passes into its collectives is at most 2 numbers per class, plus
# _SPARE (a count, the result broadcast from one rank).
_PER_CLASS = 2
_SPARE = 2
AVG_NOTE = (" Your collective averaged the counts (ReduceOp.AVG) instead of adding them: that "
            "divides every count by world_size, and each class's F1 is a ratio of two counts, "
            "so it is unchanged (to rounding); an AVG of the ranks' F1 scores would have been a "
            "mean of means.")


def _judge_budget(results: list, where: str) -> None:
    """Fail if a rank passed more numbers into its collectives than the contract allows."""
    __tracebackhide__ = True
    C = NUM_CLASSES
    budget = _PER_CLASS * C + _SPARE
    over = [(rank, r.get("numbers", 0)) for rank, r in enumerate(results)
            if r.get("numbers", 0) > budget]
    if not over:
        return
    rank, k = over[0]
    if k == C * C:
        what = (f", a {C} × {C} table such as the confusion matrix of (true, predicted) pairs, "
                f"which for ImageNet's 1000 classes is a million numbers per rank")
    elif k == 3 * C:
        what = (", 3 per class, such as the true positives, false positives and false "
                "negatives that precision and recall are written with")
    else:
        what = f", {k / C:g} per class"
    fail(where + f"rank {rank} passed {k} numbers into its collectives{what}, where the contract "
                 f"allows {_PER_CLASS} per class ({_PER_CLASS * C} here, plus {_SPARE}): "
                 f"macro-F1 is determined by fewer.",
         fix="each class's F1 is the harmonic mean of its precision and recall, two fractions "
             "with the same numerator (its true positives): write 2·P·R/(P + R) as one fraction "
             "of counts, and exchange the two per-class counts it is made of.")


@recorded
def check_f1(path="train_lab.py", runs=F1_RUNS, timeout: float | None = None) -> None:
    """Call the script's ``evaluate_f1`` on each (world size, test images) of ``runs`` and judge
    it (see :func:`judge_f1`); silent when right. ``timeout``: 90 s per launch, or
    ``DPCOURSE_CHECK_TIMEOUT`` if more."""
    __tracebackhide__ = True
    f1_note(path, runs, timeout)


def f1_note(path="train_lab.py", runs=F1_RUNS, timeout: float | None = None) -> str:
    """:func:`check_f1`, returning the note its ✔ gets ("" or :data:`AVG_NOTE`)."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, 90.0)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no script at {path}: run the cell that writes it first")
    source = path.read_text()
    try:
        ns = _namespace(source, path.name)
    except SyntaxError as exc:
        fail(f"{path.name} does not parse: line {exc.lineno}: {exc.msg}.")
    if not callable(ns.get("evaluate_f1")):
        fail(f"{path.name} defines no function evaluate_f1(model, test_set, rank, world_size, "
             f"device).")
    note = ""
    for world_size, n_test in runs:
        results = run_ranks(
            _f1_worker, world_size, source, n_test, timeout=timeout,
            hang=lambda exc: f"evaluate_f1 did not finish within {timeout:g} s on {world_size} "
                             f"ranks: does one rank call a collective (all_reduce) that another "
                             f"never calls, e.g. inside its loop over batches, when the ranks "
                             f"have different numbers of batches?",
            failed=lambda exc: fail(f"evaluate_f1 raised on rank {exc.rank} of {world_size}: "
                                    f"{exc.summary}"),
            todo=f"{path.name} still has a TODO in evaluate_f1: replace the `raise "
                 f"NotImplementedError` with your code, re-run that cell, then this check.")
        note = judge_f1(results, n_test) or note
    return note


def _saved_f1_reference(weights: dict, cfg: "Lab04Config", n_test: int = 101) -> float:
    """One process's macro-F1 of the saved weights on the lab script's test set."""
    import torch

    from dpcourse import data, models

    model = models.SmallCNN(width=cfg.width)
    model.load_state_dict(weights)
    ds = data.load("shapes10", n_train=cfg.n_train, n_test=n_test, seed=cfg.seed)
    X, y = data.to_torch(ds.x_test, ds.y_test).tensors
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            pred = model.eval()(X).argmax(1)
    finally:
        torch.set_num_threads(prev)
    return _f1_of(torch.bincount(y * 10 + pred, minlength=100).view(10, 10))


@recorded
def check(path="train_lab.py", cfgs=CONFIGS[:1], launcher: str = "torchrun",
          timeout: float | None = None, f1_runs=F1_RUNS) -> None:
    """The lab's check: ``evaluate_f1`` on 2 and 3 ranks (:func:`check_f1`), then the whole
    script under torchrun (2 ranks; pass ``cfgs=CONFIGS`` for 3 ranks with another seed and
    global batch too), comparing its weights and the F1 it saved with one process.
    ``timeout``: 120 s per run (90 s for the F1 part), or ``DPCOURSE_CHECK_TIMEOUT`` if more."""
    __tracebackhide__ = True
    f1_timeout = check_timeout(timeout, 90.0)
    timeout = check_timeout(timeout, 120.0)
    if isinstance(cfgs, Lab04Config):
        cfgs = (cfgs,)
    note = f1_note(path, f1_runs, timeout=f1_timeout) if f1_runs else ""
    for cfg in cfgs:
        weights, saves, _, f1 = run_script(path, cfg, launcher=launcher, timeout=timeout)
        judge(weights, saves, cfg)
        if f1_runs:
            where = "" if cfg == CONFIGS[0] else f"On {cfg.describe()}: "
            if not isinstance(f1, (int, float)) or isinstance(f1, bool):
                fail(f"{where}the checkpoint your script wrote to --out holds no number under "
                     f"'f1'.", fix="save {'model': ..., 'f1': f1} on rank 0.")
            want = _saved_f1_reference(weights, cfg)
            if abs(f1 - want) > 1e-6:
                fail(f"{where}the F1 your script saved ({f1:.6f}) is not one process's F1 of the "
                     f"weights it saved ({want:.6f}).",
                     fix="save the value evaluate_f1 returned after training, computed with "
                         "model.module.")
    runs = " and ".join(str(w) for w, _ in f1_runs)
    ranks = " and ".join(str(c.world_size) for c in cfgs)
    passed((f"evaluate_f1 equals one process's macro-F1 on {runs} ranks, each image once; "
            if f1_runs else "") + f"your torchrun script ends with the reference weights on "
           f"{ranks} ranks (DDP == one process on the global batch)." + note)


def config_dict(cfg: Lab04Config = Lab04Config()) -> dict:
    return asdict(cfg)


# --- the prediction: the ranks' macro-F1 averaged, on a test set split by class ------------

def check_prediction(guess, measured: float, world_size: int = 2,
                     num_classes: int = 10) -> None:
    """Compare the learner's prediction of the mean of ``world_size`` ranks' macro-F1 (a model
    that is always right, the test set split by class: each rank holds num_classes/world_size
    classes) with what was measured; explain why it is not the whole set's 1.0."""
    __tracebackhide__ = True
    from dpcourse.checks import reveal

    held = num_classes // world_size
    close = isinstance(guess.value, (int, float)) and abs(guess.value - measured) <= 0.05
    reveal(guess, round(measured, 2), close=close,
           explanation=(f"On each rank only {held} of the {num_classes} classes have an image, "
                        f"and none is predicted there; macro_f1 gives such a class F1 0 (its "
                        f"precision and recall are 0 by definition) and still averages over all "
                        f"{num_classes}, so each rank reports {held}/{num_classes} = "
                        f"{held / num_classes:.2f} though every prediction is right, and so does "
                        f"their mean; the whole set's macro-F1 is 1.00. Counts added over the "
                        f"ranks have no such problem: a class a rank lacks adds zeros."))


# --- stretch: resume after a crash ---------------------------------------------------------

RESUME_CFG = Lab04Config(epochs=3)
RESUME_DROPOUT = 0.3  # the stretch's model draws dropout masks: each rank from its own stream
# The resumed run and the uninterrupted one are the same 2-rank DDP computation (one thread per
# rank), so a right resume ends with bit-identical weights; the bound only absorbs a kernel
# that is not deterministic. Every resume mistake lands 1e-3 or more away.
RESUME_TOL = 1e-5
_CRASH_AFTER = 1  # the first run stops after epoch 1 of 0, 1, 2 (as if killed right then)

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


def _mistake(table: dict, fixes: dict, key: str, where: str = "") -> None:
    __tracebackhide__ = True
    fail(where + table[key], fix=fixes[key])


def _resume_worker(rank, world_size, save_fn, resume_fn, ckpt, stop_after, cfg):
    """One rank of the stretch's DDP training (dropout, each rank its own random stream), with
    the learner's save and resume around it (``None``: the uninterrupted reference run)."""
    __tracebackhide__ = True
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from dpcourse import data, models

    torch.set_num_threads(1)
    writes = []
    real_save, real_replace = torch.save, os.replace

    def logged_save(obj, f, *a, **k):
        # a path, or a file opened by name; not a buffer in memory (all_gather_object pickles
        # into one) nor save_checkpoint's temporary file (its os.replace is logged instead)
        name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        if isinstance(name, (str, os.PathLike)):
            writes.append(str(name))
        return real_save(obj, f, *a, **k)

    def logged_replace(src, dst, *a, **k):
        writes.append(str(dst))
        return real_replace(src, dst, *a, **k)

    ds = data.load("shapes10", n_train=cfg.n_train, n_test=10, seed=cfg.seed)
    train_set = data.to_torch(ds.x_train, ds.y_train)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.global_batch // world_size, sampler=sampler,
                        drop_last=True)
    torch.manual_seed(cfg.seed)
    model = DDP(models.SmallCNN(width=cfg.width, dropout=RESUME_DROPOUT))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    torch.manual_seed(cfg.seed + 1 + rank)  # each rank draws its own dropout masks
    start = 0
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
            start = resume_fn(ckpt, model, opt)
        finally:
            torch.set_rng_state = torch.random.set_rng_state = real_set_rng
        if isinstance(start, torch.Tensor) and start.numel() == 1:
            start = int(start.item())
        if not isinstance(start, int) or isinstance(start, bool):
            return {"error": f"resume_training_state returned {type(start).__name__}, not the "
                             f"epoch to start at (an int)"}
    resumed = _snapshot(model, opt)
    epochs_run, crashed = [], None
    torch.save, os.replace = logged_save, logged_replace
    try:
        for epoch in range(start, cfg.epochs):
            sampler.set_epoch(epoch)
            for X, y in loader:
                loss = torch.nn.functional.cross_entropy(model(X), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            epochs_run.append(epoch)
            if save_fn is not None:
                save_fn(ckpt, model, opt, epoch, rank == 0)
            dist.barrier()  # rank 0's file is complete before anyone "crashes"
            if epoch == stop_after:
                crashed = _snapshot(model, opt)
                break
    finally:
        torch.save, os.replace = real_save, real_replace
    return {"start": start, "epochs": epochs_run, "writes": writes, "resumed": resumed,
            "crashed": crashed,
            "weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}


def _snapshot(model, opt) -> dict:
    """What a resume must restore on a rank: its weights, its momentum, its random state."""
    import torch

    momentum = [opt.state.get(p, {}).get("momentum_buffer") for p in model.parameters()]
    return {"weights": [p.detach().clone() for p in model.parameters()],
            "momentum": [None if m is None else m.detach().clone() for m in momentum],
            "rng": torch.get_rng_state()}


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
def check_resume(save_training_state, resume_training_state,
                 timeout: float | None = None) -> None:
    """Stretch: train 3 epochs on 2 ranks (dropout, each rank its own random stream), "crash"
    after epoch 1, run again: with your ``save_training_state`` and ``resume_training_state``
    every rank must continue exactly where it stopped (its weights, its momentum, its random
    state), the second run must do only epoch 2 and end bit for bit (to 1e-5) with the weights
    of an uninterrupted run (``timeout``: 90 s per run, or ``DPCOURSE_CHECK_TIMEOUT`` if more)."""
    __tracebackhide__ = True
    import torch

    timeout = check_timeout(timeout, 90.0)
    cfg = RESUME_CFG
    for fn, name in ((save_training_state, "save_training_state"),
                     (resume_training_state, "resume_training_state")):
        require_answer(fn, name)
    with tempfile.TemporaryDirectory(prefix="dpcourse-lab04-resume-") as tmp:
        ckpt = os.path.join(tmp, "ckpt.pt")
        runs = []
        plan = ((save_training_state, resume_training_state, _CRASH_AFTER, "first run"),
                (save_training_state, resume_training_state, None, "run after the crash"),
                (save_training_state, None, None, "uninterrupted run"))
        for save_fn, resume_fn, stop_after, when in plan:
            # the uninterrupted run saves too (elsewhere), so whatever saving does, both do
            path = ckpt if resume_fn is not None else os.path.join(tmp, "uninterrupted.pt")
            runs.append(run_ranks(
                _resume_worker, cfg.world_size, save_fn, resume_fn, path, stop_after, cfg,
                timeout=timeout,
                hang=lambda exc: f"a run did not finish within {timeout:g} s: does a function "
                                 f"call a collective (e.g. dist.barrier) on some ranks only?",
                failed=lambda exc: fail(f"your code raised on rank {exc.rank} in the {when}: "
                                        f"{exc.summary}")))
            for r in runs[-1]:
                if "error" in r:
                    fail(r["error"] + ".")
            if len(runs) == 1:
                _judge_first_run(runs[0], ckpt)
        first, second, whole = runs
    _judge_resume(first, second, whole, cfg)


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


def _judge_resume(first: list, second: list, whole: list, cfg: Lab04Config) -> None:
    __tracebackhide__ = True
    starts = {r["start"] for r in second}
    if len(starts) != 1:
        fail(f"after the crash the ranks would resume at different epochs {sorted(starts)}, "
             f"so their collectives would no longer pair up.",
             fix="make every rank read the same checkpoint.")
    start = starts.pop()
    if start == _CRASH_AFTER:
        _mistake(RESUME_MISTAKES, RESUME_FIXES, "repeat_epoch")
    if start == 0:
        if not _same(second[0]["resumed"]["weights"], first[0]["crashed"]["weights"]):
            fail("After the crash the run started from scratch (epoch 0, fresh weights), "
                 "though the checkpoint file existed.",
                 fix="when the file exists, load it in resume_training_state and return the "
                     "first epoch still to do.")
        _mistake(RESUME_MISTAKES, RESUME_FIXES, "from_zero")
    if start != _CRASH_AFTER + 1:
        fail(f"after a crash at the end of epoch {_CRASH_AFTER}, resume_training_state returned "
             f"{start}, which is not the first epoch still to do.",
             fix=f"return the first epoch still to do, {_CRASH_AFTER + 1}.")
    crashed = [r["crashed"] for r in first]
    for what, everywhere, rank0 in (("weights", "no_weights", "weights_rank0"),
                                    ("momentum", "no_optimizer", "optimizer_rank0")):
        wrong = [rank for rank, r in enumerate(second)
                 if not _same(r["resumed"][what], crashed[rank][what])]
        if wrong:
            _mistake(RESUME_MISTAKES, RESUME_FIXES, rank0 if 0 not in wrong else everywhere)
    import torch

    rng_wrong = [rank for rank, r in enumerate(second)
                 if not torch.equal(r["resumed"]["rng"], crashed[rank]["rng"])]
    if rng_wrong:
        if 0 not in rng_wrong and all(torch.equal(second[r]["resumed"]["rng"], crashed[0]["rng"])
                                      for r in rng_wrong):
            _mistake(RESUME_MISTAKES, RESUME_FIXES, "rng_rank0")
        _mistake(RESUME_MISTAKES, RESUME_FIXES, "no_rng")
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
    passed("resume after a crash: every rank continued with its own weights, momentum and "
           "random state, trained only the last epoch and ended with the weights of an "
           "uninterrupted run")
