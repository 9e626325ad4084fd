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
