"""dpcourse.bench: size parsing, bus bandwidth, and the allreduce command end to end (small)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpcourse import bench

ROOT = Path(__file__).resolve().parents[1]


def test_parse_and_format_sizes():
    assert bench.parse_size("1K") == 1024
    assert bench.parse_size("64MiB") == 64 * 2**20
    assert bench.parse_size("16m") == 16 * 2**20
    assert bench.parse_size("4096") == 4096
    assert bench.format_size(64 * 2**20) == "64 MiB"
    with pytest.raises(ValueError, match="cannot read size"):
        bench.parse_size("lots")
    with pytest.raises(ValueError, match="multiple of 4"):
        bench.parse_size("6")


def test_bus_bandwidth_is_nccl_tests_definition():
    # 1 GB in 1 s: algbw 1 GB/s; busbw = algbw * 2(n-1)/n
    assert bench.bus_bandwidth(1e9, 1.0, 2) == pytest.approx(1e9)
    assert bench.bus_bandwidth(1e9, 1.0, 4) == pytest.approx(1.5e9)
    assert bench.bus_bandwidth(1e9, 2.0, 8) == pytest.approx(0.5e9 * 14 / 8)


def test_allreduce_command_json(capsys):
    # In-process (the launch's fork server is then shared with the other tests); the module's
    # `python -m` entry is the same main(), exercised by test_bad_arguments_are_one_line.
    assert bench.main(["allreduce", "--sizes", "4K", "64K", "--world-sizes", "2", "--reps", "2",
                       "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["rows"]
    assert [(r["world_size"], r["nbytes"]) for r in rows] == [(2, 4096), (2, 65536)]
    for r in rows:
        assert r["ring_s"] > 0 and r["all_reduce_s"] > 0
        assert r["ring_busbw"] == pytest.approx(bench.bus_bandwidth(r["nbytes"], r["ring_s"], 2))
        assert r["ratio"] == pytest.approx(r["ring_busbw"] / r["all_reduce_busbw"])
        # per-rep ratios of the interleaved pairs: median inside its spread
        assert 0 < r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"]


def test_bad_arguments_are_one_line():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "lib"))
    proc = subprocess.run([sys.executable, "-m", "dpcourse.bench", "allreduce", "--sizes", "3"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "multiple of 4 bytes" in proc.stderr


def test_table_format():
    row = bench.AllreduceRow(2, 1024, 1e-3, 2e-3, 1e6, 5e5)
    text = bench.format_table([row])
    assert "1 KiB" in text and "2.00" in text
    # a row without per-rep times: the per-pair column is not announced (never left blank)
    assert "per pair" not in text


def test_table_prints_small_bus_bandwidths_in_mb_per_s():
    row = bench.AllreduceRow(2, 1024, 1e-3, 2e-3, 1e6, 5e5)   # 1 MB/s and 0.5 MB/s
    text = bench.format_table([row], busbw_unit="MB/s")
    assert "busbw MB/s" in text and "GB/s" not in text and "1.0" in text and "0.5" in text
    assert "0.001" in bench.format_table([row])   # the default stays GB/s
    with pytest.raises(ValueError, match="busbw_unit"):
        bench.format_table([row], busbw_unit="kB/s")


def _per_rank(ring_times, builtin_times, nbytes=1024):
    return [{"ring": {nbytes: list(ring_times)}, "all_reduce": {nbytes: list(builtin_times)}}]


def test_summary_fills_the_per_pair_column_and_the_table_prints_it():
    rows = bench.summarize_allreduce(_per_rank([1.0, 2.0, 4.0], [2.0, 2.0, 2.0]), 2, [1024])
    r = rows[0]
    assert r.ratios == [2.0, 1.0, 0.5] and r.ratio_median == 1.0
    assert (r.ratio_min, r.ratio_max) == (0.5, 2.0) and r.ring_min_s == 1.0
    text = bench.format_table(rows)
    assert "per pair" in text and "1.00 [0.75-1.50] (0.50-2.00)" in text


def test_compare_says_no_clear_difference_unless_the_quartiles_agree():
    even = bench.summarize_allreduce(_per_rank([1.0, 2.0, 4.0], [2.0] * 3), 2, [1024])
    assert bench.compare(even).startswith("no clear difference")
    faster = bench.summarize_allreduce(_per_rank([1.0, 1.0, 1.9, 1.5], [2.0] * 4), 2, [1024])
    assert bench.compare(faster).startswith("the ring was faster")
    slower = bench.summarize_allreduce(_per_rank([3.0, 2.5, 2.1, 4.0], [2.0] * 4), 2, [1024])
    assert bench.compare(slower).startswith("the built-in was faster")
    with pytest.raises(ValueError, match="per-rep ratios"):
        bench.compare([bench.AllreduceRow(2, 1024, 1e-3, 2e-3, 1e6, 5e5)])


def test_reps_grow_for_small_sizes_and_are_the_same_on_every_rank():
    assert bench.reps_for(1024, 5) == 50
    assert bench.reps_for(64 * 2**20, 5) == 5
    assert bench.reps_for(2**20, 5) == 16
    assert bench.reps_for(2**20, 20) == 20


def test_nccl_without_a_gpu_per_rank_is_refused_before_any_rank_starts(monkeypatch):
    # measured on a one-GPU H100 host: two nccl ranks on one GPU crashed deep inside NCCL
    # ("Duplicate GPU detected"); now the bench says so in one sentence
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="larger than the 1 GPU"):
        bench.run_allreduce_bench(sizes=("1K",), world_sizes=(2,), backend="nccl")


# --- scaling and single (bench/scaling.py, bench/single.py) ---------------------------------------

from dpcourse.bench import scaling as bench_scaling, single as bench_single  # noqa: E402


def test_efficiency_arithmetic():
    assert bench_scaling.efficiency(1800.0, 2, 1000.0) == pytest.approx(0.9)
    assert bench_scaling.efficiency(1000.0, 1, 1000.0) == pytest.approx(1.0)


def test_alpha_beta_prediction_by_hand():
    # ring: 2(N-1) messages of alpha + 2(N-1)/N * K bytes * beta, added to the compute time
    compute, n, k, alpha, beta = 0.010, 4, 8e6, 1e-5, 1e-9
    by_hand = compute + 2 * 3 * alpha + 2 * 3 / 4 * k * beta
    assert bench_scaling.predict_step_s(compute, n, k, alpha, beta) == pytest.approx(by_hand)
    assert bench_scaling.predict_step_s(compute, 1, k, alpha, beta) == pytest.approx(compute)


def test_published_results_are_reproduced_within_tolerance():
    rows = bench_scaling.published_table()
    assert len(rows) == 2
    for r in rows:
        assert abs(r["difference_points"]) <= bench_scaling.PUBLISHED_TOLERANCE_POINTS, r
        assert r["difference_points"] == pytest.approx(
            100 * (r["predicted_efficiency"] - r["published_efficiency"]))
    v100, a100 = rows
    assert v100["grad_bytes"] == pytest.approx(25.6e6 * 4)     # fp32 gradients
    assert a100["grad_bytes"] == pytest.approx(25.6e6 * 4)     # TF32 training: fp32 grads
    assert a100["published_efficiency"] * 8 == pytest.approx(7.72)


def test_scaling_command_json(capsys, tmp_path, no_leftovers):
    figure = tmp_path / "scaling.png"
    assert bench.main(["scaling", "--max-ranks", "2", "--per-device-batch", "4", "--steps", "1",
                       "--repeats", "1", "--model", "small", "--json", "--figure",
                       str(figure)]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "scaling" and doc["overlap_assumed"] is False
    kinds = [(r["kind"], r["world_size"]) for r in doc["rows"]]
    assert kinds == [("single", 1), ("ddp", 1), ("ddp", 2), ("dp", 2)]
    single = doc["single_images_per_s"]
    for r in doc["rows"]:
        if r["kind"] == "dp":       # no GPU here: said, not measured
            assert r["images_per_s"] is None and "DataParallel just calls" in r["note"]
            continue
        assert r["efficiency"] == pytest.approx(r["images_per_s"] / (r["world_size"] * single))
        lo, hi = r["spread"]
        assert lo <= r["images_per_s"] <= hi
        compute = 4 / single
        assert r["predicted_step_ms"] == pytest.approx(1e3 * bench_scaling.predict_step_s(
            compute, r["world_size"], doc["grad_bytes"], doc["alpha"], doc["beta"]))
    assert len(doc["published"]) == 2


def test_single_command_json(capsys):
    assert bench.main(["single", "--batch", "4", "--steps", "1", "--repeats", "1",
                       "--model", "small", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["variant"]: r for r in doc["rows"]}
    assert list(rows) == list(bench_single.VARIANTS)
    assert rows["naive"]["ratio"] == pytest.approx(1.0)
    assert rows["compile"]["images_per_s"] is None      # only with --compile
    if doc["device"] == "cpu":
        assert rows["tf32"]["note"] == "n/a on cpu" and rows["fp16"]["note"] == "n/a on cpu"
    for r in rows.values():
        if r["images_per_s"] is not None:
            assert r["ratio"] == pytest.approx(r["images_per_s"] / rows["naive"]["images_per_s"])


@pytest.mark.parametrize("args, message", [
    (["scaling", "--max-ranks", "0"], "--max-ranks must be at least 1"),
    (["scaling", "--model", "vgg"], "unknown model 'vgg'"),
    (["single", "--model", "vgg"], "unknown model 'vgg'"),
])
def test_scaling_and_single_bad_input_is_one_line(args, message, no_leftovers):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "lib"))
    proc = subprocess.run([sys.executable, "-m", "dpcourse.bench", *args], capture_output=True,
                          text=True, env=env, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("python -m dpcourse.bench: error:")


def test_scaling_tf_rows_come_from_a_bounded_child(no_leftovers):
    # TensorFlow only in the child (about 8 s here); the parent never imports it. The parent is
    # a fresh interpreter: this pytest worker may have imported TF already for another test file.
    script = (
        "import json, sys\n"
        "from dpcourse.bench import scaling_tf\n"
        "rows = scaling_tf.run_tf_scaling(max_ranks=2, per_rank_batch=4, steps=1, repeats=1,\n"
        "                               model='small', timeout=120)\n"
        "print(json.dumps({'rows': rows, 'tf_in_parent': 'tensorflow' in sys.modules}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "lib"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = result["rows"]
    assert [(r["kind"], r["world_size"]) for r in rows] == [("mirrored", 1), ("mirrored", 2)]
    assert rows[0]["efficiency"] == pytest.approx(1.0)
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["images_per_s"]
                                                  / (2 * rows[0]["images_per_s"]))
    assert result["tf_in_parent"] is False


def test_bench_tf_bad_input_is_one_line():
    from dpcourse.bench import scaling_tf as bench_tf

    with pytest.raises(SystemExit) as err:
        bench_tf.main(["--max-ranks", "0"])
    assert err.value.code == 2


def test_scaling_runs_take_turns(monkeypatch):
    # Interleaved: every configuration once per repeat, never all repeats of one first.
    calls = []

    def fake_run(kind, n, cfg, backend):
        calls.append((kind, n))
        return 100.0 * n

    monkeypatch.setattr(bench_scaling, "_one_run", fake_run)
    result = bench_scaling.run_scaling(bench_scaling.ScalingConfig(max_ranks=2, repeats=2,
                                                                   model="small"))
    one_round = [("single", 1), ("ddp", 1), ("ddp", 2)]
    assert calls == one_round * 2
    ddp2 = next(r for r in result["rows"] if (r["kind"], r["world_size"]) == ("ddp", 2))
    assert ddp2["efficiency"] == pytest.approx(1.0) and ddp2["spread"] == [200.0, 200.0]


def test_ddp_table_shows_median_and_spread():
    result = {"cap": 25.0, "ratio": 1.05, "ratio_spread": [0.98, 1.10],
              "runs": [{"kind": "ddp", "bucket_cap_mb": 25.0, "step_s": 0.060,
                        "spread": [0.059, 0.066], "collectives_per_step": 1}]}
    table = bench.format_ddp_table(result)
    assert "60.0" in table and "(59.0-66.0)" in table
    assert "1.05x (per launch 0.98-1.10)" in table
