"""Helpers for lesson 04 (DDP in practice) and the scripts in ``dpcourse.scripts``.

* checkpoints: :func:`save_checkpoint` writes atomically (a temporary file in the same folder,
  then ``os.replace``), :func:`load_checkpoint` reads with ``map_location`` and
  ``weights_only=True``; :func:`state_checksum` fingerprints weights bit for bit;
* counting communication: :class:`CommCounter` + :func:`counting_allreduce_hook`, a DDP comm
  hook that does what DDP does by default (average each gradient bucket with one all_reduce)
  and counts the calls and the bytes;
* SyncBatchNorm on CPU: ``nn.SyncBatchNorm`` refuses CPU tensors ("expected input tensor to be
  on GPU or XPU ..."), so :class:`CPUSyncBatchNorm` gets the same result by another route (one
  autograd-aware all_reduce of sums, where the real one all-gathers means and invstds);
  :func:`convert_sync_batchnorm` picks the real one on CUDA and this one on CPU;
  :class:`SmallBNNet` is a tiny model with BatchNorm to show when it matters;
* several torchrun "nodes" on one machine: :func:`run_nodes` starts them concurrently, joined by
  a c10d rendezvous, and kills them all if they do not finish in time.

Nothing here runs on import. Used in lessons/04_ddp_in_practice.py and by
``python -m torch.distributed.run ... lib/dpcourse/scripts/train_ddp.py``.
"""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from dpcourse.launch import kill_tree

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "state_checksum",
    "CommCounter",
    "counting_allreduce_hook",
    "CPUSyncBatchNorm",
    "AllReduceSum",
    "convert_sync_batchnorm",
    "SmallBNNet",
    "build_model",
    "NodesResult",
    "run_nodes",
    "script_path",
    "without_function",
    "without_resume_and_save",
    "evaluate_four_ways",
]


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def save_checkpoint(path: str | os.PathLike, state: dict) -> Path:
    """Write ``state`` to ``path`` so that a reader sees the old file or the new one, never half.

    ``torch.save`` straight to ``path`` truncates the old checkpoint first and then writes for a
    while: a crash (or a rank reading it) in between finds a broken file and no old one. We
    write a temporary file in the *same folder* (``os.replace`` is only atomic within one file
    system), flush it to disk, then rename it over ``path`` in one step. Call it on rank 0 only.

    Shown in lesson 04, §3.
    """
    if not isinstance(state, dict):
        raise TypeError(f"a checkpoint must be a dict (model, optimizer, step ...), got "
                        f"{type(state).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict | None:
    """The checkpoint at ``path``, or None when there is none yet (a fresh start).

    ``map_location`` puts every tensor where this rank wants it (a checkpoint saved from cuda:0
    would otherwise land on cuda:0 in every rank); ``weights_only=True`` refuses to unpickle
    arbitrary objects, so a checkpoint cannot run code when it is loaded.

    Shown in lesson 04, §3.
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise RuntimeError(f"checkpoint {path} cannot be read ({type(exc).__name__}): it is "
                           f"damaged or half-written; was it saved without save_checkpoint, or "
                           f"by several ranks at once?") from None


def state_checksum(state: dict | nn.Module) -> str:
    """A short fingerprint of a model's state_dict, buffers included (or of any dict of
    tensors): 16 hex digits of a SHA-256 of each tensor's name, dtype and bytes.

    Shown in lesson 04, §1.
    """
    if isinstance(state, nn.Module):
        state = state.state_dict()
    h = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        if not torch.is_tensor(value):
            continue
        t = value.detach().to("cpu").contiguous()
        h.update(key.encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Counting what DDP sends
# --------------------------------------------------------------------------------------------


@dataclass
class CommCounter:
    """What :func:`counting_allreduce_hook` saw on this rank: all_reduce calls and bytes.

    Shown in lesson 04, §7.
    """

    calls: int = 0
    bytes: int = 0
    sizes: list = field(default_factory=list)


def counting_allreduce_hook(state: CommCounter, bucket):
    """torch's ``allreduce_hook`` with a counter: divide the bucket by N, all_reduce it, count.

    DDP's average without a hook, whose reducer divides each gradient by N as it copies it into
    the bucket. Register with ``ddp_model.register_comm_hook(counter, counting_allreduce_hook)``;
    DDP calls the hook once per bucket on every backward outside ``no_sync()``; it returns a
    future holding the averaged bucket.

    Shown in lesson 04, §7.
    """
    import torch.distributed as dist

    buffer = bucket.buffer()
    state.calls += 1
    state.bytes += buffer.numel() * buffer.element_size()
    state.sizes.append(buffer.numel())
    buffer.div_(dist.get_world_size())
    fut = dist.all_reduce(buffer, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


# --------------------------------------------------------------------------------------------
# SyncBatchNorm that also runs on CPU
# --------------------------------------------------------------------------------------------


class AllReduceSum(torch.autograd.Function):
    """all_reduce(SUM) with a gradient: y = sum over ranks of x, so dL/dx on each rank is the
    sum over ranks of dL/dy (every rank's loss depends on every rank's x).

    Shown in lesson 04, §9.
    """

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist

        y = x.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose batch statistics are taken over the *global* batch (all ranks).

    The same result as ``nn.SyncBatchNorm`` (which all-gathers each rank's mean, invstd and
    count; CUDA, XPU, HPU or PrivateUse1 only) by another route: each rank sums ``x`` and ``x²``
    per channel and counts its samples, one all_reduce adds them up, every rank normalises with
    the global mean and variance, and the all_reduce is differentiable: the gradients are one
    process's on the global batch. Outside a process group (or in eval mode): plain BatchNorm.

    Shown in lesson 04, §9.
    """

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input (N, C, ...), got {input.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self._check_input_dim(x)
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        stats = AllReduceSum.apply(stats)  # sum over ranks, differentiable
        c = x.shape[1]
        n = stats[2 * c]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean  # biased, as BatchNorm normalises with
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else 1.0 / float(
                    self.num_batches_tracked)
                unbiased = var.detach() * n / max(float(n) - 1.0, 1.0)
                self.running_mean.mul_(1 - m).add_(m * mean.detach())
                self.running_var.mul_(1 - m).add_(m * unbiased)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def convert_sync_batchnorm(module: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """Every BatchNorm in ``module`` made global-batch: ``nn.SyncBatchNorm`` on CUDA, the
    course's :class:`CPUSyncBatchNorm` on CPU (where the real one refuses to run).

    Shown in lesson 04, §9.
    """
    if torch.device(device).type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
            module, CPUSyncBatchNorm):
        new = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                new.weight.copy_(module.weight)
                new.bias.copy_(module.bias)
        if module.track_running_stats:
            new.running_mean.copy_(module.running_mean)
            new.running_var.copy_(module.running_var)
            new.num_batches_tracked.copy_(module.num_batches_tracked)
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, device))
    return module


class SmallBNNet(nn.Module):
    """conv-BN-relu-pool ×2 and a linear layer: small enough for CPU, with BatchNorm in it.

    Shown in lesson 04, §9.
    """

    def __init__(self, num_classes: int = 10, width: int = 16):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(4),                                                       # 8×8
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(name: str = "small_cnn", num_classes: int = 10, width: int = 16) -> nn.Module:
    """``small_cnn`` (no BatchNorm), ``small_bn`` (:class:`SmallBNNet`) or ``resnet18``."""
    from dpcourse import models

    if name == "small_cnn":
        return models.SmallCNN(num_classes, width=width)
    if name == "small_bn":
        return SmallBNNet(num_classes, width=width)
    if name == "resnet18":
        return models.resnet18_cifar(num_classes)
    raise ValueError(f"unknown model {name!r}: choose 'small_cnn', 'small_bn' or 'resnet18'")


def script_path(name: str) -> Path:
    """The path of a course script, e.g. ``script_path("train_ddp")``."""
    path = Path(__file__).resolve().parent / "scripts" / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"no course script named {name!r} (looked for {path})")
    return path


def without_function(path: str | os.PathLike, name: str) -> list[str]:
    """The script's lines, with its top-level function ``name`` cut down to one comment line.

    Shown in lesson 04, §1."""
    text = Path(path).read_text()
    fn = next(node for node in ast.parse(text).body
              if isinstance(node, ast.FunctionDef) and node.name == name)
    lines = text.splitlines()
    return (lines[:fn.lineno - 1] + [f"# def {name}(...): folded after the lab pointer"]
            + lines[fn.end_lineno:])


def without_resume_and_save(lines: list[str]) -> tuple[list[str], list[str]]:
    """``lines`` (train_single.py's or train_ddp.py's) with each block that resumes from or
    saves the checkpoint (lab 04's stretch) cut to one comment line; and the cut lines, so that
    the lesson can claim the two scripts' cut blocks are the same. Each block runs from the line
    holding its start to the next line holding its end.

    Shown in lesson 04, §1."""
    blocks = [("state = load_checkpoint(", 'print(f"resumed from step', "# (resume"),
              ("for epoch in range(step", "for epoch in range(step",
               "for epoch in ...:  # (its range"),
              ("done_in_epoch = ", "done_in_epoch = ", "# (what a resume skips"),
              ("if i // args.accum < done_in_epoch", "continue  # already", "# (skip"),
              ("if args.ckpt and is_main", '"scaler": scaler.state_dict()', "# (save")]
    kept, cut = list(lines), []
    for start, end, what in blocks:
        i = next(k for k, line in enumerate(kept) if start in line)
        j = next(k for k in range(i, len(kept)) if end in kept[k])
        indent = kept[i][:len(kept[i]) - len(kept[i].lstrip())]
        cut += kept[i:j + 1]
        kept = kept[:i] + [f"{indent}{what}: folded after the lab pointer)"] + kept[j + 1:]
    return kept, cut


def evaluate_four_ways(rank, world_size, weights, n_test, scripts):
    """Lesson 04's evaluation four ways on a trained model's ``weights`` (a checkpoint): one
    process on the whole test set (``scripts["single"]``'s ``evaluate``), DistributedSampler's
    padded shards read as each rank's own accuracy and as one accuracy over its images, each
    image once with the ranks' accuracies averaged, and ``scripts["ddp"]``'s ``evaluate``.
    Returns what rank 0 needs to print the table. A launched worker (``launch.spawn``).

    Shown in lesson 04, §4."""
    import runpy

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from dpcourse import data

    ds = data.load("shapes10", n_train=8, n_test=n_test, seed=0)  # the scripts' test images
    test_set = data.to_torch(ds.x_test, ds.y_test)
    model = build_model("small_bn", ds.num_classes, width=8)
    model.load_state_dict(load_checkpoint(weights)["model"])
    single_evaluate = runpy.run_path(scripts["single"])["evaluate"]
    ddp_evaluate = runpy.run_path(scripts["ddp"])["evaluate"]

    # what one process gets on the whole test set (computed on every rank, used on rank 0)
    one = single_evaluate(model, test_set, "cpu")
    # wrong: DistributedSampler's shards (padded), each rank's own accuracy
    padded = DataLoader(test_set, batch_size=64,
                        sampler=DistributedSampler(test_set, shuffle=False))
    right = count = 0
    model.eval()
    with torch.no_grad():
        for X, y in padded:
            right += int((model(X).argmax(1) == y).sum())
            count += len(y)
    mine = torch.tensor([right / count, right, count], dtype=torch.float64)
    everyone = mine.clone()
    dist.all_reduce(everyone)  # sums over ranks
    # right: the script's evaluate (folded after the lab pointer)
    fixed = ddp_evaluate(model, test_set, "cpu", rank, world_size)
    # mean of means over the right shards: each rank's own accuracy, averaged
    shard = torch.tensor([0.0])
    model.eval()  # (evaluate put the model back in training mode)
    if rank < n_test:
        idx = list(range(rank, n_test, world_size))
        with torch.no_grad():
            shard[0] = float((model(test_set.tensors[0][idx]).argmax(1)
                              == test_set.tensors[1][idx]).double().mean())
    dist.all_reduce(shard)
    return {"one": one.tolist(), "rank0": float(mine[0]),
            "padded_mean_of_means": float(everyone[0]) / world_size,
            "padded_sum": float(everyone[1] / everyone[2]), "padded_count": int(everyone[2]),
            "shard_mean_of_means": float(shard[0]) / world_size,
            "fixed": fixed.tolist()}



# --------------------------------------------------------------------------------------------
# Several torchrun "nodes" on one machine
# --------------------------------------------------------------------------------------------


@dataclass
class NodesResult:
    """Exit codes and outputs of the nodes started by :func:`run_nodes`, in start order."""

    returncodes: list
    outputs: list
    commands: list
    seconds: float

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    def text(self) -> str:
        """Every node's output, each line prefixed ``[node k]``."""
        return "\n".join(f"[node {k}] {line}" for k, out in enumerate(self.outputs)
                         for line in out.splitlines())


def run_nodes(script: str | os.PathLike, *script_args: str, nnodes: int = 2,
              nproc_per_node: int = 1, timeout: float = 60.0, join_timeout: float = 30.0,
              rdzv_id: str = "dpcourse-nodes", env: dict | None = None,
              cwd: str | os.PathLike | None = None) -> NodesResult:
    """Start ``nnodes`` torchrun agents at once, as if on ``nnodes`` machines, and wait.

    Each is ``torchrun --nnodes=N --nproc-per-node=P --rdzv-backend=c10d
    --rdzv-endpoint=127.0.0.1:PORT``: the same command you would type on every machine of a
    cluster, with the first machine's address as the endpoint. With c10d, ``--node_rank`` is
    ignored (so we pass none) and the nodes' ranks come from sorting the participants'
    descriptions (address, process id, a counter; ``_NodeDesc`` in
    ``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``), not from the order in which
    they join.
    ``join_timeout`` bounds how long a node waits for the others (torchrun's default is 600 s);
    ``timeout`` bounds the whole thing: past it every node and its workers are killed and a
    ``dpcourse.launch.LaunchTimeoutError`` is raised. Worker output is prefixed ``[rank k]``
    (global rank). Returns a :class:`NodesResult`; it does not raise on a non-zero exit code.
    """
    from dpcourse.launch import LaunchTimeoutError, free_port, torchrun_command, torchrun_env

    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be a positive int, got {nnodes!r}")
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be a positive int, got {nproc_per_node!r}")
    if timeout <= 0 or join_timeout <= 0:
        raise ValueError("timeout and join_timeout must be positive numbers of seconds")
    script = Path(script)
    if not script.exists():
        raise FileNotFoundError(f"run_nodes: no such script {script}")
    endpoint = f"127.0.0.1:{free_port()}"
    run_env = torchrun_env(env)
    commands, procs, logs = [], [], []
    t0 = time.monotonic()
    try:
        for node in range(nnodes):
            cmd = torchrun_command(script, *script_args, nnodes=nnodes,
                                   nproc_per_node=nproc_per_node, rdzv_endpoint=endpoint,
                                   rdzv_id=rdzv_id,
                                   options=[f"--rdzv-conf=join_timeout={join_timeout:g}"])
            # Output to a temporary file, not a pipe: nobody reads the pipes while we wait, and
            # a full pipe would stall a node.
            log = tempfile.TemporaryFile(mode="w+")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                          env=run_env, cwd=cwd, start_new_session=True))
            commands.append(cmd)
            logs.append(log)
        deadline = t0 + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise LaunchTimeoutError(
                    f"the {nnodes} torchrun nodes did not finish within {timeout:g} s; all of "
                    f"them and their workers were stopped (a node whose partners never join "
                    f"waits join_timeout={join_timeout:g} s).", timeout=timeout) from None
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
        return NodesResult([p.returncode for p in procs], outputs, commands,
                           time.monotonic() - t0)
    finally:
        for p in procs:
            kill_tree(p.pid)  # torchrun's workers live in sessions of their own
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for log in logs:
            log.close()
