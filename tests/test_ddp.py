"""dpcourse.ddp: collectives, hand-averaged == DDP == one process, sampler shards (gloo, 2 ranks)."""

import pytest
import torch

from dpcourse import ddp, launch


def test_collectives_on_two_ranks():
    res = launch.spawn(ddp.collectives_demo, 2, backend="gloo", timeout=60, show_output=False)
    assert res[0]["broadcast"] == res[1]["broadcast"] == [10.0] * 3
    assert res[0]["all_reduce"] == res[1]["all_reduce"] == [3.0, 30.0]
    assert res[0]["all_gather"] == [0.0, 1.0]
    assert res[0]["reduce_scatter"] == [10.0, 10.0] and res[1]["reduce_scatter"] == [12.0, 12.0]


def test_hand_averaged_equals_ddp_equals_single_process():
    cmp = ddp.compare_three(ddp.StepConfig(global_batch=16, steps=2, width=4, n_train=64),
                            world_size=2, backend="gloo", timeout=90)
    for key in ("grad_manual_vs_single", "grad_ddp_vs_single", "grad_manual_vs_ddp",
                "params_manual_vs_single", "params_ddp_vs_single"):
        assert cmp[key] < 1e-5, (key, cmp[key])
    assert cmp["ranks_bitwise_equal_manual"] and cmp["ranks_bitwise_equal_ddp"]


def test_without_averaging_the_ranks_drift_apart():
    # The comparison can fail: with no averaging the ranks train on different shards.
    res = launch.spawn(ddp.manual_dp_worker, 2,
                       ddp.StepConfig(global_batch=16, steps=3, width=4, n_train=64),
                       lambda model: None, backend="gloo", timeout=60, show_output=False)
    assert not torch.allclose(res[0]["params"], res[1]["params"])


def test_ddp_broadcasts_initial_weights_and_overlaps():
    res = launch.spawn(ddp.ddp_internals_worker, 2, 0.1, backend="gloo", timeout=60,
                       show_output=False)
    assert not res[0]["changed_by_ddp"] and res[1]["changed_by_ddp"]
    assert res[0]["equal_on_all_ranks"]
    kinds = [k for k, _ in res[0]["iterations"][1]]
    assert kinds.index("all_reduce") < kinds.index("first_layer_grad")


def test_sampler_shards_and_set_epoch():
    without = ddp.sampler_orders(12, 3, epochs=2, set_epoch=False)
    with_ = ddp.sampler_orders(12, 3, epochs=2, set_epoch=True)
    for orders in (without, with_):
        for per_rank in orders:
            assert ddp.shard_overlap(per_rank) == 0
            assert sorted(sum(per_rank, [])) == list(range(12))
    assert without[0] == without[1]
    assert with_[0] != with_[1]
    # padding when n does not split: one index is repeated
    assert ddp.shard_overlap(ddp.sampler_orders(5, 2, epochs=1)[0]) == 1


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="smaller than world_size"):
        ddp.StepConfig(global_batch=1).per_rank_batch(2)
    with pytest.raises(ValueError, match="does not split over 2 ranks"):
        ddp.StepConfig(global_batch=5).per_rank_batch(2)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="GPU"):
        ddp.validate_world_size(gpus + 1, "nccl")
    with pytest.raises(ValueError, match="backend"):
        ddp.validate_world_size(2, "mpi")


def test_bucket_limits_are_ddps_mib():
    assert ddp.bucket_limits(0.1) == (104857, 104857)          # int(0.1 * 1024 * 1024)
    assert ddp.bucket_limits(2) == (2 * 2**20, 2 * 2**20)
    assert ddp.bucket_limits(None) == (2**20, 25 * 2**20)      # default: 1 MiB first bucket


def test_initial_bucket_limits_one_bucket_unless_find_unused_or_a_list():
    import sys

    one = [sys.maxsize]
    assert ddp.initial_bucket_limits(0.1) == one                       # the default flags
    assert ddp.initial_bucket_limits(0.1, static_graph=True) == one
    assert ddp.initial_bucket_limits(0.1, static_graph=True, find_unused_parameters=True) == one
    assert ddp.initial_bucket_limits(0.1, find_unused_parameters=True) == [104857]
    assert ddp.initial_bucket_limits(None, find_unused_parameters=True) == [2**20, 25 * 2**20]
    for static in (False, True):                  # an explicit list wins over every flag
        for unused in (False, True):
            assert ddp.initial_bucket_limits(None, [0.1], static_graph=static,
                                             find_unused_parameters=unused) == [104857]


def test_rank_zero_buffers_are_broadcast_before_every_forward():
    res = launch.spawn(ddp.buffer_sync_worker, 2, 2, backend="gloo", timeout=60,
                       show_output=False)
    on, off = [r[True] for r in res], [r[False] for r in res]
    assert all(torch.equal(a, b) for a, b in zip(on[0]["seen"], on[1]["seen"]))
    assert not torch.equal(on[0]["final_running_mean"], on[1]["final_running_mean"])
    assert torch.equal(on[0]["eval_out"], on[1]["eval_out"])
    assert not torch.equal(off[0]["seen"][1], off[1]["seen"][1])
    assert not torch.equal(off[0]["eval_out"], off[1]["eval_out"])
    assert torch.equal(on[0]["final_running_mean"], off[0]["final_running_mean"])
    # not before EVERY forward: one that follows a no-grad or a no_sync forward starts from each
    # rank's own running mean (require_forward_param_sync is off), one that follows a training
    # forward from rank 0's
    later = [r["later"] for r in on]
    for k, (follows, _) in enumerate(later[0]):
        same = torch.equal(later[0][k][1], later[1][k][1])
        if follows in ("a no-grad forward", "a no_sync forward"):
            assert not same, follows
        elif follows == "a training forward":
            assert same, follows


def test_cpu_threads_respect_omp_num_threads():
    """A per-learner OMP_NUM_THREADS is a ceiling: 64 cores and 2 ranks give 32 threads each
    only when nothing is set (issue: rank_device overrode the instructor's setting)."""
    from dpcourse.ddp import cpu_threads_per_rank

    assert cpu_threads_per_rank(2, environ={}, cpu_count=64) == 32
    assert cpu_threads_per_rank(2, environ={"OMP_NUM_THREADS": "2"}, cpu_count=64) == 2
    assert cpu_threads_per_rank(2, environ={"OMP_NUM_THREADS": "8"}, cpu_count=4) == 2
    assert cpu_threads_per_rank(3, environ={"OMP_NUM_THREADS": "junk"}, cpu_count=2) == 1


def _threads_around_rank_device_and_setup_rank(rank, world_size):
    torch.set_num_threads(7)
    dev = ddp.rank_device()
    after_getter = torch.get_num_threads()
    same = ddp.setup_rank()
    return {"device": str(dev), "same_device": same == dev, "after_getter": after_getter,
            "after_setup": torch.get_num_threads()}


def test_rank_device_only_reads_and_setup_rank_sets_the_threads():
    """rank_device() names the device and changes nothing; setup_rank() returns the same device
    and gives each of the 2 CPU ranks its share of the cores (capped by OMP_NUM_THREADS)."""
    from dpcourse.ddp import cpu_threads_per_rank

    res = launch.spawn(_threads_around_rank_device_and_setup_rank, 2, backend="gloo",
                       timeout=60, show_output=False)
    share = cpu_threads_per_rank(2)
    for r in res:
        assert r["device"] == "cpu" and r["same_device"]
        assert r["after_getter"] == 7
        assert r["after_setup"] == share


def test_setup_rank_caps_threads_on_cpu_and_turns_tf32_off_on_a_gpu(monkeypatch):
    """Both settings, without a process group: explicit device and local world size."""
    threads = torch.get_num_threads()
    tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        monkeypatch.setattr("dpcourse.devices.usable_cores", lambda: 64)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert ddp.setup_rank("cpu", local_world_size=2) == torch.device("cpu")
        assert torch.get_num_threads() == 3                  # 32 by share, 3 by the ceiling
        monkeypatch.delenv("OMP_NUM_THREADS")
        ddp.setup_rank("cpu", local_world_size=16)
        assert torch.get_num_threads() == 4                  # 64 cores / 16 ranks
        torch.set_num_threads(5)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
        assert ddp.setup_rank("cuda:1", local_world_size=2) == torch.device("cuda", 1)
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
        # lesson 03 compares two launches' gradients bit for bit: deterministic convolutions
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.get_num_threads() == 5                  # a GPU rank keeps its threads
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def test_same_bits_compares_bits_not_values():
    """lesson 03's same_bits: -0.0 and 0.0 are equal values with different bits; a NaN is the
    same bits as itself though never an equal value; only float32 is compared."""
    zero, neg = torch.tensor([0.0]), torch.tensor([-0.0])
    assert torch.equal(zero, neg) and not ddp.same_bits(zero, neg)
    nan = torch.tensor([float("nan"), 1.0])
    assert not torch.equal(nan, nan.clone()) and ddp.same_bits(nan, nan.clone())
    x = torch.randn(3, 4)
    assert ddp.same_bits(x.t(), x.t().contiguous())          # a strided view compares too
    assert not ddp.same_bits(x, torch.nextafter(x, x + 1))     # one ulp away
    with pytest.raises(TypeError, match="float32"):
        ddp.same_bits(x.double(), x.double())
