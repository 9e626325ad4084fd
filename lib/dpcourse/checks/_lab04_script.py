"""Lab 04's run of the learner's script and the judgement of its training: the run's
configuration (:class:`Lab04Config`), the single-process reference weights of the right
conversion and of each plausible wrong one, the script run under torchrun (or, in the tests,
``dpcourse.launch.spawn``) with every ``torch.save`` recorded, and :func:`judge`, which names the
wrong conversion whose weights the script reproduced.

Kept apart from :mod:`dpcourse.checks.lab04` (the lab's macro-F1 check, which calls these) and
:mod:`dpcourse.checks._lab04_resume` (the stretch); every name here is importable from
``dpcourse.checks.lab04`` too.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dpcourse.checks import fail, run_ranks, timed_out

__all__ = ["Lab04Config", "CONFIGS", "MISTAKES", "MISTAKE_FIXES", "reference_weights",
           "run_script", "judge"]


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


def _mistake(table: dict, fixes: dict, key: str, where: str = "") -> None:
    __tracebackhide__ = True
    fail(where + table[key], fix=fixes[key])
