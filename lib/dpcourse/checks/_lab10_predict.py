"""Lab 10's prediction (solutions/lab10_bug_hunt.py, after bug 1): how many distinct examples of
the 48 script 1's two ranks read in one epoch, each rank's DistributedSampler seeded with its own
seed; counted here, compared with the learner's guess, and explained.

Exported by :mod:`dpcourse.checks.lab10`, where the lab calls it.
"""

from __future__ import annotations

from dpcourse.checks import reveal
from dpcourse.checks._lab10_scripts import SEED

__all__ = ["examples_read", "check_prediction"]


def examples_read(world_size: int = 2, seed: int = SEED, epoch: int = 0) -> int:
    """How many of the 48 examples the ranks of script 1 read, together, in one epoch: each
    rank's DistributedSampler seeded ``seed + rank`` as the script does, each rank's slice of
    its own permutation collected, the distinct indices counted. (A right script reads 48.)"""
    import torch
    from torch.utils.data import DistributedSampler

    dataset = torch.arange(48)
    read = set()
    for r in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=r, seed=seed + r)
        sampler.set_epoch(epoch)
        read.update(sampler)
    return len(read)


def check_prediction(guess) -> None:
    """Compare the learner's prediction of :func:`examples_read` for script 1 (two ranks, one
    epoch) with the count, and say where the count comes from."""
    __tracebackhide__ = True
    measured = examples_read()
    expected = 48 - 48 // 4
    reveal(guess, measured, close=isinstance(guess.value, (int, float))
           and abs(guess.value - measured) <= 6,
           explanation=f"Each rank reads its half of its own permutation, so an example is in "
                       f"rank 0's half with probability 1/2 and, independently, in rank 1's "
                       f"with 1/2: about a quarter of the data (12) is read by neither rank and "
                       f"a quarter by both, so about {expected} distinct examples per epoch — "
                       f"this run read {measured}. One shared seed cuts ONE permutation into "
                       f"disjoint halves: all 48, each once.")
