"""dpcourse.devices: profiles, backend choice, seeds, the doctor."""

import subprocess
import sys

import pytest
import torch

from dpcourse import devices
from dpcourse.__main__ import diagnose


def fake_report(gpus=0, nccl=None):
    return devices.HardwareReport(
        python="3.11", platform="Linux", cpu_count=2, torch="x", torch_cuda_build=None,
        cuda_available=gpus > 0, gpus=[f"GPU{i}" for i in range(gpus)], gloo=True,
        nccl=gpus > 0 if nccl is None else nccl, nccl_built=gpus > 0 if nccl is None else nccl,
        packages={"tensorflow-cpu": "2.21.0", "nbval": "1", "jupytext": "1", "ipywidgets": "1",
                  "matplotlib": "1"})


@pytest.mark.parametrize("gpus, name, backend, ws, rank_device", [
    (0, "cpu", "gloo", 2, "cpu"),
    (1, "one-gpu", "gloo", 2, "cpu"),
    # 2 ranks by default on every profile (the stored outputs hold everywhere) ...
    (4, "multi-gpu", "nccl", 2, "cuda"),
])
def test_profile_follows_the_hardware(monkeypatch, gpus, name, backend, ws, rank_device):
    monkeypatch.delenv("DPCOURSE_PROFILE", raising=False)
    p = devices.choose_profile(fake_report(gpus))
    assert (p.name, p.backend, p.world_size, p.rank_device) == (name, backend, ws, rank_device)
    assert p.tf_devices == 2


@pytest.mark.parametrize("ws, backend, rank_device, tf_devices", [
    (4, "nccl", "cuda", 4),   # ... and every GPU when the parameters cell asks
    (5, "gloo", "cpu", 4),    # more ranks than GPUs: NCCL would put two ranks on one GPU
])
def test_multi_gpu_world_size_from_the_parameters_cell(monkeypatch, ws, backend, rank_device,
                                                      tf_devices):
    monkeypatch.delenv("DPCOURSE_PROFILE", raising=False)
    p = devices.choose_profile(fake_report(4), world_size=ws)
    assert (p.world_size, p.backend, p.rank_device, p.tf_devices) == (ws, backend, rank_device,
                                                                     tf_devices)


def test_profile_can_be_forced_but_not_beyond_the_hardware(monkeypatch):
    monkeypatch.setenv("DPCOURSE_PROFILE", "cpu")
    assert devices.choose_profile(fake_report(4)).name == "cpu"
    monkeypatch.setenv("DPCOURSE_PROFILE", "multi-gpu")
    with pytest.raises(ValueError, match="needs a GPU"):
        devices.choose_profile(fake_report(0))
    monkeypatch.setenv("DPCOURSE_PROFILE", "tpu")
    with pytest.raises(ValueError, match="is not one of"):
        devices.choose_profile(fake_report(0))


def test_nccl_only_when_each_rank_owns_a_gpu():
    assert devices.backend_for(2, 0, True) == "gloo"
    assert devices.backend_for(2, 1, True) == "gloo"
    assert devices.backend_for(2, 2, True) == "nccl"
    assert devices.backend_for(4, 2, True) == "gloo"
    assert devices.backend_for(2, 8, False) == "gloo"


def test_device_for_rank():
    assert devices.device_for_rank(0, "gloo") == torch.device("cpu")
    if torch.cuda.device_count() == 0:
        with pytest.raises(ValueError, match="has no GPU"):
            devices.device_for_rank(0, "nccl")


def test_seed_everything_repeats_torch_and_numpy():
    import numpy as np

    devices.seed_everything(5)
    a = torch.rand(3), np.random.rand(3)
    devices.seed_everything(5)
    b = torch.rand(3), np.random.rand(3)
    assert torch.equal(a[0], b[0]) and (a[1] == b[1]).all()


def test_doctor_advice():
    assert [a for a in diagnose(fake_report()) if not a.startswith("note")] == []
    r = fake_report()
    r.packages["tensorflow-cpu"] = None
    assert any("TensorFlow is missing" in a for a in diagnose(r))
    r = fake_report(2, nccl=False)
    assert any("NCCL is not" in a for a in diagnose(r))


def test_doctor_runs_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "dpcourse", "doctor"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "profile cpu" in out.stdout or "profile one-gpu" in out.stdout or "profile multi-gpu" in out.stdout


TF_TOO_LATE = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
from dpcourse import devices
names = devices.split_tf_devices(2, "CPU")
assert len(names) == 2, names
assert devices.split_tf_devices(2, "CPU") == names  # re-running the cell is fine
assert devices.split_tf_devices(1, "CPU") == names[:1]  # fewer: the first ones
try:
    devices.split_tf_devices(3, "CPU")
except RuntimeError as e:
    print("ERR", e)
"""


def test_tf_split_and_the_too_late_error():
    out = subprocess.run([sys.executable, "-c", TF_TOO_LATE], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ERR TensorFlow has already started with 2 CPU device(s)" in out.stdout
    assert "Restart the kernel" in out.stdout


def test_usable_cores_follow_the_affinity_of_a_pinned_seat():
    """A classroom seat pinned with taskset to one core must see one core, not the server's."""
    import subprocess
    import sys

    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c",
                          "from dpcourse import devices, ddp; "
                          "print(devices.usable_cores(), ddp.cpu_threads_per_rank(1, environ={}))"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1", "1"]
