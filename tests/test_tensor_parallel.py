"""dpcourse.tensor_parallel: Megatron's MLP from scratch on 2 and 3 gloo ranks equal to the plain
MLP and to torch's parallelize_module, with its two all-reduces recorded; the 2 x 2 mesh (our TP
and torch's, each with FSDP2) equal to one device, traffic per dimension; the gradient noise
scale from a DDP run against the per-example value; lesson 11's figures.

Launches are the slow part, so each configuration is launched once (module-scoped fixtures)."""

import math

import numpy as np
import pytest
import torch

from dpcourse import launch, viz
from dpcourse import tensor_parallel as tp


# --------------------------------------------------------------------------------------------
# By hand, no ranks
# --------------------------------------------------------------------------------------------


def test_shard_bounds_cut_equal_slices():
    assert [tp.shard_bounds(64, r, 2) for r in range(2)] == [(0, 32), (32, 64)]
    assert [tp.shard_bounds(48, r, 3) for r in range(3)] == [(0, 16), (16, 32), (32, 48)]
    assert tp.shard_bounds(7, 0, 1) == (0, 7)


def test_shard_bounds_refuses_an_uneven_split_and_a_bad_rank():
    with pytest.raises(ValueError, match="64 does not split into 3 equal slices"):
        tp.shard_bounds(64, 0, 3)
    with pytest.raises(ValueError, match="rank must be in"):
        tp.shard_bounds(64, 2, 2)


def test_flash_attention_saves_no_attention_matrix():
    written = tp.attention_saved(64, heads=2, head_dim=8, fused=False)
    fused = tp.attention_saved(64, heads=2, head_dim=8, fused=True)
    assert any(shape[-2:] == (64, 64) for shape in written)
    assert not any(shape[-2:] == (64, 64) for shape in fused)
    assert (1, 2, 64) in fused                                   # the logsumexp


def test_slice_of_takes_ranks_block_along_a_dimension():
    import torch

    w = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(tp.slice_of(w, 0, 1, 2), w[2:4])
    assert torch.equal(tp.slice_of(w, 1, 2, 3), w[:, 4:6])


def test_noise_scale_from_exact_expectations_recovers_both_unknowns():
    g2, trace = 0.25, 12.0
    small, big = g2 + trace / 8, g2 + trace / 32          # E|G_B|^2 = |G|^2 + tr(Sigma)/B
    est = tp.noise_scale_from_norms(small, big, 8, 32)
    assert math.isclose(est["grad_sq"], g2) and math.isclose(est["trace"], trace)


def test_noise_scale_refuses_batches_in_the_wrong_order():
    with pytest.raises(ValueError, match="b_small < b_big"):
        tp.noise_scale_from_norms(1.0, 0.5, 32, 8)


def test_mesh_worker_refuses_a_mesh_that_does_not_match_the_ranks():
    with pytest.raises(ValueError, match="a 2 x 2 mesh needs 4 ranks, got 3"):
        tp.mesh_2d_worker(0, 3, tp.TPConfig())
    with pytest.raises(ValueError, match="7 tokens do not split over 2"):
        tp.mesh_2d_worker(0, 4, tp.TPConfig(tokens=7))


def test_tpconfig_counts_the_plain_mlps_parameters():
    cfg = tp.TPConfig(d=16, h=64)
    assert cfg.num_params == sum(p.numel() for p in tp.plain_mlp(16, 64).parameters()) == 2128


# --------------------------------------------------------------------------------------------
# On ranks
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3])
def tp_run(request):
    n = request.param
    cfg = tp.TPConfig(d=12, h=48, tokens=6)                 # 48 divides by 2 and 3
    return n, cfg, launch.spawn(tp.tensor_parallel_worker, n, cfg, backend="gloo", timeout=120)


def test_ours_equals_the_plain_mlp(tp_run):
    n, cfg, runs = tp_run
    for r in runs:
        assert r["out_diff"] < 1e-6 and r["input_grad_diff"] < 1e-6 and r["grad_diff"] < 1e-6
        assert r["ours_shapes"] == {"up.weight": (48 // n, 12), "up.bias": (48 // n,),
                                    "down.weight": (12, 48 // n), "down.bias": (12,)}


def test_the_ranks_gradients_join_into_the_plain_ones(tp_run):
    # lesson 11 §2 joins them along the dimension where they are cut, naming none
    n, cfg, runs = tp_run
    plain = runs[0]["plain_grads"]
    cut = {0: 0, 1: 0, 2: 1}                      # up.weight, up.bias rows; down.weight columns
    for i, full in enumerate(plain):
        pieces = [r["grads"][i] for r in runs]
        joined = torch.cat(pieces, dim=cut[i]) if i in cut else pieces[0]
        assert torch.allclose(joined, full, atol=1e-6), i
    assert all(torch.allclose(r["grads"][3], plain[3], atol=1e-6) for r in runs)   # down.bias


def test_two_all_reduces_of_the_activations_per_step(tp_run):
    n, cfg, runs = tp_run
    one = ("all_reduce", cfg.tokens * cfg.d, cfg.tokens * cfg.d * 4)
    assert all(r["forward"] == [one] and r["backward"] == [one] for r in runs)


def test_torch_parallelize_module_equals_ours_and_sends_the_same(tp_run):
    n, cfg, runs = tp_run
    for r in runs:
        assert max(r["torch_out_diff"], r["torch_input_grad_diff"], r["torch_grad_diff"]) < 1e-6
        assert r["torch_forward_counts"] == {"all_reduce": 1}
        assert r["torch_counts"] == {"all_reduce": 2}
        assert [c[1:] for c in r["torch_recorded"]] == [
            ("all_reduce", cfg.tokens * cfg.d, cfg.tokens * cfg.d * 4)] * 2
        assert [p[4] for p in r["torch_params"]] == ["S(0)", "S(0)", "S(1)", "R"]


def test_sequence_parallel_splits_each_all_reduce_into_gather_and_scatter():
    cfg = tp.TPConfig()
    runs = launch.spawn(tp.sequence_parallel_worker, 2, cfg, backend="gloo", timeout=120)
    share, whole = cfg.tokens // 2 * cfg.d, cfg.tokens * cfg.d
    for r in runs:
        assert max(r["out_diff"], r["input_grad_diff"], r["grad_diff"]) < 1e-6
        # each pass: the tokens' shares gathered, the partial output reduce-scattered
        assert r["forward"] == r["backward"] == [("all_gather", share, share * 4),
                                                 ("reduce_scatter", whole, whole * 4)]


def test_a_hidden_size_that_does_not_split_is_refused_on_the_ranks():
    with pytest.raises(launch.RankFailedError, match="does not split into 3 equal slices"):
        launch.spawn(tp.tensor_parallel_worker, 3, tp.TPConfig(h=64), backend="gloo",
                     timeout=120)


def test_2d_mesh_equals_one_device_with_traffic_per_dimension():
    cfg = tp.TPConfig()
    runs = launch.spawn(tp.mesh_2d_worker, 4, cfg, backend="gloo", timeout=120)
    assert sorted(r["coords"] for r in runs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    local = cfg.num_params // 2 + cfg.d // 2
    act = cfg.tokens // 2 * cfg.d
    for r in runs:
        assert r["ours_diff"] < 1e-6 and r["torch_diff"] < 1e-6
        for step in r["traffic"]:
            assert step == [("dp", "all_gather", local // 2, local * 2, local * 4),
                            ("tp", "all_reduce", act, act * 4, act * 4),
                            ("dp", "reduce_scatter", local, local * 4, local * 2)]
        assert r["held"]["up.weight"] == ((32, 16), (16, 16))
        # ours_diff compares against the slice torch's tp placement names: pin those placements
        assert {name: p.split(", ")[-1] for name, p in r["torch_placements"].items()} == {
            "0.weight": "Shard(dim=0))", "0.bias": "Shard(dim=0))",
            "2.weight": "Shard(dim=1))", "2.bias": "Replicate())"}


def test_noise_scale_inside_ddp_is_close_to_the_per_example_value():
    out = launch.spawn(tp.noise_scale_worker, 4, 16, 100, backend="gloo", timeout=120)
    rows = np.array(out[0]["rows"])
    assert all(np.allclose(o["rows"], out[0]["rows"]) for o in out)   # every rank agrees
    est = tp.noise_scale_from_norms(rows[:, 0].mean(), rows[:, 1].mean(), 16, 64)
    direct = tp.per_example_noise_scale()
    assert abs(est["trace"] / est["grad_sq"] / direct["b_simple"] - 1) < 0.15
    assert rows[:, 0].mean() > rows[:, 1].mean()       # the smaller batch's gradient is noisier


def test_fsdp2_shards_parameters_but_not_activations():
    held = {n: launch.spawn(tp.activation_memory_worker, n, backend="gloo", timeout=120)
            for n in (2, 4)}
    for n, runs in held.items():
        for r in runs:
            assert r["shard_bytes"] * n == r["full_bytes"]
            assert r["activations"] == r["one_device_activations"] > 0
    # 4 Linear + 4 GeLU inputs and the loss's input, each 8 x 48 floats
    assert held[4][0]["activations"] == held[2][0]["activations"] == 9 * 8 * 48 * 4


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


def test_lesson_11_figures_draw():
    from dpcourse import pipeline_parallel as pp

    figs = [viz.memory_wall_figure((8, 64), [10.0, 2.0], [5.0, 5.0], 80, "t"),
            viz.noise_scale_figure(60.0, 16, (1, 2, 4)),
            viz.tp_shards_figure(16, 64, 3),
            viz.tp_shards_figure(16, 64, 2, answer=True),
            viz.bubble_figure(3, 5, "1f1b"),
            viz.pipeline_gantt_figure(pp.simulate_timeline(2, 2), pp.simulate_timeline(2, 2),
                                        2, 2, 0.3, 0.25)]
    assert all(f.axes for f in figs)


def test_the_noise_task_and_model_are_the_ones_the_noise_scale_uses():
    X, y = tp.noise_task()
    assert X.shape == (4096, 20) and set(y.unique().tolist()) <= set(range(5))
    model = tp.noise_model()
    assert [tuple(p.shape) for p in model.parameters()] == [(32, 20), (32,), (5, 32), (5,)]
    assert model(X[:3]).shape == (3, 5)
