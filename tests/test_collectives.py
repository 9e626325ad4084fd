"""dpcourse.collectives: on 2 gloo ranks, every collective and send/recv is recorded with the
bytes it passes in and writes into, calls made by torch itself (a DDP comm hook, FSDP2,
ZeroRedundancyOptimizer, batch_isend_irecv) are seen, blocks nest, hooks run around each call,
and torch.distributed is left as it was, error or not.

One launch runs every scenario (a launch costs seconds); the tests read its results."""

import sys
import warnings

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from dpcourse import collectives, launch

cloudpickle.register_pickle_by_value(sys.modules[__name__])

F32 = 4


def _rows(log):
    return [(c.function, c.op, c.numel, c.nbytes, c.out_numel, c.out_nbytes,
             None if c.dtype is None else str(c.dtype), c.peer, c.async_op) for c in log]


def _every_op(rank, world):
    other = 1 - rank
    t = torch.ones(6)
    with collectives.record_collectives() as log:
        dist.all_reduce(t)
        dist.reduce(t, dst=0)
        dist.broadcast(t, src=0)
        dist.all_gather([torch.empty(6) for _ in range(world)], t)
        dist.all_gather_into_tensor(torch.empty(6 * world), t)
        dist.all_gather_single(torch.empty(6 * world), t)
        dist.gather(t, [torch.empty(6) for _ in range(world)] if rank == 0 else None, dst=0)
        dist.scatter(torch.empty(3), [torch.ones(3)] * world if rank == 0 else None, src=0)
        dist.reduce_scatter(torch.empty(3), [torch.ones(3)] * world)
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * world))
        dist.all_to_all_single(torch.empty(4), torch.ones(4))
        dist.all_to_all([torch.empty(2)] * world, [torch.ones(2)] * world)
        dist.barrier()
        half = torch.ones(5, dtype=torch.float16)
        if rank == 0:
            dist.send(half, dst=other)
            dist.recv(half, src=other)
        else:
            dist.recv(half, src=other)
            dist.send(half, dst=other)
        work = dist.isend(t, dst=other) if rank == 0 else dist.irecv(t, src=other)
        work.wait()
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        out = [None] * world
        dist.all_gather_object(out, {"rank": rank})
    return _rows(log)


def _p2p(rank, world):
    other = 1 - rank
    mine = torch.full((3,), float(rank))
    got = torch.empty(3)
    early = dist.P2POp(dist.isend, mine, other)          # built outside, with the real isend
    with collectives.record_collectives() as log:
        ops = [early, dist.P2POp(dist.irecv, got, other)]  # inside: our recording irecv
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        inside_type = isinstance(ops[1], dist.P2POp)
    # after the block, P2POps built inside still work with the real functions
    again = torch.empty(3)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, other), ops[1].__class__(
            dist.irecv, again, other)]):
        w.wait()
    return {"rows": _rows(log), "got": got.tolist(), "again": again.tolist(),
            "inside_type": inside_type}


def _torch_callers(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    out = {}
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    with collectives.record_collectives() as log:
        model(torch.randn(3, 8)).sum().backward()
    out["ddp"] = _rows(log)
    out["ddp_params"] = sum(p.numel() for p in model.parameters())

    net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    fully_shard(net[0])
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with collectives.record_collectives() as log:
        net(torch.randn(3, 8)).sum().backward()
        opt.step()
    out["fsdp"] = _rows(log)

    lin = torch.nn.Linear(8, 4)
    zero_opt = ZeroRedundancyOptimizer(lin.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    lin(torch.randn(3, 8)).sum().backward()
    with collectives.record_collectives() as log:
        zero_opt.step()
    out["zero"] = _rows(log)
    return out


def _nesting_and_hooks(rank, world):
    import torch.distributed._functional_collectives as funcol

    before_names = {name: getattr(dist, name) for name in collectives.RECORDED
                    if hasattr(dist, name)}
    funcol_before = funcol.all_reduce
    t = torch.ones(4)
    out = {}
    with collectives.record_collectives() as outer:
        dist.all_reduce(t)
        with collectives.record_collectives() as inner:
            dist.broadcast(t, src=0)
        dist.barrier()
    out["outer"] = [c.function for c in outer]
    out["inner"] = [c.function for c in inner]

    try:
        with collectives.record_collectives():
            dist.all_reduce(t)
            raise KeyError("boom")
    except KeyError:
        pass
    out["restored"] = sorted(n for n, f in before_names.items() if getattr(dist, n) is not f)
    out["restored_extra"] = [dist.P2POp.__module__, dist.P2POp is
                             dist.distributed_c10d.P2POp, funcol.all_reduce is funcol_before,
                             dist.batch_isend_irecv is dist.distributed_c10d.batch_isend_irecv]

    events = []

    def before(call):
        events.append(("before", call.function, call.args["tensor"].numel()))
        if call.function == "send":
            raise ValueError("refused")

    def after(call):
        events.append(("after", call.function, type(call.result).__name__))
        return "replaced" if call.async_op else None

    with collectives.record_collectives(before=before, after=after) as log:
        plain = dist.all_reduce(t)
        replaced = dist.all_reduce(t, async_op=True)
        try:
            dist.send(t, dst=1 - rank)
        except ValueError as exc:
            refused = str(exc)
    out.update(events=events, plain=plain, replaced=replaced, refused=refused,
               args_kept=[c.args for c in log] + [c.result for c in log])

    # before may change the arguments: here the all-reduce runs on a copy
    mine, copies = torch.ones(2), []

    def on_a_copy(call):
        call.args["tensor"] = call.args["tensor"].clone()
        copies.append(call.args["tensor"])

    with collectives.record_collectives(before=on_a_copy):
        dist.all_reduce(mine)
    out["copied"] = (mine.tolist(), copies[0].tolist())
    # funcol (DTensor's path)
    with collectives.record_collectives() as log:
        funcol.all_reduce(t, "sum", list(range(world))).wait()
    out["funcol"] = _rows(log)
    return out


def _everything(rank, world):
    warnings.simplefilter("ignore")
    return {"every_op": _every_op(rank, world), "p2p": _p2p(rank, world),
            "torch": _torch_callers(rank, world), "nesting": _nesting_and_hooks(rank, world)}


@pytest.fixture(scope="module")
def ranks():
    return launch.spawn(_everything, 2, backend="gloo", timeout=120)


def test_every_op_recorded_with_its_bytes(ranks):
    f16 = "torch.float16"
    f32 = "torch.float32"
    r0 = ranks[0]["every_op"]
    assert r0[:13] == [
        ("all_reduce", "all_reduce", 6, 24, 6, 24, f32, None, False),
        ("reduce", "reduce", 6, 24, 6, 24, f32, None, False),
        ("broadcast", "broadcast", 6, 24, 6, 24, f32, None, False),
        ("all_gather", "all_gather", 6, 24, 12, 48, f32, None, False),
        ("all_gather_into_tensor", "all_gather", 6, 24, 12, 48, f32, None, False),
        ("all_gather_single", "all_gather", 6, 24, 12, 48, f32, None, False),
        ("gather", "gather", 6, 24, 12, 48, f32, None, False),
        ("scatter", "scatter", 6, 24, 3, 12, f32, None, False),
        ("reduce_scatter", "reduce_scatter", 6, 24, 3, 12, f32, None, False),
        ("reduce_scatter_tensor", "reduce_scatter", 6, 24, 3, 12, f32, None, False),
        ("all_to_all_single", "all_to_all", 4, 16, 4, 16, f32, None, False),
        ("all_to_all", "all_to_all", 4, 16, 4, 16, f32, None, False),
        ("barrier", "barrier", 0, 0, 0, 0, None, None, False),
    ]
    assert r0[13:] == [
        ("send", "send", 5, 10, 0, 0, f16, 1, False),
        ("recv", "recv", 0, 0, 5, 10, f16, 1, False),
        ("isend", "send", 6, 24, 0, 0, f32, 1, True),
        ("all_reduce", "all_reduce", 6, 24, 6, 24, f32, None, True),
        ("all_gather_object", "all_gather", 0, r0[-1][3], 0, 0, None, None, False),
    ]
    assert r0[-1][3] > 0                                  # the pickled dict's size
    r1 = ranks[1]["every_op"]
    # rank 1 gathers nothing and scatters nothing; it receives first, then sends
    assert r1[6][4:6] == (0, 0) and r1[7][2:4] == (0, 0)
    assert [row[:2] + row[7:] for row in r1[13:16]] == [
        ("recv", "recv", 0, False), ("send", "send", 0, False), ("irecv", "recv", 0, True)]


def test_log_helpers():
    log = collectives.CollectiveLog([
            collectives.Call("all_reduce", "all_reduce", 6, 24, torch.float32),
            collectives.Call("broadcast", "broadcast", 2, 8, torch.float32),
            collectives.Call("all_reduce", "all_reduce", 1, 2, torch.float16)])
    assert log.count_by_op() == {"all_reduce": 2, "broadcast": 1}
    assert log.bytes_by_op() == {"all_reduce": 26, "broadcast": 8}
    assert [c.nbytes for c in log.of("all_reduce")] == [24, 2]
    assert log.summarize() == "all_reduce: 2 calls, 26 bytes\nbroadcast: 1 call, 8 bytes"
    assert collectives.CollectiveLog().summarize() == "no collective calls"


def test_batch_isend_irecv_and_p2pop(ranks):
    for rank in (0, 1):
        p2p = ranks[rank]["p2p"]
        other = 1 - rank
        assert p2p["got"] == [float(other)] * 3 and p2p["again"] == [float(other)] * 3
        assert p2p["rows"] == [
            ("batch_isend_irecv", "send", 3, 12, 0, 0, "torch.float32", other, True),
            ("batch_isend_irecv", "recv", 0, 0, 3, 12, "torch.float32", other, True)]
        assert p2p["inside_type"]


def test_ddp_comm_hook_seen(ranks):
    rows = ranks[0]["torch"]["ddp"]
    assert {r[0] for r in rows} == {"all_reduce"}
    assert sum(r[2] for r in rows) == ranks[0]["torch"]["ddp_params"]  # every gradient, once


def test_fsdp2_seen(ranks):
    rows = ranks[0]["torch"]["fsdp"]
    ops = [r[0] for r in rows]
    # forward: one all-gather per fully_shard unit (2); backward: the inner unit is gathered
    # again (the root keeps its parameters gathered after the forward); one reduce-scatter each
    assert ops.count("all_gather_single") == 3 and ops.count("reduce_scatter_single") == 2
    psi = 8 * 4 + 4 + 4 * 2 + 2                        # 46 parameters, no padding needed
    scattered = sum(r[2] for r in rows if r[0] == "reduce_scatter_single")
    assert scattered == psi


def test_zero_redundancy_optimizer_seen(ranks):
    rows = ranks[0]["torch"]["zero"]
    assert rows and {r[1] for r in rows} == {"broadcast"}
    assert sum(r[2] for r in rows) == 8 * 4 + 4        # every parameter broadcast by its owner


def test_blocks_nest(ranks):
    n = ranks[0]["nesting"]
    assert n["outer"] == ["all_reduce", "broadcast", "barrier"]
    assert n["inner"] == ["broadcast"]


def test_restored_after_an_exception(ranks):
    n = ranks[0]["nesting"]
    assert n["restored"] == []
    assert n["restored_extra"] == ["torch.distributed.distributed_c10d", True, True, True]


def test_hooks_run_around_each_call(ranks):
    n = ranks[0]["nesting"]
    assert n["events"] == [("before", "all_reduce", 4), ("after", "all_reduce", "NoneType"),
                           ("before", "all_reduce", 4), ("after", "all_reduce", "Work"),
                           ("before", "send", 4)]
    assert n["plain"] is None and n["replaced"] == "replaced" and n["refused"] == "refused"
    assert n["args_kept"] == [None] * 6                 # the log keeps no tensor alive


def test_before_may_change_the_arguments(ranks):
    assert ranks[0]["nesting"]["copied"] == ([1.0, 1.0], [2.0, 2.0])


def test_functional_collectives_seen(ranks):
    rows = ranks[0]["nesting"]["funcol"]
    assert [r[:4] for r in rows] == [("funcol.all_reduce", "all_reduce", 4, 16)]


def test_nothing_patched_outside_a_block():
    import torch.distributed._functional_collectives  # noqa: F401  (the block imports it)

    before = dict(vars(dist))
    with collectives.record_collectives():
        assert dist.all_reduce is not before["all_reduce"]
    assert {k for k, v in vars(dist).items() if before.get(k) is not v} == set()
