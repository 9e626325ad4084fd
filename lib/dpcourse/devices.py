"""What hardware is here, which of the course's three profiles it gives, and how ranks use it.

The three profiles (lesson 00 shows yours, ``python -m dpcourse doctor`` prints it):

* ``cpu``       — no GPU: 2 ranks on the CPU over gloo; TensorFlow splits the CPU into 2 logical
  devices. Laptops, Binder and CI.
* ``one-gpu``   — single-device lessons run on CUDA; multi-rank lessons run their ranks over gloo
  (NCCL refuses two ranks on one GPU); TensorFlow can split the GPU into logical GPUs.
* ``multi-gpu`` — NCCL, one GPU per rank; real ``nn.DataParallel``; MirroredStrategy on real GPUs.

Every profile starts the multi-rank lessons with **2 ranks** (TensorFlow: 2 replicas), even on
an 8-GPU box: the lessons' global batches, printed numbers and claims are then the same on
every machine, so the notebooks stored from a CPU build pass strict nbval on GPUs too (a run
at world size 3 broke lessons 03, 05 and 07: 32 and 64 do not split over 3 ranks). Set
``world_size`` in a lesson's parameters cell to use more GPUs; ``python -m dpcourse.bench
scaling`` measures all of them.

Lessons ask this module; nobody edits a notebook to change hardware. An instructor can force a
profile with the environment variable ``DPCOURSE_PROFILE`` (e.g. to rehearse the CPU path on a
GPU box). Nothing here imports TensorFlow unless a TF function is called.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import random
import sys
from dataclasses import dataclass, field
from importlib import metadata

import numpy as np
import torch

__all__ = [
    "HardwareReport",
    "Profile",
    "hardware_report",
    "choose_profile",
    "backend_for",
    "device_for_rank",
    "seed_everything",
    "split_tf_devices",
    "PROFILES",
]

PROFILES = ("cpu", "one-gpu", "multi-gpu")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@dataclass
class HardwareReport:
    """Facts about this machine, gathered without starting TensorFlow."""

    python: str
    platform: str
    cpu_count: int
    torch: str
    torch_cuda_build: str | None
    cuda_available: bool
    gpus: list[str]
    gloo: bool
    nccl: bool
    nccl_built: bool  # torch was built with NCCL (``nccl`` also needs a GPU here)
    packages: dict[str, str | None] = field(default_factory=dict)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a classroom seat pinned with taskset
    sees its own 3 cores, not the server's 64), else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def hardware_report() -> HardwareReport:
    """This machine's facts. ``gloo``/``nccl`` mean usable here: ``nccl`` needs a GPU too;
    ``nccl_built`` only that this torch was built with NCCL.

    Shown in lesson 00, §"Your machine: the three hardware profiles".
    """
    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    dist_ok = torch.distributed.is_available()
    packages = {name: _version(name) for name in (
        "torchvision", "tensorflow", "tensorflow-cpu", "keras", "numpy", "jupyterlab",
        "ipywidgets", "matplotlib", "nbval", "jupytext")}
    return HardwareReport(
        python=platform.python_version(),
        platform=f"{platform.system()} {platform.machine()}",
        cpu_count=usable_cores(),
        torch=torch.__version__,
        torch_cuda_build=torch.version.cuda,
        cuda_available=cuda,
        gpus=gpus,
        gloo=dist_ok and torch.distributed.is_gloo_available(),
        nccl=dist_ok and cuda and torch.distributed.is_nccl_available(),
        nccl_built=dist_ok and torch.distributed.is_nccl_available(),
        packages=packages,
    )


@dataclass(frozen=True)
class Profile:
    """How the lessons use this machine.

    ``device``      where single-device code runs ("cuda" or "cpu");
    ``world_size``  how many ranks the multi-rank lessons start by default;
    ``backend``     the torch.distributed backend for those ranks;
    ``rank_device`` "cuda" if each rank owns a GPU (rank r uses cuda:r), else "cpu";
    ``tf_devices``  how many (logical) devices MirroredStrategy mirrors over, and of which kind.
    """

    name: str
    device: str
    world_size: int
    backend: str
    rank_device: str
    tf_device_type: str
    tf_devices: int

    def describe(self) -> str:
        return (f"profile {self.name}: single-device code on {self.device}; "
                f"{self.world_size} ranks over {self.backend} on {self.rank_device}; "
                f"TensorFlow mirrors over {self.tf_devices} {self.tf_device_type} device(s)")


def choose_profile(report: HardwareReport | None = None, world_size: int | None = None) -> Profile:
    """The profile for this machine (or for ``report``), honouring ``DPCOURSE_PROFILE``.

    Shown in lesson 00, §"Your machine: the three hardware profiles".
    """
    report = report or hardware_report()
    forced = os.environ.get("DPCOURSE_PROFILE")
    if forced is not None and forced not in PROFILES:
        raise ValueError(f"DPCOURSE_PROFILE={forced!r} is not one of {', '.join(PROFILES)}")
    n = report.gpu_count
    name = forced or ("multi-gpu" if n >= 2 else "one-gpu" if n == 1 else "cpu")
    if name != "cpu" and n == 0:
        raise ValueError(f"DPCOURSE_PROFILE={name} needs a GPU, and torch sees none here")
    if name == "multi-gpu" and n < 2:
        raise ValueError(f"DPCOURSE_PROFILE=multi-gpu needs 2 or more GPUs, torch sees {n}")
    if name == "multi-gpu":
        ws = world_size or 2
        nccl = backend_for(ws, n, report.nccl) == "nccl"
        return Profile(name, "cuda", ws, "nccl" if nccl else "gloo", "cuda" if nccl else "cpu",
                       "GPU", min(ws, n))
    ws = world_size or 2
    if name == "one-gpu":
        return Profile(name, "cuda", ws, "gloo", "cpu", "GPU", 2)
    return Profile(name, "cpu", ws, "gloo", "cpu", "CPU", 2)


def backend_for(world_size: int, gpu_count: int | None = None, nccl: bool | None = None) -> str:
    """nccl only when every rank can own a GPU (and NCCL is there); gloo otherwise.

    NCCL does not run on CPU tensors ("ProcessGroupNCCL is only supported with GPUs") and
    refuses two ranks on one GPU, so anything short of a GPU per rank means gloo.

    Shown in lesson 00, §"Your machine: the three hardware profiles".
    """
    if gpu_count is None:
        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nccl is None:
        nccl = gpu_count > 0 and torch.distributed.is_nccl_available()
    return "nccl" if nccl and gpu_count >= world_size else "gloo"


def device_for_rank(local_rank: int, backend: str) -> torch.device:
    """cuda:local_rank under nccl (and makes it the current device), cpu under gloo."""
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local_rank {local_rank} has no GPU: only "
                             f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES?)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch (all GPUs too). ``deterministic`` also asks torch for
    deterministic kernels, which costs speed on GPU; on CPU the course's models are already
    bit-for-bit repeatable with the same seed and the same thread count. It also sets
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` if unset: on torch 2.14.1 only a workspace size, which
    older torch required for deterministic cuBLAS.

    Shown in lesson 01, §"Seeds and reproducibility".
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device as well
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Not a requirement on torch 2.14.1: it only sizes cuBLAS's workspace, one per handle
        # and stream. Older torch refused a GPU matmul in deterministic mode without it.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def split_tf_devices(n: int = 2, device_type: str | None = None, gpu_memory_mb: int = 2048):
    """Make TensorFlow see ``n`` logical devices, for MirroredStrategy on one machine.

    ``device_type`` "CPU" splits the processor; "GPU" splits the first GPU (``gpu_memory_mb``
    each); None picks: all real GPUs if there are ``n`` or more, else split the first GPU,
    else split the CPU. Returns the names of the devices to mirror over.

    This must run before anything else touches TensorFlow: TF fixes its devices the first time
    it uses them. Calling it again with the same or a smaller ``n`` is fine (re-running a cell:
    the first ``n`` devices); asking for more devices after TF has started raises a
    RuntimeError that says to restart.

    Shown in lesson 05, §1.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive number of devices, got {n!r}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    if "tensorflow" not in sys.modules and importlib.util.find_spec("triton"):
        # Measured here: with TF loaded first, torch's first optimizer.step() loads triton's
        # native library and the process dies with a segfault. Loading triton first avoids it.
        import triton  # noqa: F401
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    gpus = tf.config.list_physical_devices("GPU")
    if device_type is None:
        device_type = "GPU" if gpus else "CPU"
    device_type = device_type.upper()
    if device_type == "GPU" and not gpus:
        raise ValueError("device_type='GPU' but TensorFlow sees no GPU; use 'CPU'")
    if device_type == "GPU" and len(gpus) >= n:
        # Real GPUs: TF would otherwise reserve nearly all of each GPU's memory when it
        # starts, and torch in the same kernel (or a rank it spawns) would find none left.
        for gpu in gpus:
            try:
                tf.config.experimental.set_memory_growth(gpu, True)
            except RuntimeError:
                pass  # TF has started already: too late to change, and not ours to undo
        return [f"/gpu:{i}" for i in range(n)]
    physical = gpus[0] if device_type == "GPU" else tf.config.list_physical_devices("CPU")[0]
    if device_type == "GPU":
        config = [tf.config.LogicalDeviceConfiguration(memory_limit=gpu_memory_mb)] * n
    else:
        config = [tf.config.LogicalDeviceConfiguration()] * n
    try:
        tf.config.set_logical_device_configuration(physical, config)
    except RuntimeError as exc:
        have = tf.config.list_logical_devices(device_type)
        if len(have) >= n:  # already split (re-running a cell, or a split into more devices)
            return [d.name for d in have[:n]]
        raise RuntimeError(
            f"TensorFlow has already started with {len(have)} {device_type} device(s), so it "
            f"cannot be split into {n} now. Restart the kernel and run this cell before any "
            f"other TensorFlow code."
        ) from exc
    return [d.name for d in tf.config.list_logical_devices(device_type)]
