"""dpcourse.async_sgd: the parameter server (over real gloo processes), the staleness
simulator, local SGD and the large-batch helpers, plus lesson 09's figures."""

import math

import pytest
import torch

from dpcourse import async_sgd, launch, parameter_server, viz

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def problem():
    return async_sgd.make_problem(n_train=512, n_test=256)


def test_problem_and_model_shapes(problem):
    assert problem.x_train.shape == (512, 192) and problem.y_train.shape == (512,)
    model = async_sgd.make_model()
    w = async_sgd.flat_params(model)
    assert w.numel() == 192 * 64 + 64 + 64 * 10 + 10
    assert torch.equal(w, async_sgd.flat_params(async_sgd.make_model()))   # same seed
    async_sgd.set_flat_params(model, torch.zeros_like(w))
    assert float(async_sgd.flat_params(model).abs().sum()) == 0


def test_batches_are_seeded_epochs_and_shards_split_them():
    a = async_sgd.batch_schedule(10, 4, 5, seed=3)
    assert [len(b) for b in a] == [4] * 5
    assert all(torch.equal(x, y) for x, y in zip(a, async_sgd.batch_schedule(10, 4, 5, seed=3)))
    assert sorted(torch.cat(a[:2]).tolist() + a[2][:2].tolist()) == list(range(10))  # epoch 1
    b = torch.arange(6)
    parts = [async_sgd.worker_indices(b, r, 3).tolist() for r in range(3)]
    assert parts == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tau_zero_is_plain_sgd_bit_for_bit(problem, seed):
    batches = async_sgd.batch_schedule(512, 32, 60, seed=seed)
    sgd = async_sgd.plain_sgd(async_sgd.make_model(seed=seed), problem, 0.3, batches)
    assert torch.equal(async_sgd.run_stale(problem, 0, 0.3, batches, seed=seed)["w"], sgd)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_large_tau_at_large_lr_is_worse_and_lr_over_tau_rescues_it(seed):
    problem = async_sgd.make_problem(seed=seed)
    batches = async_sgd.batch_schedule(len(problem.x_train), 32, 400, seed=seed)
    fresh = async_sgd.run_stale(problem, 0, 1.0, batches, seed=seed)["loss"]
    stale = async_sgd.run_stale(problem, 16, 1.0, batches, seed=seed)["loss"]
    aware = async_sgd.run_stale(problem, 16, 1.0, batches, seed=seed,
                                server_cls=async_sgd.StalenessAwareServer)["loss"]
    start = async_sgd.evaluate(async_sgd.make_model(seed=seed),
                               async_sgd.flat_params(async_sgd.make_model(seed=seed)),
                               problem.x_test, problem.y_test)[0]
    assert stale > fresh and not stale < start        # worse, and no better than the start
    assert aware < start
    small = async_sgd.run_stale(problem, 16, 0.1, batches, seed=seed)["loss"]
    assert small < start


def test_simulated_servers_record_staleness_and_scale_the_step():
    loop = async_sgd.async_worker_loop
    server = async_sgd.SimulatedServer(torch.zeros(2), lr=1.0)
    loop(server, lambda w, b: torch.ones(2), range(6), 2)
    assert server.staleness == [0, 1, 2, 2, 2, 2] and server.version == 6
    assert torch.equal(server.w, torch.full((2,), -6.0))
    aware = async_sgd.StalenessAwareServer(torch.zeros(1), lr=1.0)
    loop(aware, lambda w, b: torch.ones(1), range(4), 2)
    assert math.isclose(float(aware.w), -(1 + 1 + 0.5 + 0.5))
    seen = async_sgd.SimulatedServer(torch.zeros(1), lr=1.0)
    loop(seen, lambda w, b: torch.ones(1), range(3), 10)   # τ above the batches: all drained
    assert seen.staleness == [0, 1, 2]


def test_what_awareness_adds_measures_the_aware_server_against_lr_over_tau(problem, capsys):
    from dpcourse.checks import ClaimError

    batches = async_sgd.batch_schedule(512, 32, 60, seed=0)
    taus = (2, 4)
    aware = [async_sgd.run_stale(problem, t, 1.0, batches,
                                 server_cls=async_sgd.StalenessAwareServer)["loss"] for t in taus]
    gaps = async_sgd.what_awareness_adds(problem, taus, 1.0, batches, aware)
    out = capsys.readouterr().out
    assert "exactly τ stale" in out and "bit for bit" in out and "unaware server, lr 1/τ" in out
    scaled = [async_sgd.run_stale(problem, t, 1.0 / t, batches)["loss"] for t in taus]
    assert gaps == [a - s for a, s in zip(aware, scaled)]
    assert any(g != 0 for g in gaps)            # the first τ updates do change something
    # losses that are not the aware server's (the plain server's here): refused
    plain = [async_sgd.run_stale(problem, t, 1.0, batches)["loss"] for t in taus]
    with pytest.raises(ClaimError, match="ends on the test losses above"):
        async_sgd.what_awareness_adds(problem, taus, 1.0, batches, plain)


def test_what_awareness_adds_refuses_a_replay_that_is_not_the_aware_run(problem, monkeypatch):
    from dpcourse.checks import ClaimError

    batches = async_sgd.batch_schedule(512, 32, 30, seed=0)
    aware = [async_sgd.run_stale(problem, 2, 1.0, batches,
                                 server_cls=async_sgd.StalenessAwareServer)["loss"]]
    real = async_sgd.run_stale

    def replay_off_by_a_bit(problem, tau, lr, batches, seed=0, server_cls=None, **kw):
        out = real(problem, tau, lr, batches, seed=seed,
                   server_cls=server_cls or async_sgd.SimulatedServer, **kw)
        if server_cls is not None and server_cls.__name__ == "FixedSteps":
            out["w"] = out["w"] + 1e-6
        return out

    monkeypatch.setattr(async_sgd, "run_stale", replay_off_by_a_bit)
    with pytest.raises(ClaimError, match="bit for bit"):
        async_sgd.what_awareness_adds(problem, (2,), 1.0, batches, aware)


def test_warmup_climbs_linearly_to_k_times_the_lr():
    assert async_sgd.warmup_lr(0, 0.1, 8, 4) == pytest.approx(0.1)
    assert async_sgd.warmup_lr(2, 0.1, 8, 4) == pytest.approx(0.45)
    assert async_sgd.warmup_lr(4, 0.1, 8, 4) == pytest.approx(0.8)
    assert async_sgd.warmup_lr(99, 0.1, 8, 4) == pytest.approx(0.8)


def test_large_batch_returns_one_loss_per_epoch(problem):
    losses = async_sgd.train_large_batch(problem, 128, lambda t: 0.05, 2)
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_share_is_the_lesson_06_formula(n):
    assert async_sgd.ring_elements_per_rank(1200, n) == 2 * (n - 1) * 1200 // n


def test_parameter_server_equals_ddp_and_counts_2nk():
    cfg = parameter_server.PSConfig(steps=3)
    out = launch.spawn(parameter_server.parameter_server_worker, 3, cfg, backend="gloo", timeout=90,
                       show_output=False)
    k = out[0]["numel"]
    assert all(float((out[0]["sync"] - w["ddp"]).abs().max()) < 1e-6 for w in out[1:])
    assert sum(out[0]["sync_bytes"]) == 2 * 2 * k * 4 * 3
    assert all(w["sync_bytes"] == (k * 4 * 3, k * 4 * 3) for w in out[1:])
    assert len(out[0]["staleness"]) == 6 and min(out[0]["staleness"]) >= 0
    assert sum(out[0]["async_bytes"]) == 2 * 6 * (k + 1) * 4


@pytest.mark.parametrize("kwargs, words", [
    ({"steps": 4, "compare_after": 8}, "compare_after must be a step of the run"),
    ({"steps": 4, "compare_after": 0}, "compare_after must be a step of the run"),
    ({"steps": 4, "compare_after": 2, "hs": (1, 0)}, "every H must be a positive int"),
])
def test_local_sgd_refuses_a_comparison_step_outside_the_run(kwargs, words):
    """A run shorter than compare_after used to end in UnboundLocalError ('early'); now a
    sentence, before any process group is needed."""
    kwargs = {"hs": (1,), **kwargs}
    with pytest.raises(ValueError, match=words):
        async_sgd.local_sgd_worker(0, 2, **kwargs)


def test_flat_params_is_defined_once_and_set_flat_params_checks_the_size():
    from dpcourse import ddp, models

    assert async_sgd.flat_params is ddp.flat_params is models.flat_params
    assert async_sgd.set_flat_params is models.set_flat_params
    model = async_sgd.make_model()
    with pytest.raises(ValueError, match="flat has 3 numbers"):
        async_sgd.set_flat_params(model, torch.zeros(3))


def test_local_sgd_h1_is_ddp_and_averages_every_h_steps():
    out = launch.spawn(async_sgd.local_sgd_worker, 2, (1, 4), 16, backend="gloo", timeout=90,
                       show_output=False)
    assert all(float((r[1]["early"] - r["ddp_early"]).abs().max()) < 1e-6 for r in out)
    assert [out[0][h]["averages"] for h in (1, 4)] == [16, 4]
    assert torch.equal(out[0][4]["w"], out[1][4]["w"])
    assert out[0][4]["sent"] == 4 * async_sgd.ring_elements_per_rank(len(out[0][4]["w"]), 2)
    # one drift per average, the same on both ranks (2 ranks sit symmetric about the mean)
    assert [len(out[0][h]["drift"]) for h in (1, 4)] == [16, 4]
    assert all(d > 0 for d in out[0][4]["drift"])
    assert out[0][4]["drift"] == pytest.approx(out[1][4]["drift"], rel=1e-5)
    # the test loss and accuracy of the start, and after training
    start_loss, start_acc = out[0]["start"]
    assert out[0][1]["loss"] < start_loss and 0 <= out[0][1]["acc"] <= 1 and 0 <= start_acc <= 1


def test_straggler_race_async_applies_more_and_the_fast_worker_waits_less():
    cfg = parameter_server.RaceConfig(budget=0.5, straggler_delay=0.05)
    out = launch.spawn(parameter_server.straggler_race, 3, cfg, backend="gloo", timeout=90,
                       show_output=False)
    server = out[0]
    assert server["sync"]["applied"] % 2 == 0 and server["sync"]["staleness"] == []
    assert len(server["async"]["staleness"]) == server["async"]["applied"]
    assert server["async"]["applied"] > server["sync"]["applied"]
    for mode in ("sync", "async"):
        spans = out[1][mode]["spans"]
        assert [k for k, _, _ in spans][-1] == "wait" and all(b >= a for _, a, b in spans)
        # the straggler's injected delay is a span of its own, after each compute, never the fast
        # worker's
        slow = out[2][mode]["spans"]
        sleeps = [(i, b - a) for i, (k, a, b) in enumerate(slow) if k == "sleep"]
        assert sleeps and not any(k == "sleep" for k, _, _ in spans)
        assert all(slow[i - 1][0] == "compute" and d >= cfg.straggler_delay for i, d in sleeps)

    def waited(mode):
        spans = out[1][mode]["spans"]
        return sum(b - a for k, a, b in spans if k == "wait") / spans[-1][2]

    assert waited("sync") > 0.5 and waited("async") < waited("sync")


def _rpc_worker(rank, world_size):
    from torch.distributed import rpc

    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
    got = rpc.rpc_sync("w0", torch.add, args=(torch.ones(2), 1)).tolist() if rank == 1 else None
    rpc.shutdown()
    return got


def test_torch_distributed_rpc_runs_on_the_pinned_torch():
    # the lesson says rpc works here and explains why it uses send/recv instead
    assert launch.spawn(_rpc_worker, 2, timeout=60, show_output=False)[1] == [2.0, 2.0]


def test_lesson_09_figures_render():
    figs = [viz.ps_traffic_figure(1000, {2: 4000, 3: 6000}),
            viz.staleness_figure((0, 1, 4), {0.1: [2.0, 2.1, math.inf]}, {0.1: [2.0, 2.0, 2.1]},
                                 start_loss=2.3),
            viz.staleness_figure((0, 1, 4), {0.1: [2.0, 2.1, 2.2]}, {0.1: [None, None, 2.1]}),
            viz.local_sgd_figure((1, 2, 4), [2.0, 2.0, 2.1], [8, 4, 2]),
            viz.large_batch_figure({"a": [2.0, 1.9], "b": [2.1, 2.0]}),
            viz.straggler_gantt_figure({"sync": {1: [("wait", 0, 0.1), ("compute", 0.1, 0.2)],
                                                 2: [("compute", 0, 0.2)]},
                                        "async": {1: [("compute", 0, 0.2)],
                                                  2: [("compute", 0, 0.2)]}},
                                       {"sync": 2, "async": 3}, 0.2)]
    assert all(viz.figure_to_png(f).startswith(b"\x89PNG") for f in figs)


def test_typical_window_skips_a_stall():
    """The zoomed window is typical: half computing over the run, not the 10 ms stall."""
    row = [("compute", 0.002 * i, 0.002 * i + 0.001) if j == 0 else
           ("wait", 0.002 * i + 0.001, 0.002 * (i + 1)) for i in range(500) for j in (0, 1)]
    row[500:520] = [("wait", 0.5, 0.52)]                   # a 20 ms stall at the middle
    start, here, run = viz.typical_window(row, 1.0, zoom=0.02)
    assert abs(here - run) <= 0.02 and not 0.48 < start < 0.52, (start, here, run)
    fig = viz.straggler_gantt_figure({"async": {1: row, 2: [("compute", 0, 1.0)]}},
                                     {"async": 1}, 1.0)
    assert fig.zoom_window == (start, here, run)


def test_local_sgd_drift_figure_draws_one_line_per_h():
    from dpcourse import viz

    fig = viz.local_sgd_drift_figure((1, 2), [2.0, 2.1], 2.3, {1: [0.1, 0.2, 0.1, 0.2], 2: [0.3, 0.3]})
    assert len(fig.axes[1].lines) == 2 and viz.figure_to_png(fig)[:4] == b"\x89PNG"


def test_staleness_figure_leaves_out_the_aware_runs_not_made():
    # lesson 09 runs the staleness-aware step only for τ >= 2 (τ = 0 and 1 are lab 09's stretch)
    fig = viz.staleness_figure((0, 1, 4), {0.1: [2.0, 2.1, 2.2]}, {0.1: [None, None, 2.1]})
    dashed = [line for line in fig.axes[0].lines if line.get_linestyle() == "--"]
    assert [list(line.get_xdata()) for line in dashed] == [[4]]
