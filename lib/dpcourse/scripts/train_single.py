r"""Train a small CNN: lesson 04's script. train_single.py runs it on one device, train_ddp.py
with DistributedDataParallel (DDP) on many. Every line that differs between the two files is a
line that data parallelism needs: lesson 04 prints that diff whole.

Run it from the repository root (with the course installed: pip install -e .):

    python lib/dpcourse/scripts/train_single.py --epochs 3 --out final.pt
    # resume from (and save to) a checkpoint
    python lib/dpcourse/scripts/train_single.py --ckpt ckpt.pt --ckpt-every 8 --out final.pt

One optimizer step sees --batch images, in --accum micro-batches, on the GPU if there is one.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler

from dpcourse import data
from dpcourse.ddp_practice import build_model, load_checkpoint, save_checkpoint, state_checksum


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="shapes10")
    p.add_argument("--n-train", type=int, default=1024)
    p.add_argument("--n-test", type=int, default=201, help="images to evaluate on")
    p.add_argument("--model", default="small_cnn", help="small_cnn, small_bn or resnet18")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="images per optimizer step")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", action="store_true", help="bf16 autocast on CPU and bf16 GPUs, fp16 + GradScaler on older GPUs")
    p.add_argument("--ckpt", default=None, help="checkpoint file: resume from it, save to it")
    p.add_argument("--ckpt-every", type=int, default=0, help="optimizer steps (0: each epoch)")
    p.add_argument("--out", default=None, help="where to write the final weights")
    return p.parse_args(argv)


def evaluate(model, test_set, device):
    """Summed loss, number correct and number of images over the whole test set."""
    loader = DataLoader(test_set, batch_size=256)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    model.eval()
    with torch.no_grad():
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            out = model(X)
            sums[0] += F.cross_entropy(out.float(), y, reduction="sum").item()
            sums[1] += (out.argmax(1) == y).sum().item()
            sums[2] += len(y)
    model.train()
    return sums


def main(argv=None) -> None:
    args = parse_args(argv)
    is_main = True  # (in train_ddp.py: rank 0 only)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    ds = data.load(args.data, n_train=args.n_train, n_test=args.n_test, seed=args.seed)
    train_set = data.to_torch(ds.x_train, ds.y_train)
    test_set = data.to_torch(ds.x_test, ds.y_test)
    # Each epoch's permutation comes from a generator seeded with seed + epoch.
    generator = torch.Generator()
    sampler = RandomSampler(train_set, generator=generator)
    loader = DataLoader(train_set, batch_size=args.batch // args.accum, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader) // args.accum
    if steps_per_epoch == 0:
        raise ValueError(f"{args.n_train} images cannot make one batch of "
                         f"{args.batch}")

    torch.manual_seed(args.seed)  # the initial weights
    model = build_model(args.model, ds.num_classes, width=args.width).to(device)
    raw_model = model  # (in train_ddp.py: the plain model inside DDP)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # --amp: bfloat16 (float32's range, no scaler) on CPU and on GPUs with native bf16 (compute
    # capability 8.0 on); float16, whose gradients need a GradScaler, on older GPUs.
    fp16 = device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False)
    amp_dtype = torch.float16 if fp16 else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp and fp16)

    step = 0
    state = load_checkpoint(args.ckpt, map_location=device) if args.ckpt else None
    if state is not None:
        raw_model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        step = state["step"]
        if is_main:
            print(f"resumed from step {step}", flush=True)

    model.train()
    for epoch in range(step // steps_per_epoch, args.epochs):
        generator.manual_seed(args.seed + epoch)  # a new permutation each epoch
        done_in_epoch = step - epoch * steps_per_epoch  # > 0 only right after a resume
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, micro-batches
        for i, (X, y) in enumerate(loader):
            if i // args.accum < done_in_epoch:
                continue  # already trained on before the checkpoint
            if i >= steps_per_epoch * args.accum:
                break
            X, y = X.to(device), y.to(device)
            last_micro = (i + 1) % args.accum == 0
            with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
                loss = F.cross_entropy(model(X), y) / args.accum
            scaler.scale(loss).backward()
            sums[0] += loss.item() * args.accum
            sums[1] += 1
            if not last_micro:
                continue
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            step += 1
            if args.ckpt and is_main and step % (args.ckpt_every or steps_per_epoch) == 0:
                save_checkpoint(args.ckpt, {"model": raw_model.state_dict(),
                                            "optimizer": opt.state_dict(),
                                            "scaler": scaler.state_dict(), "step": step})
        test = evaluate(raw_model, test_set, device)
        if is_main:
            print(f"epoch {epoch}: mean loss {sums[0] / max(sums[1], 1):.4f}, test accuracy "
                  f"{int(test[1])}/{int(test[2])}, test loss {test[0] / test[2]:.4f}", flush=True)

    if is_main and args.out:
        weights = raw_model.state_dict()
        save_checkpoint(args.out, {"model": weights, "step": step, "test": test.tolist()})
        print(f"final weights {state_checksum(weights)} after {step} steps", flush=True)


if __name__ == "__main__":
    main()
