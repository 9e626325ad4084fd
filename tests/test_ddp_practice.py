"""dpcourse.ddp_practice: atomic checkpoints, the counting comm hook, CPU SyncBatchNorm and the
multi-node launcher's time limit. (The scripts themselves run in lessons/04, under nbval.)"""

import os
import sys

import pytest
import torch

from dpcourse import ddp_practice as dp
from dpcourse import launch


def test_checkpoint_round_trip_is_atomic_and_leaves_no_temp(tmp_path):
    path = tmp_path / "ck.pt"
    assert dp.load_checkpoint(path) is None  # nothing yet: a fresh start
    dp.save_checkpoint(path, {"w": torch.arange(3.0), "step": 1})
    dp.save_checkpoint(path, {"w": torch.arange(4.0), "step": 2})
    state = dp.load_checkpoint(path)
    assert state["step"] == 2 and torch.equal(state["w"], torch.arange(4.0))
    assert os.listdir(tmp_path) == ["ck.pt"]


def test_failed_save_keeps_the_old_checkpoint(tmp_path):
    path = tmp_path / "ck.pt"
    dp.save_checkpoint(path, {"step": 1})
    with pytest.raises(Exception):
        dp.save_checkpoint(path, {"bad": lambda: 0})  # cannot be pickled
    assert dp.load_checkpoint(path)["step"] == 1 and os.listdir(tmp_path) == ["ck.pt"]


def test_half_written_or_unsafe_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "ck.pt"
    dp.save_checkpoint(path, {"w": torch.zeros(1000)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match="damaged or half-written"):
        dp.load_checkpoint(path)
    torch.save({"obj": dp.CommCounter()}, path)  # an arbitrary object: weights_only refuses it
    with pytest.raises(RuntimeError, match="cannot be read"):
        dp.load_checkpoint(path)


def test_bad_checkpoint_state_is_a_clear_error(tmp_path):
    with pytest.raises(TypeError, match="must be a dict"):
        dp.save_checkpoint(tmp_path / "x.pt", [1, 2])


def test_checksum_sees_one_bit():
    a = {"w": torch.zeros(4)}
    b = {"w": torch.zeros(4)}
    assert dp.state_checksum(a) == dp.state_checksum(b)
    b["w"][2] = torch.finfo(torch.float32).tiny
    assert dp.state_checksum(a) != dp.state_checksum(b)


def _hook_and_syncbn(rank, world_size):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse import ddp_practice as dp

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(5, 3))
    counter = dp.CommCounter()
    model.register_comm_hook(counter, dp.counting_allreduce_hook)
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(4, 5, generator=g)).sum().backward()
    synced = model.module.weight.grad.clone()
    with model.no_sync():
        model(torch.randn(4, 5, generator=g)).sum().backward()
    calls_after = counter.calls
    local = model.module.weight.grad.clone()
    # CPU SyncBatchNorm: the global batch's statistics on every rank
    g2 = torch.Generator().manual_seed(0)
    X = torch.randn(8, 3, 4, 4, generator=g2) + torch.arange(8.0).view(8, 1, 1, 1)
    bn = dp.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(3)), "cpu")
    out = bn(X[rank * 4:(rank + 1) * 4])
    ref = F.batch_norm(X, None, None, training=True)[rank * 4:(rank + 1) * 4]
    return {"calls": calls_after, "bytes": counter.bytes, "synced": synced, "local": local,
            "bn_err": float((out.detach() - ref).abs().max()), "kind": type(bn[0]).__name__}


def test_comm_hook_counts_and_averages_and_cpu_syncbn_matches_global_batch():
    r0, r1 = launch.spawn(_hook_and_syncbn, 2, backend="gloo", timeout=60)
    assert r0["calls"] == 1 and r0["bytes"] == (5 * 3 + 3) * 4  # one bucket, one sync backward
    assert torch.allclose(r0["synced"], r1["synced"])  # averaged: the same on both ranks
    assert not torch.allclose(r0["local"], r1["local"])  # no_sync: added locally, not averaged
    assert r0["kind"] == "CPUSyncBatchNorm"
    assert r0["bn_err"] < 1e-5 and r1["bn_err"] < 1e-5


def test_run_nodes_kills_nodes_that_do_not_finish(tmp_path, no_leftovers):
    # Two real torchrun agents whose worker script hangs: past the time limit everything must
    # be killed, workers included (no_leftovers checks that nothing is left running).
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(launch.LaunchTimeoutError, match="did not finish within"):
        dp.run_nodes(script, timeout=8, join_timeout=5)


def test_run_nodes_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="nnodes"):
        dp.run_nodes(__file__, nnodes=0)
    with pytest.raises(FileNotFoundError):
        dp.run_nodes(tmp_path / "missing.py")


def test_build_model_names():
    assert isinstance(dp.build_model("small_bn"), dp.SmallBNNet)
    with pytest.raises(ValueError, match="unknown model"):
        dp.build_model("resnet50")
    assert dp.script_path("train_ddp").exists() and dp.script_path("train_single").exists()


def test_checksum_handles_buffers_of_any_shape():
    state = dp.SmallBNNet(width=4).state_dict()  # has 0-dim num_batches_tracked buffers
    assert len(dp.state_checksum(state)) == 16
