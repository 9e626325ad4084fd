"""The single-device training loop: forward, loss, backward, step — and how fast it goes.

Lesson 01 builds this loop piece by piece (lab01 asks you to write ``train_one_epoch`` and
``evaluate``); every later lesson changes only the parts that data parallelism changes.

    from dpcourse import data, models, train
    ds = data.load("shapes10")
    cfg = train.TrainConfig(epochs=2)
    history = train.fit(models.SmallCNN(), ds, cfg)

Mixed precision (``amp=True``): on CUDA, float16 autocast plus a GradScaler (float16 gradients
underflow without loss scaling); on CPU, bfloat16 autocast and no scaler (bfloat16 has float32's
exponent range, so nothing underflows).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader

__all__ = [
    "TrainConfig",
    "train_one_epoch",
    "evaluate",
    "predictions",
    "fit",
    "make_loaders",
    "ThroughputMeter",
    "time_breakdown",
    "step_phases",
    "autocast_for",
    "compare_rates",
    "rate_verdict",
    "rate_shape",
    "sign_test_p",
]


@dataclass
class TrainConfig:
    """What :func:`fit` trains with. ``device`` defaults to "cpu", whatever the machine has:
    pass the device to train on (lesson 01 passes its profile's, ``device=str(device)``).

    Shown in lesson 01, §"Throughput, and where the time goes".
    """

    epochs: int = 2
    batch_size: int = 64
    optimizer: str = "sgd"  # "sgd" (with momentum) or "adam"
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    device: str = "cpu"
    amp: bool = False
    num_workers: int = 0
    progress: bool = False

    def __post_init__(self):
        for name in ("epochs", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be 'sgd' or 'adam', got {self.optimizer!r}")


def autocast_for(device: torch.device | str, enabled: bool):
    """The autocast context for this device: float16 on CUDA, bfloat16 on CPU (or nothing):
    torch's own defaults (``torch.get_autocast_dtype``), kept so that float16 also runs on GPUs
    older than Ampere; ``fit`` adds a GradScaler with float16.

    Shown in lesson 01, §"Mixed precision (AMP)".
    """
    device = torch.device(device)
    if not enabled:
        return contextlib.nullcontext()
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class ThroughputMeter:
    """Counts samples and wall-clock seconds; ``rate`` is samples per second.

    On CUDA, kernels run asynchronously: we synchronize before reading the clock, or we would
    time how fast Python *queues* work, not how fast the GPU does it.

    Shown in lesson 01, §"Throughput, and where the time goes".
    """

    device: torch.device | str = "cpu"
    samples: int = 0
    seconds: float = 0.0
    _t0: float | None = field(default=None, repr=False)

    def _sync(self):
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize()

    def start(self):
        self._sync()
        self._t0 = time.perf_counter()

    def stop(self, samples: int):
        self._sync()
        self.seconds += time.perf_counter() - self._t0
        self.samples += samples
        self._t0 = None

    @property
    def rate(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0


def train_one_epoch(model: nn.Module, loader, loss_fn, optimizer, device="cpu", amp: bool = False,
                    scaler: "torch.amp.GradScaler | None" = None, progress: bool = False,
                    meter: ThroughputMeter | None = None) -> float:
    """One pass over ``loader``; returns the mean loss per *sample* (not per batch).

    Shown in lesson 01, §"Lab 01: write the loop yourself".
    """
    model.train()  # dropout and batch norm behave differently in training
    total_loss, total = 0.0, 0
    batches = loader
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(loader, leave=False, desc="train")
    for X, y in batches:
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if meter is not None:
            meter.start()
        with autocast_for(device, amp):
            loss = loss_fn(model(X), y)  # the mean over the batch
        # The loss is read *before* anything changes: a NaN or inf loss (a spoiled batch, a
        # learning rate that blew up) raises with the weights, the optimizer's state and every
        # p.grad as the last good step left them. Reading it costs the one host sync per step
        # that the running total below needs anyway; it only comes earlier.
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"train_one_epoch: a batch's loss is {loss_value}; nothing "
                                     f"of it reached the model (weights, optimizer state, grads)")
        optimizer.zero_grad(set_to_none=True)  # gradients accumulate otherwise
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        if meter is not None:
            meter.stop(len(y))
        total_loss += loss_value * len(y)  # weight by batch size: the last batch may be short
        total += len(y)
    if total == 0:
        raise ValueError("train_one_epoch: the loader gave no samples (an empty loader?)")
    return total_loss / total


@torch.no_grad()  # no graph: less memory, faster, and nothing can leak into training
def evaluate(model: nn.Module, loader, loss_fn, device="cpu", amp: bool = False) -> tuple[float, float]:
    """Mean loss per sample and accuracy over ``loader``, in eval mode.

    Shown in lesson 01, §"Lab 01: write the loop yourself".
    """
    model.eval()
    total_loss, correct, total = 0.0, 0, 0
    for X, y in loader:
        X, y = X.to(device), y.to(device)
        with autocast_for(device, amp):
            logits = model(X)
            loss = loss_fn(logits, y)
        total_loss += loss.float().item() * len(y)
        correct += (logits.argmax(dim=1) == y).sum().item()
        total += len(y)
    if total == 0:
        raise ValueError("evaluate: the loader gave no samples (an empty loader?)")
    return total_loss / total, correct / total


def predictions(model: nn.Module, loader, device="cpu", amp: bool = False) -> torch.Tensor:
    """The class ``model`` predicts for every sample of ``loader``, in eval mode, on the CPU:
    the shape of lab 01's ``evaluate`` (lesson 01 compares AMP's predictions with fp32's).

    Shown in lesson 01, §"Mixed precision (AMP)".
    """
    model.eval()
    with torch.no_grad(), autocast_for(device, amp):
        return torch.cat([model(X.to(device)).argmax(1).cpu() for X, _ in loader])


def make_loaders(ds, batch_size: int, seed: int = 0, num_workers: int = 0):
    """Train loader (shuffled with its own seeded generator) and test loader for a Dataset.

    Shown in lesson 01, §"Throughput, and where the time goes".
    """
    from dpcourse.data import to_torch

    g = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(to_torch(ds.x_train, ds.y_train), batch_size=batch_size,
                              shuffle=True, generator=g, num_workers=num_workers)
    test_loader = DataLoader(to_torch(ds.x_test, ds.y_test), batch_size=512,
                             num_workers=num_workers)
    return train_loader, test_loader


def fit(model: nn.Module, ds, cfg: TrainConfig) -> list[dict]:
    """Train ``model`` on ``ds`` for ``cfg.epochs``; one dict of metrics per epoch.

    Shown in lesson 01, §"Throughput, and where the time goes".
    """
    from dpcourse.devices import seed_everything

    seed_everything(cfg.seed)
    device = torch.device(cfg.device)
    model.to(device)
    train_loader, test_loader = make_loaders(ds, cfg.batch_size, cfg.seed, cfg.num_workers)
    if cfg.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    loss_fn = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler("cuda") if cfg.amp and device.type == "cuda" else None
    history = []
    for epoch in range(cfg.epochs):
        meter = ThroughputMeter(device)
        train_loss = train_one_epoch(model, train_loader, loss_fn, optimizer, device, cfg.amp,
                                     scaler, cfg.progress, meter)
        test_loss, test_acc = evaluate(model, test_loader, loss_fn, device, cfg.amp)
        history.append(dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss,
                            test_acc=test_acc, samples_per_s=meter.rate))
    return history


def step_phases(model: nn.Module, loss_fn, optimizer):
    """The two phases of a training step that :func:`time_breakdown` times apart: ``forward(X,
    y)`` (forward, loss; returns the loss) and ``backward_step(loss)`` (zero the gradients,
    backward, step: the order of :func:`train_one_epoch`, which lab 01's check asks for).
    Puts the model in training mode. It holds a training step, so lesson 01 folds it.

    Shown in lesson 01, §"Lab 01: write the loop yourself".
    """
    model.train()

    def forward(X, y):
        return loss_fn(model(X), y)

    def backward_step(loss):
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return forward, backward_step


def time_breakdown(model: nn.Module, loader, loss_fn, optimizer, device="cpu",
                   max_batches: int = 20) -> dict:
    """Where one training step's time goes: waiting for data vs forward vs backward+step.

    Seconds summed over up to ``max_batches`` batches (the device is synchronized at each
    boundary, so each phase is charged what it really cost). The phases are
    :func:`step_phases`.

    Shown in lesson 01, §"Throughput, and where the time goes".
    """
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    parts = {"data": 0.0, "forward": 0.0, "backward+step": 0.0}
    forward, backward_step = step_phases(model, loss_fn, optimizer)
    it = iter(loader)
    for _ in range(max_batches):
        t0 = time.perf_counter()          # before asking the loader
        try:
            X, y = next(it)
        except StopIteration:
            break
        X, y = X.to(device), y.to(device)
        sync()
        t1 = time.perf_counter()          # the batch is on the device
        loss = forward(X, y)
        sync()
        t2 = time.perf_counter()          # after the forward and the loss
        backward_step(loss)
        sync()
        t3 = time.perf_counter()          # after the optimizer step
        parts["data"] += t1 - t0
        parts["forward"] += t2 - t1
        parts["backward+step"] += t3 - t2
    return parts


def round_wins(runs_a, runs_b) -> tuple[int, int]:
    """Over interleaved rounds (run i of a beside run i of b): how many rounds ``runs_b`` won
    and how many it lost (higher is faster; a tied round counts as neither).

    Shown in lesson 01, §"Throughput, and where the time goes"; lesson 02, §"Why it is slow".
    """
    pairs = list(zip(runs_a, runs_b))
    return sum(b > a for a, b in pairs), sum(b < a for a, b in pairs)


def rate_verdict(runs_a, runs_b, outliers: int = 1) -> tuple[str, str]:
    """Whether throughputs ``runs_b`` beat ``runs_a`` (higher is faster), by
    :func:`compare_rates`' rule: ``(word, how)`` with ``word`` "faster", "slower" or "unclear"
    and ``how`` "in every run of n rounds", "in all but one of n rounds", "in every run" or "".
    ``outliers=0`` drops "all but one": only a clean sweep of the rounds counts.

    Shown in lesson 01, §"Throughput, and where the time goes"; lesson 02, §"Why it is slow".
    """
    runs_a, runs_b = list(runs_a), list(runs_b)
    if not runs_a or not runs_b:
        raise ValueError("compare_rates needs at least one run on each side")
    if len(runs_a) == len(runs_b):
        n = len(runs_a)
        wins, losses = round_wins(runs_a, runs_b)
        for count, word in ((wins, "faster"), (losses, "slower")):
            if n >= 3 and count == n:
                return word, f"in every run of {n} rounds"
            if n >= 5 and count == n - 1 and outliers >= 1:
                return word, f"in all but one of {n} rounds"
    elif min(runs_b) > max(runs_a):
        return "faster", "in every run"
    elif max(runs_b) < min(runs_a):
        return "slower", "in every run"
    return "unclear", ""


def sign_test_p(runs_a, runs_b) -> float:
    """Two-sided sign test over interleaved rounds: the chance that two equally fast settings,
    each round won by either with probability 1/2, split the rounds at least as lopsidedly as
    ``runs_a`` and ``runs_b`` did (tied rounds left out).

    Shown in lesson 01, §"Throughput, and where the time goes".
    """
    wins, losses = round_wins(runs_a, runs_b)
    n, k = wins + losses, max(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, j) for j in range(k, n + 1)) / 2 ** n) if n else 1.0


def compare_rates(name_a: str, runs_a, name_b: str, runs_b, outliers: int = 1) -> str:
    """One sentence comparing two sets of repeated throughputs (higher is faster), computed
    from the runs.

    Runs of equal count are taken as *interleaved rounds*: run i of a and run i of b were
    measured back to back, so a slow moment of the machine hits both, and they are compared as
    a pair. "faster in every run" needs at least 3 rounds, all won; "in all but one" needs at
    least 5 rounds and tolerates one outlier round. Unequal counts fall back to comparing the
    ranges: "in every run" only when they do not overlap. Anything else is "no clear
    difference" (:func:`rate_verdict` decides). For interleaved rounds the ratio printed is the
    median of the rounds' own ratios b / a, which always points the way the rounds voted (the
    ratio of the two medians can point the other way when the machine's speed drifts), and so
    is the sign test's p (:func:`sign_test_p`): at 7 rounds "all but one" has p = 0.125, at 5
    rounds 0.375 — one outlier tolerated costs that much; ``outliers=0`` tolerates none (every
    round of 7: p = 0.0156). Unequal counts print median(b) / median(a).

    Shown in lesson 01, §"Throughput, and where the time goes"; lesson 02, §"Why it is slow".
    """
    runs_a, runs_b = list(runs_a), list(runs_b)
    word, how = rate_verdict(runs_a, runs_b, outliers)
    paired = len(runs_a) == len(runs_b)
    if paired:  # the rounds' own ratios: they point the way the rounds voted
        ratio = statistics.median(b / a for a, b in zip(runs_a, runs_b))
        effect = "median round"
    else:
        ratio = statistics.median(runs_b) / statistics.median(runs_a)
        effect = "medians"
    p = f"; sign test p = {sign_test_p(runs_a, runs_b):.3g}" if paired else ""
    if word != "unclear":
        return (f"{name_b} was {word} than {name_a} {how} "
                f"({effect}: {ratio:.2f}x {name_a}'s speed{p}).")
    if paired:
        wins = max(round_wins(runs_a, runs_b))
        return (f"no clear difference between {name_a} and {name_b}: neither won enough rounds "
                f"(at best {wins} of {len(runs_a)}; {effect}: {name_b} at {ratio:.2f}x "
                f"{name_a}'s speed{p}).")
    return (f"no clear difference between {name_a} and {name_b}: their runs overlap "
            f"(medians: {name_b} at {ratio:.2f}x {name_a}'s speed, within the spread).")


def rate_shape(runs_by_size: dict, outliers: int = 1) -> tuple[str, str]:
    """The shape of throughput against batch size, named from its steps: each size against the
    next larger one by :func:`rate_verdict` (a step "rose" or "fell" only where that rule says
    "faster" or "slower"; "no clear change" otherwise). When no step is clear, the smallest
    size against the largest decides between "rising", "falling" and "flat". ``outliers`` is
    :func:`rate_verdict`'s (0: a step counts only when one size won every round).

    Returns ``(shape, sentence)``: ``shape`` is "rising" (no step fell and the last one rose),
    "plateau" (rose, then no clear change), "peak" (rose, then fell), "falling" (fell and none
    rose), "up and down" (fell, then rose), "ends differ" (no step is clear, but the largest
    size beat or lost to the smallest: no shape between them is shown, a rise, a plateau and a
    peak alike would give it) or "flat"; ``sentence`` lists the steps and names the shape.
    "rising" and "plateau" also need the largest size faster than the smallest; where a step
    rose, none fell, and the ends are not so, the shape is "rose, ends unclear" (or "rose, ends
    slower"): a gain over the whole range is not shown, only the steps that rose.

    Shown in lesson 01, §"Throughput, and where the time goes".
    """
    sizes = sorted(runs_by_size)
    if len(sizes) < 2:
        raise ValueError("rate_shape needs at least two batch sizes")
    verb = {"faster": "rose", "slower": "fell", "unclear": "showed no clear change"}
    steps = []                                     # [from size, to size, word]: one per run
    for a, b in zip(sizes, sizes[1:]):             # of equal words, consecutive steps merged
        word = rate_verdict(runs_by_size[a], runs_by_size[b], outliers)[0]
        if steps and steps[-1][2] == word:
            steps[-1][1] = b
        else:
            steps.append([a, b, word])
    told = ", ".join(f"{verb[w]} from batch {a} to {b}" for a, b, w in steps)
    words = [w for _, _, w in steps]
    if "slower" not in words and "faster" not in words:
        ends = rate_verdict(runs_by_size[sizes[0]], runs_by_size[sizes[-1]], outliers)[0]
        if ends == "unclear":
            return "flat", (f"{told}; batch {sizes[-1]} against batch {sizes[0]}: no clear "
                            "change either, flat within the noise")
        return "ends differ", (f"{told}; only the ends differ, batch {sizes[-1]} {ends} than "
                               f"batch {sizes[0]}: the shape in between is not shown")
    if "slower" not in words:
        ends = rate_verdict(runs_by_size[sizes[0]], runs_by_size[sizes[-1]], outliers)[0]
        if ends != "faster":                       # a step rose, the whole range did not
            rose = " and ".join(f"{a} to {b}" for a, b, w in steps if w == "faster")
            return f"rose, ends {'unclear' if ends == 'unclear' else 'slower'}", (
                f"{told}; yet batch {sizes[-1]} against batch {sizes[0]}: "
                f"{'no clear change' if ends == 'unclear' else 'slower'}, so a rise is shown "
                f"only from batch {rose}, not from the smallest batch to the largest")
        if words[-1] == "faster":
            return "rising", f"{told}: still rising at the largest batch, {sizes[-1]}"
        return "plateau", f"{told}: rising, then flat from batch {steps[-1][0]} on"
    fall = words.index("slower")
    if "faster" in words[fall:]:
        return "up and down", f"{told}: up and down, no single peak"
    if "faster" not in words:
        return "falling", f"{told}: slower beyond batch {steps[fall][0]}"
    top, first = steps[fall][0], steps[fall - 1][0] if words[fall - 1] == "unclear" else None
    peak = f"batch {top}" if first is None else f"batches {first} to {top}"
    return "peak", f"{told}: a peak at {peak}, then slower"
