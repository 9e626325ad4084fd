r"""Train a small CNN: lesson 04's script. train_single.py runs it on one device, train_ddp.py
with DistributedDataParallel (DDP) on many. Every line that differs between the two files is a
line that data parallelism needs, except the crash hook (--fail-at-step, --fail-rank, os.kill)
that lesson 04 uses to play a fault: lesson 04 prints that diff whole.

Run it from the repository root (with the course installed: pip install -e .):

    torchrun --nproc-per-node=2 lib/dpcourse/scripts/train_ddp.py --epochs 3 --out final.pt
    # survive a crash: restart all ranks (up to 3 times), each resuming from the last checkpoint
    torchrun --nproc-per-node=2 --max-restarts=3 lib/dpcourse/scripts/train_ddp.py \
        --ckpt ckpt.pt --ckpt-every 8 --out final.pt
    # two machines: the same command on both; HOST is the first machine's address
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --rdzv-id=job1 lib/dpcourse/scripts/train_ddp.py --out final.pt

One optimizer step sees --per-rank-batch x WORLD_SIZE x --accum images (the global batch). DDP
averages the ranks' gradients, so with the same --lr this run equals train_single.py with --batch
set to the global batch (to float rounding). Every rank runs this whole file. torchrun's agent
(one per machine: it starts the workers, watches them, restarts them all when one dies) tells
each worker who it is in environment variables. A GPU machine gives each rank its own GPU (nccl);
else the ranks share the CPU (gloo). --fail-at-step plays a crash: a rank kills itself there.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from dpcourse import data
from dpcourse.ddp_practice import (build_model, convert_sync_batchnorm, load_checkpoint,
                                   save_checkpoint, state_checksum)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="shapes10")
    p.add_argument("--n-train", type=int, default=1024)
    p.add_argument("--n-test", type=int, default=201, help="images to evaluate on")
    p.add_argument("--model", default="small_cnn", help="small_cnn, small_bn or resnet18")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--per-rank-batch", type=int, default=32, help="images per rank per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", action="store_true", help="bf16 autocast on CPU and bf16 GPUs, fp16 + GradScaler on older GPUs")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over the global batch")
    p.add_argument("--ckpt", default=None, help="checkpoint file: resume from it, save to it")
    p.add_argument("--ckpt-every", type=int, default=0, help="optimizer steps (0: each epoch)")
    p.add_argument("--out", default=None, help="where to write the final weights")
    p.add_argument("--fail-at-step", type=int, default=-1, help="test hook: die after this step")
    p.add_argument("--fail-rank", type=int, default=1)
    return p.parse_args(argv)


def evaluate(model, test_set, device, rank, world_size):
    """Summed loss, number correct and number of images over the WHOLE test set, on every rank."""
    # Rank r takes images r, r + world_size, ...: each image exactly once, shards of unequal
    # length. Not DistributedSampler: it pads the shards to equal length with repeated images.
    loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=256)
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
    dist.all_reduce(sums)  # add the ranks' sums and counts (a mean of means would be wrong)
    return sums


def store_for_this_attempt():
    """The c10d store (the key-value server ranks meet in), with keys private to this attempt.

    After a crash torchrun restarts every worker, and they meet again in the rendezvous's store,
    which c10d reuses across restarts (unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): it still
    holds the dead attempt's keys (peers' addresses). A prefix per attempt keeps them apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # not under torchrun's agent: init_process_group makes its own store
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                is_master=False)
    return dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", agent_store)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("train_ddp.py reads its rank from torchrun: torchrun --nproc-per-node=2 " + sys.argv[0])
    rank = int(os.environ["RANK"])  # 0 .. WORLD_SIZE-1 over all machines
    local_rank = int(os.environ["LOCAL_RANK"])  # 0 .. LOCAL_WORLD_SIZE-1 on this machine
    world_size = int(os.environ["WORLD_SIZE"])
    is_main = rank == 0  # the one rank that prints and writes files
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        backend, device = "nccl", torch.device("cuda", local_rank)  # one GPU per rank
        torch.cuda.set_device(device)  # else every rank's NCCL and .cuda() would use GPU 0
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            store=store_for_this_attempt())
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # > 0 after a restart

    ds = data.load(args.data, n_train=args.n_train, n_test=args.n_test, seed=args.seed)
    train_set = data.to_torch(ds.x_train, ds.y_train)
    test_set = data.to_torch(ds.x_test, ds.y_test)
    # Each rank reads its own shard of each epoch's permutation (seeded with seed + epoch).
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed,
                                 drop_last=True)
    loader = DataLoader(train_set, batch_size=args.per_rank_batch, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader) // args.accum
    if steps_per_epoch == 0:
        raise ValueError(f"{args.n_train} images cannot make one batch of "
                         f"{args.per_rank_batch * world_size * args.accum}")

    torch.manual_seed(args.seed)  # the initial weights (DDP copies rank 0's to all ranks anyway)
    model = build_model(args.model, ds.num_classes, width=args.width).to(device)
    if args.sync_bn:
        model = convert_sync_batchnorm(model, device)
    model = DDP(model, device_ids=[local_rank] if backend == "nccl" else None)
    raw_model = model.module  # the plain model inside: what we save, load and evaluate
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # --amp: bfloat16 (float32's range, no scaler) on CPU and on GPUs with native bf16 (compute
    # capability 8.0 on); float16, whose gradients need a GradScaler, on older GPUs.
    fp16 = device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False)
    amp_dtype = torch.float16 if fp16 else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp and fp16)

    if is_main:
        print(f"{world_size} ranks over {backend}, global batch "
              f"{args.per_rank_batch * world_size * args.accum}", flush=True)
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
        sampler.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
        done_in_epoch = step - epoch * steps_per_epoch  # > 0 only right after a resume
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, micro-batches
        for i, (X, y) in enumerate(loader):
            if i // args.accum < done_in_epoch:
                continue  # already trained on before the checkpoint
            if i >= steps_per_epoch * args.accum:
                break
            X, y = X.to(device), y.to(device)
            last_micro = (i + 1) % args.accum == 0
            # no_sync: no all-reduce on the first accum-1 micro-batches, their gradients add up
            # here, and the last backward all-reduces the sum.
            with model.no_sync() if not last_micro else nullcontext():
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
            if step == args.fail_at_step and rank == args.fail_rank and attempt == 0:
                print(f"rank {rank}: simulated fault at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(sums)  # the loss of every rank's batches, not rank 0's alone
        # Buffers (BatchNorm's statistics) get no all-reduce: evaluate rank 0's, those we save.
        for buffer in raw_model.buffers():
            dist.broadcast(buffer, src=0)
        test = evaluate(raw_model, test_set, device, rank, world_size)
        if is_main:
            print(f"epoch {epoch}: mean loss {sums[0] / max(sums[1], 1):.4f}, test accuracy "
                  f"{int(test[1])}/{int(test[2])}, test loss {test[0] / test[2]:.4f}", flush=True)

    if is_main and args.out:
        weights = raw_model.state_dict()
        save_checkpoint(args.out, {"model": weights, "step": step, "test": test.tolist()})
        print(f"final weights {state_checksum(weights)} after {step} steps", flush=True)
    dist.barrier()  # nobody leaves while another rank may still need it
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # A rank whose peer died gets an error ("Connection reset by peer"). Leave at once: a
        # normal exit can hang in gloo's threads, and torchrun would wait 30 s before a restart.
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # os._exit skips the interpreter's shutdown, where gloo threads kept alive by DDP now and
    # then abort a finished process (SIGABRT), which torchrun would count as a failure.
    sys.stdout.flush()
    os._exit(0)
