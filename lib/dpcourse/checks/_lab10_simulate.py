"""Lab 10's reference (solutions/lab10_bug_hunt.py, "Check the five fixes"): the lab's training
on every rank's replica side by side in this one process, done right or with one of the known
mistakes a "fixed" script may still make (:data:`BUGS`, each with the cause the learner reads
and what to change), and the distance between two sets of weights. A data-parallel run done
right equals :func:`simulate` to float tolerance (:data:`TOL`); each mistake lands 1e-2 or more
away.

Used by :func:`dpcourse.checks.lab10.judge_fix`; every name is exported by
:mod:`dpcourse.checks.lab10`.
"""

from __future__ import annotations

import functools

from dpcourse.checks._lab10_scripts import SEED

__all__ = ["TOL", "BUGS", "SUSPECTS", "simulate"]

TOL = 1e-5  # float drift measured at ~1e-7; every bug lands 1e-2 or more away

# variant name -> (the cause the learner reads when a "fixed" script reproduces that mistake,
# what to change: added only when the same mistake comes back, checks.fail's fix=)
BUGS = {
    "sampler_seed_rank": ("each rank's sampler still has its own seed, so the ranks still take "
                          "their slices of different permutations.",
                          "What must hold: every rank's sampler shuffles with one and the "
                          "same seed, the one the run's --seed gives, so the ranks cut their "
                          "slices from one permutation."),
    "sampler_seed_ignored": ("the sampler's seed no longer comes from --seed: the check ran the "
                             "script with --seed 3, and the sampler shuffled as if it were 0.",
                             "What must hold: the sampler's seed follows the run's --seed (a "
                             "run with another --seed shuffles otherwise), and is the same on "
                             "every rank."),
    "no_sampler": ("the loader still ignores the DistributedSampler: every rank reads every "
                   "example, so the ranks duplicate each other's work.",
                   "Pass sampler=sampler to the DataLoader, and no shuffle."),
    "no_sampler_in_order": ("the loader still ignores the DistributedSampler (without shuffle "
                            "it now reads the data in order): every rank reads every example.",
                            "The loader must draw from the sampler (sampler=sampler)."),
    "clip_local": ("each rank still clips its own gradient before the average, so the norm "
                   "clipped is one rank's, not the global batch's.",
                   "Clip once the gradients are averaged, just before opt.step()."),
    "no_clip": ("the gradients are no longer clipped at all: the weights match a run without "
                "clipping.", "Keep the clipping, after the average."),
    "no_broadcast": ("the replicas no longer start from the same weights: each rank keeps what "
                     "its own seed drew, so their averaged gradients step different models.",
                     "Keep the broadcast, with one sender named on every rank."),
    "divided_twice": ("the gradients are still divided by world_size twice (once through the "
                      "loss, once after all_reduce): every step is world_size times too "
                      "small.", "Divide once."),
    "grad_sum": ("the gradients are now summed, not averaged: every step is world_size times "
                 "too large.", "Divide by world_size exactly once, in the loss or after "
                                "all_reduce."),
    "halved": ("on 3 ranks the gradients were divided by 2, a number true on 2 ranks only.",
               "Divide by world_size."),
}
# which mistakes each script's fix is compared with, when its weights are wrong
SUSPECTS = {1: ("sampler_seed_rank", "sampler_seed_ignored"),
            2: ("no_sampler", "no_sampler_in_order"),
            3: ("clip_local", "no_clip"), 4: ("no_broadcast",),
            5: ("divided_twice", "grad_sum", "halved")}


def _data():
    import torch

    g = torch.Generator().manual_seed(1234)
    X = torch.randn(48, 6, generator=g)
    y = torch.tanh(X @ torch.randn(6, 1, generator=g))
    return X, y


@functools.lru_cache(maxsize=64)
def _simulate(world_size: int, seed: int, variant: str, clip, init_from: int = 0,
              replica: int = 0) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    known = ("correct", *BUGS)
    if variant not in known:
        raise ValueError(f"unknown variant {variant!r}: one of {known}")
    X, y = _data()
    ds = TensorDataset(X, y)
    if variant in ("no_sampler", "no_sampler_in_order"):
        # every rank reads everything, in the same order: the ranks are one replica
        torch.manual_seed(seed + init_from)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        loader = DataLoader(ds, batch_size=4, shuffle=variant == "no_sampler")
        for epoch in range(3):
            for xb, yb in loader:
                o.zero_grad()
                F.mse_loss(m(xb), yb).backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                o.step()
        return {k: v.detach().clone() for k, v in m.state_dict().items()}
    sampler_seed = {"sampler_seed_ignored": 0}.get(variant, seed)
    samplers = [DistributedSampler(ds, num_replicas=world_size, rank=r,
                                   seed=sampler_seed + (r if variant == "sampler_seed_rank" else 0))
                for r in range(world_size)]
    loaders = [DataLoader(ds, batch_size=4, sampler=s) for s in samplers]
    models, opts = [], []
    for r in range(world_size):
        # every replica starts from rank init_from's weights (a broadcast from it), or, with no
        # broadcast, from what its own seed drew
        torch.manual_seed(seed + (r if variant == "no_broadcast" else init_from))
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        models.append(m)
        opts.append(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    divide = {"grad_sum": 1, "halved": 2, "divided_twice": world_size ** 2}.get(variant,
                                                                                 world_size)
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        for batches in zip(*loaders):
            for m, o, (xb, yb) in zip(models, opts, batches):
                o.zero_grad()
                F.mse_loss(m(xb), yb).backward()
                if clip is not None and variant == "clip_local":
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            for ps in zip(*(m.parameters() for m in models)):
                total = ps[0].grad.clone()
                for p in ps[1:]:
                    total += p.grad
                for p in ps:
                    p.grad.copy_(total / divide)
            if clip is not None and variant not in ("clip_local", "no_clip"):
                for m in models:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            for o in opts:
                o.step()
    return {k: v.detach().clone() for k, v in models[replica].state_dict().items()}


def simulate(world_size: int = 2, seed: int = SEED, variant: str = "correct",
             clip: float | None = None, init_from: int = 0) -> dict:
    """Rank 0's final weights for the lab's training on ``world_size`` ranks, done right
    (``"correct"``) or with one of the mistakes in :data:`BUGS`, all replicas in this process;
    ``clip``: the gradient-norm clipping of script 3 (after the average when done right);
    ``init_from``: the rank whose initial weights (``seed + init_from``) every replica starts
    from — script 4 seeds each rank differently and broadcasts one rank's weights."""
    return {k: v.clone() for k, v in _simulate(world_size, seed, variant, clip,
                                               init_from).items()}


def _distance(a: dict, b: dict) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].shape == b[k].shape
               else float("inf") for k in a)
