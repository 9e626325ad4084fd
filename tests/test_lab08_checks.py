"""lab08's checks: shard_bounds (in process) and ZeroTwo, ZeRO-2 reduce-scattered bucket by
bucket during the backward (2 and 3 gloo ranks, next to DDP, on a model with a frozen and a
tied parameter).

Every wrong answer must fail with the sentence that names its mistake; every right variant
(another way to round up, one bucket per parameter, two buckets in flight, the old collective
names, list collectives, dividing first, asynchronous all-gathers, futures...) must pass. Launches are the slow part, so the classes run together: one launch per configuration
calls the check's own worker for every class (``run_classes``) and each test reads its result
through the check's own diagnosis; a few tests run the checks end to end.
"""

import math
import re
import sys
import time
import warnings

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
import torch.nn.functional as F

from conftest import distinct_run, launches_replayed
from dpcourse.checks import LabCheckError, lab08

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# --------------------------------------------------------------------------------------------
# shard_bounds
# --------------------------------------------------------------------------------------------


def unit_of(element_size):
    return 16 // element_size


def negated_floor(numel, rank, world_size, element_size):
    unit = unit_of(element_size)
    size = -(-numel // world_size)
    size = -(-size // unit) * unit
    return rank * size, (rank + 1) * size


def integer_ceil(numel, rank, world_size, element_size):
    unit = unit_of(element_size)
    size = (numel + world_size * unit - 1) // (world_size * unit) * unit
    return rank * size, (rank + 1) * size


def math_ceil(numel, rank, world_size, element_size):
    size = math.ceil(numel / world_size / unit_of(element_size)) * unit_of(element_size)
    return rank * size, (rank + 1) * size


def in_bytes(numel, rank, world_size, element_size):
    piece_bytes = math.ceil(numel * element_size / world_size / 16) * 16
    size = piece_bytes // element_size
    return rank * size, (rank + 1) * size


def as_list(numel, rank, world_size, element_size):
    start, end = math_ceil(numel, rank, world_size, element_size)
    return [start, end]


def numpy_ints(numel, rank, world_size, element_size):
    size = np.int64(np.ceil(numel / (world_size * unit_of(element_size)))) * \
        unit_of(element_size)
    return np.int64(rank) * size, np.int64(rank + 1) * size


@pytest.mark.parametrize("fn", [negated_floor, integer_ceil, math_ceil, in_bytes, as_list,
                                numpy_ints])
def test_right_shard_bounds_pass(fn, capsys):
    lab08.check_shard_bounds(fn)
    out = capsys.readouterr().out
    assert out.count("✔") == 1
    assert "ceil" not in out and "numel / world_size" not in out   # what was checked, no formula


def aligned(numel, world_size, element_size):
    return math_ceil(numel, 0, world_size, element_size)[1]


# the design decision of part 1: where the padding goes so that every piece starts on 16 bytes


def plain_ceil(numel, rank, world_size, element_size):
    # lesson 08's equal pieces, rounded up: right until a piece must start on 16 bytes
    size = math.ceil(numel / world_size)
    return rank * size, (rank + 1) * size


def aligned_vector(numel, rank, world_size, element_size):
    # the whole vector padded to 16 bytes, then cut: its end is aligned, its pieces are not
    unit = unit_of(element_size)
    padded = math.ceil(numel / unit) * unit
    size = math.ceil(padded / world_size)
    return rank * size, (rank + 1) * size


def sixteen_numbers(numel, rank, world_size, element_size):
    # aligned to 16 numbers, not 16 bytes: every piece starts on the boundary, with padding
    # the collectives then send for nothing
    size = math.ceil(math.ceil(numel / world_size) / 16) * 16
    return rank * size, (rank + 1) * size


def fp32_only(numel, rank, world_size, element_size):
    # 16 bytes taken as 4 numbers, whatever the element size
    size = math.ceil(numel / world_size / 4) * 4
    return rank * size, (rank + 1) * size


def one_unit_too_long(numel, rank, world_size, element_size):
    size = aligned(numel, world_size, element_size) + unit_of(element_size)
    return rank * size, (rank + 1) * size


# the mistakes of equal pieces themselves, in pieces that are aligned where they can be


def floor_size(numel, rank, world_size, element_size):
    size = numel // world_size
    return rank * size, (rank + 1) * size


def inclusive_end(numel, rank, world_size, element_size):
    size = aligned(numel, world_size, element_size)
    return rank * size, (rank + 1) * size - 1


def overlapping(numel, rank, world_size, element_size):
    size = aligned(numel, world_size, element_size)
    return rank * size, (rank + 1) * size + 1


def clipped(numel, rank, world_size, element_size):
    size = aligned(numel, world_size, element_size)
    return rank * size, min((rank + 1) * size, numel)


def start_and_length(numel, rank, world_size, element_size):
    size = aligned(numel, world_size, element_size)
    return rank * size, size


def reversed_ranks(numel, rank, world_size, element_size):
    return math_ceil(numel, world_size - 1 - rank, world_size, element_size)


def one_based(numel, rank, world_size, element_size):
    size = aligned(numel, world_size, element_size)
    return rank * size + 1, (rank + 1) * size + 1


def as_slice(numel, rank, world_size, element_size):
    return slice(*math_ceil(numel, rank, world_size, element_size))


def one_too_long(numel, rank, world_size, element_size):
    size = numel // world_size + 1            # right when world_size does not divide numel
    return rank * size, (rank + 1) * size


def uneven(numel, rank, world_size, element_size):
    # the last ranks one number more: every number owned, the sizes differ
    size, extra = divmod(numel, world_size)
    first_long = world_size - extra
    start = rank * size + max(0, rank - first_long)
    return start, start + size + (rank >= first_long)


def only_the_start(numel, rank, world_size, element_size):
    return rank * aligned(numel, world_size, element_size)


def three_arguments(numel, rank, world_size):
    return math_ceil(numel, rank, world_size, 4)


@pytest.mark.parametrize("fn, phrase", [
    (plain_ceil, r"for numel=53 numbers of 4 B on 2 ranks .*: the pieces are equal, touch and "
                 r"own every number, but rank 1's piece starts at number 27, byte 108 of the "
                 r"vector, which is not on a 16-byte boundary"),
    (aligned_vector, r"for numel=53 numbers of 4 B on 3 ranks .*: you padded the vector to 56 "
                     r"numbers \(224 B, a whole number of 16-byte units\), but cut in 3 its "
                     r"pieces are 19 numbers \(76 B\) each, so rank 1's piece starts at byte "
                     r"76 — not on a 16-byte boundary"),
    (sixteen_numbers, r"for numel=53 numbers of 4 B on 2 ranks .*a multiple of 16 \*numbers\* "
                      r"\(64 B\) — the boundary is in bytes, and pieces 4 numbers shorter"),
    (fp32_only, r"for numel=53 numbers of 2 B on 3 ranks .*: pieces of 20 numbers of 2 B: rank "
                r"1's piece starts at number 20, byte 40, which is not on a 16-byte boundary"),
    (one_unit_too_long, r"every piece starts on a 16-byte boundary and every number is owned, "
                        r"but pieces 4 numbers shorter \(28\) would be too"),
    (floor_size, "too short — together they cover 52 of the 53 numbers, and the last 1 belong "
                 "to no rank: every number must have an owner"),
    (one_too_long, "rank 1's piece starts at number 27, byte 108 of the vector, which is not on "
                   "a 16-byte boundary"),
    (uneven, "piece sizes \\[.*\\] — a reduce-scatter and an all-gather move pieces of one size"),
    (inclusive_end, "belong to no rank — end is exclusive"),
    (overlapping, "both own numbers .* must not overlap"),
    (clipped, "last piece is clipped at numel, so it is shorter than the others"),
    (start_and_length, "that is \\(start, length\\)"),
    (reversed_ranks, "rank r must own the r-th piece"),
    (one_based, r"numbers 0..0 belong to no rank \(the first piece starts at 1\)"),
    (as_slice, "which is not two integers"),
    (only_the_start, "which is not two integers"),
    (three_arguments, "takes 3 positional arguments but 4 were given"),
])
def test_wrong_shard_bounds_are_named(fn, phrase):
    with pytest.raises((LabCheckError, TypeError), match=phrase):
        lab08.check_shard_bounds(fn)


@pytest.mark.parametrize("fn", [plain_ceil, aligned_vector], ids=lambda f: f.__name__)
def test_the_alignment_mistakes_say_what_to_change_the_second_time(fn):
    with pytest.raises(LabCheckError) as first:
        lab08.check_shard_bounds(fn)
    assert "whole number of 16-byte units." not in first.value.message
    with pytest.raises(LabCheckError, match="make each piece's length a whole number of "
                                            "16-byte units"):
        lab08.check_shard_bounds(fn)


def test_the_same_shard_bounds_mistake_met_twice_adds_what_to_change():
    with pytest.raises(LabCheckError) as first:
        lab08.check_shard_bounds(one_based)
    assert "rank 0 starts at 0" not in first.value.message
    with pytest.raises(LabCheckError, match="numbers 0..0 belong to no rank .*rank 0 starts at 0"):
        lab08.check_shard_bounds(one_based)


def test_unfinished_shard_bounds_is_not_implemented():
    def shard_bounds(numel, rank, world_size, element_size):
        raise NotImplementedError("TODO")

    with pytest.raises(NotImplementedError, match="replace the TODO"):
        lab08.check_shard_bounds(shard_bounds)


# --------------------------------------------------------------------------------------------
# ZeroTwo: the answers a learner could write
# --------------------------------------------------------------------------------------------


def make_buckets(params, cap):
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class GoodTwo:
    """The lab's answer, in small methods so that each wrong answer changes one of them."""

    def __init__(self, params, optimizer_cls, bucket_cap=128, **kwargs):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        trainable = self.trainable(params)
        self.buckets = self.group(trainable, bucket_cap)
        self.bucket_of, self.layout, pieces, offset = {}, [], [], 0
        for i, bucket in enumerate(self.buckets):
            numel = sum(p.numel() for p in bucket)
            size = self.piece(numel, bucket[0].element_size())
            flat = F.pad(torch.cat([p.detach().reshape(-1) for p in bucket]),
                         (0, size * self.world_size - numel))
            pieces.append(flat[self.rank * size:(self.rank + 1) * size])
            self.layout.append((size, offset))
            offset += size
            for p in bucket:
                self.bucket_of[p] = i
        self.shard = self.make_shard(pieces)
        self.shard.grad = self.make_shard_grad()
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        self.arrived = [0] * len(self.buckets)
        self.in_flight = []
        for p in self.hooked(params, trainable):
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def piece(self, numel, element_size):
        return aligned(numel, self.world_size, element_size)

    def trainable(self, params):
        return [p for p in params if p.requires_grad]

    def hooked(self, params, trainable):
        return trainable

    def group(self, trainable, cap):
        return make_buckets(trainable, cap)

    def make_shard(self, pieces):
        return nn.Parameter(torch.cat(pieces))

    def make_shard_grad(self):
        return torch.zeros_like(self.shard)

    def zero_grad(self):
        for bucket in self.buckets:
            for p in bucket:
                p.grad = None

    def _grad_ready(self, p):
        i = self.bucket_of[p]
        self.arrived[i] += 1
        if self.arrived[i] < len(self.buckets[i]):
            return
        self.arrived[i] = 0
        self.bucket_full(i)

    def bucket_full(self, i):
        self.before_launch()
        self.launch(i)

    def before_launch(self):
        self.finish(keep=0)

    def padded(self, i):
        size, _ = self.layout[i]
        numel = sum(q.numel() for q in self.buckets[i])
        buffer = F.pad(torch.cat([q.grad.reshape(-1) for q in self.buckets[i]]),
                       (0, size * self.world_size - numel))
        self.drop(i)
        return buffer

    def drop(self, i):
        for q in self.buckets[i]:
            q.grad = None

    def out(self, i):
        size, offset = self.layout[i]
        return self.shard.grad[offset:offset + size]

    def launch(self, i):
        buffer, out = self.padded(i), self.out(i)
        work = dist.reduce_scatter_single(out, buffer, async_op=True)
        self.in_flight.append((work, buffer, out))

    def finish(self, keep=0):
        while len(self.in_flight) > keep:
            work, buffer, out = self.in_flight.pop(0)
            self.wait(work)
            out /= self.world_size

    def wait(self, work):
        work.wait()

    def step(self):
        self.finish(keep=0)
        self.optimizer.step()
        self.gather()

    def gather(self):
        for bucket, (size, offset) in zip(self.buckets, self.layout):
            full = self.shard.new_empty(size * self.world_size)
            dist.all_gather_single(full, self.shard.detach()[offset:offset + size])
            start = 0
            for p in bucket:
                p.data.copy_(full[start:start + p.numel()].view_as(p))
                start += p.numel()


class TwoInFlight(GoodTwo):
    def before_launch(self):
        self.finish(keep=1)                       # wait for the bucket before the last one


class OneBucketPerParameter(GoodTwo):
    def group(self, trainable, cap):
        return [[p] for p in reversed(trainable)]


class OldNamesTwo(GoodTwo):
    def launch(self, i):
        buffer, out = self.padded(i), self.out(i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            work = dist.reduce_scatter_tensor(out, buffer, async_op=True)
        self.in_flight.append((work, buffer, out))

    def gather(self):
        for bucket, (size, offset) in zip(self.buckets, self.layout):
            full = self.shard.new_empty(size * self.world_size)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                dist.all_gather_into_tensor(full, self.shard.detach()[offset:offset + size])
            numels = [q.numel() for q in bucket]
            for p, piece in zip(bucket, full[:sum(numels)].split(numels)):
                p.data.copy_(piece.view_as(p))


class ListReduceScatter(GoodTwo):
    def launch(self, i):
        buffer, out = self.padded(i), self.out(i)
        work = dist.reduce_scatter(out, list(buffer.chunk(self.world_size)), async_op=True)
        self.in_flight.append((work, buffer, out))


class DivideFirstTwo(GoodTwo):
    def padded(self, i):
        return super().padded(i) / self.world_size

    def finish(self, keep=0):
        while len(self.in_flight) > keep:
            self.in_flight.pop(0)[0].wait()


class AsyncGathers(GoodTwo):
    def gather(self):
        pending = []
        for size, offset in self.layout:
            full = self.shard.new_empty(size * self.world_size)
            work = dist.all_gather_single(full, self.shard.detach()[offset:offset + size],
                                          async_op=True)
            pending.append((full, work))
        for bucket, (full, work) in zip(self.buckets, pending):
            work.wait()
            torch._utils._unflatten_dense_tensors  # noqa: B018 — a learner's import, unused
            numels = [q.numel() for q in bucket]
            for p, piece in zip(bucket, full[:sum(numels)].split(numels)):
                p.data.copy_(piece.view_as(p))


class AllReduceThenSlice(GoodTwo):
    # an all-reduce of the bucket, then this rank's slice: the same weights, twice the traffic
    def launch(self, i):
        buffer, out = self.padded(i), self.out(i)
        work = dist.all_reduce(buffer, async_op=True)
        self.in_flight.append((work, buffer, out))

    def finish(self, keep=0):
        while len(self.in_flight) > keep:
            work, buffer, out = self.in_flight.pop(0)
            work.wait()
            size = out.numel()
            out.copy_(buffer[self.rank * size:(self.rank + 1) * size] / self.world_size)


class BroadcastsFirst(GoodTwo):
    # the lab says every rank starts from the same weights, so a broadcast is not needed; a
    # learner who broadcasts rank 0's weights anyway (as lesson 08's Stage does) is right too
    def trainable(self, params):
        params = list(params)
        for p in params:
            dist.broadcast(p.data, src=0)
        return [p for p in params if p.requires_grad]


class CloneAndDivOut(GoodTwo):
    # the shard a clone of one slice per bucket; the mean by torch.div(..., out=)
    def make_shard(self, pieces):
        return nn.Parameter(torch.cat([piece.clone() for piece in pieces]))

    def finish(self, keep=0):
        while len(self.in_flight) > keep:
            work, buffer, out = self.in_flight.pop(0)
            work.wait()
            torch.div(out, self.world_size, out=out)


class CopyFreeThenWait(GoodTwo):
    # the new bucket is copied and its p.grad freed before the old bucket is waited for: once
    # freed, the old buffer and the new one are two buckets — but between the copy and the
    # free, the new bucket is alive twice beside the old one's buffer (refused since the check
    # weighs every line of the learner's hook)
    def bucket_full(self, i):
        buffer, out = self.padded(i), self.out(i)
        self.finish(keep=0)
        self.in_flight.append((dist.reduce_scatter_single(out, buffer, async_op=True), buffer,
                               out))


class WaitsLastAtBackwardEnd(GoodTwo):
    # each bucket waits for the one before it, and the last one is waited for by a callback
    # at the end of the backward instead of in step()
    def bucket_full(self, i):
        super().bucket_full(i)
        if i == len(self.buckets) - 1:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)


class LaunchThenWait(GoodTwo):
    # part 5's second order: copy, free and launch bucket k, then wait for bucket k - 1
    def bucket_full(self, i):
        self.launch(i)
        self.finish(keep=1)


class PreallocatedCopy(GoodTwo):
    # the buffer made first (with the parameters' dtype), each gradient copied in and freed
    # one by one, after the old bucket was waited for: at most the bucket twice
    def padded(self, i):
        size, _ = self.layout[i]
        buffer = self.buckets[i][0].grad.new_zeros(size * self.world_size)
        start = 0
        for q in self.buckets[i]:
            buffer[start:start + q.numel()] = q.grad.reshape(-1)
            start += q.numel()
            q.grad = None
        return buffer


class PieceInElements(GoodTwo):
    # the piece computed in bytes, then turned back into numbers
    def piece(self, numel, element_size):
        return in_bytes(numel, 0, self.world_size, element_size)[1]


class FirstListedSkipsNone(GoodTwo):
    # a bucket launched when its FIRST-listed parameter arrives, missing gradients read as
    # zeros: launched before it is full, at an arrival that is not its last-listed one
    def _grad_ready(self, p):
        i = self.bucket_of[p]
        if p is self.buckets[i][0]:
            for q in self.buckets[i]:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
            self.bucket_full(i)


class EveryGradPresent(GoodTwo):
    # no counter: a bucket is full when none of its p.grad is None any more (zero_grad sets
    # them to None, and launching one drops them)
    def _grad_ready(self, p):
        i = self.bucket_of[p]
        if all(q.grad is not None for q in self.buckets[i]):
            self.bucket_full(i)


class AvgOpTwo(GoodTwo):
    # the collective averages (gloo takes ReduceOp.AVG in torch 2.14): nothing to divide
    def launch(self, i):
        buffer, out = self.padded(i), self.out(i)
        work = dist.reduce_scatter_single(out, buffer, op=dist.ReduceOp.AVG, async_op=True)
        self.in_flight.append((work, buffer, out))

    def finish(self, keep=0):
        while len(self.in_flight) > keep:
            self.in_flight.pop(0)[0].wait()


RIGHT_TWOS = [GoodTwo, OneBucketPerParameter, OldNamesTwo, ListReduceScatter,
              DivideFirstTwo, AsyncGathers, AllReduceThenSlice, BroadcastsFirst,
              CloneAndDivOut, WaitsLastAtBackwardEnd, PreallocatedCopy, PieceInElements,
              EveryGradPresent, AvgOpTwo]


class PlainCeilPieces(GoodTwo):
    # the buckets cut in the smallest equal pieces, not shard_bounds' aligned ones
    def piece(self, numel, element_size):
        return math.ceil(numel / self.world_size)


class TwoLineCopy(GoodTwo):
    # the flat vector and its padded copy in two locals: the bucket three times at once
    def padded(self, i):
        size, _ = self.layout[i]
        numel = sum(q.numel() for q in self.buckets[i])
        flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
        buffer = F.pad(flat, (0, size * self.world_size - numel))
        self.drop(i)
        return buffer


class ShardView(GoodTwo):
    def make_shard(self, pieces):
        # every rank's slices of every bucket, padded, in one vector; the shard a slice of it
        mine = torch.cat(pieces)
        whole = torch.cat([mine] * self.world_size)
        return nn.Parameter(whole[:mine.numel()])


class ShardGradView(GoodTwo):
    def make_shard_grad(self):
        return self.shard.new_zeros(self.shard.numel() * self.world_size)[:self.shard.numel()]


class InStep(GoodTwo):
    def bucket_full(self, i):
        pass

    def step(self):
        for i in range(len(self.buckets)):
            self.launch(i)
        super().step()


class AllAtTheEnd(GoodTwo):
    def bucket_full(self, i):
        self.ready = getattr(self, "ready", []) + [i]
        if len(self.ready) == len(self.buckets):
            for j in self.ready:
                self.launch(j)
            self.ready = []


class LateByOne(GoodTwo):
    # each bucket launched only once the next one is full (the last one at once)
    def bucket_full(self, i):
        held, done = getattr(self, "held", None), getattr(self, "done", 0) + 1
        if held is not None:
            self.launch(held)
        self.held, self.done = i, done
        if done == len(self.buckets):
            self.launch(i)
            self.held, self.done = None, 0


class Blocking(GoodTwo):
    def launch(self, i):
        buffer, out = self.padded(i), self.out(i)
        dist.reduce_scatter_single(out, buffer)
        out /= self.world_size


class WaitRightAway(GoodTwo):
    def launch(self, i):
        super().launch(i)
        self.finish(keep=0)


class NeverWaited(GoodTwo):
    def finish(self, keep=0):
        if keep == 0 and self.in_flight:
            for _, _, out in self.in_flight:
                out /= self.world_size
            self.in_flight = []

    def before_launch(self):
        pass


class NeverDrops(GoodTwo):
    def drop(self, i):
        pass


class KeepsEveryBuffer(GoodTwo):
    def before_launch(self):
        pass                                      # every bucket in flight until step()


class KeepsPaddedPerParameter(GoodTwo):
    def padded(self, i):
        self.kept = getattr(self, "kept", {})
        for q in self.buckets[i]:                 # a padded copy per parameter, kept
            self.kept[q] = F.pad(q.grad.reshape(-1), (0, self.world_size))
        return super().padded(i)


class KeepsGradientsInAList(GoodTwo):
    def drop(self, i):
        self.old = getattr(self, "old", []) + [q.grad for q in self.buckets[i]]
        super().drop(i)


class KeepsViewsOfBuffers(GoodTwo):
    def launch(self, i):
        super().launch(i)
        buffer = self.in_flight[-1][1]            # a view per parameter keeps the whole buffer
        self.views = getattr(self, "views", []) + [buffer[:q.numel()] for q in self.buckets[i]]


class KeepsLastBufferIntoNextStep(GoodTwo):
    # the mutant that deletes `self.in_flight = None`: the last bucket's buffer outlives step()
    def finish(self, keep=0):
        if len(self.in_flight) > keep:
            work, buffer, out = self.in_flight[-1]
            work.wait()
            if not getattr(self, "done", None) is work:
                out /= self.world_size
            self.done = work                      # waited, divided, but never dropped

    def launch(self, i):
        super().launch(i)
        self.in_flight = self.in_flight[-1:]


class HooksFrozen(GoodTwo):
    def hooked(self, params, trainable):
        return list(self.all_params)

    def trainable(self, params):
        self.all_params = list(params)
        return [p for p in self.all_params if p.requires_grad]


class BucketsFrozen(GoodTwo):
    def trainable(self, params):
        params = list(params)
        self.really = [p for p in params if p.requires_grad]
        return params

    def hooked(self, params, trainable):
        return self.really


class SummedTwo(GoodTwo):
    def finish(self, keep=0):
        while len(self.in_flight) > keep:
            self.in_flight.pop(0)[0].wait()


class DividedTwiceTwo(DivideFirstTwo):
    def finish(self, keep=0):
        GoodTwo.finish(self, keep)


class NoAllGatherTwo(GoodTwo):
    def gather(self):
        size_offsets = self.layout
        for bucket, (size, offset) in zip(self.buckets, size_offsets):
            full = self.shard.new_zeros(size * self.world_size)
            full[self.rank * size:(self.rank + 1) * size] = self.shard.detach()[offset:
                                                                              offset + size]
            start = 0
            for p in bucket:
                mine = full[start:start + p.numel()].view_as(p)
                p.data.copy_(torch.where(mine != 0, mine, p.data))
                start += p.numel()


class AccumulatesTwo(GoodTwo):
    def launch(self, i):
        buffer, out = self.padded(i), self.out(i)
        tmp = torch.empty_like(out)
        work = dist.reduce_scatter_single(tmp, buffer, async_op=True)
        self.in_flight.append((work, buffer, out, tmp))

    def finish(self, keep=0):
        while len(self.in_flight) > keep:
            work, buffer, out, tmp = self.in_flight.pop(0)
            work.wait()
            out += tmp / self.world_size          # never zeroed: earlier steps stay in


class NoCopyBackTwo(GoodTwo):
    def gather(self):
        for size, offset in self.layout:
            full = self.shard.new_empty(size * self.world_size)
            dist.all_gather_single(full, self.shard.detach()[offset:offset + size])


class ReducesIntoANewTensor(GoodTwo):
    # the reduce-scatter's output is a fresh tensor, never written into self.shard.grad
    def out(self, i):
        size, _ = self.layout[i]
        return self.shard.new_empty(size)


class RebindsTheMean(GoodTwo):
    # out = out / n: a new tensor; the shard's gradient keeps the sum
    def finish(self, keep=0):
        while len(self.in_flight) > keep:
            work, buffer, out = self.in_flight.pop(0)
            work.wait()
            out = out / self.world_size           # noqa: F841 — the learner's mistake


class IteratesParamsTwice(GoodTwo):
    # params is model.parameters(), a generator: the second pass (the hooks) finds nothing
    def trainable(self, params):
        self.params = params
        return [p for p in params if p.requires_grad]

    def hooked(self, params, trainable):
        return [p for p in self.params if p.requires_grad]


class RereadsForBuckets(GoodTwo):
    # the learner's finding: the trainable list from one pass over the generator, the buckets
    # from a second (empty) one — the raw error was "IndexError: list index out of range"
    def __init__(self, params, optimizer_cls, bucket_cap=128, **kwargs):
        self.trainable_list = [p for p in params if p.requires_grad]
        self.buckets = make_buckets([p for p in params if p.requires_grad], bucket_cap)
        self.first_bucket = self.buckets[0]


class RereadsForHooks(GoodTwo):
    # a pass to count, then the real work on a second pass: no parameter, no bucket, and
    # torch.cat of no pieces raises
    def trainable(self, params):
        self.count = sum(1 for _ in params)
        return [p for p in params if p.requires_grad]


class DefaultDtypeGather(GoodTwo):
    # the all-gather's output made without dtype= (or device=): torch's default, not the
    # parameters' (on a GPU it would sit on the CPU)
    def gather(self):
        for bucket, (size, offset) in zip(self.buckets, self.layout):
            full = torch.empty(size * self.world_size)
            dist.all_gather_single(full, self.shard.detach()[offset:offset + size])
            start = 0
            for p in bucket:
                p.data.copy_(full[start:start + p.numel()].view_as(p))
                start += p.numel()


class DefaultDtypeBuffer(GoodTwo):
    # the padded buffer made with torch.zeros, then filled: torch's default dtype
    def padded(self, i):
        size, _ = self.layout[i]
        buffer = torch.zeros(size * self.world_size)
        buffer[:sum(q.numel() for q in self.buckets[i])] = torch.cat(
            [q.grad.reshape(-1) for q in self.buckets[i]])
        self.drop(i)
        return buffer


class DefaultDtypeShard(GoodTwo):
    # the shard made with torch.zeros, then filled: it and its optimizer state are float64
    def make_shard(self, pieces):
        shard = torch.zeros(sum(p.numel() for p in pieces))
        shard.copy_(torch.cat(pieces))
        return nn.Parameter(shard)


class DefaultDtypeShardGrad(GoodTwo):
    def make_shard_grad(self):
        return torch.zeros(self.shard.numel())


class CopyBeforeWait(GoodTwo):
    # the learner's finding: the new bucket's padded buffer is filled before the old bucket's
    # reduce-scatter is waited for and before its p.grad is freed — old buffer, new buffer and
    # the bucket's p.grad alive together
    def bucket_full(self, i):
        size, _ = self.layout[i]
        numel = sum(q.numel() for q in self.buckets[i])
        buffer = F.pad(torch.cat([q.grad.reshape(-1) for q in self.buckets[i]]),
                       (0, size * self.world_size - numel))
        self.finish(keep=0)
        self.drop(i)
        out = self.out(i)
        self.in_flight.append((dist.reduce_scatter_single(out, buffer, async_op=True), buffer,
                               out))


class CountNeverReset(GoodTwo):
    # the per-bucket count of arrived gradients is compared with == and never set back to 0:
    # in step 2 it runs past the bucket's size and no bucket fills again
    def _grad_ready(self, p):
        i = self.bucket_of[p]
        self.arrived[i] += 1
        if self.arrived[i] == len(self.buckets[i]):
            self.bucket_full(i)


class CountAtSizeIsNotFull(GoodTwo):
    # `<=` where `<` belongs: the arrival that completes a bucket returns as if it were not
    # full, so step 1 launches nothing and step 2's first arrival launches a bucket whose
    # other gradients are gone (p.grad None after zero_grad)
    def _grad_ready(self, p):
        i = self.bucket_of[p]
        self.arrived[i] += 1
        if self.arrived[i] <= len(self.buckets[i]):
            return
        self.arrived[i] = 0
        self.bucket_full(i)


class LastListedLaunches(GoodTwo):
    # a bucket taken as full when its last-listed parameter arrives: right only when the
    # gradients arrive in the reverse of the order they are listed
    def _grad_ready(self, p):
        i = self.bucket_of[p]
        if p is self.buckets[i][-1]:
            self.bucket_full(i)


class LastListedSkipsNone(GoodTwo):
    # the same shortcut, with the missing gradients read as zeros: it never raises
    def _grad_ready(self, p):
        i = self.bucket_of[p]
        if p is self.buckets[i][-1]:
            for q in self.buckets[i]:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
            self.bucket_full(i)


class LaunchesBeforeFull(GoodTwo):
    # the comparison turned round: a bucket is launched while its count is below its size
    def _grad_ready(self, p):
        i = self.bucket_of[p]
        self.arrived[i] += 1
        if self.arrived[i] < len(self.buckets[i]):
            self.bucket_full(i)
            return
        self.arrived[i] = 0


class OffsetByNumel(GoodTwo):
    # each bucket's slice of the shard starts at the sum of the earlier buckets' numel, not
    # of their shard sizes: the later slices run past the shard
    def out(self, i):
        size, _ = self.layout[i]
        offset = sum(sum(q.numel() for q in b) for b in self.buckets[:i])
        return self.shard.grad[offset:offset + size]


class SwappedReduceScatter(GoodTwo):
    # reduce_scatter_single(input, output): the padded bucket where its slice belongs
    def launch(self, i):
        buffer, out = self.padded(i), self.out(i)
        work = dist.reduce_scatter_single(buffer, out, async_op=True)
        self.in_flight.append((work, buffer, out))


class SwappedAllGather(GoodTwo):
    # all_gather_single(input, output): this rank's piece where the gathered vector belongs
    def gather(self):
        for bucket, (size, offset) in zip(self.buckets, self.layout):
            full = self.shard.new_empty(size * self.world_size)
            dist.all_gather_single(self.shard.detach()[offset:offset + size], full)
            start = 0
            for p in bucket:
                p.data.copy_(full[start:start + p.numel()].view_as(p))
                start += p.numel()


WRONG_TWOS = [
    (ShardView, "self.shard is a view of a larger tensor"),
    (ShardGradView, "self.shard.grad is a view of a larger tensor"),
    (InStep, "reduce-scattered the gradients in step\\(\\), after the backward"),
    (AllAtTheEnd, "launched at the end of the backward"),
    (LateByOne, "launched later than when it was full"),
    (Blocking, "was blocking \\(no async_op=True\\)"),
    (WaitRightAway, "right after launching it"),
    (NeverWaited, "not been waited for when the inner optimizer stepped"),
    (NeverDrops, "still in p.grad when the backward ended"),
    (TwoInFlight, "2 bucket reduce-scatters were in flight at once"),
    (LaunchThenWait, "and 2 bucket reduce-scatters were in flight at once: .* — you copy a "
                     "bucket while the one launched before it is not yet waited for"),
    (CopyFreeThenWait, r"at line \d+ of your padded\(\), \d+ bytes .* — you copied the new "
                       r"bucket before waiting for the old one: for as long as its p.grad lives "
                       r"beside its copy, three buckets' worth"),
    (PlainCeilPieces, r"a reduce-scatter's input cut in [23] gives pieces of \d+ numbers \(\d+ "
                      r"B\), so rank 1's piece starts at byte \d+ of the bucket's buffer — not "
                      r"on a 16-byte boundary"),
    (TwoLineCopy, r"at line \d+ of your padded\(\), \d+ bytes .* in your local variables, "
                  r"`flat` in padded\(\) \(\d+ B\), `buffer` in padded\(\) \(\d+ B\) — a "
                  r"local variable keeps its tensor alive until your function returns"),
    (KeepsEveryBuffer, "every bucket's padded gradient buffer stayed alive until step"),
    (KeepsPaddedPerParameter, "self.kept.* still held .* bytes of gradients"),
    (KeepsGradientsInAList, "self.old.* still held .* bytes of gradients"),
    (KeepsViewsOfBuffers, "self.views.* still held .* bytes of gradients"),
    (KeepsLastBufferIntoNextStep, "self.in_flight.* still held .* bytes of gradients at the "
                                  "peak .* a buffer whose reduce-scatter is over"),
    (HooksFrozen, "frozen parameter \\(requires_grad=False\\)"),
    (BucketsFrozen, "frozen parameter \\(requires_grad=False\\) never gets a gradient"),
    (SummedTwo, "gradients [23]× too large: you summed"),
    (DividedTwiceTwo, "gradients [23]× too small: you divided by the world size twice"),
    (NoAllGatherTwo, "each rank changed only its own shard"),
    (AccumulatesTwo, "gradients of the earlier steps are added"),
    (NoCopyBackTwo, "self.shard had moved but the model's parameters had not"),
    (ReducesIntoANewTensor, "self.shard.grad was all zeros when the inner optimizer stepped"),
    (RebindsTheMean, "gradients [23]× too large: you summed .*a division into a new tensor"),
    (IteratesParamsTwice, "params is a generator"),
    (RereadsForBuckets, r"raised on rank 0 \(IndexError: list index out of range\) after it "
                        r"had looped over params again once it was used up: params is "
                        r"model.parameters\(\), a generator"),
    (RereadsForHooks, r"raised on rank 0 \(.*\) after it had looped over params again"),
    (DefaultDtypeGather, "an all-gather got a float64 tensor while the parameters are "
                         "float32 — a tensor made with torch.zeros/torch.empty"),
    (DefaultDtypeBuffer, "a reduce-scatter got a float64 tensor .* contract 6"),
    (DefaultDtypeShard, "self.shard is float64 while the parameters are float32 .* device="),
    (DefaultDtypeShardGrad, "self.shard.grad was given another dtype than self.shard .* "
                            "contract 6"),
    (OffsetByNumel, "this slice does not start where the earlier buckets' pieces end in "
                    "self.shard"),
    (SwappedReduceScatter, r"reduce_scatter_single\(output, input\) takes the output first, "
                           r"and yours got an output of (\d+) numbers and an input of \d+ — an "
                           r"output [23] × its input .* passed the wrong way round"),
    (SwappedAllGather, r"all_gather_single\(output, input\) takes the output first, and yours "
                       r"got an output of \d+ numbers and an input of \d+ — an input [23] × its "
                       r"output .* passed the wrong way round"),
    (CountAtSizeIsNotFull, "in step 2's backward .* self.arrived held \\[3, 1, 3, 1, 2, 3\\] "
                           "for buckets of \\[3, 1, 3, 1, 2, 3\\] parameters — yet no bucket "
                           "was reduce-scattered: your test of a full bucket took a count equal "
                           "to the size for 'not yet'"),
    (LaunchesBeforeFull, "in step 1's backward, after 1 gradient had arrived .* at bucket 0's "
                         "arrival 1 of 3: your test of a full bucket lets a bucket through "
                         "before its last gradient has come"),
    (CopyBeforeWait, "when you called wait\\(\\) on reduce-scatter \\d+, \\d+ bytes .*the old "
                     "bucket's padded buffer, still in flight \\(\\d+ B\\), the new bucket's "
                     "buffer, already filled \\(\\d+ B\\), and the new bucket's gradients, "
                     "still in p.grad \\(\\d+ B\\) — you copied the new bucket before waiting"),
    (LastListedLaunches, r"raised on rank 0 in step 1's backward \(.*\): bucket 5 \(1.weight, "
                         r"0.bias, 0.weight\) was launched when its last-listed parameter, "
                         r"0.weight, arrived, while 1.weight's gradient had not .* 1.weight, an "
                         r"input gain, is listed after 0.weight but applied before it"),
    (LastListedSkipsNone, r"^bucket 5 \(1.weight, 0.bias, 0.weight\) was launched when its "
                          r"last-listed parameter, 0.weight, arrived, while 1.weight's gradient "
                          r"had not"),
    (FirstListedSkipsNone, r"^a reduce-scatter was launched at the arrival of 12.bias while "
                           r"bucket 0 still waited for 12.weight, 10.bias: contract 4"),
    (CountNeverReset, "after step 2 .* step 2 none, though all \\d+ gradients arrived — "
                      "self.arrived started at \\[0, .* and still held \\[.*your hooks' count "
                      "of arrived gradients carried over from step 1, so no bucket ever filled "
                      "again"),
]

# --------------------------------------------------------------------------------------------
# One launch per configuration for all of them
# --------------------------------------------------------------------------------------------

CLASSES = RIGHT_TWOS + [cls for cls, _ in WRONG_TWOS]


def run_one(rank, world_size, cls, opt_name):
    # the answers that raise here raise on every rank at the same point: none is left waiting
    try:
        return lab08._zero_worker(rank, world_size, cls, opt_name)
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}


def run_classes(rank, world_size, opt_name):
    torch.set_num_threads(1)
    return [run_one(rank, world_size, cls, opt_name) for cls in CLASSES]


@pytest.fixture(scope="module")
def zero_runs():
    """Every class on each configuration, one launch per configuration, the two launches at
    the same time: much of a launch is its ranks waiting on each other's collectives, so the
    second launch runs in the first one's waits."""
    from concurrent.futures import ThreadPoolExecutor

    from dpcourse import launch

    with ThreadPoolExecutor(len(lab08.CONFIGS)) as pool:
        futures = {config: pool.submit(launch.spawn, run_classes, *config, backend="gloo",
                                       timeout=240, show_output=False)
                   for config in lab08.CONFIGS}
        return {config: f.result() for config, f in futures.items()}


@pytest.fixture(scope="module", params=lab08.CONFIGS, ids=lambda c: f"{c[0]}-ranks-{c[1]}")
def results(request, zero_runs):
    world_size, opt_name = request.param
    per_rank = zero_runs[request.param]
    got = {cls.__name__: [r[i] for r in per_rank] for i, cls in enumerate(CLASSES)}
    return world_size, opt_name, got


def diagnose(results, cls):
    world_size, opt_name, got = results
    per_rank = got[cls.__name__]
    if "raised" in per_rank[0]:
        lab08._raised(0, per_rank[0]["raised"])
    return lab08._diagnose(per_rank, world_size, opt_name)


# Adam divides by the gradients' own scale: gradients N times too large or too small step
# (almost) like the right ones, and only the SGD configuration must name the mistake.
SCALE_BLIND = {"SummedTwo", "DividedTwiceTwo", "RebindsTheMean"}


def expect_named(results, cls, phrase):
    _, opt_name, _ = results
    if cls.__name__ in SCALE_BLIND and opt_name == "adam":
        try:
            diagnose(results, cls)
        except LabCheckError as err:
            assert re.search(phrase, str(err)), str(err)
        return
    with pytest.raises(LabCheckError, match=phrase):
        diagnose(results, cls)


@pytest.mark.parametrize("cls", RIGHT_TWOS, ids=lambda c: c.__name__)
def test_right_zero_twos_pass(results, cls):
    assert "of 1488 B" in diagnose(results, cls)


@pytest.mark.parametrize("cls, phrase", WRONG_TWOS, ids=[c.__name__ for c, _ in WRONG_TWOS])
def test_wrong_zero_twos_are_named(results, cls, phrase):
    expect_named(results, cls, phrase)


def test_the_peak_is_two_buckets_for_the_answer(results):
    # right after the copy of the bucket of 8.bias, 6.bias, 6.weight (80 numbers), before its
    # p.grad is let go: the bucket in p.grad and in its padded buffer (80 on 2 ranks, 84 on 3)
    world_size, _, _ = results
    peak = int(diagnose(results, GoodTwo).split(" of ")[0])
    assert peak == 4 * (80 + world_size * aligned(80, world_size, 4)), peak
    assert peak <= 4 * lab08._live_limit(world_size) < 4 * sum(lab08._trainable_numels())


def test_the_check_model_has_a_frozen_and_a_tied_parameter():
    model = lab08._mlp()
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == [lab08._FROZEN]
    assert model[8].weight is model[4].weight
    # the input gain is listed after layer 0's parameters, and its gradient arrives after them
    names = [n for n, p in model.named_parameters()]
    assert names.index(lab08._LATE) == names.index("0.bias") + 1
    assert sum(lab08._trainable_numels()) == 372


# --------------------------------------------------------------------------------------------
# End to end: the check as the lab calls it
# --------------------------------------------------------------------------------------------


def test_check_zero_two_end_to_end():
    # a wrong answer refused by the check as the lab calls it (its launch, run_ranks, the
    # diagnosis). A right one passing end to end, its ✔ saying "reduce-scattered
    # asynchronously", on both configurations: solutions/lab08's nbval run (the reference
    # ZeroTwo); GoodTwo's own pass is test_right_zero_twos_pass, from the same worker and
    # diagnosis
    with pytest.raises(LabCheckError, match="in step\\(\\), after the backward"):
        lab08.check_zero_two(InStep, configs=((2, "adam"),))


class Unpadded(GoodTwo):
    # the parameters were padded, the gradients not: the reduce-scatter gets uneven pieces
    def padded(self, i):
        buffer = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
        self.drop(i)
        return buffer


def test_unpadded_vector_raises_with_the_padding_hint():
    # the cause first (pieces that do not split evenly); the padding only the second time. The
    # same class checked twice: launched once, the ranks' failure replayed the second time
    # (conftest.launches_replayed); the check's judgement and its memory run again on it
    with launches_replayed(distinct_run):
        with pytest.raises(LabCheckError, match=r"raised on rank .*do not split into \d equal "
                                                r"pieces\. \(Run the check again"):
            lab08.check_zero_two(Unpadded, configs=((3, "sgd"),))
        with pytest.raises(LabCheckError, match="raised on rank .*pad each bucket's flat vector"):
            lab08.check_zero_two(Unpadded, configs=((3, "sgd"),))


class OnlyRankZeroGathers(GoodTwo):
    def gather(self):
        if self.rank == 0:
            return super().gather()


def test_a_deadlock_is_stopped_and_its_ranks_named():
    t0 = time.monotonic()
    with pytest.raises(LabCheckError, match="rank\\(s\\) [0-9, ]+ never finished within 5 s — "
                                            "a deadlock") as err:
        lab08.check_zero_two(OnlyRankZeroGathers, configs=((2, "adam"),), timeout=5)
    assert time.monotonic() - t0 < 15
    # both ranks wait (rank 1 went on to the next collective), so it may be slowness too:
    # the sentence then shows where the longer timeout goes
    assert "check_zero_two(..., timeout=120)" in str(err.value), str(err.value)


class Todo(GoodTwo):
    def step(self):
        raise NotImplementedError("TODO: finish, step, all-gather")


def test_unfinished_class_is_not_implemented_without_launching():
    t0 = time.monotonic()
    with pytest.raises(NotImplementedError, match="replace the TODOs"):
        lab08.check_zero_two(Todo)
    assert time.monotonic() - t0 < 2


def test_an_instance_instead_of_the_class_is_named():
    with pytest.raises(LabCheckError, match="your class itself"):
        lab08.check_zero_two(object())


def test_the_library_stages_and_torchs_zero_are_not_the_answer():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from dpcourse import zero

    for stage in (zero.Zero1, zero.Zero2, zero.Zero3):
        with pytest.raises(LabCheckError, match="lesson 08's own stage .* your own ZeroTwo"):
            lab08.check_zero_two(stage)
    with pytest.raises(LabCheckError, match="torch's ZeroRedundancyOptimizer, a ZeRO-1"):
        lab08.check_zero_two(ZeroRedundancyOptimizer)


# --------------------------------------------------------------------------------------------
# Predict, then measure: the peak of live gradient bytes
# --------------------------------------------------------------------------------------------


def measured_peaks(rank, world_size):
    # measure_peak's worker for each class, then measure_schedules' worker, in turn
    from dpcourse.checks import _lab08_peak

    torch.set_num_threads(1)
    peaks = {cls.__name__: _lab08_peak._peak_worker(rank, world_size, cls)["peak"]
             for cls in (GoodTwo, TwoInFlight, CopyBeforeWait)}
    return peaks, _lab08_peak._schedules_worker(rank, world_size)


@pytest.fixture(scope="module")
def peaks():
    """What measure_peak returns for GoodTwo, TwoInFlight and CopyBeforeWait, and what
    measure_schedules returns, from ONE launch of lab08.PEAK_WORLD_SIZE ranks running their
    workers in turn (the largest over the ranks, as they take it): three launches fewer. Both
    run end to end, the learner's way, in solutions/lab08's nbval run (measure_peak on the
    reference ZeroTwo, measure_schedules)."""
    from dpcourse import launch

    per_rank = launch.spawn(measured_peaks, lab08.PEAK_WORLD_SIZE, backend="gloo", timeout=240,
                            show_output=False)
    classes = {name: max(r[0][name] for r in per_rank) for name in per_rank[0][0]}
    return classes, {order: max(r[1][order] for r in per_rank) for order in lab08.SCHEDULES}


def test_the_peak_with_one_bucket_in_flight_is_the_largest_bucket_copied(capsys, peaks):
    from dpcourse.checks import predict

    assert lab08.peak_buckets() == [4680, 4160, 4160, 1088]
    assert lab08.expected_peak() == (4 * (4680 + 4680), 0)
    measured = peaks[0]["GoodTwo"]
    assert measured == 37440
    lab08.check_peak_prediction(predict("lab08", "peak", 37000, unit="B"), measured)
    out = " ".join(capsys.readouterr().out.split())
    assert "measured: 37440 B — right." in out
    assert "at most at bucket 1: (4160 + 4680) × 4 = 35360 B" in out
    assert "at most at bucket 0: (4680 + 4680) × 4 = 37440 B. The peak is the larger, 37440 B" \
        in out
    lab08.check_peak_prediction(predict("lab08", "peak", 2 * 4096, unit="B"), measured)
    assert "— not what happened." in capsys.readouterr().out


def test_the_peak_of_two_buckets_in_flight_is_said_to_keep_more(capsys, peaks):
    from dpcourse.checks import predict

    measured = peaks[0]["TwoInFlight"]
    assert measured > 37440
    lab08.check_peak_prediction(predict("lab08", "peak", 37440, unit="B"), measured)
    assert "is not that of one bucket in flight (37440 B): it keeps more alive" in \
        " ".join(capsys.readouterr().out.split())


def test_the_three_orders_measure_what_the_bucket_sizes_predict(capsys, peaks):
    from dpcourse.checks import predict

    measured = peaks[1]
    assert measured == {order: peak for order, (peak, _, _) in lab08.schedule_peaks().items()}
    assert measured == {"wait-then-launch": 37440, "launch-then-wait": 52000,
                        "launch-all": 68640}
    assert measured["launch-all"] > 4 * sum(lab08.peak_buckets()) == 56352
    # a learner who thinks the bytes only move from p.grad into the buffer, and that launching
    # everything costs what DDP holds
    lab08.check_schedule_predictions(predict("lab08", "wait first", 35360, unit="B"),
                                     predict("lab08", "launch first", 37440, unit="B"),
                                     predict("lab08", "launch all", 56352, unit="B"), measured)
    out = " ".join(capsys.readouterr().out.split())
    assert "measured: 52000 B — not what happened." in out
    assert "at bucket 1: (4160 + 4160 + 4680) × 4 = 52000 B, 14560 B (one more bucket) above " \
           "waiting first (37440 B)" in out
    assert "You predicted waiting first's peak: the bytes do not just move" in out
    assert "measured: 68640 B — not what happened." in out
    assert "at bucket 2's copy, the buffers of the buckets before it (4680 + 4160) and bucket 2 " \
           "twice (4160 + 4160), × 4 = 68640 B — more than the 56352 B" in out
    assert "You predicted all the gradients" in out
    assert "Your prediction: 35360 B; measured: 37440 B — not what happened." in out
    lab08.check_schedule_predictions(predict("lab08", "wait first", 37440, unit="B"),
                                     predict("lab08", "launch first", 52000, unit="B"),
                                     predict("lab08", "launch all", 68000, unit="B"), measured)
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("— right.") == 3 and "You predicted" not in out
    assert "right after bucket 0 is copied, before its p.grad is let go: (4680 + 4680) × 4 B" \
        in out
    with pytest.raises(LabCheckError, match="needs what lab08.measure_schedules\\(\\) returned"):
        lab08.check_schedule_predictions(predict("lab08", "a", 1, unit="B"),
                                         predict("lab08", "b", 1, unit="B"),
                                         predict("lab08", "c", 1, unit="B"), 52000)


def test_copy_before_wait_and_an_unreset_count_say_what_to_change_the_second_time(results):
    for cls, fix in ((CopyBeforeWait, "wait for the old bucket and let go of its buffer before "
                                      "you build the new one"),
                     (LastListedLaunches, "count the arrivals per bucket"),
                     (CountNeverReset, "set a bucket's count in self.arrived back to 0")):
        with pytest.raises(LabCheckError) as first:
            diagnose(results, cls)
        assert fix not in str(first.value)
        with pytest.raises(LabCheckError, match=fix):
            diagnose(results, cls)


def test_copy_before_wait_peak_is_three_buckets_and_said_to_keep_more(capsys, peaks):
    # weighed inside the hook, at the wait() for bucket 0: its buffer (4680), bucket 1's new
    # buffer (4160) and bucket 1's p.grad (4160) — one bucket more than the answer at its arrival
    from dpcourse.checks import predict

    measured = peaks[0]["CopyBeforeWait"]
    assert measured == 4 * (4680 + 4160 + 4160) == 52000
    lab08.check_peak_prediction(predict("lab08", "peak", 37440, unit="B"), measured)
    assert "is not that of one bucket in flight (37440 B): it keeps more alive" in \
        " ".join(capsys.readouterr().out.split())


def test_swapped_arguments_are_not_called_an_offset_mistake(results):
    # the learner's finding: swapped arguments were named "the output slice is the wrong
    # size" and, the second time, "check the offset"; the fix names the argument order
    for cls, fix in ((SwappedReduceScatter, "reduce_scatter_single\\(this bucket's slice of "
                                            "self.shard.grad, the padded bucket"),
                     (SwappedAllGather, "all_gather_single\\(the padded vector of world_size "
                                        "pieces, this rank's slice")):
        with pytest.raises(LabCheckError) as first:
            diagnose(results, cls)
        assert "offset" not in str(first.value) and "wrong size" not in str(first.value)
        assert not re.search(fix, str(first.value))
        with pytest.raises(LabCheckError, match=fix):
            diagnose(results, cls)


@pytest.mark.parametrize("cls", [CountAtSizeIsNotFull, LaunchesBeforeFull],
                         ids=lambda c: c.__name__)
def test_a_full_bucket_test_off_by_one_is_not_called_a_frozen_parameter(results, cls):
    # both raise on a p.grad that is None, as a frozen parameter in a bucket would: the
    # counts say which it was, and the fix comes on the second meeting
    with pytest.raises(LabCheckError) as first:
        diagnose(results, cls)
    assert "frozen" not in str(first.value) and "its count equal" not in str(first.value)
    with pytest.raises(LabCheckError) as second:
        diagnose(results, cls)
    assert "count equal its number of parameters" in str(second.value), str(second.value)
