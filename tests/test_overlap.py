"""dpcourse.overlap and dpcourse.overlap_experiments: bucket assignment, the PowerSGD formula,
counting, and the three wrappers equal to DDP on 3 gloo ranks (the lesson proves 2);
`python -m dpcourse.bench ddp`."""

import json
import math
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpcourse import bench, launch, overlap
from dpcourse import overlap_experiments as ox


def _params(*numels):
    return [nn.Parameter(torch.zeros(n)) for n in numels]


def test_assign_buckets_reverse_order_and_cap():
    ps = _params(100_000, 10, 100_000, 300_000)   # 0.38, 0, 0.38, 1.14 MiB
    buckets = overlap.assign_buckets(ps, 1.0)
    index = {id(p): i for i, p in enumerate(ps)}
    assert [[index[id(p)] for p in b] for b in buckets] == [[3], [2, 1, 0]]
    one = overlap.assign_buckets(ps, math.inf)
    assert len(one) == 1 and [id(p) for p in one[0]] == [id(p) for p in reversed(ps)]
    assert len(overlap.assign_buckets(ps, 1e-6)) == 4        # each alone, none dropped


def _indices(params, buckets):
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in b] for b in buckets]


def _torch_rule(params, caps_mb):
    """DDP's own assignment (reducer.cpp, compute_bucket_assignment_by_size) of the params in
    reverse order, as indices into ``params``."""
    limits = [sys.maxsize if c == math.inf else int(c * 2**20) for c in caps_mb]
    n = len(params)
    got, _ = dist._compute_bucket_assignment_by_size(
        list(reversed(params)), limits, [False] * n, list(range(n - 1, -1, -1)))
    return [list(b) for b in got]


def _models():
    from dpcourse import models

    torch.manual_seed(0)
    mixed = [nn.Parameter(torch.zeros(n, dtype=d)) for n, d in
             [(30_000, torch.float32), (70_000, torch.float64), (5, torch.float32),
              (200_000, torch.float16), (90_000, torch.float64), (1_000, torch.float32)]]
    return {"SmallCNN": list(models.SmallCNN(width=8).parameters()),
            "wide_mlp 320x64": list(ox.wide_mlp(320, 64).parameters()),
            "wide_mlp 1024x8": list(ox.wide_mlp(1024, 8).parameters()),
            "three dtypes": mixed}


@pytest.mark.parametrize("caps", [(0.001,), (0.01,), (0.05,), (0.3,), (1,), (4,), (25,),
                                  (math.inf,), (1, 25), (0.01, 0.05)])
def test_assign_buckets_is_ddps_rule(caps):
    """Same buckets as torch's own function, at every cap, with a first-bucket cap too."""
    for what, params in _models().items():
        mine = _indices(params, overlap.assign_buckets(params, caps[-1], *caps[:-1]))
        theirs = _torch_rule(params, caps)
        if what == "three dtypes":   # buckets left open at the end come in hash order there
            mine, theirs = sorted(mine), sorted(theirs)
        assert mine == theirs, (what, caps)


def test_assign_buckets_closes_once_the_cap_is_reached():
    ps = _params(2**18, 2**18, 1)                  # 1 MiB, 1 MiB, 4 bytes
    assert _indices(ps, overlap.assign_buckets(ps, 1.0)) == [[2, 1], [0]]
    ps = _params(10, 20, 30)                        # one dtype per bucket: float64 alone
    ps[1] = nn.Parameter(torch.zeros(20, dtype=torch.float64))
    assert _indices(ps, overlap.assign_buckets(ps, 1.0)) == [[2, 0], [1]]


def _ddp_buckets_worker(rank, world_size, which, cap):
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse import models, overlap
    from dpcourse import overlap_experiments as ox

    torch.manual_seed(0)
    module = models.SmallCNN(width=8) if which == "cnn" else ox.wide_mlp(64, 6)
    params = list(module.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    ready = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: ready.append(index[id(p)]))
    model = DDP(module, bucket_cap_mb=cap)
    seen = []

    def hook(state, bucket):
        seen.append([index[id(p)] for p in bucket.parameters()])
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    for _ in range(2):                               # DDP rebuilds its buckets after step 1
        seen.clear()
        ready.clear()
        F.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.arange(4)).backward()
    in_ready_order = [params[i] for i in reversed(ready)]   # assign_buckets walks it reversed
    caps = (25, 1) if cap is None else (cap,)
    mine = overlap.assign_buckets(in_ready_order, *caps)
    return seen, [[index[id(p)] for p in b] for b in mine]


@pytest.mark.parametrize("which, cap", [("cnn", None), ("cnn", 0.01), ("cnn", 0.05),
                                        ("mlp", 0.01), ("mlp", 0.05), ("mlp", None)])
def test_real_ddps_rebuilt_buckets_are_assign_buckets_in_gradient_order(which, cap):
    seen, mine = launch.spawn(_ddp_buckets_worker, 2, which, cap, backend="gloo",
                              timeout=120)[0]
    assert seen == mine


@pytest.mark.parametrize("cap", [0, -1, float("nan")])
def test_assign_buckets_refuses_a_bad_cap(cap):
    with pytest.raises(ValueError, match="positive number of MiB"):
        overlap.assign_buckets(_params(3), cap)


def test_cap_steps_kib_holds_every_cap_where_the_count_changes():
    params = list(nn.Sequential(nn.Linear(20, 30), nn.Linear(30, 7), nn.Linear(7, 3)).parameters())
    steps = overlap.cap_steps_kib(params, 0.001, 10)
    assert steps == sorted(steps) and all(0.001 <= s <= 10 for s in steps)
    count = lambda kib: len(overlap.assign_buckets(params, kib / 1024))
    # between two neighbouring steps the count cannot change
    for a, b in zip(steps, steps[1:]):
        assert count(a * 1.0001) == count(b * 0.9999)
    assert count(steps[0] * 0.9999) != count(steps[-1] * 1.0001)
    # the widest run, all of them, is bucket_nbytes' one flat buffer
    widest = overlap.cap_steps_kib(params, 0, float("inf"))[-1]
    assert widest == overlap.bucket_nbytes(params) / 1024


def test_powersgd_formula():
    got = overlap.powersgd_elements([(1024, 1024), (1024,), (8, 3, 3, 3)], rank=2)
    # 1024x1024 -> P 1024x2 + Q 1024x2; the 8x27 conv -> P 8x2 + Q 27x2 ((8+27)*2*2 < 216);
    # the bias (1024 x 1) would not gain 2x: sent whole
    assert got["P"] == 2048 + 16 and got["Q"] == 2048 + 54
    assert got["uncompressed"] == 1024
    assert got["total"] == 2064 + 2102 + 1024 and got["dense"] == 1024 ** 2 + 1024 + 216
    assert overlap.powersgd_elements([(8, 27)], rank=4)["uncompressed"] == 216  # 35*4*2 > 216


def test_comm_hooks_send_what_the_formulas_say():
    """What DDP's comm hooks all-reduce, recorded per step: the whole model in fp32, half the
    bytes in fp16, and PowerSGD's P and Q (powersgd_elements) once it starts at step 2."""
    cfg = ox.OverlapConfig(global_batch=8, steps=3)
    out = launch.spawn(ox.comm_hook_worker, 2, cfg, ("none", "fp16", "powersgd"), 1, 2,
                       backend="gloo", timeout=120)[0]
    psi = sum(math.prod(s) for s in out["shapes"])
    runs = out["runs"]
    assert [(s["elements"], s["bytes"], s["dtypes"]) for s in runs["none"]["sent"]] == \
        [(psi, 4 * psi, ["float32"])] * 3
    assert [(s["elements"], s["bytes"], s["dtypes"]) for s in runs["fp16"]["sent"]] == \
        [(psi, 2 * psi, ["float16"])] * 3
    predicted = overlap.powersgd_elements(out["shapes"], rank=1)["total"]
    assert predicted < psi / 2
    assert [s["elements"] for s in runs["powersgd"]["sent"]] == [psi, psi, predicted]


def test_wrap_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        ox.wrap("zero", nn.Linear(2, 2))


def test_all_three_equal_ddp_on_three_ranks():
    cfg = ox.OverlapConfig(global_batch=24, steps=3, lr=0.1)
    out = launch.spawn(ox.equality_worker, 3, cfg, ox.KINDS, 0.01, backend="gloo",
                       timeout=120)
    for r in out:
        for kind in ("after_backward", "per_parameter", "bucketed"):
            assert torch.allclose(r[kind]["params"], r["ddp"]["params"], atol=1e-5), kind
    assert out[0]["after_backward"]["collectives"] == 10 * 3
    assert out[0]["bucketed"]["collectives"] == 3 * 3       # 3 buckets at 0.01 MiB
    assert all(torch.equal(out[0]["bucketed"]["params"], r["bucketed"]["params"]) for r in out)


def test_a_batch_that_does_not_split_is_refused_in_the_rank():
    cfg = ox.OverlapConfig(global_batch=25, steps=1)
    with pytest.raises(launch.RankFailedError, match="does not split over 2 ranks"):
        launch.spawn(ox.equality_worker, 2, cfg, ("bucketed",), backend="gloo",
                     timeout=60, show_output=False)


def test_bench_ddp_json(capsys):
    assert bench.main(["ddp", "--steps", "1", "--width", "64", "--depth", "4",
                       "--caps", "0.01", "inf", "--cap", "0.05", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    kinds = [(r["kind"], r["bucket_cap_mb"]) for r in doc["runs"]]
    assert kinds[:4] == [(k, 0.05) for k in ox.KINDS]
    assert ("bucketed", "one bucket") in kinds and ("bucketed", 0.01) in kinds
    # each way's step time is the median of its launches, and the ratio bucketed / DDP the
    # median of the launches' ratios: both lie inside the spread the table prints
    assert doc["repeats"] == 3
    assert all(r["spread"][0] <= r["step_s"] <= r["spread"][1] for r in doc["runs"])
    assert doc["ratio_spread"][0] <= doc["ratio"] <= doc["ratio_spread"][1]
    by = {(r["kind"], r["bucket_cap_mb"]): r for r in doc["runs"]}
    assert by[("per_parameter", 0.05)]["collectives_per_step"] == 8   # 4 Linear layers
    assert by[("bucketed", "one bucket")]["collectives_per_step"] == 1


def test_bench_ddp_takes_medians_over_launches(monkeypatch):
    """Three launches (DDP 10, 30, 10 ms; bucketed 10, 30, 30 ms): each way's time is the median
    of its launches (bucketed 30, DDP 10), but the ratio is the median of the launches' own
    ratios (1, 1, 3 -> 1), not the ratio of the medians (3): each launch's pair saw the same
    machine. The table prints both with their spreads."""
    from dpcourse import launch
    from dpcourse.bench import ddp as bench_ddp

    bucketed = iter([0.010, 0.030, 0.030])
    ddp = iter([0.010, 0.030, 0.010])

    def fake_spawn(fn, world_size, cfg, runs, warmup, **kwargs):
        times = {"bucketed": next(bucketed), "ddp": next(ddp)}
        return [{"runs": [{"kind": kind, "bucket_cap_mb": cap, "collectives_per_step": 1,
                           "step_s": times.get(kind, 0.005)} for kind, cap in runs]}]

    monkeypatch.setattr(launch, "spawn", fake_spawn)
    out = bench_ddp.run_ddp_bench(caps=(), cap=1.0, width=8, depth=2, global_batch=4)
    by = {r["kind"]: r for r in out["runs"]}
    assert by["bucketed"]["step_s"] == 0.030 and by["bucketed"]["spread"] == [0.010, 0.030]
    assert by["ddp"]["step_s"] == 0.010 and by["ddp"]["spread"] == [0.010, 0.030]
    assert out["ratio"] == pytest.approx(1.0) and out["ratio_spread"] == pytest.approx([1, 3])
    table = bench_ddp.format_ddp_table(out)
    assert "bucketed / DDP at 1 MiB: 1.00x (per launch 1.00-3.00)" in table
    rows = {line.split()[0]: line.split()[-3:-1] for line in table.splitlines()[1:-1]}
    assert rows["bucketed"] == ["30.0", "(10.0-30.0)"] and rows["ddp"] == ["10.0", "(10.0-30.0)"]


def test_bench_ddp_refuses_bad_input(capsys):
    with pytest.raises(SystemExit):
        bench.main(["ddp", "--steps", "0"])
    assert "steps must be at least 1" in capsys.readouterr().err


def test_predict_step_is_the_overlap_formula():
    cost = lambda nbytes: 1.0 + nbytes / 1000          # alpha = 1 ms, 1 byte per us
    ready = [1, 2, 3, 10]                                # 4 gradients, backward ends at 10
    # two buckets: 3 gradients (2000 B, ready at 3), 1 gradient (1000 B, ready at 10)
    got = overlap.predict_step(ready, [(3, 2000), (1, 1000)], cost, 5, 10, 1)
    # first bucket 3..6 hidden by the backward; last 10..12 after it
    assert got["step_ms"] == 5 + 10 + 2 + 1 and got["exposed_comm_ms"] == 2
    assert got["spans"] == [(3, 6), (10, 12)] and got["comm_ms"] == 5
    late = overlap.predict_step(ready, [(3, 2000), (1, 1000)], cost, 5, 10, 1, overlap=False)
    assert late["step_ms"] == 5 + 10 + 5 + 1             # nothing hidden: all after 10
    slow = overlap.predict_step(ready, [(3, 20000), (1, 1000)], cost, 5, 10, 1)
    assert slow["spans"][1] == (24, 26)                  # queued behind the first bucket
    with pytest.raises(ValueError, match="hold 3 gradients"):
        overlap.predict_step(ready, [(3, 1)], cost, 0, 10, 0)


def test_controls_launch_only_after_the_backward():
    cfg = ox.OverlapConfig(model="wide_mlp", width=64, depth=4, global_batch=8, steps=1)
    out = launch.spawn(ox.timing_worker, 2, cfg,
                       [("bucketed_after", 0.01), ("per_parameter_after", 25), ("local", None),
                        ("ddp", 0.01), ("bucketed", 0.01)], 1, backend="gloo", timeout=120,
                       show_output=False)[0]
    by = {r["kind"]: r for r in out["runs"]}
    # a gradient's tick is stamped before the class's hook launches: the last gradient's tick
    # comes before the last launch, and every launch has a tick before it
    tl = by["bucketed"]["timeline"]
    launches = [t for what, _, t in tl["events"] if what == "launch"]
    assert len(launches) >= 2 and max(launches) >= max(tl["ready"])
    assert all(any(r <= t for r in tl["ready"]) for t in launches)
    for kind in ("bucketed_after", "per_parameter_after"):
        tl = by[kind]["timeline"]
        launches = [t for what, _, t in tl["events"] if what == "launch"]
        assert launches and min(launches) >= tl["backward_end"], kind
    assert by["per_parameter_after"]["collectives_per_step"] == 8
    # the copies are measured inside the ranks, per bucket; every timed step is kept
    copies = by["bucketed_after"]["copy_ms"]
    assert len(copies) == by["bucketed_after"]["n_buckets"] and all(
        a > 0 and b > 0 for a, b in copies)
    assert by["local"]["copy_ms"] is None
    assert all(len(v) == cfg.steps for v in by["local"]["steps_s"].values())
    assert by["local"]["collectives_per_step"] == 0
    ddp = by["ddp"]["ddp"]
    assert ddp["profiled_all_reduces"] == ddp["num_buckets_reduced"] == len(ddp["rebuilt_buckets"])
    assert by["ddp"]["collectives_per_step"] == ddp["profiled_all_reduces"] >= 2


def test_lesson_07_figures_draw():
    from dpcourse import viz

    assert viz.reducer_figure().axes
    rows = [{"bucket_cap_mb": c, "measured_ms": 3, "predicted_ms": 2, "measured_after_ms": 4,
             "predicted_after_ms": 3} for c in (0.1, math.inf)]
    fig = viz.overlap_model_figure(rows)
    assert len(fig.axes[0].patches) == 4 * len(rows)
    tl = {"ready": [1.0, 2.0], "events": [("launch", 0, 2.0), ("done", 0, 3.0)],
          "backward_end": 2.5, "sync_end": 4.0}
    ax = viz.overlap_timeline_figure(tl).axes[0]
    legend = ax.get_legend()
    # the legend sits outside the axes, where it cannot hide a bucket's bar
    assert legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1


def test_predict_step_with_copies():
    cost = lambda nbytes: 1.0 + nbytes / 1000
    copy = lambda nbytes: nbytes / 2000                  # 1000 B -> 0.5 ms
    ready = [1, 2, 3, 10]
    got = overlap.predict_step(ready, [(3, 2000), (1, 1000)], cost, 5, 10, 1,
                               copy_in_ms=copy, copy_back_ms=copy)
    # copies in: 1 ms then 0.5 ms -> backward ends at 11.5; bucket 0 at 3 + 1 = 4 .. 7;
    # bucket 1 at 10 + 1.5 = 11.5 .. 13.5; copies back 1.5 ms
    assert got["spans"] == [(4, 7), (11.5, 13.5)]
    assert got["step_ms"] == 5 + 13.5 + 1.5 + 1 and got["exposed_comm_ms"] == 2
    late = overlap.predict_step(ready, [(3, 2000), (1, 1000)], cost, 5, 10, 1, overlap=False,
                                copy_in_ms=copy, copy_back_ms=copy)
    assert late["step_ms"] == 5 + 10 + 1.5 + 5 + 1.5 + 1
    # the same copies as measured in a run: one time per bucket
    listed = overlap.predict_step(ready, [(3, 2000), (1, 1000)], cost, 5, 10, 1,
                                  copy_in_ms=[1.0, 0.5], copy_back_ms=[1.0, 0.5])
    assert listed == got
    with pytest.raises(ValueError, match="1 copy times given for 2 buckets"):
        overlap.predict_step(ready, [(3, 2000), (1, 1000)], cost, 5, 10, 1, copy_in_ms=[1.0])


def _two_backwards(rank, world_size):
    model = overlap.BucketedDataParallel(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)))
    x = torch.ones(4, 3)
    model(x).sum().backward()
    try:
        model(x).sum().backward()                     # no finish_gradient_synchronization
    except RuntimeError as exc:
        refused = str(exc)
    else:
        refused = None
    # after a finish, a backward is accepted again
    model.finish_gradient_synchronization()
    model.module.zero_grad()
    model(x).sum().backward()
    model.finish_gradient_synchronization()
    return refused, model.collectives


def test_a_second_backward_before_finishing_is_refused():
    refused, collectives = launch.spawn(_two_backwards, 1, backend="gloo", timeout=60)[0]
    assert refused is not None and refused.startswith(
        "1.bias got a second gradient before finish_gradient_synchronization()")
    assert collectives == 2                            # one bucket, two finished backwards


def _unused_layer(rank, world_size):
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(3, 1)
            self.unused = nn.Linear(3, 1)       # never called in forward

        def forward(self, x):
            return self.used(x)

    model = overlap.BucketedDataParallel(Head(), bucket_cap_mb=1e-5)
    model(torch.ones(4, 3)).sum().backward()
    try:
        model.finish_gradient_synchronization()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_unused_parameter_is_named_with_both_ddp_settings():
    # a bucket holding a parameter with no gradient is never sent: the class names the
    # parameter, and both DDP settings that mark such parameters ready (lesson 07, section 6:
    # find_unused_parameters every iteration; static_graph for a set fixed from the first)
    said = launch.spawn(_unused_layer, 1, backend="gloo", timeout=60)[0]
    assert said is not None and "never filled" in said
    assert "unused.weight" in said and "used.weight" not in said.replace("unused.weight", "")
    assert "find_unused_parameters=True" in said
    assert "static_graph=True when the same parameters are unused in every iteration" in said


def test_predict_step_one_bucket_saves_nothing():
    # the last gradient is ready before backward() returns; the bucket holding it is complete
    # only when the backward ends, so with one bucket overlap and its control do the same work
    cost = lambda nbytes: 1.0 + nbytes / 1000
    ready = [1, 2, 3, 8]
    for copies in (None, [0.7]):
        run = overlap.predict_step(ready, [(4, 3000)], cost, 5, 10, 1, copy_in_ms=copies,
                                   copy_back_ms=copies)
        control = overlap.predict_step(ready, [(4, 3000)], cost, 5, 10, 1, overlap=False,
                                       copy_in_ms=copies, copy_back_ms=copies)
        assert run["step_ms"] == control["step_ms"]
    # two buckets: the first still starts at its ready time, the last at the backward's end
    two = overlap.predict_step(ready, [(3, 2000), (1, 1000)], cost, 5, 10, 1)
    assert two["spans"] == [(3, 6), (10, 12)]


def test_overlap_verdicts_never_word_a_one_bucket_pair_as_overlap():
    # a run with one bucket is a null pair: its clear verdict is the test erring, not overlap
    said = ox.overlap_verdicts([("0.1 MiB", 40, 0), ("1 MiB", 12, -1), ("4 MiB", 5, 0),
                                ("25 MiB", 1, 1), ("one bucket", 1, 0)])
    assert "clearly saved time at 1 MiB, clearly cost time at none of the caps" in said
    assert "no clear difference at the other 2 caps with several buckets." in said
    assert "At 25 MiB (one bucket), where overlap cannot act, the test still called a " \
           "difference, 'slower'" in said
    assert "At one bucket, where overlap cannot act: no clear difference, as expected." in said
    assert "25 MiB" not in said.split(".")[0] and "weak" not in said
    quiet = ox.overlap_verdicts([("4 MiB", 5, 1), ("25 MiB", 1, 0), ("one bucket", 1, 0)],
                                yardstick_ok=False)
    assert "clearly cost time at 4 MiB" in quiet and "the other 0 caps" in quiet
    assert "(weak: identical work got a clear verdict too, above)." in quiet
    assert "At 25 MiB (one bucket) and one bucket, where overlap cannot act: no clear " \
           "difference, as expected." in quiet
    assert "test still called" not in quiet


def test_ddp_buckets_worker_reads_real_ddps_buckets():
    cfg = ox.OverlapConfig(model="small_cnn", width=8, global_batch=8)
    found, rebuilt = launch.spawn(ox.ddp_buckets_worker, 2, [(cfg, 0.05, True), (cfg, 0.05, False)],
                                  backend="gloo", timeout=120, show_output=False)[0]
    module = cfg.build()
    names = {p: n for n, p in module.named_parameters()}
    ours = [{names[p] for p in b} for b in overlap.assign_buckets(list(module.parameters()), 0.05)]
    assert len(rebuilt["first"]) == 1 and [set(b) for b in rebuilt["after"]] == ours
    # find_unused_parameters=True: registration order walked, the list reversed, kept for good
    assert found["first"] == found["after"] and [set(b) for b in found["first"]] != ours
    assert found["first"][0][-1] == "classifier.4.bias"


def test_off_cpu_wire_sends_every_bucket_once_per_step():
    cfg = ox.OverlapConfig(model="wide_mlp", width=64, depth=4, global_batch=8)
    sent = []

    def wire(nbytes):
        sent.append(nbytes)
        return 5.0

    out = ox.off_cpu_wire(cfg, 0.01, wire, rounds=2)
    n = len(out["bucket_bytes"])
    assert n > 1 and sum(out["bucket_bytes"]) == overlap.bucket_nbytes(cfg.build().parameters())
    assert len(sent) == 2 * 3 * n                      # 2 variants, 3 rounds (1 warm-up)
    for kind in ("overlap", "control"):
        assert len(out[kind]["step"]) == len(out[kind]["backward"]) == 2
    # the control sends after the backward, one message at a time: every message adds its 5 ms
    assert all(s - b >= 5.0 * n for s, b in zip(out["control"]["step"],
                                                 out["control"]["backward"]))


def test_off_cpu_wire_refuses_a_bucket_sent_before_its_gradients(monkeypatch):
    """off_cpu_wire sends a bucket when its last parameter's gradient arrives, which is right
    only where the gradients arrive in reverse registration order (the MLP's, above). A model
    whose output layer is registered before the hidden layer it follows breaks that: the one
    bucket's last parameter (the output weight) arrives first, and the experiment must raise
    rather than time a bucket sent half empty."""

    class OutputFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(16, 10)
            self.hidden = nn.Linear(3 * 32 * 32, 16)

        def forward(self, x):
            return self.out(torch.relu(self.hidden(x.flatten(1))))

    monkeypatch.setattr(ox, "wide_mlp", lambda *args, **kwargs: OutputFirst())
    cfg = ox.OverlapConfig(model="wide_mlp", width=16, depth=2, global_batch=8)
    with pytest.raises(RuntimeError, match="bucket 0 was sent before all its gradients arrived"):
        ox.off_cpu_wire(cfg, 100, lambda nbytes: 0.0, rounds=1)
