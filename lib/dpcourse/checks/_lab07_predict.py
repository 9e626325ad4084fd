"""Lab 07's predict-then-measure cell: when does the bucket that fills first go on the wire?

Part 2's check model at its first cap (0.002 MiB, 4 buckets): the backward reaches ``out``
(bucket 1) before ``hidden`` (bucket 0), so bucket 1 is complete after the 2nd gradient but may
go only after bucket 0, complete at the 4th. The question is how many gradients have arrived
when bucket 1's all-reduce is launched: "as soon as it is full" (the lesson's class) says 2,
the in-order launch says 4. The measurement runs the learner's own class with a hook
registered before theirs that counts arrivals, and notes the count at every all-reduce.
Re-exported by :mod:`dpcourse.checks.lab07`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import check_timeout, fail, run_ranks
from ._lab07_bench import CONFIGS, DEFAULT_TIMEOUT, _check_net
from ._lab07_buckets import MiB, _greedy, _nth

PREDICTION_CAP_MB = CONFIGS[0][1]
PREDICTION_BUCKET = 1
PREDICTION_QUESTION = (f"gradients arrived when bucket {PREDICTION_BUCKET}'s all-reduce is "
                       f"launched (part 2's model, {PREDICTION_CAP_MB} MiB)")


def _prediction_buckets(cap_mb: float = PREDICTION_CAP_MB) -> tuple[list, list]:
    """The check model's trainable parameter names and DDP's buckets of them (indices)."""
    model = _check_net()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for _, p in named]
    return [n for n, _ in named], _greedy(sizes, cap_mb * MiB, list(range(len(named) - 1, -1, -1)))


def show_prediction_model(cap_mb: float = PREDICTION_CAP_MB) -> None:
    """Print part 2's check model: its parameters in registration order, its forward, and the
    buckets DDP's rule makes of it at ``cap_mb``."""
    model = _check_net()
    print(f"bucket_cap_mb = {cap_mb} MiB = {cap_mb * MiB:,.0f} bytes")
    print(f"{'parameter':<16} {'shape':<10} {'bytes':>7}  trainable")
    for name, p in model.named_parameters():
        shape = "×".join(map(str, p.shape))
        print(f"{name:<16} {shape:<10} {p.numel() * p.element_size():>7,}  "
              f"{'yes' if p.requires_grad else 'no (frozen)'}")
    print("forward: out(relu(hidden(conv(x).flatten(1))) * scale)")
    names, buckets = _prediction_buckets(cap_mb)
    for i, b in enumerate(buckets):
        print(f"bucket {i}: {', '.join(names[j] for j in b)}")


def _launch_worker(rank: int, world_size: int, cls, cap_mb: float) -> dict:
    __tracebackhide__ = True
    import torch.distributed as dist  # noqa: F401  (the learner's class uses it)

    from ..collectives import record_collectives

    module = _check_net()
    names = {id(p): n for n, p in module.named_parameters()}
    arrived: list[str] = []

    def spy_ready(p):  # registered before the learner's hooks, so it runs first
        arrived.append(names[id(p)])

    for p in module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(spy_ready)
    launches: list[tuple[int, int]] = []

    def before(call):
        if call.function == "all_reduce":
            launches.append((len(arrived), call.args["tensor"].numel()))

    model = cls(module, bucket_cap_mb=cap_mb)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    module.zero_grad(set_to_none=True)
    with record_collectives(before=before):
        F.cross_entropy(model(x), y).backward()
        model.finish_gradient_synchronization()
    return {"arrived": arrived, "launches": launches}


def measure_launches(cls, cap_mb: float = PREDICTION_CAP_MB, timeout: float | None = None) -> dict:
    """Run ``cls`` (your BucketedDDP) on 2 ranks for one step of part 2's check model and
    return rank 0's record: the parameters in the order their gradients arrived, and for every
    all-reduce (in launch order) how many gradients had arrived and how many elements it
    carried."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    per_rank = run_ranks(_launch_worker, 2, cls, cap_mb, timeout=timeout,
                         hang="every rank must launch the same all-reduces in the same order, "
                              "and every launched all-reduce must be waited on.")
    return per_rank[0]


def check_prediction(guess, measured: dict, cap_mb: float = PREDICTION_CAP_MB) -> None:
    """Compare the learner's prediction with the arrivals counted when bucket 1 was launched,
    and say when each bucket was complete and when it went."""
    __tracebackhide__ = True
    from . import reveal

    names, buckets = _prediction_buckets(cap_mb)
    model = _check_net()
    numel = dict((n, p.numel()) for n, p in model.named_parameters())
    sizes = [sum(numel[names[j]] for j in b) for b in buckets]
    order = measured["arrived"]
    complete = [max(order.index(names[j]) + 1 for j in b) for b in buckets]
    launched = [None] * len(buckets)
    for count, n in measured["launches"]:
        i = sizes.index(n) if n in sizes else None
        if i is not None and launched[i] is None:
            launched[i] = count
    k = PREDICTION_BUCKET
    value = launched[k]
    if value is None:
        fail(f"your wrapper launched no all-reduce of bucket {k}'s {sizes[k]} elements in this "
             f"step (its all-reduces carried {[n for _, n in measured['launches']]} elements): "
             f"there is nothing to compare your prediction with.",
             fix="make part 2's check pass first, then run the measurement again.")
    story = "; ".join(f"bucket {i}: complete after the {_nth(c)}, launched after the "
                      f"{_nth(l) if l is not None else '(never)'}"
                      for i, (c, l) in enumerate(zip(complete, launched)))
    waited = value - complete[k]
    why = (f"The backward reaches `out` first, so bucket {k} was "
           f"complete after the {_nth(complete[k])} gradient, while bucket 0 (`hidden`) was "
           f"complete only after the {_nth(complete[0])}. ")
    if value == complete[0] and waited > 0:
        why += (f"So bucket {k} waited {waited} more gradient(s): every rank must issue bucket "
                f"0's all-reduce first, so bucket {k} goes in the same hook call that "
                f"completes bucket 0, right after it. ")
    elif value < complete[0]:
        why += (f"Your wrapper launched bucket {k} the moment it was full, before bucket 0: "
                f"that is the lesson's class, not part 2's in-order launch. ")
    else:
        why += (f"In order, bucket {k} could have gone right after bucket 0, after the "
                f"{_nth(complete[0])} gradient; your wrapper sent it only after the "
                f"{_nth(value)}. ")
    reveal(guess, value, close=guess.value == value,
           explanation=why + f"Gradients counted on rank 0: {story}.")
