"""dpcourse.dp: DataParallel from scratch equals the plain module, and its costs are counted."""

import copy

import pytest
import torch
import torch.nn.functional as F

from dpcourse import dp, dp_costs, models


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = models.SmallCNN(width=4)
    X = torch.randn(12, 3, 32, 32)
    y = torch.randint(0, 10, (12,))
    return model, X, y


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_outputs_and_grads_equal_plain_module(setup, n):
    model, X, y = setup
    plain = copy.deepcopy(model)
    out = dp.data_parallel(model, X, dp.devices_for(n, kind="cpu"))
    F.cross_entropy(out, y).backward()
    ref = plain(X)
    F.cross_entropy(ref, y).backward()
    assert torch.allclose(out, ref, atol=1e-5)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_replicas_are_tied_to_the_original(setup):
    model, X, _ = setup
    reps = dp.replicate(model, 3)
    p0 = next(model.parameters())
    for i, r in enumerate(reps):
        q = next(r.parameters())
        assert not q.is_leaf and torch.equal(p0, q)
        # replica 0 shares the module's storage (as torch's replicate does); the others copy
        assert (q.data_ptr() == p0.data_ptr()) == (i == 0)
    # a backward through one replica only lands on the original parameters
    reps[2](X[:2]).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_scatter_gather_roundtrip_and_bad_batches():
    X = torch.arange(20.0).reshape(10, 2)
    chunks = dp.scatter(X, 4)
    assert [c.shape[0] for c in chunks] == [3, 3, 3, 1]
    assert torch.equal(dp.gather(chunks), X)
    # like nn.DataParallel: torch.chunk's sizes, fewer chunks when the batch runs out first
    assert [c.shape[0] for c in dp.scatter(X[:3], 4)] == [1, 1, 1]
    assert [c.shape[0] for c in dp.scatter(X[:5], 4)] == [2, 2, 1]
    assert [c.shape[0] for c in dp.scatter(X[:6], 4)] == [2, 2, 2]
    with pytest.raises(ValueError, match="empty batch"):
        dp.scatter(X[:0], 4)


def test_parallel_apply_keeps_grad_mode_and_reports_the_failing_replica(setup):
    model, X, _ = setup
    reps = dp.replicate(model, 2)
    outs = dp.parallel_apply(reps, dp.scatter(X, 2))
    assert all(o.requires_grad for o in outs)
    with torch.no_grad():
        outs = dp.parallel_apply(reps, dp.scatter(X, 2))
    assert not any(o.requires_grad for o in outs)
    with pytest.raises(RuntimeError, match="replica 1 failed"):
        dp.parallel_apply(reps, [X[:2], torch.randn(2, 5)])
    with pytest.raises(ValueError, match="one input chunk per replica"):
        dp.parallel_apply(reps, [X])


def test_traffic_is_2_n_minus_1_k(setup):
    model, X, y = setup
    K = models.count_parameters(model)
    for n in (2, 4):
        m = copy.deepcopy(model)
        with dp.TrafficCounter() as tc:
            F.cross_entropy(dp.data_parallel(m, X, n), y).backward()
        assert tc.params_out == tc.grads_in == (n - 1) * K
        assert tc.total == dp.parameter_server_traffic(n, K) == 2 * (n - 1) * K
        assert tc.replicate_calls == 1


def test_devices_for_refuses_more_gpus_than_present():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"this machine has {gpus}"):
        dp.devices_for(gpus + 1, kind="cuda")
    with pytest.raises(ValueError, match="positive int"):
        dp.devices_for(0)


def test_real_data_parallel_report(setup):
    model, X, _ = setup
    rep = dp.real_data_parallel(model, X)
    assert rep.matches_module
    if rep.gpu_count >= 2:
        assert rep.mode == "parallel" and rep.replicate_calls == 1
    else:
        assert rep.mode == "passthrough" and rep.replicate_calls == 0
        assert rep.scatter_calls == (1 if rep.gpu_count == 1 else 0)
        assert rep.parallel_apply_calls == 0
        assert "calls" in rep.explain() and "no threads" in rep.explain()


def test_real_data_parallel_mode_is_observed_not_assumed(setup, monkeypatch):
    """The mode comes from the calls of DataParallel's replicate, not from the GPU count: a
    DataParallel whose forward replicates (as it does with 2+ GPUs) is reported parallel."""
    model, X, _ = setup

    def forward_that_replicates(self, *inputs):
        replicas = self.replicate(self.module, [torch.device("cpu")])
        return replicas[0](*inputs)

    monkeypatch.setattr(torch.nn.DataParallel,
                        "forward", forward_that_replicates)
    monkeypatch.setattr(torch.nn.DataParallel, "replicate", lambda self, m, ids: [m])
    rep = dp.real_data_parallel(model, X)
    assert rep.mode == "parallel" and rep.replicate_calls == 1


def test_measurements_have_the_right_form(setup):
    model, X, _ = setup
    t = dp_costs.time_replicate_vs_forward(model, X, 2, repeats=2)
    assert t["replicate_s"] > 0 and t["forward_chunk_s"] > 0 and t["torch_replicate_s"] > 0
    g = dp_costs.gil_threads_demo(n=50_000)
    assert g["sequential_s"] > 0 and g["threaded_s"] > 0
    assert g["cpu_per_wall"] < 1.3  # the GIL: one core at a time for pure Python


def test_kernel_gil_probe_tells_a_kernel_that_holds_the_gil(monkeypatch):
    torch.set_num_threads(1)
    released = dp_costs.kernel_gil_probe(tries=1)
    assert released["longest_gap_s"] < 0.5 * released["kernel_s"]
    # a C call that keeps the GIL (sum over a range) stands in for the kernel: a long pause
    monkeypatch.setattr(torch, "mm", lambda a, b: sum(range(5_000_000)))
    held = dp_costs.kernel_gil_probe(size=8, tries=1)
    assert held["longest_gap_s"] > 0.5 * held["kernel_s"]


def test_torch_replicate_is_timed_on_its_training_path(setup):
    # detach=False, as DataParallel.replicate in a training step: torch's replicate then goes
    # through the (stood-in) differentiable Broadcast, which counts its copies like ours.
    model, X, _ = setup
    K = models.count_parameters(model)
    with dp.TrafficCounter() as tc:
        dp_costs.time_replicate_vs_forward(model, X, 2, repeats=1)
    assert tc.replicate_calls == 1 and tc.params_out == 2 * K


def test_replicate_makes_one_distinct_module_per_device():
    # A memo shared between the deep copies once made every "replica" the same object, whose
    # parameters pointed at the last device's copy.
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    reps = dp.replicate(model, dp.devices_for(3, "cpu"))
    assert len({id(r) for r in reps}) == 3
    firsts = [r[0].weight for r in reps]
    assert len({id(w) for w in firsts}) == 3
    assert all(torch.equal(w, model[0].weight) for w in firsts)


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                               torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 10))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_replica_zero_shares_buffers_so_batchnorm_keeps_device_0s_statistics(n):
    # torch's DataParallel guarantees that the replica on device_ids[0] shares parameters and
    # buffers with the module: BatchNorm's running statistics then come from chunk 0 alone.
    net = _bn_net()
    X = torch.randn(16, 3, 32, 32)
    devs = dp.devices_for(n, "cpu")
    reps = dp.replicate(net, devs)
    assert reps[0][1].running_mean is net[1].running_mean
    assert all(r[1].running_mean is not net[1].running_mean for r in reps[1:])
    first, whole = copy.deepcopy(net), copy.deepcopy(net)
    dp.data_parallel(net, X, devs)
    first(dp.scatter(X, devs)[0])
    whole(X)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(net[1], name), getattr(first[1], name)), name
    if n > 1:
        assert not torch.allclose(net[1].running_mean, whole[1].running_mean)


def test_new_thread_starts_with_grad_on_and_parallel_apply_passes_no_grad_on():
    import threading
    seen = []
    with torch.no_grad():
        t = threading.Thread(target=lambda: seen.append(torch.is_grad_enabled()))
        t.start()
        t.join()
        outs = dp.parallel_apply([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)],
                                 [torch.ones(1, 2), torch.ones(1, 2)])
    assert seen == [True]  # the reason parallel_apply must carry the caller's mode over
    assert not any(o.requires_grad for o in outs)


def test_data_parallel_uses_fewer_devices_when_the_batch_runs_out():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    X = torch.randn(6, 3)
    with dp.TrafficCounter() as tc:
        out = dp.data_parallel(model, X, 4)  # torch.chunk: 3 chunks of 2 -> 3 replicas
        out.sum().backward()
    K = sum(p.numel() for p in model.parameters())
    assert torch.allclose(out, model(X), atol=1e-6)
    assert tc.params_out == 2 * K and tc.grads_in == 2 * K  # counted copies, 3 devices
