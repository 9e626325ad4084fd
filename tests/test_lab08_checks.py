"""lab08's checks: shard_bounds (in process), ZeroOne and the stretch's ZeroTwo (2 and 3 gloo
ranks, next to DDP).

Every wrong answer must fail with the sentence that names its mistake; every right variant
(another way to round up, all-reduce then slice, the old collective names, list collectives,
torch's flatten helpers, async collectives, buckets instead of one group per parameter...) must
pass. Launches are the slow part, so the classes run together: one launch per configuration
calls the check's own worker for every class (``run_classes``) and each test reads its result
through the check's own diagnosis; a few tests run the checks end to end.
"""

import math
import re
import sys
import time

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from dpcourse.checks import LabCheckError, lab08

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# --------------------------------------------------------------------------------------------
# shard_bounds
# --------------------------------------------------------------------------------------------


def negated_floor(numel, rank, world_size):
    size = -(-numel // world_size)
    return rank * size, (rank + 1) * size


def integer_ceil(numel, rank, world_size):
    size = (numel + world_size - 1) // world_size
    return rank * size, (rank + 1) * size


def math_ceil(numel, rank, world_size):
    size = math.ceil(numel / world_size)
    return rank * size, (rank + 1) * size


def as_list(numel, rank, world_size):
    size = math.ceil(numel / world_size)
    return [rank * size, rank * size + size]


def numpy_ints(numel, rank, world_size):
    size = np.int64(np.ceil(numel / world_size))
    return np.int64(rank) * size, np.int64(rank + 1) * size


@pytest.mark.parametrize("fn", [negated_floor, integer_ceil, math_ceil, as_list, numpy_ints])
def test_right_shard_bounds_pass(fn, capsys):
    lab08.check_shard_bounds(fn)
    assert capsys.readouterr().out.count("✔") == 1


def floor_size(numel, rank, world_size):
    size = numel // world_size
    return rank * size, (rank + 1) * size


def inclusive_end(numel, rank, world_size):
    size = math.ceil(numel / world_size)
    return rank * size, (rank + 1) * size - 1


def overlapping(numel, rank, world_size):
    size = math.ceil(numel / world_size)
    return rank * size, (rank + 1) * size + 1


def clipped(numel, rank, world_size):
    size = math.ceil(numel / world_size)
    return rank * size, min((rank + 1) * size, numel)


def start_and_length(numel, rank, world_size):
    size = math.ceil(numel / world_size)
    return rank * size, size


def reversed_ranks(numel, rank, world_size):
    return math_ceil(numel, world_size - 1 - rank, world_size)


def one_based(numel, rank, world_size):
    size = math.ceil(numel / world_size)
    return rank * size + 1, (rank + 1) * size + 1


def as_slice(numel, rank, world_size):
    return slice(*math_ceil(numel, rank, world_size))


def only_the_start(numel, rank, world_size):
    return rank * math.ceil(numel / world_size)


@pytest.mark.parametrize("fn, phrase", [
    (floor_size, "size rounded down"),
    (inclusive_end, "belong to no rank — end is exclusive"),
    (overlapping, "both own numbers .* must not overlap"),
    (clipped, "last shard is clipped at numel"),
    (start_and_length, "that is \\(start, length\\)"),
    (reversed_ranks, "rank r must own the r-th shard"),
    (one_based, "numbers 0..0 belong to no rank — rank 0 starts at 0"),
    (as_slice, "return two integers"),
    (only_the_start, "return two integers"),
])
def test_wrong_shard_bounds_are_named(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab08.check_shard_bounds(fn)


def test_unfinished_shard_bounds_is_not_implemented():
    def shard_bounds(numel, rank, world_size):
        raise NotImplementedError("TODO")

    with pytest.raises(NotImplementedError, match="replace the TODO"):
        lab08.check_shard_bounds(shard_bounds)


# --------------------------------------------------------------------------------------------
# ZeroOne: the answers a learner could write
# --------------------------------------------------------------------------------------------


def pad_to(flat, n):
    return nn.functional.pad(flat, (0, n - flat.numel()))


class Good:
    # the solution, as in the lab
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.end = math_ceil(self.numel, self.rank, self.world_size)
        self.padded = (self.end - self.start) * self.world_size
        flat = pad_to(torch.cat([p.detach().reshape(-1) for p in self.params]), self.padded)
        self.shard = self.make_shard(flat)
        self.optimizer = optimizer_cls([self.shard], **kwargs)

    def make_shard(self, flat):
        return flat[self.start:self.end].clone().requires_grad_(True)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def flat_grads(self):
        return pad_to(torch.cat([p.grad.reshape(-1) for p in self.params]), self.padded)

    def reduce(self, grads):
        mine = torch.empty(self.end - self.start)
        dist.reduce_scatter_single(mine, grads)
        return mine / self.world_size

    def gather(self):
        full = torch.empty(self.padded)
        dist.all_gather_single(full, self.shard.detach())
        return full

    def copy_back(self, full):
        offset = 0
        for p in self.params:
            p.data.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def step(self):
        self.shard.grad = self.reduce(self.flat_grads())
        self.optimizer.step()
        self.copy_back(self.gather())


class AllReduceThenSlice(Good):
    def reduce(self, grads):
        dist.all_reduce(grads)
        return grads[self.start:self.end] / self.world_size


class OldNames(Good):
    def reduce(self, grads):
        mine = torch.empty(self.end - self.start)
        dist.reduce_scatter_tensor(mine, grads)
        return mine / self.world_size

    def gather(self):
        full = torch.empty(self.padded)
        dist.all_gather_into_tensor(full, self.shard.detach())
        return full


class ListCollectives(Good):
    def reduce(self, grads):
        mine = torch.empty(self.end - self.start)
        dist.reduce_scatter(mine, list(grads.chunk(self.world_size)))
        return mine / self.world_size

    def gather(self):
        pieces = [torch.empty_like(self.shard) for _ in range(self.world_size)]
        dist.all_gather(pieces, self.shard.detach())
        return torch.cat(pieces)


class DivideFirst(Good):
    def reduce(self, grads):
        grads /= self.world_size
        mine = torch.empty(self.end - self.start)
        dist.reduce_scatter_single(mine, grads)
        return mine


class AsyncCollectives(Good):
    def reduce(self, grads):
        mine = torch.empty(self.end - self.start)
        dist.reduce_scatter_single(mine, grads, async_op=True).wait()
        return mine.div_(self.world_size)

    def gather(self):
        full = torch.empty(self.padded)
        dist.all_gather_single(full, self.shard.detach(), async_op=True).wait()
        return full


class FlattenHelpers(Good):
    def flat_grads(self):
        return pad_to(_flatten_dense_tensors([p.grad for p in self.params]), self.padded)

    def copy_back(self, full):
        views = _unflatten_dense_tensors(full[:self.numel], [p.data for p in self.params])
        for p, v in zip(self.params, views):
            p.data.copy_(v)


class VectorHelpers(Good):
    def flat_grads(self):
        return pad_to(parameters_to_vector(p.grad for p in self.params), self.padded)

    def copy_back(self, full):
        vector_to_parameters(full[:self.numel], self.params)


class ShardAsParameter(Good):
    def make_shard(self, flat):
        return nn.Parameter(flat[self.start:self.end].clone())


class ZeroGradInPlace(Good):
    def zero_grad(self):
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()
        self.optimizer.zero_grad()


class AverageOp(Good):
    # gloo on torch 2.14 has ReduceOp.AVG: no division needed
    def reduce(self, grads):
        mine = torch.empty(self.end - self.start)
        dist.reduce_scatter_single(mine, grads, op=dist.ReduceOp.AVG)
        return mine


class Broadcasts(Good):
    # each rank broadcasts its shard in turn: N messages instead of one all-gather
    def gather(self):
        pieces = []
        for r in range(self.world_size):
            piece = self.shard.detach().clone() if r == self.rank else torch.empty_like(self.shard)
            dist.broadcast(piece, src=r)
            pieces.append(piece)
        return torch.cat(pieces)


RIGHT_ONES = [Good, AllReduceThenSlice, OldNames, ListCollectives, DivideFirst,
              AsyncCollectives, FlattenHelpers, VectorHelpers, ShardAsParameter, ZeroGradInPlace,
              AverageOp, Broadcasts]


class WholeModel(Good):
    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.optimizer = optimizer_cls(self.params, **kwargs)

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= self.world_size
        self.optimizer.step()


class NoAllGather(Good):
    def gather(self):
        full = torch.zeros(self.padded)
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        full[:self.numel] = flat
        full[self.start:self.end] = self.shard.detach()
        return full


class Summed(Good):
    def reduce(self, grads):
        mine = torch.empty(self.end - self.start)
        dist.reduce_scatter_single(mine, grads)
        return mine


class DividedTwice(DivideFirst):
    def reduce(self, grads):
        return super().reduce(grads) / self.world_size


class OffsetNotAdvanced(Good):
    def copy_back(self, full):
        for p in self.params:
            p.data.copy_(full[:p.numel()].view_as(p))


class GradSliceTooShort(AllReduceThenSlice):
    def reduce(self, grads):
        dist.all_reduce(grads)
        return grads[self.start:self.end - 1] / self.world_size


class NonLeafShard(Good):
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.end = math_ceil(self.numel, self.rank, self.world_size)
        self.padded = (self.end - self.start) * self.world_size
        flat = pad_to(torch.cat([p.reshape(-1) for p in self.params]), self.padded)
        self.shard = flat[self.start:self.end].clone()
        self.optimizer = optimizer_cls([self.shard], **kwargs)


class OneTooLong(Good):
    def make_shard(self, flat):
        return flat[self.start:self.end + 1].clone().requires_grad_(True)


class OneTooShort(Good):
    def make_shard(self, flat):
        return flat[self.start:self.end - 1].clone().requires_grad_(True)


class CutAtNumel(Good):
    def make_shard(self, flat):
        return flat[self.start:min(self.end, self.numel)].clone().requires_grad_(True)


class LocalGradients(Good):
    def reduce(self, grads):
        return grads[self.start:self.end].clone()


class NoCopyBack(Good):
    def copy_back(self, full):
        pass


class NoInnerStep(Good):
    def step(self):
        self.shard.grad = self.reduce(self.flat_grads())
        self.copy_back(self.gather())


class ZeroGradKeeps(Good):
    def zero_grad(self):
        self.optimizer.zero_grad()


class ShiftedGradient(Good):
    # all-reduce, then the slice one to the right: every number stepped with its neighbour's
    def reduce(self, grads):
        dist.all_reduce(grads)
        grads = torch.cat([grads, torch.zeros(1)])
        return grads[self.start + 1:self.end + 1] / self.world_size


WRONG_ONES = [
    (WholeModel, "steps all 53 numbers of the model.*no memory saved"),
    (NoAllGather, "each rank changed only its own shard"),
    (Summed, "you summed the gradients over the ranks"),
    (OneTooLong, "not ceil\\(53 / \\d\\) = \\d+: one more — an off-by-one"),
    (OneTooShort, "not ceil\\(53 / \\d\\) = \\d+: one fewer — an off-by-one"),
    (CutAtNumel, "the last shard was cut at numel = 53"),
    (LocalGradients, "the gradients were never averaged"),
    (NoCopyBack, "the weights have not changed: copy the gathered shards back"),
    (NoInnerStep, "the weights have not changed"),
    (ZeroGradKeeps, "gradients of the earlier steps are added.*zero_grad\\(\\) must clear"),
    (ShiftedGradient, "differ from DDP \\+ (adam|sgd) at"),
    (DividedTwice, "you divided by the world size twice"),
    (OffsetNotAdvanced, "every parameter holds the first numbers .* advance the offset"),
    (GradSliceTooShort, "raised on rank 0: .*self.shard.grad must be this rank's slice"),
    (NonLeafShard, "can't optimize a non-leaf .*from detached values \\(p\\.detach"),
]

# --------------------------------------------------------------------------------------------
# ZeroTwo (the stretch): the answers a learner could write
# --------------------------------------------------------------------------------------------


class GoodTwo:
    # the solution, as in the lab: one group per parameter
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.where = {}
        pieces, offset = [], 0
        for p in self.params:
            start, end = math_ceil(p.numel(), self.rank, self.world_size)
            flat = pad_to(p.detach().reshape(-1), (end - start) * self.world_size)
            pieces.append(flat[start:end])
            self.where[p] = (end - start, offset)
            offset += end - start
        self.shard = torch.cat(pieces).clone().requires_grad_(True)
        self.shard.grad = torch.zeros_like(self.shard)
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        self.register()

    def register(self):
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def reduce_into(self, mine, flat):
        dist.reduce_scatter_single(mine, flat)
        mine /= self.world_size

    def _grad_ready(self, p):
        size, offset = self.where[p]
        flat = pad_to(p.grad.reshape(-1), size * self.world_size)
        self.reduce_into(self.shard.grad[offset:offset + size], flat)
        p.grad = None

    def gather_into(self, p):
        size, offset = self.where[p]
        full = torch.empty(size * self.world_size)
        dist.all_gather_single(full, self.shard.detach()[offset:offset + size])
        p.data.copy_(full[:p.numel()].view_as(p))

    def step(self):
        self.optimizer.step()
        for p in self.params:
            self.gather_into(p)


class TwoAllReduce(GoodTwo):
    def reduce_into(self, mine, flat):
        dist.all_reduce(flat)
        r = self.rank
        mine.copy_(flat[r * mine.numel():(r + 1) * mine.numel()] / self.world_size)


class TwoAsync(GoodTwo):
    # launched in the hook, waited in step(): the reduce-scatter overlaps the backward
    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.pending = []

    def reduce_into(self, mine, flat):
        work = dist.reduce_scatter_single(mine, flat, async_op=True)
        self.pending.append((work, mine, flat))

    def step(self):
        for work, mine, _ in self.pending:
            work.wait()
            mine /= self.world_size
        self.pending = []
        super().step()


class TwoOneGather(GoodTwo):
    # one all-gather of the whole shard, then each parameter's slices picked out of it
    def step(self):
        self.optimizer.step()
        n = self.shard.numel()
        full = torch.empty(n * self.world_size)
        dist.all_gather_single(full, self.shard.detach())
        for p in self.params:
            size, offset = self.where[p]
            pieces = [full[r * n + offset:r * n + offset + size] for r in range(self.world_size)]
            p.data.copy_(torch.cat(pieces)[:p.numel()].view_as(p))


class TwoAccumulates(GoodTwo):
    # adds into the shard's gradient (gradient accumulation works) and zeroes it in zero_grad
    def reduce_into(self, mine, flat):
        out = torch.empty_like(mine)
        dist.reduce_scatter_single(out, flat)
        mine += out / self.world_size

    def zero_grad(self):
        super().zero_grad()
        self.shard.grad.zero_()


class TwoBuckets(GoodTwo):
    # groups of parameters in backward order (at most 20 numbers each, lesson 07's rule), each
    # group flattened, padded and sharded as one; reduce-scattered once its last gradient is in
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.groups, current = [], []
        for p in reversed(self.params):
            if current and sum(q.numel() for q in current) + p.numel() > 20:
                self.groups.append(current)
                current = []
            current.append(p)
        self.groups.append(current)
        self.sizes, pieces = [], []
        for group in self.groups:
            flat = torch.cat([q.detach().reshape(-1) for q in group])
            start, end = math_ceil(flat.numel(), self.rank, self.world_size)
            pieces.append(pad_to(flat, (end - start) * self.world_size)[start:end])
            self.sizes.append(end - start)
        self.shard = torch.cat(pieces).clone().requires_grad_(True)
        self.shard.grad = torch.zeros_like(self.shard)
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        self.group_of = {p: i for i, g in enumerate(self.groups) for p in g}
        self.waiting = [len(g) for g in self.groups]
        self.register()

    def _grad_ready(self, p):
        i = self.group_of[p]
        self.waiting[i] -= 1
        if self.waiting[i]:
            return
        self.waiting[i] = len(self.groups[i])
        group, size = self.groups[i], self.sizes[i]
        flat = pad_to(torch.cat([q.grad.reshape(-1) for q in group]), size * self.world_size)
        offset = sum(self.sizes[:i])
        self.reduce_into(self.shard.grad[offset:offset + size], flat)
        for q in group:
            q.grad = None

    def step(self):
        self.optimizer.step()
        offset = 0
        for group, size in zip(self.groups, self.sizes):
            full = torch.empty(size * self.world_size)
            dist.all_gather_single(full, self.shard.detach()[offset:offset + size])
            offset += size
            start = 0
            for q in group:
                q.data.copy_(full[start:start + q.numel()].view_as(q))
                start += q.numel()


RIGHT_TWOS = [GoodTwo, TwoAllReduce, TwoAsync, TwoOneGather, TwoAccumulates, TwoBuckets]


class TwoNeverDrops(GoodTwo):
    def _grad_ready(self, p):
        size, offset = self.where[p]
        flat = pad_to(p.grad.reshape(-1), size * self.world_size)
        self.reduce_into(self.shard.grad[offset:offset + size], flat)


class TwoTensorHook(GoodTwo):
    # a hook on the gradient before it is accumulated: p.grad is set after it, and stays
    def register(self):
        for p in self.params:
            p.register_hook(lambda grad, p=p: self._reduce(p, grad))

    def _reduce(self, p, grad):
        size, offset = self.where[p]
        flat = pad_to(grad.reshape(-1), size * self.world_size)
        self.reduce_into(self.shard.grad[offset:offset + size], flat)


class TwoWholeModelAtOnce(GoodTwo):
    # waits for every gradient, then reduce-scatters them all in the last hook
    def _grad_ready(self, p):
        self.seen = getattr(self, "seen", 0) + 1
        if self.seen < len(self.params):
            return
        self.seen = 0
        for q in self.params:
            super()._grad_ready(q)


class TwoSavesGradients(GoodTwo):
    # drops p.grad, but keeps the tensor and reduce-scatters everything in step()
    def _grad_ready(self, p):
        self.saved = getattr(self, "saved", {})
        self.saved[p] = p.grad
        p.grad = None

    def step(self):
        for p, g in self.saved.items():
            p.grad = g
            super()._grad_ready(p)
        self.saved = {}
        super().step()


class TwoSummed(GoodTwo):
    def reduce_into(self, mine, flat):
        dist.reduce_scatter_single(mine, flat)


class TwoAccumulatesForever(TwoAccumulates):
    def zero_grad(self):
        GoodTwo.zero_grad(self)


class TwoNoAllGather(GoodTwo):
    def gather_into(self, p):
        size, offset = self.where[p]
        start = self.rank * size
        flat = p.detach().reshape(-1).clone()
        mine = self.shard.detach()[offset:offset + size]
        n = max(0, min(size, p.numel() - start))
        flat[start:start + n] = mine[:n]
        p.data.copy_(flat.view_as(p))


class TwoLocalOnly(GoodTwo):
    def reduce_into(self, mine, flat):
        mine.copy_(flat[self.rank * mine.numel():(self.rank + 1) * mine.numel()])


class TwoArrivalOffsets(GoodTwo):
    # offsets counted in the order the gradients arrive, not the order of the shard
    def _grad_ready(self, p):
        size, _ = self.where[p]
        self.cursor = getattr(self, "cursor", 0)
        flat = pad_to(p.grad.reshape(-1), size * self.world_size)
        self.reduce_into(self.shard.grad[self.cursor:self.cursor + size], flat)
        self.cursor = (self.cursor + size) % self.shard.numel()
        p.grad = None


WRONG_TWOS = [
    (Good, "you kept all full gradients until step\\(\\)"),
    (TwoSavesGradients, "you kept all full gradients until step\\(\\)"),
    (TwoNeverDrops, "reduce-scattered during the backward, but all 53 .* set p.grad = None"),
    (TwoTensorHook, "reduce-scattered during the backward, but all 53 .* set p.grad = None"),
    (TwoWholeModelAtOnce, "waited for the whole model before reduce-scattering"),
    (TwoSummed, "you summed the gradients over the ranks"),
    (TwoAccumulatesForever, "gradients of the earlier steps are added"),
    (TwoNoAllGather, "each rank changed only its own shard"),
    (TwoLocalOnly, "the gradients were never averaged"),
    (TwoArrivalOffsets, "differ from DDP \\+ (adam|sgd) at"),
]

# --------------------------------------------------------------------------------------------
# One launch per configuration for all of them
# --------------------------------------------------------------------------------------------

STAGE_ONE = RIGHT_ONES + [cls for cls, _ in WRONG_ONES]
STAGE_TWO = RIGHT_TWOS + [cls for cls, _ in WRONG_TWOS]


def run_one(rank, world_size, cls, opt_name, stage):
    # the answers that raise here raise on every rank at the same point: none is left waiting
    try:
        return lab08._zero_worker(rank, world_size, cls, opt_name, stage)
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}


def run_classes(rank, world_size, opt_name):
    torch.set_num_threads(1)
    return ([run_one(rank, world_size, cls, opt_name, 1) for cls in STAGE_ONE],
            [run_one(rank, world_size, cls, opt_name, 2) for cls in STAGE_TWO])


@pytest.fixture(scope="module", params=lab08.CONFIGS, ids=lambda c: f"{c[0]}-ranks-{c[1]}")
def results(request):
    from dpcourse import launch

    world_size, opt_name = request.param
    per_rank = launch.spawn(run_classes, world_size, opt_name, backend="gloo", timeout=90,
                            show_output=False)
    got = {}
    for stage, classes in ((1, STAGE_ONE), (2, STAGE_TWO)):
        for i, cls in enumerate(classes):
            got[stage, cls.__name__] = [r[stage - 1][i] for r in per_rank]
    return world_size, opt_name, got


def diagnose(results, cls, stage):
    world_size, opt_name, got = results
    per_rank = got[stage, cls.__name__]
    if "raised" in per_rank[0]:
        lab08._raised(0, per_rank[0]["raised"])
    return lab08._diagnose(per_rank, world_size, opt_name, stage)


# Adam divides by the gradients' own scale: gradients N times too large or too small step
# (almost) like the right ones, and only the SGD configuration must name the mistake.
SCALE_BLIND = {"Summed", "DividedTwice", "TwoSummed"}


def expect_named(results, cls, stage, phrase):
    _, opt_name, _ = results
    if cls.__name__ in SCALE_BLIND and opt_name == "adam":
        try:
            diagnose(results, cls, stage)
        except LabCheckError as err:
            assert re.search(phrase, str(err)), str(err)
        return
    with pytest.raises(LabCheckError, match=phrase):
        diagnose(results, cls, stage)


@pytest.mark.parametrize("cls", RIGHT_ONES, ids=lambda c: c.__name__)
def test_right_zero_ones_pass(results, cls):
    diagnose(results, cls, 1)


@pytest.mark.parametrize("cls, phrase", WRONG_ONES, ids=[c.__name__ for c, _ in WRONG_ONES])
def test_wrong_zero_ones_are_named(results, cls, phrase):
    expect_named(results, cls, 1, phrase)


@pytest.mark.parametrize("cls", RIGHT_TWOS, ids=lambda c: c.__name__)
def test_right_zero_twos_pass(results, cls):
    assert "of 53" in diagnose(results, cls, 2)


@pytest.mark.parametrize("cls, phrase", WRONG_TWOS, ids=[c.__name__ for c, _ in WRONG_TWOS])
def test_wrong_zero_twos_are_named(results, cls, phrase):
    expect_named(results, cls, 2, phrase)


def test_the_peak_is_one_parameter_for_the_solution_and_the_model_for_zero_one(results):
    world_size, opt_name, got = results
    assert diagnose(results, GoodTwo, 2).startswith("30 of 53")      # the 6×5 weight alone
    assert max(s["peak"] for r in got[1, "Good"] for s in r["steps"]) == 53


# --------------------------------------------------------------------------------------------
# End to end: the checks as the lab calls them
# --------------------------------------------------------------------------------------------


def test_check_zero_one_end_to_end(capsys):
    lab08.check_zero_one(Good)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "216 B of 424 B on 2 ranks (adam)" in out


def test_check_zero_two_end_to_end(capsys):
    lab08.check_zero_two(GoodTwo, configs=((3, "sgd"),))
    assert "during the backward, at most: 30 of 53 on 3 ranks (sgd)" in capsys.readouterr().out
    with pytest.raises(LabCheckError, match="kept all full gradients until step"):
        lab08.check_zero_two(Good, configs=((2, "adam"),))


class Unpadded(Good):
    # the parameters were padded, the gradients not: the reduce-scatter gets 53 numbers
    def flat_grads(self):
        return torch.cat([p.grad.reshape(-1) for p in self.params])


def test_unpadded_vector_raises_with_the_padding_hint():
    with pytest.raises(LabCheckError, match="raised on rank .*pad the flat vector to a multiple"):
        lab08.check_zero_one(Unpadded, configs=((2, "adam"),))


class OnlyRankZeroGathers(Good):
    def gather(self):
        if self.rank == 0:
            return super().gather()
        return NoAllGather.gather(self)


def test_a_deadlock_is_stopped_and_its_ranks_named():
    t0 = time.monotonic()
    with pytest.raises(LabCheckError, match="rank\\(s\\) [0-9, ]+ never finished within 5 s — "
                                            "a deadlock"):
        lab08.check_zero_one(OnlyRankZeroGathers, configs=((2, "adam"),), timeout=5)
    assert time.monotonic() - t0 < 15


class Todo(Good):
    def step(self):
        raise NotImplementedError("TODO: reduce-scatter, step, all-gather")


@pytest.mark.parametrize("check", [lab08.check_zero_one, lab08.check_zero_two])
def test_unfinished_class_is_not_implemented_without_launching(check):
    t0 = time.monotonic()
    with pytest.raises(NotImplementedError, match="replace the TODOs"):
        check(Todo)
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("check", [lab08.check_zero_one, lab08.check_zero_two])
def test_an_instance_instead_of_the_class_is_named(check):
    with pytest.raises(LabCheckError, match="your class itself"):
        check(object())
