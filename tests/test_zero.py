"""dpcourse.zero: the memory and traffic formulas by hand, then on 2 and 3 gloo ranks every
stage equal to torch's DDP, its bytes held and sent equal to the formulas, and FSDP2's tour.

Launches are the slow part (seconds each; a training run here takes milliseconds), so each
world size is launched once and the tests read that launch's results."""

import sys
import warnings

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from dpcourse import collectives, launch, viz, zero
from dpcourse import zero_experiments as zx

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ships _everything to the ranks

GB = 1e9
PSI = 2531                         # ZeroConfig's MLP: 1333 + 968 + 230
LAYERS = [1333, 968, 230]


# --------------------------------------------------------------------------------------------
# Formulas, by hand
# --------------------------------------------------------------------------------------------


def test_paper_figure_1():
    # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    got = {s: 7.5e9 * zero.bytes_per_param(s, 64) / GB for s in zero.STAGES}
    assert got == {"ddp": 120.0, "zero1": 31.40625, "zero2": 16.640625, "zero3": 1.875}
    assert [round(v, 1) for v in got.values()] == [120.0, 31.4, 16.6, 1.9]


def test_memory_per_rank_pads_each_unit():
    # 2531 over 3 ranks: 844 per rank (one padding element); per layer 445 + 323 + 77 = 845
    assert zero.memory_per_rank("zero1", [PSI], 3) == {
        "params": 2 * PSI, "grads": 2 * PSI, "optimizer": 12 * 844, "total": 4 * PSI + 12 * 844}
    assert zero.memory_per_rank("zero2", PSI, 3)["grads"] == 2 * 844
    assert zero.memory_per_rank("zero3", LAYERS, 3)["total"] == 16 * 845
    assert zero.memory_per_rank("ddp", LAYERS, 3)["total"] == 16 * PSI
    # no padding when every unit divides: exactly Ψ × bytes_per_param
    for stage in zero.STAGES:
        assert zero.memory_per_rank(stage, [600, 6], 3)["total"] == \
            606 * zero.bytes_per_param(stage, 3)


def test_fits():
    rows = {r["stage"]: r for r in zero.fits(7.5e9, 32 * GB, 64)}   # a 32 GB V100, N = 64
    assert [rows[s]["fits"] for s in zero.STAGES] == [False, True, True, True]
    assert rows["zero3"]["bytes_per_rank"] == 1.875 * GB
    assert rows["ddp"]["max_params"] == 2 * 10**9                  # 32 GB / 16 B
    tight = {r["stage"]: r["fits"] for r in zero.fits(7.5e9, 32 * GB, 64, activation_bytes=GB)}
    assert tight == {"ddp": False, "zero1": False, "zero2": True, "zero3": True}


def test_traffic_formula():
    assert zero.traffic_per_step("ddp", PSI, 2) == 2 * PSI * 4
    assert zero.traffic_per_step("zero1", PSI, 3, element_size=2) == 2 * 2532 * 2
    assert zero.traffic_per_step("zero3", LAYERS, 3) == 3 * (1335 + 969 + 231) * 4
    assert zero.traffic_per_step("zero_redundancy", PSI, 2) == 3 * PSI * 4
    # 1.5x DDP exactly when nothing is padded; a little more otherwise
    assert zero.traffic_per_step("zero3", [600, 6], 3) / zero.traffic_per_step("ddp", 606, 3) \
        == 1.5
    assert zero.fsdp2_padded_numel((43, 30), 3) == 45 * 30
    assert zero.fsdp2_padded_numel((10,), 3) == 12


def test_traffic_with_gradients_in_another_dtype():
    """bf16 weights, fp32 gradients (lesson 08 §5): reductions weigh 4 bytes an element,
    all-gathers and broadcasts 2, so ZeRO-1/2 send 0.75x an fp32 DDP and ZeRO-3 1.0x, not 1.5x;
    left out, grad_bytes changes nothing."""
    ddp = zero.traffic_per_step("ddp", 606, 3, element_size=2, grad_bytes=4)
    assert ddp == 606 * 8
    assert zero.traffic_per_step("zero1", 606, 3, element_size=2, grad_bytes=4) == 606 * 6
    assert zero.traffic_per_step("zero2", 2531, 3, element_size=2, grad_bytes=4) == 2532 * 6
    assert zero.traffic_per_step("zero3", [600, 6], 3, element_size=2, grad_bytes=4) == ddp
    assert zero.traffic_per_step("zero_redundancy", 606, 2, element_size=2, grad_bytes=4) \
        == 606 * (8 + 2)
    for stage in ("ddp", "zero1", "zero2", "zero3", "zero_redundancy"):
        assert zero.traffic_per_step(stage, LAYERS, 3, element_size=2, grad_bytes=2) \
            == zero.traffic_per_step(stage, LAYERS, 3, element_size=2)


@pytest.mark.parametrize("call, match", [
    (lambda: zero.bytes_per_param("zero4", 2), "stage must be one of"),
    (lambda: zero.memory_per_rank("fsdp", PSI, 2), "stage must be one of"),
    (lambda: zero.traffic_per_step("zero9", PSI, 2), "stage must be one of"),
    (lambda: zero.bytes_per_param("zero1", 0), "world_size must be an int >= 1"),
    (lambda: zero.bytes_per_param("zero1", 2.0), "world_size must be an int >= 1"),
    (lambda: zero.fits(10, 32 * GB, -1), "world_size must be an int >= 1"),
    (lambda: zero.fits(-1, 32 * GB, 2), "must be >= 0"),
    (lambda: zx.ZeroConfig(optimizer="lamb"), "optimizer must be"),
    (lambda: zx.ZeroConfig().batches(0, 5), "does not split over 5 ranks"),
])
def test_bad_input_is_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_count_bytes_counts_storages():
    flat = torch.zeros(10)
    a, b = flat[:4], flat[4:]                      # two views of one buffer: 40 bytes, once
    freed = torch.zeros(8)
    freed.untyped_storage().resize_(0)             # ZeRO-3's freed weights: 0 bytes
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))])
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    p = opt.param_groups[0]["params"][0]
    got = zero.count_bytes({"params": [a, b, freed, p], "grads": [p.grad],
                            "optimizer": zero.optimizer_tensors(opt)})
    # p counted under params only; Adam: exp_avg + exp_avg_sq, the 0-d step left out
    assert got == {"params": 40 + 12, "grads": 12, "optimizer": 24, "total": 88}


def test_summarize_traffic_weighs_whole_buffers():
    def call(op, numel, out_numel=0, function=None):
        return collectives.Call(function or op, op, numel, 4 * numel, torch.float32,
                                out_numel, 4 * out_numel)

    # an all-reduce weighs twice its tensor; an all-gather its whole output (the shard × N),
    # a reduce-scatter its whole input; a barrier carries nothing
    calls = [call("all_reduce", 10, 10), call("all_gather", 3, 12), call("reduce_scatter", 12, 3),
             call("barrier", 0)]
    assert zero.summarize_traffic(calls, 4) == {
        "calls": 3, "by_op": {"all_reduce": 40, "all_gather": 48, "reduce_scatter": 48},
        "volume": 2 * 40 + 48 + 48, "ring_bytes_per_rank": 176 * 3 / 4}
    with pytest.raises(ValueError, match="no ring weight for a send"):
        zero.summarize_traffic([call("send", 5, function="isend")], 2)


# --------------------------------------------------------------------------------------------
# On 2 and 3 ranks: one launch each
# --------------------------------------------------------------------------------------------


def _helpers_on_uneven_sizes(rank, world_size):
    """flatten_padded + reduce_scatter_mean + all_gather_flat on 11 numbers (padded to 12)."""
    tensors = [torch.arange(5.0) + 100 * rank, torch.arange(6.0).reshape(2, 3) - rank]
    flat = zero.flatten_padded(tensors, world_size)
    with collectives.record_collectives() as calls:
        shard = zero.reduce_scatter_mean(flat)
        full = zero.all_gather_flat(shard)
        with warnings.catch_warnings():           # the deprecated name: recorded once
            warnings.simplefilter("ignore", FutureWarning)
            dist.reduce_scatter_tensor(torch.empty_like(shard), flat)
    back = [torch.empty(5), torch.empty(2, 3)]
    zero.copy_flat_into(full, back)
    return {"flat": flat, "shard": shard, "full": full, "back": back,
            "calls": [(c.op, c.numel, c.out_numel) for c in calls]}


def _awkward_model(kind):
    """An MLP with a frozen weight (fine-tuning), a tied weight (one Parameter in two layers),
    or both; the check of every stage beside torch DDP."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 9),
                                torch.nn.Tanh(), torch.nn.Linear(9, 9), torch.nn.Tanh(),
                                torch.nn.Linear(9, 4))
    if kind in ("frozen", "both"):
        model[0].weight.requires_grad_(False)
        model[6].bias.requires_grad_(False)
    if kind in ("tied", "both"):
        model[4].weight = model[2].weight
    return model


def _frozen_and_tied(rank, world_size, steps=4):
    """Every stage and torch DDP, Adam, on models with frozen and tied parameters: the final
    weights (all of them, frozen included) and the frozen ones' initial values."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for kind in ("frozen", "tied", "both"):
        got = {}
        for run in ("torch_ddp",) + zero.STAGES:
            model = _awkward_model(kind)
            if run == "torch_ddp":
                opt = zx.TorchRun(DDP(model), torch.optim.Adam(model.parameters(), lr=0.05),
                                     list(model.parameters()), [])
                call = opt.model
            else:
                opt = zero.WRAPPERS[run](model, lambda ps: torch.optim.Adam(ps, lr=0.05),
                                         torch.float32)
                call = model
            for step in range(steps):
                g = torch.Generator().manual_seed(step)
                X = torch.randn(6 * world_size, 7, generator=g)[rank * 6:(rank + 1) * 6]
                y = torch.randint(0, 4, (6 * world_size,), generator=g)[rank * 6:(rank + 1) * 6]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(call(X), y).backward()
                opt.step()
            got[run] = opt.full_weights()
        got["start"] = torch.cat([p.detach().reshape(-1) for p in _awkward_model(kind)
                                  .parameters()])
        got["frozen_start"] = [p.detach().clone().reshape(-1) for p in _awkward_model(kind)
                               .parameters() if not p.requires_grad]
        got["frozen_end"] = [p.detach().clone().reshape(-1) for p in model.parameters()
                             if not p.requires_grad]
        out[kind] = got
    return out


def _everything(rank, world_size):
    fp32 = zx.ZeroConfig()
    return {
        "fp32": zx.equality_worker(rank, world_size, fp32),
        "bf16": zx.equality_worker(rank, world_size, zx.ZeroConfig(mixed_precision=True),
                                     zero.STAGES),
        "other_optimizers": {
            name: zx.equality_worker(rank, world_size, zx.ZeroConfig(optimizer=name),
                                       ("torch_ddp", "zero1", "zero3"))
            for name in ("adamw", "sgd")},
        "fsdp2": zx.fsdp2_worker(rank, world_size, zx.ZeroConfig(mixed_precision=True)),
        "helpers": _helpers_on_uneven_sizes(rank, world_size),
        "awkward": _frozen_and_tied(rank, world_size),
        "timeline": zx.zero3_timeline_worker(rank, world_size, zx.ZeroConfig(steps=2)),
        "rooted": zx.fsdp2_root_worker(rank, world_size, zx.ZeroConfig(steps=2)),
        "accumulated": zx.fsdp2_accumulation_worker(rank, world_size, zx.ZeroConfig(steps=2), 2),
    }


_RESULTS = {}


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request):
    n = request.param
    if n not in _RESULTS:
        _RESULTS[n] = launch.spawn(_everything, n, backend="gloo", timeout=180,
                                   show_output=False)
    return n, _RESULTS[n]


def test_every_stage_equals_torch_ddp(ranks):
    n, out = ranks
    for r in out:
        ref = r["fp32"]["torch_ddp"]
        for run, got in r["fp32"].items():
            assert torch.allclose(got["params"], ref["params"], rtol=1e-5, atol=1e-6), run
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), run
        for name, runs in r["other_optimizers"].items():
            for run in ("zero1", "zero3"):
                assert torch.allclose(runs[run]["params"], runs["torch_ddp"]["params"],
                                      rtol=1e-5, atol=1e-6), (name, run)
    for run in zx.RUNS:                           # and every rank holds the same weights
        assert all(torch.equal(r["fp32"][run]["params"], out[0]["fp32"][run]["params"])
                   for r in out), run
    # the loss falls on the global batch (mean over ranks), it is learning something
    losses = torch.tensor([r["fp32"]["zero3"]["losses"] for r in out]).mean(0)
    assert losses[-1] < losses[0]


def test_frozen_and_tied_parameters_train_like_torch_ddp(ranks):
    # frozen: Replicated, Zero1 and Zero2 used to crash (p.grad is None in flatten_padded)
    n, out = ranks
    for r in out:
        for kind, got in r["awkward"].items():
            for stage in zero.STAGES:
                assert torch.allclose(got[stage], got["torch_ddp"], rtol=1e-5, atol=1e-6), \
                    (kind, stage, float((got[stage] - got["torch_ddp"]).abs().max()))
            assert not torch.allclose(got["torch_ddp"], got["start"]), kind   # it trained
            for start, end in zip(got["frozen_start"], got["frozen_end"]):
                assert torch.equal(start, end), kind      # a frozen weight never moves


def test_the_gradient_peak_is_inside_step_beside_its_flat_copy(ranks):
    # Lesson 08 §3: when the backward returns DDP, ZeRO-1 and the short ZeRO-2 hold 4Ψ of
    # gradients, but step() flattens them while every p.grad is alive: just before its
    # collective the flat copy (padded) and, for the stages, the received slice come on top.
    # A weighing that forgot the copy would see 4Ψ there too.
    n, out = ranks
    flat = 4 * zero.shard_numel(PSI, n) * n
    for r in out:
        runs = r["fp32"]
        assert {runs[s]["grads_after_backward"] for s in ("ddp", "zero1", "zero2")} == {4 * PSI}
        assert {s: runs[s]["grads_at_collective"] for s in ("ddp", "zero1", "zero2")} == {
            "ddp": 8 * PSI, "zero1": 4 * PSI + flat + flat // n,
            "zero2": 4 * PSI + flat + flat // n}


def test_flatten_padded_makes_one_new_padded_buffer():
    a, b = torch.arange(5.0), torch.arange(6.0).reshape(2, 3)
    flat = zero.flatten_padded([a, b], 4)
    assert flat.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0]
    assert flat.untyped_storage().nbytes() == 12 * 4       # exactly the padded size
    flat[0] = 9
    assert a[0] == 0                                        # a copy, not a view


def test_bytes_held_equal_the_formula(ranks):
    n, out = ranks
    for r in out:
        for stage in zero.STAGES:                   # mixed precision: 2 + 2 + 12
            got = r["bf16"][stage]
            assert got["held"] == zero.memory_per_rank(stage, got["units"], n), stage
        ddp = r["fp32"]["torch_ddp"]                # torch's fp32 Adam: 4 + 4 + 8, no master
        assert ddp["held"] == zero.memory_per_rank("ddp", PSI, n, 4, 4, 8)
        fsdp = r["fp32"]["fsdp2"]                   # FSDP2 stores padded shards
        assert fsdp["held"]["params"] == fsdp["held"]["grads"] == 4 * sum(fsdp["units"]) // n
    assert out[0]["bf16"]["zero3"]["units"] == LAYERS
    # ZeroRedundancyOptimizer splits whole parameters among the ranks: the state adds up to
    # one copy (8 bytes of Adam state per parameter), each rank holding only part of it
    zro = [r["fp32"]["zero_redundancy"]["held"]["optimizer"] for r in out]
    assert sum(zro) == 8 * PSI and max(zro) < 8 * PSI


def test_traffic_equals_the_formula(ranks):
    n, out = ranks
    for r in out:
        for precision, size in (("fp32", 4), ("bf16", 2)):
            for stage in zero.STAGES:
                got = r[precision][stage]
                expected = zero.traffic_per_step(stage, got["units"], n, size)
                assert [t["volume"] for t in got["traffic"]] == [expected] * 4, (precision, stage)
        fp32 = r["fp32"]
        assert fp32["torch_ddp"]["traffic"][0]["volume"] == zero.traffic_per_step("ddp", PSI, n)
        assert fp32["zero_redundancy"]["traffic"][0]["by_op"] == {"all_reduce": 4 * PSI,
                                                                 "broadcast": 4 * PSI}
        assert fp32["fsdp2"]["traffic"][0]["volume"] == \
            zero.traffic_per_step("zero3", fp32["fsdp2"]["units"], n)
        z3, ddp = fp32["zero3"]["traffic"][0], fp32["ddp"]["traffic"][0]
        assert z3["calls"] == 9 and ddp["calls"] == 1
        padded = sum(n * zero.shard_numel(u, n) for u in LAYERS)
        assert z3["volume"] / ddp["volume"] == 3 * padded / (2 * PSI) == pytest.approx(1.5, 2e-3)


def test_fsdp2_tour(ranks):
    n, out = ranks
    widths = zx.ZeroConfig().widths
    for rank, r in enumerate(out):
        f = r["fsdp2"]
        assert (f["compute_dtype"], f["sharded_dtype"], f["grad_dtype"]) == \
            ("torch.bfloat16", "torch.float32", "torch.float32")
        rows = widths[1]                             # first layer's weight: 43 rows, dim 0
        assert f["shards"][0][:3] == ("0.weight", "DTensor", (rows, widths[0]))
        assert f["shards"][0][3][0] == min(-(-rows // n), rows - rank * -(-rows // n))
        assert f["reloaded_shards_equal"]
        units = r["fp32"]["fsdp2"]["units"]          # bf16 all-gathers, fp32 reduce-scatter
        assert f["traffic"][0]["by_op"] == {"all_gather": 2 * 2 * sum(units),
                                            "reduce_scatter": 4 * sum(units)}
    assert out[0]["fsdp2"]["plain_model_equal"] and out[0]["fsdp2"]["file_bytes"] > 4 * PSI
    assert len(out[0]["fsdp2"]["state_dict_keys"]) == 6
    assert all(r["fsdp2"]["state_dict_keys"] == [] for r in out[1:])   # cpu_offload: rank 0


def test_reduce_scatter_and_all_gather_on_uneven_sizes(ranks):
    n, out = ranks
    flats = torch.stack([r["helpers"]["flat"] for r in out])
    assert flats.shape == (n, 12) and torch.all(flats[:, 11:] == 0)      # 11 numbers + pad
    mean = flats.mean(0)
    s = 12 // n
    for rank, r in enumerate(out):
        h = r["helpers"]
        assert torch.allclose(h["shard"], mean[rank * s:(rank + 1) * s])
        assert torch.allclose(h["full"], mean)
        assert torch.allclose(h["back"][1].reshape(-1), mean[5:11])
        assert h["calls"] == [("reduce_scatter", 12, s), ("all_gather", s, 12),
                              ("reduce_scatter", 12, s)]


def test_zero3_timeline_is_gather_free_gather_free_reduce_scatter_per_layer(ranks):
    n, out = ranks
    for r in out:
        events = r["timeline"]
        for layer in range(3):
            kinds = [kind for i, kind, _, _ in events if i == layer]
            assert kinds == ["all-gather (forward)", "free", "all-gather (backward)",
                             "free", "reduce-scatter"], (layer, kinds)
        assert all(end >= start for _, _, start, end in events)
        starts = [start for _, _, start, _ in events]
        assert starts == sorted(starts)                 # recorded in the order they happened
    fig = viz.zero3_timeline_figure(out[0]["timeline"], ["a", "b", "c"])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["c", "b", "a"]


def test_fsdp2_gathers_its_root_once(ranks):
    n, out = ranks
    for r in out:
        root, others = sum(r["rooted"]["root_units"]), sum(r["rooted"]["other_units"])
        for step in r["rooted"]["traffic"]:
            assert step["by_op"] == {"all_gather": 4 * (2 * others + root),
                                     "reduce_scatter": 4 * (others + root)}
    assert out[0]["rooted"]["root_units"] == [zero.fsdp2_padded_numel((10, 22), n),
                                             zero.fsdp2_padded_numel((10,), n)]


def test_fsdp2_with_two_micro_batches_gathers_2k_times_and_reduces_k_times(ranks):
    # lesson 08, §6: 3Ψ holds with one forward and one backward per step; with k = 2
    # micro-batches FSDP2's defaults all-gather a non-root unit 2k times, the root k times, and
    # reduce-scatter every unit k times: k times the one-pass volume
    n, out = ranks
    for r in out:
        acc, rooted = r["accumulated"], r["rooted"]
        units = acc["units"]
        for counts in acc["counts"]:
            assert counts == {"all_gather": 4 * units + 2, "reduce_scatter": 2 * (units + 1)}
        for one, two in zip(rooted["traffic"], acc["traffic"]):
            assert two["by_op"] == {op: 2 * v for op, v in one["by_op"].items()}


def test_frozen_and_tied_config_builds_both_cases():
    model = zx.ZeroConfig(frozen_and_tied=True).build()
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert linears[1].weight is linears[2].weight                   # tied
    assert linears[1].bias is not linears[2].bias
    assert not linears[0].bias.requires_grad                       # frozen
    assert sum(not p.requires_grad for p in model.parameters()) == 1
    plain = zx.ZeroConfig().build()
    assert sum(p.numel() for p in plain.parameters()) == 2531      # the default is unchanged
    assert all(p.requires_grad for p in plain.parameters())
