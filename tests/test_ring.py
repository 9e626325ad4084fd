"""dpcourse.ring: the simulator, the cost models, the fit and the real ring; dpcourse.viz figures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpcourse import launch, ring, viz


@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("length", [0, 1, 2, 5, 7, 8, 9, 64, 101, 1000])
def test_simulator_sums_and_counts_bytes(n, length):
    rng = np.random.default_rng(10 * n + length)
    arrays = [rng.integers(-50, 50, length).astype(np.int64) for _ in range(n)]
    trace = ring.simulate_ring(arrays)
    total = np.sum(arrays, axis=0) if length else np.zeros(0, np.int64)
    assert all(np.array_equal(b, total) for b in trace.result)
    assert len(trace.steps) == 1 + 2 * (n - 1)
    # exact bytes (uneven chunks included) ...
    assert trace.bytes_sent() == ring.ring_bytes_per_worker(length, n, itemsize=8)
    # ... and the textbook 2(N-1)K/N, to within one element per step for uneven chunks
    k = length * 8
    for sent in trace.bytes_sent():
        assert abs(sent - 2 * (n - 1) * k / n) <= 2 * (n - 1) * 8
        if length % n == 0:
            assert sent == 2 * (n - 1) * k // n
    assert (trace.steps[-1].contributions == n).all()


def test_simulator_leaves_inputs_and_intermediate_states_right():
    arrays = [np.full(6, float(w + 1)) for w in range(3)]
    trace = ring.simulate_ring(arrays)
    assert all((a == w + 1).all() for w, a in enumerate(arrays))
    after_sr = trace.steps[2]  # end of reduce-scatter: worker i owns chunk i+1 complete
    for w in range(3):
        c = (w + 1) % 3
        assert after_sr.contributions[w, c] == 3
        a, b = trace.bounds[c]
        assert (after_sr.buffers[w][a:b] == 6).all()
    assert trace.steps[1].transfers[0] == ring.Transfer(0, 1, 0, 2)
    assert "w0->w1: chunk 0" in trace.describe(1)


def test_chunk_bounds_is_array_split_and_tensor_split():
    for length in range(0, 20):
        for n in range(1, 7):
            sizes = [b - a for a, b in ring.chunk_bounds(length, n)]
            assert sizes == [len(c) for c in np.array_split(np.arange(length), n)]
            assert sizes == [len(c) for c in torch.arange(length).tensor_split(n)]


def test_bad_inputs_get_one_clear_error():
    with pytest.raises(ValueError, match="same length"):
        ring.simulate_ring([np.zeros(3), np.zeros(4)])
    with pytest.raises(ValueError, match="1-D"):
        ring.simulate_ring([np.zeros((2, 2))])
    with pytest.raises(ValueError, match="unknown algorithm"):
        ring.cost("butterfly", 4, 1e6, 1e-6, 1e-9)
    with pytest.raises(TypeError, match="torch.Tensor"):
        ring.ring_allreduce([1.0, 2.0])


def test_cost_models():
    a, b = 5e-6, 1 / 10e9
    k = 100e6
    for n in (2, 4, 8, 64):
        r = ring.cost("ring", n, k, a, b)
        assert r.steps == 2 * (n - 1)
        assert r.critical_path_bytes == pytest.approx(2 * (n - 1) * k / n)
        assert r.critical_path_bytes < 2 * k  # under 2K whatever N
        assert ring.cost("parameter-server", n, k, a, b).critical_path_bytes == 2 * n * k
        # the critical path, not one link's one direction: in then out for the naive way and
        # the tree; for Rabenseifner's at N = 6, p = 4's bytes plus the two K-byte fold steps
        assert ring.cost("naive", n, k, a, b).critical_path_bytes == 2 * (n - 1) * k
        assert ring.cost("tree", n, k, a, b).critical_path_bytes == 2 * math.ceil(
            math.log2(n)) * k
        assert ring.cost("rabenseifner", n, k, a, b).critical_path_bytes == pytest.approx(
            2 * (n - 1) * k / n)
        assert ring.cost("naive", n, k, a, b).seconds == pytest.approx(2 * (n - 1) * (a + k * b))
    assert ring.cost("rabenseifner", 6, k, a, b).critical_path_bytes == pytest.approx(
        2 * 3 * k / 4 + 2 * k)
    # big messages: ring beats everything; tiny messages: the tree's few steps win
    big = {alg: ring.cost(alg, 16, k, a, b).seconds for alg in ring.ALGORITHMS}
    assert min(big, key=big.get) == "ring"
    small = {alg: ring.cost(alg, 64, 1e3, a, b).seconds for alg in ("ring", "tree", "naive")}
    assert min(small, key=small.get) == "tree"


def test_fit_recovers_known_alpha_beta():
    rng = np.random.default_rng(0)
    ns, ks = np.meshgrid([2, 4], 1024 * 4.0 ** np.arange(8))
    ns, ks = ns.ravel(), ks.ravel()
    t = 2 * (ns - 1) * 30e-6 + 2 * (ns - 1) / ns * ks * 2e-9
    fit = ring.fit_alpha_beta(ns, ks, t * rng.uniform(0.97, 1.03, t.shape))
    assert fit.alpha == pytest.approx(30e-6, rel=0.1)
    assert fit.beta == pytest.approx(2e-9, rel=0.1)
    assert fit.relative_errors.max() < 0.1
    with pytest.raises(ValueError):
        ring.fit_alpha_beta([2], [1024], [1e-3])


def test_contention_fit_recovers_a_machine_with_fewer_cores_than_ranks():
    # 4 ranks on 2 cores: every term twice as long as the plain ring model says.
    ns, ks = np.meshgrid([2, 4], 1024 * 4.0 ** np.arange(8))
    ns, ks = ns.ravel(), ks.ravel()
    t = np.maximum(1, ns / 2) * (2 * (ns - 1) * 30e-6 + 2 * (ns - 1) / ns * ks * 2e-9)
    plain = ring.fit_alpha_beta(ns, ks, t)
    shared = ring.fit_alpha_beta(ns, ks, t, cores=2)
    assert shared.alpha == pytest.approx(30e-6, rel=1e-6)
    assert shared.beta == pytest.approx(2e-9, rel=1e-6)
    assert shared.relative_errors.max() < 1e-6 < np.median(plain.relative_errors)
    assert shared.slowdown([2, 4, 8]).tolist() == [1.0, 2.0, 4.0]
    per_n = ring.fit_alpha_beta_per_n(ns, ks, t)
    assert sorted(per_n) == [2, 4] and per_n[4].alpha == pytest.approx(60e-6, rel=1e-6)
    with pytest.raises(ValueError, match="cores must be"):
        ring.fit_alpha_beta(ns, ks, t, cores=0)


def _compare_with_all_reduce(rank, world_size):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(123)  # same shapes on every rank
    results = []
    for trial in range(12):
        dims = torch.randint(1, 6, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)
        shape = tuple(int(d) for d in dims) if trial else (1,)
        dtype = [torch.float32, torch.float64, torch.int64, torch.int32, torch.float16,
                 torch.bfloat16][trial % 6]
        x = (torch.randn(shape, generator=g) * 50 + rank).to(dtype) + rank
        mine, theirs = x.clone(), x.clone()
        ring.ring_allreduce(mine)
        dist.all_reduce(theirs)
        if dtype.is_floating_point:  # another order of N additions: a few roundings apart
            tol = 4 * world_size * torch.finfo(dtype).eps * float(x.abs().max().double())
            ok = torch.allclose(mine.double(), theirs.double(), rtol=0, atol=tol)
        else:
            ok = torch.equal(mine, theirs)
        results.append((str(dtype), shape, ok))
    # average, a non-contiguous tensor, and an empty one
    x = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)
    y = x.clone()
    ring.ring_allreduce(x, op="average")
    dist.all_reduce(y)
    results.append(("average, non-contiguous", tuple(x.shape), torch.allclose(x, y / world_size)))
    e = torch.empty(0)
    results.append(("empty", (0,), ring.ring_allreduce(e).numel() == 0))
    big = torch.rand(3 * 2**18 + 5, generator=torch.Generator().manual_seed(rank))
    ref = big.clone()
    ring.ring_allreduce(big, segment_bytes=4096)  # many segments per chunk
    dist.all_reduce(ref)
    results.append(("segmented", tuple(big.shape), torch.allclose(big, ref, rtol=1e-5)))
    if world_size == 4:  # a sub-group of 3 ranks: peers are found through global ranks
        group = dist.new_group([1, 2, 3])
        if rank in (1, 2, 3):
            x = torch.arange(10.0) * (rank + 1)
            y = x.clone()
            ring.ring_allreduce(x, group=group)
            dist.all_reduce(y, group=group)
            results.append(("group", (10,), torch.equal(x, y)))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_real_ring_equals_all_reduce(world_size):
    per_rank = launch.spawn(_compare_with_all_reduce, world_size, backend="gloo", timeout=120)
    bad = [r for res in per_rank for r in res if not r[2]]
    assert not bad, bad


def test_average_on_integers_is_refused():
    with pytest.raises(TypeError, match="floating-point"):
        ring.ring_allreduce(torch.ones(3, dtype=torch.int64), op="average")
    with pytest.raises(ValueError, match="op must be"):
        ring.ring_allreduce(torch.ones(3), op="max")


def test_figures_render_png():
    trace = ring.simulate_ring([np.arange(3.0) + w for w in range(3)])
    png = viz.figure_to_png(viz.ring_steps_figure(trace, steps=[0, 4]))
    assert png.startswith(b"\x89PNG")
    assert viz.figure_to_png(viz.cost_figure(5e-6, 1e-10)).startswith(b"\x89PNG")
    ks = np.array([1024, 65536, 1 << 20] * 2, dtype=float)
    ns = np.array([2] * 3 + [4] * 3)
    fit = ring.fit_alpha_beta(ns, ks, ring.AlphaBetaFit(1e-5, 1e-9, ns, ks, ks).predict(ns, ks))
    assert viz.figure_to_png(viz.fit_figure(fit)).startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="step must be"):
        viz.draw_ring_step(trace, 99)


def test_stepper_slider_shows_each_states_frame():
    widgets = pytest.importorskip("ipywidgets")

    def only(box, kind):  # the one widget of that type inside box, wherever the layout puts it
        found, todo = [], [box]
        while todo:
            w = todo.pop(0)
            found += [w] if isinstance(w, kind) else []
            todo.extend(getattr(w, "children", ()))
        (w,) = found
        return w

    trace = ring.simulate_ring([np.ones(2)] * 2)
    frames = viz.ring_frames(trace)
    box = viz.ring_stepper(trace, static=False)
    image, slider = only(box, widgets.Image), only(box, widgets.IntSlider)
    assert slider.max == len(frames) - 1 == 2  # one frame per state: start + 2(N-1) steps
    assert image.value == frames[0]
    slider.value = 2
    assert image.value == frames[2] and frames[2].startswith(b"\x89PNG") and frames[2] != frames[0]


def test_the_ring_is_cheapest_at_small_n_if_anywhere():
    """Lesson 06, §3: among the first four (Rabenseifner's set aside) the ring's latency
    2(N-1)α outgrows the tree's 2⌈log2 N⌉α, so the N where the ring is the cheapest form a
    prefix 2..upto, shrinking with K."""
    alpha, beta = 10e-6, 1 / 32e9
    four = ring.ALGORITHMS
    for nbytes in (1e3, 1e5, 1e7, 1e8):
        found = ring.ring_cheapest_up_to(nbytes, alpha, beta, n_max=128, algorithms=four)
        upto = found.n
        best = [ring.cheapest(n, nbytes, alpha, beta, four) == "ring" for n in range(2, 129)]
        if upto is None:
            assert not best[0] and not found.censored
        else:
            assert all(best[: upto - 1]) and (upto == 128 or not best[upto - 1])
            assert found.censored == (upto == 128 and best[-1])
    ups = [ring.ring_cheapest_up_to(k, alpha, beta, n_max=128, algorithms=four).n or 1
           for k in (1e5, 1e7, 1e8)]
    assert ups == sorted(ups) and ups[0] < ups[-1]


def test_ring_cheapest_up_to_says_when_the_answer_is_the_search_cap():
    """Review s7 C3: 'the ring is the cheapest up to N = 128 for K = 102 MB' read the search's
    cap as a crossover; searched further, the ring stays the cheapest of the first four up to
    N = 3533. A censored answer must say so, an uncensored one must not."""
    alpha, beta, k = 10e-6, 1 / 32e9, 25.6e6 * 4
    four = ring.ALGORITHMS
    capped = ring.ring_cheapest_up_to(k, alpha, beta, n_max=128, algorithms=four)
    assert (capped.n, capped.censored) == (128, True)
    assert str(capped) == "128 or more (the search stopped at 128)"
    wide = ring.ring_cheapest_up_to(k, alpha, beta, n_max=5000, algorithms=four)
    assert (wide.n, wide.censored) == (3533, False) and str(wide) == "3533"
    assert ring.cheapest(3534, k, alpha, beta, four) != "ring"
    # the cap exactly at the crossover is not censored: at n_max the ring already lost
    assert ring.ring_cheapest_up_to(k, alpha, beta, n_max=3534, algorithms=four).censored is False
    assert ring.ring_cheapest_up_to(k, alpha, beta, n_max=3533, algorithms=four).censored is True
    nowhere = ring.ring_cheapest_up_to(k, alpha, beta, n_max=64, algorithms=("tree", "naive"))
    assert (nowhere.n, nowhere.censored, str(nowhere)) == (None, False, "nowhere (not even at N = 2)")
    with pytest.raises(ValueError, match="n_max must be at least 2"):
        ring.ring_cheapest_up_to(k, alpha, beta, n_max=1)


def test_cheapest_compares_all_five_by_default():
    """The finding behind it: 'the ring is the cheapest up to N = 128' was computed without
    Rabenseifner's, which at N = 128, α = 10 µs, PCIe takes 6.49 ms against the ring's 8.89."""
    alpha, beta, k = 10e-6, 1 / 32e9, 25.6e6 * 4
    assert ring.cheapest(128, k, alpha, beta) == "rabenseifner"
    assert ring.cheapest(128, k, alpha, beta, ring.ALGORITHMS) == "ring"
    assert ring.cost("rabenseifner", 128, k, alpha, beta).seconds == pytest.approx(6.49e-3)
    assert ring.cost("ring", 128, k, alpha, beta).seconds == pytest.approx(8.89e-3)
    # with Rabenseifner's in, the ring stops being the cheapest at N = 4 at the latest (α > 0)
    for nbytes in (1e3, 1e5, 1e8):
        upto = ring.ring_cheapest_up_to(nbytes, alpha, beta, n_max=64)
        assert not upto.censored and (upto.n is None or upto.n <= 3)
    where = ring.cheapest_by_n(k, alpha, beta, n_max=128)
    assert where["rabenseifner"] == [4, 8, 16, 32, 64, 128]
    assert sorted(sum(where.values(), [])) == list(range(2, 129))  # every N exactly once
    assert all(ring.cheapest(n, k, alpha, beta) == a for a, ns in where.items() for n in ns)
    with pytest.raises(ValueError, match="algorithms must be"):
        ring.cheapest(4, k, alpha, beta, ("ring", "butterfly"))


def test_spans_writes_runs_of_n():
    assert ring.spans([]) == ""
    assert ring.spans([4]) == "4"
    assert ring.spans([2, 3, 5, 6, 7, 9, 16, 8]) == "2–3, 5–9, 16"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_rabenseifner_simulation_sums_and_sends_what_cost_says(n):
    """Every worker ends with the sum, at every N (powers of two and the others, whose extra
    workers fold in first), the inputs stay untouched, and the most any worker sends is one
    direction of the busiest link: 2(p-1)K/p, plus K where N is not a power of two p (the
    extra worker's whole array in, then the result back) -- cost()'s critical path less that K."""
    rng = np.random.default_rng(n)
    k = 48  # divisible by every power of two up to 8: the halves are exact
    arrays = [rng.standard_normal(k) for _ in range(n)]
    before = [a.copy() for a in arrays]
    results, sent = ring.simulate_rabenseifner(arrays)
    want = np.sum(before, axis=0)
    assert len(results) == n and all(np.allclose(r, want) for r in results)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before))
    nbytes = k * arrays[0].itemsize
    p = 1 << (n.bit_length() - 1)
    extra = 0 if p == n else nbytes
    assert max(sent) == 2 * (p - 1) * nbytes / p + extra
    assert max(sent) == ring.cost("rabenseifner", n, nbytes, 0, 1).critical_path_bytes - extra
    with pytest.raises(ValueError, match="same length"):
        ring.simulate_rabenseifner([np.zeros(3), np.zeros(4)])


def test_blocking_ring_orders_match_the_counts_lesson_06_derives():
    """Alternating order: 2 transfer times a step on even N, 2N/(N-1) on odd N; one rank
    receiving first: a chain of N."""
    for per_step, derived in ring.blocking_ring_orders((2, 3, 4, 5, 8, 9)).values():
        assert per_step == derived
    assert ring.blocking_ring_time([True, False, True, False]) == 2 * 2 * 3
