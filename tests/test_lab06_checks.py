"""Every named mistake of lab 06 is caught with a sentence naming it; the reference passes."""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest

from dpcourse import ring
from dpcourse.checks import LabCheckError, lab06

# The wrong rings below run in spawned ranks; ship them by value, as a notebook cell would be.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- the simulator phases ---------------------------------------------------------------------


def sr_reference(buffers):
    n = len(buffers)
    b = ring.chunk_bounds(len(buffers[0]), n)
    for s in range(n - 1):
        out = [buffers[i][slice(*b[(i - s - 1) % n])].copy() for i in range(n)]
        for i in range(n):
            buffers[(i + 1) % n][slice(*b[(i - s - 1) % n])] += out[i]


def sr_off_by_one(buffers):  # sends chunk (i - s - 1): a shifted ring, ends on the wrong chunk
    n = len(buffers)
    b = ring.chunk_bounds(len(buffers[0]), n)
    for s in range(n - 1):
        out = [buffers[i][slice(*b[(i - s - 2) % n])].copy() for i in range(n)]
        for i in range(n):
            buffers[(i + 1) % n][slice(*b[(i - s - 2) % n])] += out[i]


def sr_too_many_steps(buffers):
    n = len(buffers)
    b = ring.chunk_bounds(len(buffers[0]), n)
    for s in range(n):
        out = [buffers[i][slice(*b[(i - s - 1) % n])].copy() for i in range(n)]
        for i in range(n):
            buffers[(i + 1) % n][slice(*b[(i - s - 1) % n])] += out[i]


def ag_reference(buffers):
    n = len(buffers)
    b = ring.chunk_bounds(len(buffers[0]), n)
    for s in range(n - 1):
        out = [buffers[i][slice(*b[(i + 1 - s - 1) % n])].copy() for i in range(n)]
        for i in range(n):
            buffers[(i + 1) % n][slice(*b[(i + 1 - s - 1) % n])] = out[i]


def ag_missing(buffers):
    return None


def ag_adds(buffers):
    n = len(buffers)
    b = ring.chunk_bounds(len(buffers[0]), n)
    for s in range(n - 1):
        out = [buffers[i][slice(*b[(i + 1 - s - 1) % n])].copy() for i in range(n)]
        for i in range(n):
            buffers[(i + 1) % n][slice(*b[(i + 1 - s - 1) % n])] += out[i]


def ag_off_by_one(buffers):
    n = len(buffers)
    b = ring.chunk_bounds(len(buffers[0]), n)
    for s in range(n - 1):
        out = [buffers[i][slice(*b[(i - s - 1) % n])].copy() for i in range(n)]
        for i in range(n):
            buffers[(i + 1) % n][slice(*b[(i - s - 1) % n])] = out[i]


def sr_lesson_layout(buffers):  # lesson 06's indices: worker i ends with chunk (i + 1) mod N
    lab06._scatter_reduce(buffers, base=0)


def ag_lesson_layout(buffers):
    lab06._all_gather(buffers, base=0)


def test_scatter_reduce_reference_passes(capsys):
    lab06.check_scatter_reduce(sr_reference)
    assert "scatter_reduce" in capsys.readouterr().out


def test_scatter_reduce_returning_new_arrays_passes():
    def functional(buffers):
        buffers = [b.copy() for b in buffers]
        sr_reference(buffers)
        return buffers
    lab06.check_scatter_reduce(functional)


@pytest.mark.parametrize("fn, phrase", [
    (sr_off_by_one, "off-by-one chunk index in scatter_reduce"),
    (sr_too_many_steps, "it takes exactly N-1"),
    (sr_lesson_layout, "lesson 06's layout"),
    (lambda bufs: None, "left the buffers unchanged"),
])
def test_scatter_reduce_mistakes(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab06.check_scatter_reduce(fn)


def test_all_gather_reference_passes():
    lab06.check_all_gather(ag_reference)


@pytest.mark.parametrize("fn, phrase", [
    (ag_missing, "nothing a worker received was written into its own array"),
    (ag_adds, "already the complete sum"),
    (ag_off_by_one, "off-by-one chunk index in all_gather"),
    (ag_lesson_layout, "lesson 06's layout"),
])
def test_all_gather_mistakes(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab06.check_all_gather(fn)


def test_an_unsolved_todo_stops_with_not_implemented():
    def todo(buffers):
        raise NotImplementedError("TODO: send chunk (i - s)")
    with pytest.raises(NotImplementedError, match="TODO: send chunk"):
        lab06.check_scatter_reduce(todo)


def ring_todo(tensor, op="sum"):
    raise NotImplementedError("TODO: scatter-reduce")


def test_an_unsolved_real_ring_stops_with_not_implemented():
    with pytest.raises(NotImplementedError, match="ring_allreduce is not written yet"):
        lab06.check_ring_allreduce(ring_todo, timeout=60)


# --- the real ring ----------------------------------------------------------------------------


def learner_ring(tensor, op="sum", off_by_one=False, gather=True, average=True, blocking=False):
    """A learner's ring, with the lab's plausible mistakes as switches."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    chunks = list(flat.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n

    def exchange(send, recv):
        if blocking:  # the deadlock: everybody sends first
            dist.send(send, right)
            dist.recv(recv, left)
        else:
            reqs = [dist.isend(send, right), dist.irecv(recv, left)]
            for q in reqs:
                q.wait()

    shift = 1 if off_by_one else 0
    for s in range(n - 1):
        send = chunks[(rank - s) % n]
        recv_chunk = chunks[(rank - s - 1 + shift) % n]
        buf = torch.empty_like(chunks[(rank - s - 1) % n])
        exchange(send, buf)
        if buf.shape == recv_chunk.shape:
            recv_chunk += buf
        else:
            recv_chunk += buf[: recv_chunk.numel()].sum() * 0  # keep going, wrongly
    if gather:
        for s in range(n - 1):
            exchange(chunks[(rank + 1 - s) % n], chunks[(rank - s) % n])
    if op == "average" and average:
        flat /= n
    return tensor


def ring_ok(tensor, op="sum"):
    return learner_ring(tensor, op)


def ring_off_by_one(tensor, op="sum"):
    return learner_ring(tensor, op, off_by_one=True)


def ring_no_gather(tensor, op="sum"):
    return learner_ring(tensor, op, gather=False)


def ring_no_average(tensor, op="sum"):
    return learner_ring(tensor, op, average=False)


def ring_blocking(tensor, op="sum"):
    return learner_ring(tensor, op, blocking=True)


def ring_library(tensor, op="sum"):
    return ring.ring_allreduce(tensor, op=op)


def ring_raises(tensor, op="sum"):
    raise ZeroDivisionError("oops")


def ring_out_of_place(tensor, op="sum"):
    return learner_ring(tensor.clone(), op)


def ring_extra_gather_steps(tensor, op="sum"):
    """Right values, but the all-gather runs N steps instead of N-1: one message too many."""
    import torch.distributed as dist

    learner_ring(tensor, "sum")
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.view(-1).tensor_split(n))
    s = n - 1  # one more all-gather step: it only re-sends a complete chunk
    reqs = [dist.isend(chunks[(rank + 1 - s) % n].clone(), (rank + 1) % n),
            dist.irecv(chunks[(rank - s) % n], (rank - 1) % n)]
    for q in reqs:
        q.wait()
    if op == "average":
        tensor.view(-1).div_(n)
    return tensor


def ring_built_in(tensor, op="sum"):
    import torch.distributed as dist

    dist.all_reduce(tensor)
    if op == "average":
        tensor /= dist.get_world_size()
    return tensor


def ring_whole_tensors(tensor, op="sum"):
    """Passes the whole tensor around the ring N-1 times: right sum, N times the traffic."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    total, travelling = tensor.clone(), tensor.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(travelling)
        reqs = [dist.isend(travelling, (rank + 1) % n), dist.irecv(incoming, (rank - 1) % n)]
        for q in reqs:
            q.wait()
        total += incoming
        travelling = incoming
    tensor.copy_(total / n if op == "average" else total)
    for _ in range(n - 1):  # pad the message count to 2(N-1) so only the sizes give it away
        reqs = [dist.isend(tensor.view(-1)[:1].clone(), (rank + 1) % n),
                dist.irecv(torch.empty(1, dtype=tensor.dtype), (rank - 1) % n)]
        for q in reqs:
            q.wait()
    return tensor


def ring_batched(tensor, op="sum"):
    """A right ring whose exchange uses dist.batch_isend_irecv with P2POp: must pass."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    chunks = flat.tensor_split(n)

    def exchange(send, recv):
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % n),
               dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        exchange(chunks[(rank - s) % n], incoming)
        chunks[(rank - s - 1) % n].add_(incoming)
    for s in range(n - 1):
        exchange(chunks[(rank + 1 - s) % n], chunks[(rank - s) % n])
    if op == "average":
        flat.div_(n)
    return tensor


@pytest.mark.parametrize("fn, phrase", [
    (ring_extra_gather_steps, r"sent 5 messages .* exactly 2\(N-1\) = 4"),
    (ring_built_in, "called dist.all_reduce"),
    (ring_whole_tensors, "some message carried more than one chunk"),
])
def test_ring_that_skips_the_idea_is_named(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab06.check_ring_allreduce(fn, timeout=60)


@pytest.mark.parametrize("fn", [ring_ok, ring_batched])
def test_ring_reference_passes(fn, capsys):
    lab06.check_ring_allreduce(fn, timeout=60)
    assert "ring_allreduce equals the sum" in capsys.readouterr().out


@pytest.mark.parametrize("fn, phrase", [
    (ring_off_by_one, "off-by-one chunk index in the scatter-reduce"),
    (ring_no_gather, "missing all-gather"),
    (ring_no_average, "summing without averaging"),
    (ring_raises, "raised on rank .*ZeroDivisionError"),
    (ring_out_of_place, "leaves the tensor it was given unchanged"),
])
def test_ring_mistakes(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab06.check_ring_allreduce(fn, timeout=60)


def test_blocking_sends_deadlock_and_the_check_says_so():
    # Measured: with gloo, every rank blocking in dist.send before its dist.recv hangs at any
    # size (1 element included), so the check must end at its timeout and name the deadlock.
    with pytest.raises(LabCheckError, match="deadlock: every rank called a blocking dist.send") \
            as err:
        lab06.check_ring_allreduce(ring_blocking, timeout=8)
    # diagnosed: the sentence must not send the learner to a longer timeout
    assert "slowness" not in str(err.value) and "timeout=" not in str(err.value)


def test_references_agree_with_simulator():
    arrays = [np.arange(7.0) * (w + 1) for w in range(4)]
    bufs = [a.copy() for a in arrays]
    lab06.reference_scatter_reduce(bufs)
    lab06.reference_all_gather(bufs)
    trace = ring.simulate_ring(arrays)
    assert all(np.array_equal(a, b) for a, b in zip(bufs, trace.result))



# --- 2 and 3 ranks, the in-place division, right variants, and the segmented stretch ----------


def ring_rebinding_division(tensor, op="sum"):
    import torch.distributed as dist

    learner_ring(tensor, "sum")
    flat = tensor.view(-1)
    if op == "average":
        flat = flat / dist.get_world_size()  # a new tensor: the caller's keeps the sum
    return tensor


def ring_divides_by_three(tensor, op="sum"):
    learner_ring(tensor, "sum")
    if op == "average":
        tensor /= 3  # right on 3 ranks only
    return tensor


def ring_hard_coded_three(tensor, op="sum"):
    """Right on 3 ranks: every index computed with n = 3."""
    import torch
    import torch.distributed as dist

    n, rank = 3, dist.get_rank()
    chunks = tensor.view(-1).tensor_split(n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        reqs = [dist.isend(chunks[(rank - s) % n], (rank + 1) % n),
                dist.irecv(incoming, (rank - 1) % n)]
        for q in reqs:
            q.wait()
        chunks[(rank - s - 1) % n].add_(incoming)
    for s in range(n - 1):
        reqs = [dist.isend(chunks[(rank + 1 - s) % n], (rank + 1) % n),
                dist.irecv(chunks[(rank - s) % n], (rank - 1) % n)]
        for q in reqs:
            q.wait()
    if op == "average":
        tensor.div_(n)
    return tensor


def ring_with_chunk_bounds(tensor, op="sum"):
    """Right: chunk boundaries from dpcourse.ring, a new-tensor average copied back."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    bounds = ring.chunk_bounds(flat.numel(), n)

    def chunk(i):
        lo, hi = bounds[i % n]
        return flat[lo:hi]

    for s in range(n - 1):
        incoming = torch.empty_like(chunk(rank - s - 1))
        for q in [dist.irecv(incoming, (rank - 1) % n), dist.isend(chunk(rank - s), (rank + 1) % n)]:
            q.wait()
        chunk(rank - s - 1).add_(incoming)
    for s in range(n - 1):
        for q in [dist.irecv(chunk(rank - s), (rank - 1) % n),
                  dist.isend(chunk(rank + 1 - s), (rank + 1) % n)]:
            q.wait()
    if op == "average":
        tensor.copy_(tensor / n)
    return tensor


def test_more_right_rings_pass(capsys):
    lab06.check_ring_allreduce(ring_with_chunk_bounds, timeout=60)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "on 3 and 2 ranks" in out


@pytest.mark.parametrize("fn, phrase", [
    (ring_rebinding_division, "the division made a new tensor"),
    (ring_divides_by_three, "on 2 ranks you divided by 3"),
    (ring_hard_coded_three, "but there are only 2 ranks"),
])
def test_rings_tied_to_one_setup_fail(fn, phrase):
    with pytest.raises(LabCheckError) as err:
        lab06.check_ring_allreduce(fn, timeout=60)
    assert phrase in str(err.value), str(err.value)


def segmented_ring(tensor, op="sum", segments=4, overlap=True, whole=False, gather_segments=False,
                   wrong_piece=False):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    flat = tensor.view(-1)
    chunks = flat.tensor_split(n)
    S = 1 if whole else segments

    def swap(send, recv):
        return [dist.isend(send, right), dist.irecv(recv, left)]

    for s in range(n - 1):
        out = chunks[(rank - s) % n].tensor_split(S)
        tgt = chunks[(rank - s - 1) % n].tensor_split(S)
        inc = [torch.empty_like(t) for t in tgt]
        if overlap:
            pending = swap(out[0], inc[0])
            for j in range(S):
                nxt = swap(out[j + 1], inc[j + 1]) if j + 1 < S else []
                for w in pending:
                    w.wait()
                k = (j + 1) % S if wrong_piece and tgt[(j + 1) % S].shape == inc[j].shape else j
                tgt[k].add_(inc[j])
                pending = nxt
        else:  # right too, just not pipelined: one piece at a time
            for j in range(S):
                for w in swap(out[j], inc[j]):
                    w.wait()
                tgt[j].add_(inc[j])
    for s in range(n - 1):
        send, recv = chunks[(rank + 1 - s) % n], chunks[(rank - s) % n]
        pairs = zip(send.tensor_split(S), recv.tensor_split(S)) if gather_segments else [(send, recv)]
        for a, b in pairs:
            for w in swap(a, b):
                w.wait()
    if op == "average":
        flat /= n
    return tensor


def seg_ok(tensor, op="sum", segments=4):
    return segmented_ring(tensor, op, segments)


def seg_no_overlap(tensor, op="sum", segments=4):
    return segmented_ring(tensor, op, segments, overlap=False)


def seg_gather_too(tensor, op="sum", segments=4):
    return segmented_ring(tensor, op, segments, gather_segments=True)


def seg_whole(tensor, op="sum", segments=4):
    return segmented_ring(tensor, op, segments, whole=True)


def seg_wrong_piece(tensor, op="sum", segments=4):
    return segmented_ring(tensor, op, segments, wrong_piece=True)


def seg_built_in(tensor, op="sum", segments=4):
    import torch.distributed as dist

    for piece in tensor.view(-1).tensor_split(segments):
        dist.all_reduce(piece)
    if op == "average":
        tensor /= dist.get_world_size()
    return tensor


@pytest.mark.parametrize("fn", [seg_ok, seg_gather_too])
def test_right_segmented_rings_pass(fn, capsys):
    lab06.check_segmented_ring(fn, timeout=60)
    assert capsys.readouterr().out.count("✔") == 1


@pytest.mark.parametrize("fn, phrase", [
    (seg_whole, "sends each chunk (about 16) as 4 pieces"),
    (seg_wrong_piece, "wrong result on rank"),
    (seg_built_in, "called dist.all_reduce"),
    (ring_ok, "unexpected keyword argument 'segments'"),
])
def test_segmented_mistakes_are_named(fn, phrase):
    with pytest.raises(LabCheckError) as err:
        lab06.check_segmented_ring(fn, timeout=60)
    assert phrase in str(err.value), str(err.value)


def seg_extra_gather_step(tensor, op="sum", segments=4):
    """Right values, but the all-gather runs N steps: it re-sends a finished chunk."""
    import torch.distributed as dist

    segmented_ring(tensor, "sum", segments)
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(n)
    for w in [dist.isend(chunks[(rank + 2) % n].clone(), (rank + 1) % n),
              dist.irecv(chunks[(rank + 1) % n], (rank - 1) % n)]:
        w.wait()
    if op == "average":
        tensor /= n
    return tensor


def test_segmented_ring_with_an_extra_step_is_named():
    with pytest.raises(LabCheckError, match="more or fewer than N-1 steps"):
        lab06.check_segmented_ring(seg_extra_gather_step, timeout=60)


# --- issue 31/37: causes named, the reference refused, the stretch's order, the prediction ---


def sr_floor_chunks(buffers):  # length // N per chunk: the remainder belongs to no chunk
    n = len(buffers)
    q = len(buffers[0]) // n
    for s in range(n - 1):
        out = [buffers[i][((i - s - 1) % n) * q:((i - s - 1) % n + 1) * q].copy() for i in range(n)]
        for i in range(n):
            c = (i - s - 1) % n
            buffers[(i + 1) % n][c * q:(c + 1) * q] += out[i]


def ag_rebinds(buffers):  # the loop runs, but assigns to a name: nothing is written back
    n = len(buffers)
    b = ring.chunk_bounds(len(buffers[0]), n)
    for s in range(n - 1):
        out = [buffers[i][slice(*b[(i - s) % n])].copy() for i in range(n)]
        for i in range(n):
            target = buffers[(i + 1) % n][slice(*b[(i - s) % n])].copy()
            target = out[i]  # noqa: F841
    return None


def test_numpy_phases_name_the_cause():
    with pytest.raises(LabCheckError, match="ignores ring.chunk_bounds"):
        lab06.check_scatter_reduce(sr_floor_chunks)
    with pytest.raises(LabCheckError, match="nothing a worker received was written"):
        lab06.check_all_gather(ag_rebinds)


def ring_gather_into_temporary(tensor, op="sum"):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        for w in [dist.isend(chunks[(rank - s) % n], right), dist.irecv(incoming, left)]:
            w.wait()
        chunks[(rank - s - 1) % n].add_(incoming)
    for s in range(n - 1):
        temporary = torch.empty_like(chunks[(rank - s) % n])
        for w in [dist.isend(chunks[(rank + 1 - s) % n], right), dist.irecv(temporary, left)]:
            w.wait()
    if op == "average":
        tensor /= n
    return tensor


def ring_floor_chunks(tensor, op="sum"):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    flat = tensor.view(-1)
    q = flat.numel() // n
    chunks = [flat[i * q:(i + 1) * q] for i in range(n)]
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        for w in [dist.isend(chunks[(rank - s) % n], right), dist.irecv(incoming, left)]:
            w.wait()
        chunks[(rank - s - 1) % n].add_(incoming)
    for s in range(n - 1):
        for w in [dist.isend(chunks[(rank + 1 - s) % n], right),
                  dist.irecv(chunks[(rank - s) % n], left)]:
            w.wait()
    if op == "average":
        flat /= n
    return tensor


def ring_receive_offset(tensor, op="sum"):
    """Receives (and adds) into the chunk it sends: on uneven lengths the sizes disagree."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s) % n])
        for w in [dist.isend(chunks[(rank - s) % n], right), dist.irecv(incoming, left)]:
            w.wait()
        chunks[(rank - s) % n].add_(incoming)
    return tensor


def ring_parity_blocking(tensor, op="sum"):
    """Right: blocking send/recv, even ranks send first and odd ranks receive first."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)

    def exchange(send, recv):
        if rank % 2 == 0:
            dist.send(send, right)
            dist.recv(recv, left)
        else:
            dist.recv(recv, left)
            dist.send(send, right)

    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        exchange(chunks[(rank - s) % n], incoming)
        chunks[(rank - s - 1) % n].add_(incoming)
    for s in range(n - 1):
        exchange(chunks[(rank + 1 - s) % n], chunks[(rank - s) % n])
    if op == "average":
        tensor.div_(n)
    return tensor


@pytest.mark.parametrize("fn, phrase", [
    (ring_gather_into_temporary, "what a rank receives never reaches its tensor"),
    (ring_floor_chunks, "ignores ring.chunk_bounds"),
    (ring_receive_offset, "chunk indices are off by one"),
    (ring_library, "dpcourse.ring.ring_allreduce"),
])
def test_real_ring_causes_are_named(fn, phrase):
    with pytest.raises(LabCheckError) as err:
        lab06.check_ring_allreduce(fn, timeout=60)
    assert phrase in str(err.value), str(err.value)


def test_the_reference_ring_itself_is_refused():
    with pytest.raises(LabCheckError, match="reference ring"):
        lab06.check_ring_allreduce(ring.ring_allreduce, timeout=60)
    with pytest.raises(LabCheckError, match="reference ring"):
        lab06.check_segmented_ring(ring.ring_allreduce, timeout=60)


def test_a_parity_ordered_blocking_ring_passes():
    lab06.check_ring_allreduce(ring_parity_blocking, timeout=60)


def seg_all_posted_first(tensor, op="sum", segments=4):
    """Right: every piece of a step posted at once, then waited and added in order."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    for s in range(n - 1):
        out = chunks[(rank - s) % n].tensor_split(segments)
        tgt = chunks[(rank - s - 1) % n].tensor_split(segments)
        inc = [torch.empty_like(t) for t in tgt]
        works = [(dist.isend(o, right), dist.irecv(i, left)) for o, i in zip(out, inc)]
        for j, (a, b) in enumerate(works):
            a.wait()
            b.wait()
            tgt[j].add_(inc[j])
    for s in range(n - 1):
        for w in [dist.isend(chunks[(rank + 1 - s) % n], right),
                  dist.irecv(chunks[(rank - s) % n], left)]:
            w.wait()
    if op == "average":
        tensor /= n
    return tensor


def test_segmented_ring_judged_by_order_of_posts_and_waits(capsys):
    lab06.check_segmented_ring(seg_all_posted_first, timeout=60)
    assert capsys.readouterr().out.count("✔") == 1
    with pytest.raises(LabCheckError) as err:
        lab06.check_segmented_ring(seg_no_overlap, timeout=60)
    assert "before it had posted piece 1" in str(err.value), str(err.value)


def seg_post_all_wait_all_add_all(tensor, op="sum", segments=4):
    """Right values, but no overlap: every piece posted, every piece waited, then all added."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    for s in range(n - 1):
        out = chunks[(rank - s) % n].tensor_split(segments)
        tgt = chunks[(rank - s - 1) % n].tensor_split(segments)
        inc = [torch.empty_like(t) for t in tgt]
        works = [w for o, i in zip(out, inc) for w in (dist.isend(o, right), dist.irecv(i, left))]
        for w in works:
            w.wait()
        for t, i in zip(tgt, inc):
            t.add_(i)
    for s in range(n - 1):
        for w in [dist.isend(chunks[(rank + 1 - s) % n], right),
                  dist.irecv(chunks[(rank - s) % n], left)]:
            w.wait()
    if op == "average":
        tensor /= n
    return tensor


def test_segmented_ring_must_add_a_piece_before_waiting_on_the_next():
    with pytest.raises(LabCheckError) as err:
        lab06.check_segmented_ring(seg_post_all_wait_all_add_all, timeout=60)
    assert "waited for piece 1 of a scatter-reduce chunk while piece 0 had arrived but was not " \
           "yet added" in str(err.value), str(err.value)


def ring_tuple_item_assignment(tensor, op="sum"):
    """Adds into chunks[i] with +=, which assigns into tensor_split's tuple: TypeError."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        for w in [dist.isend(chunks[(rank - s) % n], (rank + 1) % n),
                  dist.irecv(incoming, (rank - 1) % n)]:
            w.wait()
        chunks[(rank - s - 1) % n] += incoming
    return tensor


def test_tuple_item_assignment_is_explained():
    with pytest.raises(LabCheckError) as err:
        lab06.check_ring_allreduce(ring_tuple_item_assignment, timeout=60)
    assert "the tuple that tensor_split returns" in str(err.value), str(err.value)


def test_prediction_is_compared_with_the_most_bytes_a_rank_sends(capsys):
    from dpcourse.checks import predict

    measured = lab06.measure_bytes_sent(ring_ok)
    # N = 4, K = 10: chunks 3, 3, 2, 2; each rank skips two neighbouring chunks
    assert sorted(measured) == [56, 60, 60, 64] and sum(measured) == 2 * 3 * 10 * 4
    lab06.check_prediction(predict("lab06", "most bytes", 64, unit="bytes"), measured)
    out = capsys.readouterr().out
    assert "measured: 64 bytes — right" in out and "only the average" in out
    lab06.check_prediction(predict("lab06", "most bytes", 60, unit="bytes"), measured)
    assert "not what happened" in capsys.readouterr().out


def test_segmented_ring_declared_in_flight_must_be_what_the_ring_did(capsys):
    """The stretch's design decision (receives in flight at once) is declared and measured: a
    ring that posts a whole step's pieces has 4 in flight with segments=4, not 2."""
    lab06.check_segmented_ring(seg_all_posted_first, timeout=60, in_flight=4)
    assert "up to 4 receive(s) in flight" in capsys.readouterr().out
    for attempt in (1, 2):
        with pytest.raises(LabCheckError) as err:
            lab06.check_segmented_ring(seg_all_posted_first, timeout=60, in_flight=2)
        msg = str(err.value)
        assert "you declared 2 scatter-reduce receive(s) in flight" in msg, msg
        assert "had up to 4 posted and not yet waited on" in msg, msg
        assert ("set in_flight to what your code does (4)" in msg) == (attempt == 2), msg


def test_a_repeated_mistake_gets_its_fix():
    """First meeting: the cause only; the same mistake again: the fix joins the sentence."""
    for attempt in (1, 2):
        with pytest.raises(LabCheckError) as err:
            lab06.check_all_gather(ag_adds)
        msg = str(err.value)
        assert "already the complete sum" in msg, msg
        assert ("overwrite the worker's copy" in msg) == (attempt == 2), msg
