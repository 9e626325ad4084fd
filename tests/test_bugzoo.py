"""dpcourse.bugzoo: every broken program shows its symptom, and its fix removes it — all bounded
by short timeouts, nothing left running."""

import inspect
import math
import socket

import pytest
import torch

from dpcourse import bugzoo, detectors, launch

pytestmark = pytest.mark.usefixtures("no_leftovers")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("zoo")
    return workdir, launch.spawn(bugzoo.zoo_worker, 2, str(workdir), backend="gloo",
                                 timeout=60, show_output=False)


@pytest.mark.parametrize("bug, pending, fixed_result", [
    (bugzoo.partial_collective, [0], [1.5, None]),
    (bugzoo.collective_order, [0, 1], [[2.0] * 4, [2.0] * 4]),
    (bugzoo.early_stop, [0], [3, 3]),
])
def test_the_hanging_programs_hang_and_their_fixes_finish(bug, pending, fixed_result):
    with pytest.raises(launch.LaunchTimeoutError) as err:
        launch.spawn(bug, 2, False, backend="gloo", timeout=2, show_output=False)
    assert err.value.pending == pending
    assert launch.spawn(bug, 2, True, backend="gloo", timeout=30,
                        show_output=False) == fixed_result


def test_three_ranks_fixed_programs_still_agree():
    assert launch.spawn(bugzoo.early_stop, 3, True, backend="gloo", timeout=30,
                        show_output=False) == [4, 4, 4]


def _flat(checksums):
    return [sum(c.values()) for c in checksums]


def test_resume_on_one_rank(zoo):
    _, runs = zoo
    broken = [_flat(r["resume"][False]) for r in runs]
    assert all(a != b for a, b in zip(*broken))
    fixed = [_flat(r["resume"][True]) for r in runs]
    assert fixed[0] == fixed[1]


def test_averaged_loss_logs_well_but_drifts(zoo):
    _, runs = zoo
    broken = [r["averaged_loss"][False] for r in runs]
    assert broken[0]["logged_loss"] == pytest.approx(broken[1]["logged_loss"], abs=1e-6)
    assert _flat(broken[0]["weights"])[-1] != _flat(broken[1]["weights"])[-1]
    fixed = [r["averaged_loss"][True] for r in runs]
    assert _flat(fixed[0]["weights"]) == _flat(fixed[1]["weights"])


def test_batchnorm_buffers_differ_only_in_the_broken_program(zoo):
    _, runs = zoo
    b0, b1 = (r["batchnorm"][False] for r in runs)
    assert b0["1.running_mean"] != b1["1.running_mean"] and b0["0.weight"] == b1["0.weight"]
    f0, f1 = (r["batchnorm"][True] for r in runs)
    assert f0 == f1


def test_nan_spreads_from_one_rank_unless_the_step_is_skipped(zoo):
    _, runs = zoo
    for r in runs:
        assert all(math.isnan(v) for v in r["nan"][False]["eval_loss"][3:])
        assert all(math.isfinite(v) for v in r["nan"][True]["eval_loss"])
    assert math.isfinite(runs[0]["nan"][False]["local_grad_norm"][3])  # rank 0 was healthy
    assert math.isnan(runs[1]["nan"][False]["local_grad_norm"][3])


def test_set_epoch(zoo):
    _, runs = zoo
    for r in runs:
        broken, fixed = r["set_epoch"][False], r["set_epoch"][True]
        assert broken[0] == broken[1] == broken[2]
        assert len({tuple(o) for o in fixed}) == 3
    for e in range(3):
        assert sorted(runs[0]["set_epoch"][True][e] + runs[1]["set_epoch"][True][e]) == \
            list(range(16))


def test_unused_parameter_fails_without_find_unused(zoo):
    _, runs = zoo
    for r in runs:
        assert "Expected to have finished reduction" in r["unused"][False]
        assert r["unused"][True] == "ok"


def test_checkpoint_writers(zoo):
    workdir, runs = zoo
    assert [len(r["checkpoint"][False]) for r in runs] == [1, 1]
    assert [len(r["checkpoint"][True]) for r in runs] == [1, 0]
    for variant in ("broken", "fixed"):
        state = torch.load(workdir / variant / "checkpoint.pt")
        assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_port_in_use_fails_fast_and_a_free_port_works():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(launch.RankFailedError) as err:
            launch.spawn(bugzoo.port_in_use, 2, s.getsockname()[1], timeout=20,
                         show_output=False)
    assert err.value.rank == 0 and "EADDRINUSE" in err.value.summary
    assert launch.spawn(bugzoo.port_in_use, 2, launch.free_port(), timeout=20,
                        show_output=False) == ["connected", "connected"]


def test_unused_parameter_first_backward_makes_no_all_reduce(zoo):
    # iteration 0's one bucket holds head_b, whose gradient never arrives: no all-reduce, so
    # each rank keeps its own gradients; find_unused_parameters=True averages them
    _, runs = zoo
    broken = [r["unused_first_grads"][False] for r in runs]
    fixed = [r["unused_first_grads"][True] for r in runs]
    # (the biases' gradients of a summed output do not depend on the batch: equal anyway)
    assert detectors.compare_checksums(broken) == ["body.weight", "head_a.weight"]
    assert detectors.compare_checksums(fixed) == []


def test_unused_parameter_message_is_whole_and_info_names_the_parameters(zoo):
    _, runs = zoo
    for r in runs:
        assert "Parameter indices which did not receive grad for rank" in r["unused"][False]
        assert "TORCH_DISTRIBUTED_DEBUG" in r["unused"][False]
        assert "head_b.bias, head_b.weight" in r["unused_info"]


def test_averaged_loss_gradient_is_own_over_n_and_torch_warns(zoo):
    _, runs = zoo
    for r in runs:
        broken = r["averaged_loss"][False]
        assert broken["grad_minus_own_over_n"] == [0.0] * 6
        assert "autograd kernel was not registered" in broken["warnings"][0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_differentiable_all_reduce_of_the_loss_gives_each_rank_its_own_gradient(world_size):
    """Bug 5 with torch.distributed.nn.functional.all_reduce: the backward sums the ranks' 1/N
    into 1, so each rank's gradient is exactly its own and the replicas still drift."""
    runs = launch.spawn(bugzoo.averaged_loss_differentiable, world_size, backend="gloo",
                        timeout=60, show_output=False)
    assert all(r["grad_minus_own"] == [0.0, 0.0] for r in runs)
    assert detectors.compare_checksums([r["weights"][0] for r in runs]) == []
    assert detectors.compare_checksums([r["weights"][1] for r in runs]) != []


def test_ddp_buffer_sync_leaves_batchnorm_statistics_apart_after_the_last_step(zoo):
    _, runs = zoo
    a, b = (r["batchnorm_ddp"] for r in runs)
    assert [k for k in a if a[k] != b[k]] == ["1.running_mean", "1.running_var"]


def test_the_corrupted_rank_loss_stays_finite(zoo):
    _, runs = zoo
    assert math.isfinite(runs[1]["nan"][False]["local_loss"][3])
    assert math.isnan(runs[1]["nan"][False]["local_grad_norm"][3])


def _finite_verdicts(rank, world_size, bad_rank):
    return bugzoo.all_ranks_finite(math.nan if rank == bad_rank else 1.0)


def _verdict_device(rank, world_size):
    import torch.distributed as dist

    seen = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        seen.append(str(tensor.device))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        bugzoo.all_ranks_finite(1.0, device=torch.device("cpu"))
    finally:
        dist.all_reduce = real
    return seen


def test_all_ranks_finite_sends_its_verdict_from_the_device_it_is_given():
    # NCCL takes CUDA tensors only: the verdict must travel on the parameters' device
    assert launch.spawn(_verdict_device, 2, backend="gloo", timeout=30,
                        show_output=False) == [["cpu"], ["cpu"]]
    assert "device" in inspect.signature(bugzoo.all_ranks_finite).parameters


@pytest.mark.parametrize("bad_rank, expected", [(None, [True] * 3), (0, [False] * 3),
                                                (2, [False] * 3)])
def test_all_ranks_finite_gives_one_verdict_on_every_rank(bad_rank, expected):
    assert launch.spawn(_finite_verdicts, 3, bad_rank, backend="gloo", timeout=30,
                        show_output=False) == expected


def test_checksum_collision_differs_in_its_weights_and_not_in_its_checksums():
    # lesson 10's folded run of what a weighted checksum misses (lab 10's stretch, hint 2)
    assert bugzoo.checksum_collision() == (False, [])
