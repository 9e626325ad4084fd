"""Train a small CNN with DistributedDataParallel: the torchrun script of lesson 04.

Every rank runs this whole file; torchrun tells each which one it is through environment
variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). It is train_single.py
with the distributed parts added - compare the two with ``diff``; nothing else differs.

Run it (from the repository root, with ``lib`` on PYTHONPATH or the course installed):

    # one machine, 2 processes
    torchrun --nproc-per-node=2 lib/dpcourse/scripts/train_ddp.py --epochs 3 --out final.pt
    # restart up to 3 times after a failure, resuming from the last checkpoint
    torchrun --nproc-per-node=2 --max-restarts=3 lib/dpcourse/scripts/train_ddp.py \\
        --ckpt ckpt.pt --ckpt-every 8 --out final.pt
    # two machines (run on both; HOST is the first machine's address)
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=job1 lib/dpcourse/scripts/train_ddp.py --out final.pt
    # without torchrun it runs as a single process (world size 1)
    python lib/dpcourse/scripts/train_ddp.py --out final.pt

The global batch is ``--per-rank-batch`` × WORLD_SIZE × ``--accum``; DDP averages gradients
over ranks, so the learning rate is that of one process on the global batch. ``--fail-at-step``
is a test hook: one rank kills itself there (only on the first attempt) to simulate a fault.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from dpcourse import data, devices
from dpcourse.ddp_practice import (build_model, convert_sync_batchnorm, load_checkpoint,
                                   save_checkpoint, state_checksum)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="shapes10")
    p.add_argument("--n-train", type=int, default=1024)
    p.add_argument("--model", default="small_cnn", help="small_cnn, small_bn or resnet18")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--per-rank-batch", type=int, default=32)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", action="store_true", help="bf16 autocast on CPU, fp16 + GradScaler on CUDA")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over the global batch")
    p.add_argument("--ckpt", default=None, help="checkpoint file: resume from it, save to it")
    p.add_argument("--ckpt-every", type=int, default=0, help="optimizer steps (0: each epoch)")
    p.add_argument("--out", default=None, help="where rank 0 writes the final weights")
    p.add_argument("--fail-at-step", type=int, default=-1, help="test hook: die after this step")
    p.add_argument("--fail-rank", type=int, default=1)
    return p.parse_args(argv)


def _store_for_attempt(attempt: int):
    """The rendezvous store, with keys private to this attempt (None: the default env://).

    After a restart, torchrun's workers meet again in the agent's store, which still holds the
    previous attempt's addresses; with torch 2.14 a restarted rank can read a dead peer's
    address there and fail with "Gloo connectFullMesh failed ... Connection refused". A prefix
    per attempt keeps the attempts apart (see pytorch/pytorch#167288).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    return dist.PrefixStore(f"dpcourse/attempt_{attempt}", store)


def main(argv=None) -> None:
    args = parse_args(argv)
    # --- distributed: who am I? (torchrun sets these; without torchrun we are alone) ---
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    is_main = rank == 0  # the one rank that logs and writes files
    backend = devices.backend_for(local_world_size)  # nccl only if every local rank owns a GPU
    if "MASTER_ADDR" not in os.environ:  # plain `python train_ddp.py`
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # > 0 after a restart
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            store=_store_for_attempt(attempt))
    device = devices.device_for_rank(local_rank, backend)
    # --- end distributed setup ---

    devices.seed_everything(args.seed)
    ds = data.load(args.data, n_train=args.n_train, n_test=10, seed=args.seed)
    train_set = data.to_torch(ds.x_train, ds.y_train)
    # Each rank reads its own shard of every epoch's permutation (seeded by seed + epoch).
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.per_rank_batch, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader) // args.accum
    if steps_per_epoch == 0:
        raise ValueError(f"{args.n_train} images cannot make one global batch of "
                         f"{args.per_rank_batch * world_size * args.accum}")

    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = build_model(args.model, ds.num_classes, width=args.width).to(device)
    if args.sync_bn:
        model = convert_sync_batchnorm(model, device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    use_scaler = args.amp and device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=use_scaler)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

    if is_main:
        print(f"{world_size} ranks over {backend}, global batch "
              f"{args.per_rank_batch * world_size * args.accum}", flush=True)
    step = 0
    state = load_checkpoint(args.ckpt, map_location=device) if args.ckpt else None
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        step = state["step"]
        if is_main:
            print(f"resumed from step {step}", flush=True)

    model.train()
    for epoch in range(step // steps_per_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
        done_in_epoch = step - epoch * steps_per_epoch  # > 0 only right after a resume
        total, count = 0.0, 0
        for i, (X, y) in enumerate(loader):
            if i // args.accum < done_in_epoch:
                continue  # already trained on before the checkpoint
            if i >= steps_per_epoch * args.accum:
                break
            X, y = X.to(device), y.to(device)
            last_micro = (i + 1) % args.accum == 0
            # no_sync: no all_reduce on the first accum-1 micro-batches; the gradients add up
            # locally and the last backward all-reduces their sum.
            with model.no_sync() if not last_micro else nullcontext():
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
            if args.ckpt and is_main and (
                    (args.ckpt_every and step % args.ckpt_every == 0)
                    or (not args.ckpt_every and step % steps_per_epoch == 0)):
                save_checkpoint(args.ckpt, {"model": model.module.state_dict(),
                                            "optimizer": opt.state_dict(),
                                            "scaler": scaler.state_dict(), "step": step})
            if step == args.fail_at_step and rank == args.fail_rank and attempt == 0:
                print(f"rank {rank}: simulated fault at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        if is_main:
            print(f"epoch {epoch}: mean loss {total / max(count, 1):.4f}", flush=True)

    if is_main and args.out:
        weights = model.module.state_dict()
        save_checkpoint(args.out, {"model": weights, "step": step})
        print(f"final weights {state_checksum(weights)} after {step} steps", flush=True)
    # --- distributed: end cleanly ---
    dist.barrier()  # nobody leaves while another rank still needs it
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit skips interpreter shutdown, where gloo threads kept alive by DDP sometimes abort
    # an already finished process (SIGABRT) - which torchrun would count as a failure.
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # A rank whose peer died gets an error here ("Connection reset by peer"). Leave at once:
        # a normal exit can hang in gloo's threads, and torchrun would wait 30 s for it before
        # it restarts the group.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
