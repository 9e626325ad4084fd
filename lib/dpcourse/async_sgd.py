"""Beyond lockstep: stale gradients, local SGD, large batches (lesson 09).

Every data-parallel method so far kept the ranks in lockstep: one all-reduce per step, and the
slowest rank sets the pace. This module holds three of the ways out that the lesson shows, each
small enough to read top to bottom, and the small problem they share; the fourth, a parameter
server over point-to-point messages, is :mod:`dpcourse.parameter_server`:

1. **staleness, simulated**: a deterministic simulator in one process in which every gradient
   arrives τ updates late (:class:`SimulatedServer`, :func:`async_worker_loop`), and the
   staleness-aware step of Zhang et al. (2016) (:class:`StalenessAwareServer`);
2. **local SGD**: H local steps between two averages of the weights (:func:`local_sgd_worker`);
3. **large batches**: the linear scaling rule with and without warmup (Goyal et al., 2017)
   (:func:`train_large_batch`).

The problem is small on purpose, so that the sweeps run in seconds on a laptop: the course's
shapes10 images averaged down to 8×8 pixels (192 numbers) and a two-layer MLP over them
(:func:`make_problem`, :func:`make_model`). Weights travel as one flat vector
(:func:`flat_params`, :func:`set_flat_params`), as they would in a real parameter server.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .models import flat_params, set_flat_params

__all__ = [
    "Problem",
    "make_problem",
    "make_model",
    "flat_params",
    "set_flat_params",
    "loss_and_gradient",
    "evaluate",
    "batch_schedule",
    "worker_indices",
    "ring_elements_per_rank",
    "SimulatedServer",
    "StalenessAwareServer",
    "TooStale",
    "BoundedServer",
    "async_worker_loop",
    "plain_sgd",
    "run_stale",
    "what_awareness_adds",
    "local_sgd_worker",
    "train_large_batch",
    "warmup_lr",
]


# --------------------------------------------------------------------------------------------
# The problem: shapes10 at 8×8, a two-layer MLP, flat weights
# --------------------------------------------------------------------------------------------


@dataclass
class Problem:
    """Training and test tensors: ``x`` float32 (n, 192), ``y`` int64 (n,)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def make_problem(n_train: int = 2048, n_test: int = 1024, seed: int = 0,
                 dataset: str = "shapes10") -> Problem:
    """The course's images, averaged over 4×4 blocks (32×32×3 -> 8×8×3 = 192 features).

    Shown in lesson 09, §1.
    """
    from dpcourse import data

    ds = data.load(dataset, n_train=n_train, n_test=n_test, seed=seed)

    def features(images, labels):
        x, y = data.to_torch(images, labels).tensors
        return F.avg_pool2d(x, 4).flatten(1).contiguous(), y

    x_train, y_train = features(ds.x_train, ds.y_train)
    x_test, y_test = features(ds.x_test, ds.y_test)
    return Problem(x_train, y_train, x_test, y_test)


def make_model(in_features: int = 192, hidden: int = 64, classes: int = 10,
               seed: int = 0) -> nn.Module:
    """A two-layer MLP, the same weights for the same seed on every rank.

    Shown in lesson 09, §1.
    """
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def loss_and_gradient(model: nn.Module, flat: torch.Tensor, x, y) -> tuple[float, torch.Tensor]:
    """The loss of weights ``flat`` on a batch, and its gradient as one flat vector.

    Shown in lesson 09, §1.
    """
    set_flat_params(model, flat)
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def evaluate(model: nn.Module, flat: torch.Tensor, x, y) -> tuple[float, float]:
    """(loss, accuracy) of weights ``flat``; a diverged run has loss ``inf`` (NaN too).

    Shown in lesson 09, §1.
    """
    set_flat_params(model, flat)
    with torch.no_grad():
        logits = model(x)
        loss = F.cross_entropy(logits, y).item()
        acc = (logits.argmax(1) == y).float().mean().item()
    return (loss if math.isfinite(loss) else math.inf), acc


def batch_schedule(n: int, batch: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """The indices of ``steps`` batches of ``batch`` examples: epoch after epoch of a seeded
    shuffle, the same on every rank (each rank then takes its part: :func:`worker_indices`).
    The epochs are concatenated before the cut, so a batch can straddle two of them.

    Shown in lesson 09, §1.
    """
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(n, generator=g)
                       for _ in range(math.ceil(steps * batch / n))])
    return [order[t * batch:(t + 1) * batch] for t in range(steps)]


def worker_indices(indices: torch.Tensor, worker: int, workers: int) -> torch.Tensor:
    """The indices worker ``worker`` (0-based) of ``workers`` takes from a global batch's:
    its equal, contiguous part, ``len // workers`` long (a remainder is left out: 64 over 3
    workers gives 21 each, one sample unused). Lesson 03's
    ``ddp.shard_of`` slices the tensors themselves.

    Shown in lesson 09, §1.
    """
    size = len(indices) // workers
    return indices[worker * size:(worker + 1) * size]


def ring_elements_per_rank(numel: int, n: int) -> int:
    """Elements rank 0 sends in a ring all-reduce (lesson 06), counted chunk by chunk by
    ``ring.ring_bytes_per_worker`` (folded below it): 2(N-1)K/N when N divides K; otherwise the
    first K mod N chunks are one element longer, and the count is within 2 elements of it.

    Shown in lesson 09, §1.
    """
    from dpcourse import ring

    return ring.ring_bytes_per_worker(numel, n, itemsize=1)[0]


# --------------------------------------------------------------------------------------------
# 2. Staleness, simulated: every gradient arrives τ updates late
# --------------------------------------------------------------------------------------------


class SimulatedServer:
    """A parameter server in one process: ``pull()`` hands out a copy of the weights and their
    version (the number of updates so far); ``push(grad, version)`` applies a gradient that was
    computed on weights of that version, and records how stale it was.

    Shown in lesson 09, §2.
    """

    def __init__(self, w: torch.Tensor, lr: float):
        self.w = w.clone()
        self.lr = lr
        self.version = 0
        self.staleness = []

    def pull(self) -> tuple[torch.Tensor, int]:
        return self.w.clone(), self.version

    def push(self, grad: torch.Tensor, version: int) -> None:
        self.staleness.append(self.version - version)
        self.w.add_(grad, alpha=-self.lr)
        self.version += 1


class StalenessAwareServer(SimulatedServer):
    """Zhang et al. (2016), "Staleness-aware async-SGD": a gradient s updates stale takes a
    step lr / s (lr when it is fresh), so the stale ones move the weights less.

    Shown in lesson 09, §"Lab 09: the asynchronous worker loop".
    """

    def push(self, grad: torch.Tensor, version: int) -> None:
        staleness = self.version - version
        self.staleness.append(staleness)
        self.w.add_(grad, alpha=-self.lr / max(1, staleness))
        self.version += 1


class TooStale(Exception):
    """A push that a :class:`BoundedServer` refused: the gradient was staler than the server
    takes, and nothing was applied."""


class BoundedServer(SimulatedServer):
    """A server that bounds staleness by refusing: a push whose gradient is more than
    ``max_staleness`` updates stale raises :class:`TooStale` and applies nothing (``refused``
    counts those pushes). Lab 09's loop must cope with it. This is not Stale Synchronous Parallel (Ho et al. 2013) or bounded
    delay (Li et al. 2014): those never refuse an update, they make the fast worker wait
    before its next read until the slowest is within the bound."""

    def __init__(self, w: torch.Tensor, lr: float, max_staleness: int):
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        super().__init__(w, lr)
        self.max_staleness = max_staleness
        self.refused = 0

    def push(self, grad: torch.Tensor, version: int) -> None:
        staleness = self.version - version
        if staleness > self.max_staleness:
            self.refused += 1
            raise TooStale(f"a gradient of version {version} is {staleness} updates stale at "
                           f"version {self.version}; this server takes at most "
                           f"{self.max_staleness}")
        super().push(grad, version)


def async_worker_loop(server, compute_gradient, batches, tau: int) -> None:
    """Asynchronous workers, simulated without a thread: each batch, a worker pulls the
    weights and starts its gradient; a gradient lands on the server τ pulls later, when
    τ newer ones are in flight behind it; at the end the ones still in flight land in order.
    Gradient k is computed on weights of version max(0, k - τ) and applied as update k:
    w_{k+1} = w_k - lr · g(w_{max(0, k-τ)}). With τ = 0 this is plain SGD.

    Shown in lesson 09, §"Lab 09: the asynchronous worker loop".
    """
    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())
    while in_flight:
        server.push(*in_flight.popleft())


def plain_sgd(model: nn.Module, problem: Problem, lr: float, batches) -> torch.Tensor:
    """The reference: torch's SGD on the model, batch after batch. Returns the flat weights.

    Shown in lesson 09, §2.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for indices in batches:
        opt.zero_grad()
        F.cross_entropy(model(problem.x_train[indices]), problem.y_train[indices]).backward()
        opt.step()
    return flat_params(model)


def run_stale(problem: Problem, tau: int, lr: float, batches, seed: int = 0,
              server_cls=SimulatedServer, loop=async_worker_loop) -> dict:
    """Train the MLP from ``seed`` with every gradient τ updates late; the test loss and
    accuracy after the budget, the final weights, the staleness of every update.

    Shown in lesson 09, §2.
    """
    model = make_model(seed=seed)
    server = server_cls(flat_params(model), lr)

    def compute_gradient(w, indices):
        return loss_and_gradient(model, w, problem.x_train[indices], problem.y_train[indices])[1]

    loop(server, compute_gradient, batches, tau)
    loss, acc = evaluate(model, server.w, problem.x_test, problem.y_test)
    return {"w": server.w, "loss": loss, "acc": acc, "staleness": server.staleness}


def what_awareness_adds(problem: Problem, taus, lr: float, batches, aware_losses,
                        seed: int = 0) -> list[float]:
    """What the staleness-aware server adds in this simulator, where every gradient is τ
    updates late. Reruns the aware server at ``lr`` on ``batches`` for each τ of ``taus`` and
    claims it ends on ``aware_losses`` (the lesson's runs, one per τ); claims that from the
    (τ+1)-th update on each update was exactly τ stale; reruns each with an *unaware* server
    whose steps are fixed in advance, the aware step lr / max(1, s) for the first τ updates and
    lr/τ from there on, and claims it ends on the aware run's weights, bit for bit. Last, runs
    the plain unaware server at lr/τ and prints its test loss beside the aware run's: the gap
    (aware − unaware) is what the first τ updates alone change. Returns the gaps, one per τ.

    Shown in lesson 09, §"Lab 09: the asynchronous worker loop".
    """
    from dpcourse.checks import claim

    aware = [run_stale(problem, tau, lr, batches, seed=seed, server_cls=StalenessAwareServer)
             for tau in taus]
    claim("rerun here, the aware server ends on the test losses above, exactly",
          [r["loss"] for r in aware] == list(aware_losses), aware_losses=aware_losses)
    claim("in every aware run, from the (τ+1)-th update on, each update was exactly τ stale",
          all(r["staleness"][tau:] == [tau] * (len(batches) - tau)
              for tau, r in zip(taus, aware)))

    def fixed_steps(steps):              # unaware of staleness: update k steps steps[k]
        class FixedSteps(SimulatedServer):
            def push(self, grad, version):
                self.lr = steps[self.version]
                super().push(grad, version)
        return FixedSteps

    same = []
    for tau, r in zip(taus, aware):
        steps = ([lr / max(1, s) for s in r["staleness"][:tau]]
                 + [lr / tau] * (len(batches) - tau))
        replay = run_stale(problem, tau, lr, batches, seed=seed, server_cls=fixed_steps(steps))
        same.append(torch.equal(replay["w"], r["w"]))
    claim(f"each aware run (seed {seed}, every τ) ends on the weights, bit for bit, of an "
          "unaware server stepping lr/max(1, s) in its first τ updates and lr/τ after them",
          all(same), same=same)
    scaled = [run_stale(problem, tau, lr / tau, batches, seed=seed) for tau in taus]
    gaps = [a["loss"] - r["loss"] for a, r in zip(aware, scaled)]
    rows = {f"seed {seed}, test loss after the budget": [f"τ = {t}" for t in taus],
            f"staleness-aware server, lr {lr:g}": [f"{a['loss']:.4f}" for a in aware],
            f"unaware server, lr {lr:g}/τ": [f"{r['loss']:.4f}" for r in scaled],
            "what the first τ updates alone change": [f"{g:+.4f}" for g in gaps]}
    for label, row in rows.items():
        print(f"{label:<38}" + "".join(f"{x:<10}" for x in row))
    return gaps


# --------------------------------------------------------------------------------------------
# 3. Local SGD: H steps alone, then average the weights
# --------------------------------------------------------------------------------------------


def local_sgd_worker(rank: int, world_size: int, hs, steps: int = 128, batch: int = 64,
                     lr: float = 0.5, n_train: int = 2048, seed: int = 0,
                     compare_after: int = 8) -> dict:
    """Each rank steps SGD on its shard of every global batch and averages the weights with
    an all-reduce every H steps, for each H in ``hs``; then torch DDP on the same batches.
    Returns per H the final weights, the weights after ``compare_after`` steps, the test
    loss and accuracy, the number of averages, the elements each rank sent (the formula
    2(N-1)K/N per average, not a count) and the drift at each average: the distance from this
    rank's weights to the average, relative to the average's norm; and under "start" the test
    (loss, accuracy) of the starting weights.

    Shown in lesson 09, §3.
    """
    if not 1 <= compare_after <= steps:
        raise ValueError(f"compare_after must be a step of the run, 1..steps={steps}; got "
                         f"{compare_after}")
    if any(not isinstance(h, int) or h < 1 for h in hs):
        raise ValueError(f"every H must be a positive int (steps between averages), got {hs!r}")
    torch.set_num_threads(1)
    problem = make_problem(n_train, 1024, seed=seed)
    batches = batch_schedule(n_train, batch, steps, seed=seed)
    out = {}
    for h in hs:
        model = make_model(seed=seed)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        averages, drift = 0, []
        for t, indices in enumerate(batches):
            mine = worker_indices(indices, rank, world_size)
            opt.zero_grad()
            F.cross_entropy(model(problem.x_train[mine]), problem.y_train[mine]).backward()
            opt.step()
            if (t + 1) % h == 0:                         # every H steps: average the weights
                before = flat_params(model)
                for p in model.parameters():
                    dist.all_reduce(p.data)
                    p.data /= world_size
                averages += 1
                after = flat_params(model)                # drift: how far this rank had gone
                drift.append(float((before - after).norm() / after.norm()))
            if t + 1 == compare_after:
                early = flat_params(model)
        w = flat_params(model)
        loss, acc = evaluate(model, w, problem.x_test, problem.y_test)
        out[h] = {"w": w, "early": early, "drift": drift, "loss": loss, "acc": acc,
                  "averages": averages,
                  "sent": averages * ring_elements_per_rank(len(w), world_size)}
    model = make_model(seed=seed)
    out["start"] = evaluate(model, flat_params(model), problem.x_test, problem.y_test)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for indices in batches[:compare_after]:
        mine = worker_indices(indices, rank, world_size)
        opt.zero_grad()
        F.cross_entropy(ddp(problem.x_train[mine]), problem.y_train[mine]).backward()
        opt.step()
    out["ddp_early"] = flat_params(model)
    return out


# --------------------------------------------------------------------------------------------
# 4. Large batches: the linear scaling rule and warmup
# --------------------------------------------------------------------------------------------


def warmup_lr(step: int, base_lr: float, k: int, warmup_steps: int) -> float:
    """Goyal et al. (2017): the target is k × base_lr (k times the batch, k times the step);
    with warmup the lr climbs linearly from base_lr to the target over ``warmup_steps``.

    Shown in lesson 09, §4.
    """
    target = k * base_lr
    if step >= warmup_steps:
        return target
    return base_lr + (target - base_lr) * step / warmup_steps


def train_large_batch(problem: Problem, batch: int, lr_at, epochs: int, seed: int = 0,
                      momentum: float = 0.9) -> list[float]:
    """SGD with momentum for ``epochs`` epochs of ``batch`` examples, the lr of step t being
    ``lr_at(t)``. Returns the test loss after each epoch (``inf`` once diverged).

    Shown in lesson 09, §4.
    """
    model = make_model(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr_at(0), momentum=momentum)
    n = len(problem.x_train)
    per_epoch = n // batch
    batches = batch_schedule(n, batch, per_epoch * epochs, seed=seed)
    losses = []
    for t, indices in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = lr_at(t)
        opt.zero_grad()
        F.cross_entropy(model(problem.x_train[indices]), problem.y_train[indices]).backward()
        opt.step()
        if (t + 1) % per_epoch == 0:
            w = flat_params(model)
            losses.append(evaluate(model, w, problem.x_test, problem.y_test)[0])
    return losses
