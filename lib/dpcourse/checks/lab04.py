"""Check for lab 04: a single-device training script turned into a torchrun DDP script.

``check(path)`` runs the learner's script with 2 processes through torchrun, with the lab's
arguments (see :class:`Lab04Config`), and compares the weights it writes to ``--out`` with those
of one process trained on the global batch. DDP changes nothing in the maths, so they must be
equal to float tolerance. When they are not, we replay the plausible wrong answers in one
process and name the one whose weights the script reproduced:

* no DistributedSampler: every rank reads the same batches, so the global batch is halved;
* the per-rank batch left at the global batch: the global batch is doubled;
* the learning rate multiplied by the world size (the global batch did not change);
* ``sampler.set_epoch`` forgotten: every epoch repeats epoch 0's order;
* no DDP wrapper: rank 0 trained alone on its half of the data.

Saving on every rank is caught directly: the check records every ``torch.save`` per rank.
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

from dpcourse.checks import fail, passed

__all__ = ["Lab04Config", "reference_weights", "run_script", "judge", "check", "MISTAKES"]


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


# name -> the sentence the learner reads when their weights match that wrong answer
MISTAKES = {
    "same_data": "Every rank trained on the same batches: use a DistributedSampler (with "
                 "num_replicas=world_size and rank=rank) so each rank reads its own shard.",
    "batch_not_divided": "Each rank used the global batch, so the global batch doubled: give "
                         "the DataLoader per_rank_batch = global_batch // world_size.",
    "lr_scaled": "The learning rate was multiplied by the world size, but the global batch did "
                 "not change (DDP averages the gradients): keep lr as it is.",
    "no_set_epoch": "Every epoch repeated the first epoch's order: call "
                    "sampler.set_epoch(epoch) at the start of each epoch.",
    "no_ddp": "Rank 0 trained alone on its half of the data, its gradients never averaged "
              "with the other rank's: wrap the model in DistributedDataParallel.",
}


@functools.lru_cache(maxsize=4)
def _load_lab_data(cfg: Lab04Config):
    from dpcourse import data

    ds = data.load("shapes10", n_train=cfg.n_train, n_test=10, seed=cfg.seed)
    return data.to_torch(ds.x_train, ds.y_train).tensors


def reference_weights(cfg: Lab04Config = Lab04Config(), variant: str = "correct") -> dict:
    """The weights one process gets for the right answer (``"correct"``) or for a mistake
    (a fresh copy; computed once per config and variant)."""
    return {k: v.clone() for k, v in _reference_weights(cfg, variant).items()}


@functools.lru_cache(maxsize=16)
def _reference_weights(cfg: Lab04Config, variant: str) -> dict:
    """Everything happens in this process on the whole data: a DDP run on N ranks with
    DistributedSampler reads, at each step, the union of the ranks' batches, which is a
    contiguous slice of the epoch's permutation (seeded with seed + epoch).
    """
    import torch
    import torch.nn.functional as F

    from dpcourse import models

    if variant != "correct" and variant not in MISTAKES:
        raise ValueError(f"unknown variant {variant!r}: 'correct' or one of {sorted(MISTAKES)}")
    X, y = _load_lab_data(cfg)
    n, ws = len(y), cfg.world_size
    batch, lr = cfg.global_batch, cfg.lr
    if variant == "same_data" or variant == "no_ddp":
        batch = cfg.global_batch // ws
    elif variant == "batch_not_divided":
        batch = cfg.global_batch * ws
    elif variant == "lr_scaled":
        lr = cfg.lr * ws
    torch.manual_seed(cfg.seed)
    model = models.SmallCNN(width=cfg.width)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels as one torchrun worker (OMP_NUM_THREADS=1)
    try:
        for epoch in range(cfg.epochs):
            g = torch.Generator()
            g.manual_seed(cfg.seed + (0 if variant == "no_set_epoch" else epoch))
            order = torch.randperm(n, generator=g)
            if variant == "no_ddp":
                order = order[0::ws]  # rank 0's shard
            for start in range(0, len(order) - batch + 1, batch):
                idx = order[start:start + batch]
                loss = F.cross_entropy(model(X[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    finally:
        torch.set_num_threads(prev)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


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


def _last_error_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        line = re.sub(r"^\[rank \d+\]\s*(\[rank\d+\]:\s*)?", "", line).strip()
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:", line):
            return line
    return "see the output above"


def run_script(path, cfg: Lab04Config = Lab04Config(), launcher: str = "torchrun",
               timeout: float = 120.0):
    """Run the learner's script on ``cfg.world_size`` ranks.

    Returns ``(weights or None, {rank: [paths saved]}, output)``; calls ``fail`` if it crashed
    or hung. ``launcher="spawn"`` runs the same script in ``dpcourse.launch.spawn`` ranks (same
    environment variables, no torchrun), which the tests use because it starts in a second.
    """
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
                fail(f"Your script did not finish within {timeout:g} s under torchrun: a rank "
                     f"is probably waiting in a collective the other rank never calls.")
            output = result.output
            if result.returncode != 0:
                print("\n".join(output.splitlines()[-25:]))
                fail(f"Your script failed under torchrun ({_last_error_line(output)}).")
        else:
            try:
                launch.spawn(_spawn_worker, cfg.world_size, str(path.resolve()), args, log,
                             timeout=timeout, show_output=False)
            except launch.LaunchTimeoutError:
                fail(f"Your script did not finish within {timeout:g} s: a rank is probably "
                     f"waiting in a collective the other rank never calls.")
            except launch.RankFailedError as e:
                fail(f"Your script failed on rank {e.rank} ({e.summary}).")
            output = ""
        saves = {}
        for r in range(cfg.world_size):
            p = Path(f"{log}.{r}")
            saves[r] = p.read_text().split() if p.exists() else []
        weights = None
        if os.path.exists(out):
            try:
                state = torch.load(out, map_location="cpu", weights_only=True)
            except Exception as exc:
                fail(f"The file your script wrote to --out cannot be loaded ({type(exc).__name__}"
                     f"): save a dict of tensors with save_checkpoint or torch.save.")
            weights = _model_weights(state)
    return weights, saves, output


def _model_weights(state) -> dict:
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    if not isinstance(state, dict):
        fail(f"--out should hold the model's state_dict (or {{'model': state_dict}}), got a "
             f"{type(state).__name__}.")
    # A DDP-wrapped model's state_dict prefixes every key with "module."; accept it.
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


def _distance(a: dict, b: dict) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].shape == b[k].shape
               else float("inf") for k in a)


def judge(weights, saves: dict, cfg: Lab04Config = Lab04Config(), tol: float = 1e-4) -> str:
    """Pass, or fail with the sentence that names the mistake."""
    __tracebackhide__ = True
    others = sorted(r for r, paths in saves.items() if r != 0 and paths)
    if others:
        fail(f"Rank {others[0]} called torch.save too: save only where is_main is true (rank 0) - "
             f"ranks writing one file at once race and can leave it half-written.")
    if weights is None:
        fail("Your script wrote no weights to --out: on rank 0, save the model's state_dict "
             "there (model.module.state_dict() under DDP).")
    ref = reference_weights(cfg)
    if set(weights) != set(ref):
        fail(f"The saved weights have keys {sorted(weights)[:3]}..., not those of "
             f"SmallCNN(width={cfg.width}): save model.module.state_dict().")
    d = _distance(weights, ref)
    if d <= tol:
        return passed(f"your torchrun script ends with the reference weights (to within "
                      f"{tol:g}): DDP on {cfg.world_size} ranks == one process on the global batch")
    for name, sentence in MISTAKES.items():
        if _distance(weights, reference_weights(cfg, name)) <= tol:
            fail(sentence)
    fail(f"Your final weights differ from the reference by up to {d:.3g}, and match none of the "
         f"usual mistakes: compare your script with the single-device one line by line.")


def check(path="train_lab.py", cfg: Lab04Config = Lab04Config(), launcher: str = "torchrun",
          timeout: float = 120.0) -> str:
    """Run the learner's DDP script with torchrun on 2 ranks and compare its final weights."""
    __tracebackhide__ = True
    weights, saves, _ = run_script(path, cfg, launcher=launcher, timeout=timeout)
    return judge(weights, saves, cfg)


def config_dict(cfg: Lab04Config = Lab04Config()) -> dict:
    return asdict(cfg)
