"""One device, one training loop, made faster step by step: what each switch buys.

    python -m dpcourse.bench single                      # GPU: ResNet-18; CPU: the small CNN
    python -m dpcourse.bench single --model resnet18 --batch 256 --steps 20 --json
    python -m dpcourse.bench single --compile            # adds torch.compile (bounded: slow start)

Variants, each the same loop (forward, cross-entropy, backward, SGD step) on CIFAR-shaped
synthetic data:

* naive    — fp32, NCHW (the baseline, ratio 1.00);
* tf32     — fp32 tensors, TF32 tensor-core matmuls/convolutions (CUDA only; "n/a on cpu");
* bf16     — ``torch.autocast(dtype=torch.bfloat16)`` (CPU too: slower on CPUs without bf16
  units; on this project's 2-core Xeon with AMX (amx_bf16) the small CNN ran 1.4-1.5x naive);
* fp16     — autocast fp16 + ``GradScaler`` (CUDA only);
* channels_last — fp32 with NHWC memory format;
* compile  — ``torch.compile`` (only with ``--compile``). Bounded by its mode, not a timer:
  the default mode (no max-autotune) compiles ResNet-18 in well under a minute; the compile
  falls in the warm-up, which is reported ("warm-up s") and not in images/s;
* tuned    — bf16 + channels_last (+ TF32 on CUDA, + compile with ``--compile``).

Throughput is images/s, median over ``--repeats`` runs per variant, the variants taking turns run
by run (interleaved); spread is (min, max). On CPU this reports what the machine gives and claims
nothing.

Goal on one H100: tuned >= 2.5x naive fp32. Measured once with ``--compile`` (2026-11-27, one
H100 80GB HBM3, torch 2.11.0+cu130 — that machine's, not the pinned 2.14.1 — ResNet-18, batch
256, median of 3 interleaved runs of 20 steps): naive 6,951 images/s; tf32 2.63x, bf16 3.09x,
fp16 2.81x, channels_last 0.98x, compile 0.99x (fp32 convolutions gain nothing from fusion;
its 19 s compile falls in the warm-up), tuned 3.59x. Run it on yours: the ratios depend on the
card and the release.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from dataclasses import dataclass

from dpcourse.bench.scaling import throughput_table

__all__ = ["SingleConfig", "VARIANTS", "run_single", "format_single", "add_arguments", "main"]

VARIANTS = ("naive", "tf32", "bf16", "fp16", "channels_last", "compile", "tuned")


@dataclass
class SingleConfig:
    model: str = "auto"          # resnet18 with a GPU, small without
    batch: int = 32
    steps: int = 3               # timed steps per run (after 2 warm-up steps)
    repeats: int = 3
    compile: bool = False
    lr: float = 0.01

    def validate(self) -> None:
        if self.model not in ("auto", "resnet18", "small"):
            raise ValueError(f"unknown model {self.model!r}: choose 'resnet18' or 'small'")
        for name in ("batch", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")


def why_not(variant: str, cuda: bool, compile_: bool) -> str | None:
    """Why a variant is not run here, or None."""
    if variant in ("tf32", "fp16") and not cuda:
        return "n/a on cpu"
    if variant == "compile" and not compile_:
        return "not run (pass --compile)"
    return None


class Runner:
    """A model, optimizer and batch set up for one variant; ``time(steps)`` -> seconds/step."""

    def __init__(self, variant: str, cfg: SingleConfig, device):
        import torch

        from dpcourse.bench.scaling import build

        torch.manual_seed(0)
        self.cuda = device.type == "cuda"
        self.device = device
        tuned = variant == "tuned"
        self.tf32 = self.cuda and variant in ("tf32", "tuned")
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(variant)
        if tuned:
            self.dtype = torch.bfloat16
        fmt = torch.channels_last if variant in ("channels_last", "tuned") else torch.contiguous_format
        self.model = build(cfg.model).to(device, memory_format=fmt)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9)
        self.scaler = torch.amp.GradScaler("cuda") if variant == "fp16" else None
        self.step_fn = self.model
        if variant == "compile" or (tuned and cfg.compile):
            self.step_fn = torch.compile(self.model)
        self.X = torch.randn(cfg.batch, 3, 32, 32, device=device).to(memory_format=fmt)
        self.y = torch.randint(0, 10, (cfg.batch,), device=device)

    def step(self) -> None:
        import torch

        self.opt.zero_grad(set_to_none=True)
        ctx = (torch.autocast(self.device.type, dtype=self.dtype) if self.dtype is not None
               else contextlib.nullcontext())
        with ctx:
            loss = torch.nn.functional.cross_entropy(self.step_fn(self.X), self.y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()

    def time(self, steps: int) -> float:
        import torch

        # TF32 is a global switch: set it for this variant's steps only
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps


def run_single(cfg: SingleConfig) -> dict:
    import torch

    cfg.validate()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cfg.model == "auto":
        cfg.model = "resnet18" if cuda else "small"
    runners, skipped, warmup_s = {}, {}, {}
    for v in VARIANTS:
        reason = why_not(v, cuda, cfg.compile)
        if reason:
            skipped[v] = reason
            continue
        runners[v] = Runner(v, cfg, device)
        t0 = time.perf_counter()
        for _ in range(2):       # warm-up (and compile, for the compiled variants)
            runners[v].time(1)
        warmup_s[v] = time.perf_counter() - t0
    samples = {v: [] for v in runners}
    for _ in range(cfg.repeats):
        for v, r in runners.items():   # interleaved
            samples[v].append(cfg.batch / r.time(cfg.steps))
    naive = statistics.median(samples["naive"])
    rows = []
    for v in VARIANTS:
        if v in skipped:
            rows.append(dict(variant=v, images_per_s=None, spread=None, ratio=None,
                             note=skipped[v]))
        else:
            med = statistics.median(samples[v])
            rows.append(dict(variant=v, images_per_s=med, spread=[min(samples[v]), max(samples[v])],
                             ratio=med / naive, warmup_s=warmup_s[v], note=""))
    return dict(benchmark="single", device=str(device), model=cfg.model, batch=cfg.batch,
                steps=cfg.steps, repeats=cfg.repeats, rows=rows)


def format_single(result: dict) -> str:
    head = f"{'variant':<14}{'images/s':>10}{'(min-max)':>18}{'x naive':>9}{'warm-up s':>11}"
    return "\n".join(throughput_table(
        head, result["rows"], lambda r: f"{r['variant']:<14}",
        lambda r, lo, hi: (f"{r['images_per_s']:>10.0f}{f'({lo:.0f}-{hi:.0f})':>18}"
                           f"{r['ratio']:>9.2f}{r['warmup_s']:>11.1f}")))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="auto",
                   help="resnet18 or small (default: resnet18 with a GPU, small without)")
    p.add_argument("--batch", type=int, default=None, help="default 256 on a GPU, 32 on CPU")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20 "
                                                           "on a GPU, 3 on CPU)")
    p.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved")
    p.add_argument("--compile", action="store_true", help="add torch.compile variants")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")


def _given(value, default):
    """The flag's value if given (0 included, so that validation can refuse it), else default."""
    return default if value is None else value


def main(args: argparse.Namespace) -> int:
    # Bad input is refused before torch is imported (seconds on a loaded machine): the flags
    # whose default depends on a GPU are checked as given (a default is never refused).
    SingleConfig(model=args.model, batch=_given(args.batch, 1), steps=_given(args.steps, 1),
                 repeats=args.repeats, compile=args.compile).validate()
    import torch

    gpu = torch.cuda.is_available()
    cfg = SingleConfig(model=args.model, batch=_given(args.batch, 256 if gpu else 32),
                       steps=_given(args.steps, 20 if gpu else 3), repeats=args.repeats,
                       compile=args.compile)
    result = run_single(cfg)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['model']} on {result['device']}, batch {cfg.batch}, median of "
          f"{cfg.repeats} interleaved runs of {cfg.steps} steps"
          + ("" if gpu else " (CPU: what this machine gives, no claim)"))
    print(format_single(result))
    return 0
