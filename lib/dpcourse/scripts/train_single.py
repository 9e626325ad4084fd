"""Train a small CNN on one device: the script that lesson 04 turns into train_ddp.py.

It is the single-device twin of train_ddp.py: the same data, model, optimizer, checkpoints,
gradient accumulation and mixed precision; ``diff train_single.py train_ddp.py`` shows exactly
what data parallelism adds. Run it (from the repository root, with ``lib`` on PYTHONPATH or the
course installed):

    python lib/dpcourse/scripts/train_single.py --epochs 3 --batch 64 --out final.pt
    # resume from (and save to) a checkpoint
    python lib/dpcourse/scripts/train_single.py --ckpt ckpt.pt --ckpt-every 8 --out final.pt

``--batch`` is the batch of one optimizer step; with ``--accum k`` it is made of k
micro-batches of ``--batch / k``. With the same seed, ``train_ddp.py`` on N ranks with
``--per-rank-batch B/N`` ends with the same weights as this script with ``--batch B``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler

from dpcourse import data, devices
from dpcourse.ddp_practice import build_model, load_checkpoint, save_checkpoint, state_checksum


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="shapes10")
    p.add_argument("--n-train", type=int, default=1024)
    p.add_argument("--model", default="small_cnn", help="small_cnn, small_bn or resnet18")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="images per optimizer step")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", action="store_true", help="bf16 autocast on CPU, fp16 + GradScaler on CUDA")
    p.add_argument("--ckpt", default=None, help="checkpoint file: resume from it, save to it")
    p.add_argument("--ckpt-every", type=int, default=0, help="optimizer steps (0: each epoch)")
    p.add_argument("--out", default=None, help="where to write the final weights")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(devices.choose_profile().device)
    if args.batch % args.accum:
        raise ValueError(f"--batch {args.batch} does not split into {args.accum} micro-batches")

    devices.seed_everything(args.seed)
    ds = data.load(args.data, n_train=args.n_train, n_test=10, seed=args.seed)
    train_set = data.to_torch(ds.x_train, ds.y_train)
    # Shuffle with a generator re-seeded with seed + epoch: every run sees the same orders.
    generator = torch.Generator()
    sampler = RandomSampler(train_set, generator=generator)
    loader = DataLoader(train_set, batch_size=args.batch // args.accum, sampler=sampler,
                        drop_last=True)
    steps_per_epoch = len(loader) // args.accum
    if steps_per_epoch == 0:
        raise ValueError(f"{args.n_train} images cannot make one batch of {args.batch}")

    torch.manual_seed(args.seed)  # the initial weights
    model = build_model(args.model, ds.num_classes, width=args.width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    use_scaler = args.amp and device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=use_scaler)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

    step = 0
    state = load_checkpoint(args.ckpt, map_location=device) if args.ckpt else None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        step = state["step"]
        print(f"resumed from step {step}", flush=True)

    model.train()
    for epoch in range(step // steps_per_epoch, args.epochs):
        generator.manual_seed(args.seed + epoch)
        done_in_epoch = step - epoch * steps_per_epoch  # > 0 only right after a resume
        total, count = 0.0, 0
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
            total += loss.item() * args.accum
            count += 1
            if not last_micro:
                continue
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            step += 1
            if args.ckpt and (
                    (args.ckpt_every and step % args.ckpt_every == 0)
                    or (not args.ckpt_every and step % steps_per_epoch == 0)):
                save_checkpoint(args.ckpt, {"model": model.state_dict(),
                                            "optimizer": opt.state_dict(),
                                            "scaler": scaler.state_dict(), "step": step})
        print(f"epoch {epoch}: mean loss {total / max(count, 1):.4f}", flush=True)

    if args.out:
        weights = model.state_dict()
        save_checkpoint(args.out, {"model": weights, "step": step})
        print(f"final weights {state_checksum(weights)} after {step} steps", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
