"""How a rank starts (lessons 03 and 04): the experiment's configuration
(:class:`StepConfig`), the refusals of a world size the backend cannot run, the CPU threads one
rank may use, the device a rank computes on, and :func:`setup_rank`, which every worker calls
first. Importable from :mod:`dpcourse.ddp` too, where lesson 03's workers use them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import devices as _devices


# --------------------------------------------------------------------------------------------
# Configuration and bad input
# --------------------------------------------------------------------------------------------


@dataclass
class StepConfig:
    """One small data-parallel experiment: the same numbers for every rank and the reference.

    ``global_batch`` samples per step in total; each of the ``world_size`` ranks takes a
    contiguous ``global_batch // world_size`` of them (``per_rank_batch``).

    Shown in lesson 03, §"Averaging gradients — and DDP, which does it for you".
    """

    global_batch: int = 32
    steps: int = 1
    lr: float = 0.05
    width: int = 8
    n_train: int = 512
    seed: int = 0
    data_seed: int = 0

    def per_rank_batch(self, world_size: int) -> int:
        if self.global_batch < world_size:
            raise ValueError(f"global_batch {self.global_batch} is smaller than world_size "
                             f"{world_size}: some rank would get no sample")
        if self.global_batch % world_size:
            raise ValueError(f"global_batch {self.global_batch} does not split over {world_size} "
                             f"ranks; use a multiple of {world_size}")
        return self.global_batch // world_size


def validate_world_size(world_size: int, backend: str) -> None:
    """One sentence instead of a hang or a CUDA error deep inside a rank."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ValueError("nccl needs one GPU per rank and this machine has no GPU; use "
                             "backend='gloo'")
        if world_size > gpus:
            raise ValueError(f"world_size {world_size} is larger than the {gpus} GPU(s) here: nccl "
                             f"needs one GPU per rank; use backend='gloo' or world_size <= {gpus}")
    elif backend != "gloo":
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def cpu_threads_per_rank(local_world_size: int, environ=None, cpu_count: int | None = None) -> int:
    """Intra-op threads for one of ``local_world_size`` CPU ranks on this machine: its share of
    the cores this process may use (its affinity: a pinned classroom seat's own cores), never
    more than ``OMP_NUM_THREADS`` when that is set to a positive number."""
    import os

    environ = os.environ if environ is None else environ
    share = max(1, (cpu_count or _devices.usable_cores()) // max(1, local_world_size))
    try:
        ceiling = int(environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        ceiling = 0
    return min(share, ceiling) if ceiling > 0 else share


def rank_device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK under nccl, the CPU under gloo.

    It only reads (``LOCAL_RANK`` and the process group's backend) and changes nothing: the
    process-wide settings a rank needs are made by :func:`setup_rank`, which returns the same
    device.
    """
    import os

    return _devices.device_for_rank(int(os.environ.get("LOCAL_RANK", 0)), dist.get_backend())


def setup_rank(device: torch.device | None = None,
               local_world_size: int | None = None) -> torch.device:
    """Prepare this process to compute as one rank, and return its device.

    Call it once at the top of a worker, after the process group is up (``launch.spawn`` and
    torchrun set it up before the worker runs). ``device`` defaults to :func:`rank_device`,
    ``local_world_size`` to ``LOCAL_WORLD_SIZE`` or the group's size. It changes
    process-wide settings, by device:

    * on the CPU, the intra-op thread count becomes this rank's share of the cores
      (:func:`cpu_threads_per_rank`; torchrun does the same with OMP_NUM_THREADS=1): two ranks
      each running two intra-op threads on two cores fight over them (measured when the
      course was built, not in a lesson: ARCHITECTURE.md, "Known traps": on 2 cores at load
      7-12, ``train.fit`` took 35-65 s with two threads, 7-16 s with one). A thread count the
      environment sets (``OMP_NUM_THREADS``, as an instructor does per learner on a shared
      server) is a ceiling this never raises;
    * on a GPU, TF32 is switched off for convolutions and matmuls: TF32 (on by default for
      cuDNN) rounds to ~1e-3, which would hide the float-tolerance equality lesson 03 proves
      against the CPU reference; and cuDNN is asked for deterministic convolution algorithms
      (``cudnn.deterministic`` on, ``cudnn.benchmark`` off): ``torch.use_deterministic_algorithms``'
      docstring lists ``Conv2d`` on CUDA among the normally nondeterministic operations, and
      lesson 03 compares two launches' gradients bit for bit. It costs some convolution speed;
      the benchmarks (``dpcourse.bench``) do not call this.

    Shown in lesson 03, §"Averaging gradients — and DDP, which does it for you".
    """
    import os

    dev = rank_device() if device is None else torch.device(device)
    if dev.type == "cpu":
        if local_world_size is None:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(cpu_threads_per_rank(local_world_size))
    else:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.deterministic = True   # Conv2d on CUDA: same bits every launch
        torch.backends.cudnn.benchmark = False
    return dev
