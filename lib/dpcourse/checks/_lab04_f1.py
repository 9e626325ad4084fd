"""Lab 04 part 1, judged: ``evaluate_f1`` taken out of the learner's script and run on 2 and 3
ranks over test sets their ranks do not divide, with a model that counts what each rank
evaluates and a spy on what it hands to its collectives; then one sentence naming the mistake
(which images each rank evaluated, what the ranks exchanged, how many numbers, in which dtype,
and what the returned number is). :mod:`dpcourse.checks.lab04`'s docstring lists every mistake;
its names are importable from there.
"""

from __future__ import annotations

import functools
from pathlib import Path

from dpcourse.checks import check_timeout, fail, recorded, run_ranks
from dpcourse.checks._lab04_script import _mistake


# --- the lab: macro-F1 over a test set split across the ranks --------------------------------

# (world size, test images): 301 on 2 ranks and 302 on 3 ranks split unevenly, so
# DistributedSampler pads both with a repeated image; large enough that every class is right
# on every rank, so the ranks' precisions and recalls averaged differ from their F1 averaged.
F1_RUNS = ((2, 301), (3, 302))
NUM_CLASSES = 10  # shapes10's classes, the script's NUM_CLASSES
_F1_TOL = 1e-6  # float32 arithmetic in an answer is fine; every mistake is 1e-3 or more away

F1_MISTAKES = {  # the cause; what to change is in F1_FIXES (shown on the second meeting)
    "mean_of_f1": "The ranks' F1 scores were averaged: F1 is a ratio of counts, not a mean over "
                  "images, so the mean of the shards' F1 is not the F1 of the whole set.",
    "sum_of_f1": "The ranks' F1 scores were added up (an all_reduce of the F1 itself): that is "
                 "world_size times a mean of the shards' F1, not the F1 of the whole set.",
    "mean_of_pr": "The ranks' precisions and recalls were averaged: each is a fraction over a "
                  "different number of images on each rank (the images it predicted as the "
                  "class, the images truly of it), so the mean of the ranks' fractions is not "
                  "the whole set's.",
    "accuracy": "That number is the accuracy, not the macro-F1 that macro_f1 defines (the mean "
                "over the 10 classes of each class's F1).",
    "precision_only": "That number is the mean over the classes of each class's precision (its "
                      "true positives over the images predicted as it), not of its F1: the "
                      "counts you exchanged say nothing of the images truly of each class, "
                      "which its recall is made of.",
    "recall_only": "That number is the mean over the classes of each class's recall (its true "
                   "positives over the images truly of it: the balanced accuracy), not of its "
                   "F1: the counts you exchanged say nothing of the images predicted as each "
                   "class, which its precision is made of.",
}
F1_FIXES = {
    "mean_of_f1": "Add up over the ranks the counts that F1 is made of, then compute F1 once "
                  "from the sums.",
    "sum_of_f1": "Add up the counts that F1 is made of instead, then compute F1 once.",
    "mean_of_pr": "Add up over the ranks what each fraction is made of, then compute precision, "
                  "recall and F1 once.",
    "accuracy": "Compute each class's F1 from the whole test set's counts and average them.",
    "precision_only": "F1 = 2PR/(P + R) needs both fractions: exchange per-class counts from "
                      "which precision and recall both follow (two per class are enough).",
    "recall_only": "F1 = 2PR/(P + R) needs both fractions: exchange per-class counts from which "
                   "precision and recall both follow (two per class are enough).",
}

# What a rank may send must not grow with the test set: the check calls evaluate_f1 a second
# time on a test set this many times larger and compares the bytes (pickled objects may vary
# by a few bytes with the values they hold, e.g. a larger int).
_GROWTH = 4
_GROWTH_SLACK = 64

def _f1_of(confusion) -> float:
    """macro-F1 of a confusion matrix, as the lab's given macro_f1 computes it."""
    import torch

    confusion = confusion.double()
    tp = confusion.diagonal()
    den = 2 * tp + (confusion.sum(0) - tp) + (confusion.sum(1) - tp)
    f1 = torch.where(den > 0, 2 * tp / den.clamp(min=1), torch.zeros_like(tp))
    return float(f1.mean())


def _f1_model(seed: int = 0):
    """A small fixed CNN whose predictions spread over the 10 classes (all F1 variants differ)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 5, stride=4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 7 * 7, 10))


@functools.lru_cache(maxsize=4)
def _f1_data(n_test: int):
    from dpcourse import data

    ds = data.load("shapes10", n_train=10, n_test=n_test, seed=7)
    return data.to_torch(ds.x_test, ds.y_test).tensors


def _namespace(source: str, filename: str = "train_lab.py") -> dict:
    """The imports, constants and functions of the learner's script, without running its main
    part (everything under ``if __name__ == "__main__":`` and other statements are left out)."""
    import ast

    tree = ast.parse(source, filename)
    keep = [node for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef,
                                 ast.Assign, ast.AnnAssign))]
    ns: dict = {"__name__": "train_lab"}
    exec(compile(ast.Module(body=keep, type_ignores=[]), filename, "exec"), ns)
    return ns


def _f1_sets(n_test: int) -> dict:
    """The test sets a rank evaluates (``n_test`` images, and ``_GROWTH`` times as many), made
    once in the check's process and handed to the ranks: each rank making them again cost more
    than the evaluation (1,500 images on each of 3 ranks)."""
    return {n: _f1_data(n) for n in (n_test, _GROWTH * n_test)}


def _f1_worker(rank, world_size, source, n_test, sets=None):
    """One rank: the learner's evaluate_f1 on its share, with a model that counts its inputs and
    sees whether it runs in training mode or under autograd; then once more on a test set
    _GROWTH times larger, to measure whether what the rank sends grows with the test set."""
    import torch
    from torch.utils.data import TensorDataset

    from dpcourse.checks._lab04_exchange import ExchangeSpy, WhereTensorsLive, mark
    from dpcourse.collectives import record_collectives

    torch.set_num_threads(1)
    model = _f1_model()
    seen = {"images": 0, "training": False, "grad": False, "indices": []}
    sets = sets or _f1_sets(n_test)
    X0, _ = sets[n_test]
    index_of = {x.numpy().tobytes(): i for i, x in enumerate(X0)}  # which image the model saw

    def count(module, inputs, output):
        batch = inputs[0]
        seen["images"] += int(batch.shape[0])
        seen["training"] |= module.training
        seen["grad"] |= torch.is_grad_enabled()
        if seen["indices"] is not None:
            try:
                found = [index_of.get(x.detach().cpu().float().numpy().tobytes())
                         for x in batch]
            except Exception:  # an input the check cannot read back: count images only
                found = [None]
            seen["indices"] = None if None in found else seen["indices"] + found

    model.register_forward_hook(count)
    # the CPU, but not "cpu": a tensor made with device="cpu" is then told from one on `device`
    # (_lab04_exchange), as on GPUs where `device` is cuda:r
    device = torch.device("cpu", 0)
    for t in [*model.parameters(), *model.buffers()]:
        mark(t, True)  # the model lives on `device`, as the script puts it there
    sent = []
    spy = ExchangeSpy(rank)
    # The learner's module is built inside the recording, so even a name imported from
    # torch.distributed (from torch.distributed import all_reduce) is the recorded one.
    with record_collectives(before=spy.before) as calls:
        ns = _namespace(source)
        for n in (n_test, _GROWTH * n_test):
            X, y = sets[n]
            before = len(calls)
            with WhereTensorsLive(device):
                value = ns["evaluate_f1"](model, TensorDataset(X, y), rank, world_size, device)
            sent.append(sum(c.nbytes for c in calls[before:]))
            if n == n_test:
                first, first_seen = value, dict(seen)
                exchange = {"numbers": spy.numbers, "off_device": spy.off_device,
                            "off_named": spy.off_named,
                            "averaged": spy.averaged, "to_one": list(spy.to_one),
                            "narrow": spy.narrow,
                            "collectives": len(calls) - before}
                seen["indices"] = None  # the larger set's images are not looked up
    value = first
    if torch.is_tensor(value):
        return {"error": _TENSOR_RETURNED.format(shape=tuple(value.shape), dtype=value.dtype),
                "fix": _TENSOR_FIX}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {"error": f"evaluate_f1 returned {type(value).__name__}, not a number (a float)"}
    return {"value": float(value), **first_seen, "sent": sent, **exchange}


def _f1_batch_worker(rank, world_size, sources, n_test, sets=None):
    """:func:`_f1_worker` for each of ``sources`` in turn, in one process group: each script's
    ``evaluate_f1`` gets a fresh counting model and spy, and the ranks' collectives pair up
    script by script, as in a launch of its own."""
    return [_f1_worker(rank, world_size, source, n_test, sets) for source in sources]


def f1_results(sources, world_size: int, n_test: int, timeout: float = 90.0) -> list:
    """What :func:`check_f1` judges for each script text in ``sources`` on ``world_size`` ranks
    and ``n_test`` test images, from ONE launch (the tests' batch of right and wrong answers:
    a launch costs more than the evaluation it runs): a list per script of the ranks' results,
    for :func:`judge_f1`. For scripts that finish on every rank; one that raises or deadlocks
    stops the batch (give it to :func:`check_f1`). ``timeout`` is per script."""
    __tracebackhide__ = True
    sources = list(sources)
    per_rank = run_ranks(
        _f1_batch_worker, world_size, sources, n_test, _f1_sets(n_test),
        timeout=timeout * max(1, len(sources)),
        hang=f"evaluate_f1 of one of {len(sources)} scripts did not finish on {world_size} ranks",
        failed=lambda exc: fail(f"evaluate_f1 of one of {len(sources)} scripts raised on rank "
                                f"{exc.rank} of {world_size}: {exc.summary}"))
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(sources))]


# A tensor is not the float the contract asks for, even a 0-d one that prints like a number:
# the script saves what evaluate_f1 returns, and on GPUs it is a CUDA tensor in the checkpoint.
_TENSOR_RETURNED = ("evaluate_f1 returned a tensor (shape {shape}, {dtype}), not a Python float: "
                    "the script puts what it returns into the checkpoint, and on GPUs that "
                    "tensor lives on the GPU, so the file holds a CUDA tensor where a number "
                    "belongs, one that a machine without a GPU cannot even load without "
                    "map_location")
_TENSOR_FIX = "turn the result into a Python number with float(...) (or .item()) before returning it."


def _f1_variants(n_test: int, world_size: int) -> dict:
    """One process's macro-F1 of the lab's test set, and the numbers each mistake gives."""
    import torch
    from torch.utils.data import DistributedSampler, TensorDataset

    X, y = _f1_data(n_test)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _f1_model().eval()
        with torch.no_grad():
            pred = model(X).argmax(1)
    finally:
        torch.set_num_threads(prev)

    def confusion(idx):
        idx = torch.as_tensor(list(idx), dtype=torch.long)
        return torch.bincount(y[idx] * 10 + pred[idx], minlength=100).view(10, 10)

    n, N = n_test, world_size
    shardings = {
        "strided": [range(r, n, N) for r in range(N)],
        "contiguous": [range(r * n // N, (r + 1) * n // N) for r in range(N)],
        "chunks": [range(r * -(-n // N), min(n, (r + 1) * -(-n // N))) for r in range(N)],
    }
    ds = TensorDataset(X, y)
    for shuffle in (True, False):
        shardings[f"sampler_{shuffle}"] = [
            list(DistributedSampler(ds, num_replicas=N, rank=r, shuffle=shuffle)) for r in range(N)]
    whole = confusion(range(n)).double()
    tp = whole.diagonal()
    out = {"correct": _f1_of(confusion(range(n))),
           "accuracy": float((pred == y).double().mean()),
           "precision_only": float((tp / whole.sum(0).clamp(min=1)).mean()),
           "recall_only": float((tp / whole.sum(1).clamp(min=1)).mean()),
           "mean_of_f1": [], "sum_of_f1": [], "mean_of_pr": [], "weighted_mean_of_f1": []}
    for shards in shardings.values():
        f1s = [_f1_of(confusion(s)) for s in shards]
        out["mean_of_f1"].append(sum(f1s) / N)
        sizes = [len(s) for s in shards]
        out["weighted_mean_of_f1"].append(sum(k * f for k, f in zip(sizes, f1s)) / sum(sizes))
        out.setdefault("shards", []).append(list(zip(f1s, sizes)))
        out["sum_of_f1"].append(sum(f1s))
        out["mean_of_pr"].append(_f1_of_mean_pr([confusion(s) for s in shards]))
    return out


def _f1_of_mean_pr(confusions) -> float:
    """macro-F1 from the ranks' per-class precision and recall averaged over the ranks (0 where
    a rank's fraction is undefined, as macro_f1 sets it)."""
    import torch

    def pr(c):
        c = c.double()
        tp = c.diagonal()
        return (torch.where(c.sum(0) > 0, tp / c.sum(0).clamp(min=1), 0.0),
                torch.where(c.sum(1) > 0, tp / c.sum(1).clamp(min=1), 0.0))

    fractions = [pr(c) for c in confusions]
    p = sum(f[0] for f in fractions) / len(fractions)
    r = sum(f[1] for f in fractions) / len(fractions)
    return float(torch.where(p + r > 0, 2 * p * r / (p + r).clamp(min=1e-300), 0.0).mean())


def _overcount(results: list, n_test: int, total: int) -> str:
    """The cause of more forwards than images, from the images each rank's model saw: the
    same image twice on one rank (a second pass over the share), or on two ranks (shares that
    overlap, e.g. DistributedSampler's padding); only the counts when the images are unknown."""
    from collections import Counter

    head = f"the ranks ran the model on {total} images for {n_test}"
    lists = [r.get("indices") for r in results]
    if any(idx is None for idx in lists):
        return head + ", so some images were counted more than once."
    per_rank = [Counter(idx) for idx in lists]
    for rank, c in enumerate(per_rank):
        again = sorted(i for i, k in c.items() if k > 1)
        if again:
            times = max(c.values())
            return (head + f": rank {rank} evaluated {len(again)} of its {len(c)} images more "
                           f"than once (up to {times} times; image {again[0]} among them), so "
                           f"its forwards counted them again: a second pass over the same "
                           f"share, not an overlap between ranks.")
    ranks_of = Counter(i for c in per_rank for i in c)
    shared = sorted(i for i, k in ranks_of.items() if k > 1)
    who = [r for r, c in enumerate(per_rank) if shared[0] in c]
    padding = len(shared) < len(results) and len({len(c) for c in per_rank}) == 1
    why = (": every share has the same length, which for a set that does not split evenly "
           "means repeated images (DistributedSampler pads the shares that way)"
           if padding else ": the ranks' shares overlap")
    return (head + f": {len(shared)} image(s) were evaluated on more than one rank (image "
                   f"{shared[0]} on ranks {who[0]} and {who[1]}){why}, so they were counted "
                   f"twice.")


def judge_f1(results: list, n_test: int) -> str:
    """The ✔'s note ("" or :data:`AVG_NOTE`) if every rank returned one process's macro-F1,
    each image evaluated once in eval mode without autograd, sending fewer than 3 numbers per
    class whatever the test set's size, in dtypes exact up to 10^5, from tensors on
    ``device``; else fail with the
    sentence that names the mistake."""
    __tracebackhide__ = True
    N = len(results)
    where = f"On {N} ranks with {n_test} test images: "
    for r in results:
        if "error" in r:
            fail(where + r["error"] + ".", fix=r.get("fix"))
    if any(r["training"] for r in results):
        fail(where + "the model ran in training mode, where dropout and BatchNorm behave "
                     "differently from test time.", fix="call model.eval() before evaluating.")
    if any(r.get("grad") for r in results):
        fail(where + "the model's forward ran with autograd on, so it built a graph and kept "
                     "every layer's activations for a backward that never comes.",
             fix="evaluate under torch.no_grad() (or torch.inference_mode()).")
    values = [r["value"] for r in results]
    if max(values) - min(values) > _F1_TOL:
        _judge_different(results, values, n_test, where)
    images = [r["images"] for r in results]
    total = sum(images)
    if all(i == n_test for i in images) and N > 1:
        fail(where + f"every rank evaluated all {n_test} images: the work was not split.",
             fix="give each rank only its share of the images and combine what the ranks "
                 "counted.")
    idle = [r for r, i in enumerate(images) if i == 0]
    if idle and N > 1 and n_test >= N:
        busy = ", ".join(f"rank {r} {i}" for r, i in enumerate(images) if i)
        fail(where + f"rank {idle[0]} ran the model on no image ({busy} of the {n_test}): the "
                     f"contract has each rank evaluate its own share, so the job takes as long "
                     f"as one process and the idle rank's accelerator waits.",
             fix="give every rank a share of the test set (about len(test_set) / world_size "
                 "images each) and combine what the ranks counted.")
    if total > n_test:
        fail(where + _overcount(results, n_test, total),
             fix="split the indices yourself so that each image is on exactly one rank (the "
                 "shares may differ by one), and run the model once per image.")
    if total < n_test:
        fail(where + f"the ranks evaluated only {total} of the {n_test} images: the rest never "
                     f"reached the metric.",
             fix="count every image once (no drop_last, and the remainder goes to some "
                 "rank).")
    sent = [r.get("sent", [0, 0]) for r in results]
    grown = [s for s in sent if s[1] > s[0] + _GROWTH_SLACK]
    if grown:
        small, big = grown[0]
        fail(where + f"what a rank sends grows with the test set ({small} bytes for {n_test} "
                     f"images, {big} for {_GROWTH * n_test}): the labels or predictions "
                     f"themselves travel between the ranks.",
             fix="exchange a summary whose size does not depend on the number of images, from "
                 "which the macro-F1 follows.")
    _judge_budget(results, where)
    want = _f1_variants(n_test, N)
    got = values[0]
    if abs(got - want["correct"]) > _F1_TOL:
        for name in ("mean_of_f1", "sum_of_f1", "mean_of_pr"):
            if any(abs(got - v) <= _F1_TOL for v in want[name]):
                _mistake(F1_MISTAKES, F1_FIXES, name, where)
        weighted = [i for i, v in enumerate(want["weighted_mean_of_f1"])
                    if abs(got - v) <= _F1_TOL]
        if weighted:
            # no equal-weight mean matched: the same shards (unequal in size) weighted by size
            ranks = ", ".join(f"{f:.4f} on {k} images" for f, k in want["shards"][weighted[0]])
            fail(where + f"your macro-F1 {got:.6f} is the ranks' F1 scores ({ranks}) averaged "
                         f"with each rank weighted by its number of images, where one "
                         f"process's is {want['correct']:.6f}. Weighting by images makes a mean over images "
                         f"exact (the accuracy), but F1 is no mean over images: each class's F1 "
                         f"is a ratio of counts over the whole set, so no mean of the shards' "
                         f"F1, weighted or not, is the F1 of the whole set.",
                 fix=F1_FIXES["mean_of_f1"])
        for name in ("accuracy", "precision_only", "recall_only"):
            if abs(got - want[name]) <= _F1_TOL:
                _mistake(F1_MISTAKES, F1_FIXES, name, where)
        fail(where + f"your macro-F1 {got:.6f} differs from one process's {want['correct']:.6f} "
                     f"(macro_f1 of the whole test set's labels and predictions), and matches "
                     f"none of the usual mistakes.",
             fix="compute F1 once, from counts added up over every rank's images.")
    _judge_dtype(results, n_test, where)
    off, named = next(((r["off_device"], r.get("off_named")) for r in results
                       if r.get("off_device")), (None, None))
    if off and named:
        fail(where + f"{off} was made on the CPU by name (device={named!r}), not on the "
                     f"`device` your function is given: on NCCL every tensor a collective gets "
                     f"must be on this rank's GPU; yours was made on the CPU (here gloo took it; "
                     f"on GPUs this call raises RuntimeError: No backend type associated with "
                     f"device type cpu).",
             fix="never write a device out: make the tensor with device=device, the argument "
                 "(on GPUs it is this rank's cuda:r), or move it there with .to(device).")
    if off:
        fail(where + f"{off} is not on `device`: it was made without device= (or moved off "
                     f"it) and never moved there. Here every rank computes on the CPU, so gloo "
                     f"took it; on GPUs the group is NCCL's, which only moves GPU memory, and "
                     f"this call raises (RuntimeError: No backend type associated with device "
                     f"type cpu).",
             fix="make the tensor you exchange on the device (torch.zeros(..., device=device)), "
                 "or move it there with .to(device) before the collective.")
    return AVG_NOTE if any(r.get("averaged") for r in results) else ""


_DTYPE_FIX = ("exchange the counts in a dtype that holds every count of 10⁵ images exactly, and "
              "count in it too: an integer dtype (torch.int64, or int32), or float32 (exact up "
              "to 2^24 = 16,777,216) or float64.")


def _judge_dtype(results: list, n_test: int, where: str) -> None:
    """Fail if a rank passed a tensor into its collectives in a dtype whose whole numbers stop
    below the contract's real test set (float16: 2048; bfloat16: 256; int16: 32767): the
    check's own test sets are too small to show the rounding, so the dtype is judged."""
    __tracebackhide__ = True
    from dpcourse.checks._lab04_exchange import REAL_TEST_IMAGES

    rank, narrow = next(((rank, r["narrow"]) for rank, r in enumerate(results)
                         if r.get("narrow")), (None, None))
    if narrow is None:
        return
    after = f" ({narrow['after']})" if narrow["after"] else ""
    fail(where + f"the tensor of shape {narrow['shape']} that rank {rank} passed to "
                 f"{narrow['collective']} is {narrow['dtype']}, which holds whole numbers "
                 f"exactly only up to {narrow['limit']:,}{after}. Every count of these "
                 f"{n_test} images stays under that, so your macro-F1 came out right here; on "
                 f"the contract's real test set of {REAL_TEST_IMAGES:,} images a class's counts "
                 f"go past {narrow['limit']:,}, where {narrow['dtype']} no longer holds them "
                 f"exactly, and the F1 computed from them is not the exact value.",
         fix=_DTYPE_FIX)


def _judge_different(results: list, values: list, n_test: int, where: str) -> None:
    """The ranks returned different numbers: name why. A collective whose result only its
    destination receives (``dist.reduce``, ``gather``) leaves the sum on one rank; no
    collective at all leaves each rank its own share's F1."""
    __tracebackhide__ = True
    shown = ", ".join(f"{v:.4f}" for v in values)
    head = where + f"the ranks returned different numbers ({shown})"
    to_one = next((r["to_one"][0] for r in results if r.get("to_one")), None)
    correct = _f1_variants(n_test, len(results))["correct"]
    if to_one is not None:
        name, dst = to_one
        others = [rank for rank in range(len(results)) if rank != dst]
        if 0 <= dst < len(values) and abs(values[dst] - correct) <= _F1_TOL:
            who = " and ".join(f"rank {r}" for r in others)
            got = " and ".join(f"{values[r]:.4f}" for r in others)
            fail(head + f". Rank {dst} returned the whole test set's macro-F1 ({correct:.4f}): "
                        f"it is the destination of your dist.{name}(..., dst={dst}), the only "
                        f"rank that receives the sum. On {who} the tensor was left holding "
                        f"only part of it (torch: 'Only the process with rank dst is going to "
                        f"receive the final result'), so the F1 computed from it there, "
                        f"{got}, is not the whole set's.",
                 fix="every rank must end with the sums (or with the F1 computed from them): "
                     "use a collective that leaves its result on every rank, all_reduce, or "
                     "send the destination's F1 to the others afterwards (broadcast).")
    if not any(r.get("collectives") for r in results):
        fail(head + f", where one process's macro-F1 of the whole test set is {correct:.4f}: "
                    f"no rank called a collective, so each returned its own share's result, "
                    f"not the whole test set's.",
             fix="make the ranks combine what they counted before the F1 is computed.")
    fail(head + f", where one process's macro-F1 of the whole test set is {correct:.4f}: "
                f"after your collectives the ranks did not hold the same sums, so each computed "
                f"the F1 of something else.",
         fix="make every rank end with the same sums, added over all the ranks (all_reduce), "
             "before the F1 is computed.")


# The contract: what a rank passes into its collectives, all classes together, is fewer numbers
# than _PER_CLASS_LIMIT per class (under 30 in total for 10 classes): enough for two counts per
# class and a few spare numbers (a count, a broadcast result), not for three counts per class
# nor a table.
_PER_CLASS_LIMIT = 3
AVG_NOTE = (" Your collective averaged the counts (ReduceOp.AVG) instead of adding them: that "
            "divides every count by world_size, and each class's F1 is a ratio of two counts, "
            "so it is unchanged (to rounding); an AVG of the ranks' F1 scores would have been a "
            "mean of means.")


def _judge_budget(results: list, where: str) -> None:
    """Fail if a rank passed more numbers into its collectives than the contract allows."""
    __tracebackhide__ = True
    C = NUM_CLASSES
    limit = _PER_CLASS_LIMIT * C
    over = [(rank, r.get("numbers", 0)) for rank, r in enumerate(results)
            if r.get("numbers", 0) >= limit]
    if not over:
        return
    rank, k = over[0]
    if k == C * C:
        what = (f", a {C} × {C} table such as the confusion matrix of (true, predicted) pairs, "
                f"which for ImageNet's 1000 classes is a million numbers per rank")
    elif k == 3 * C:
        what = (", 3 per class, such as the true positives, false positives and false "
                "negatives that precision and recall are written with")
    else:
        what = f", {k / C:g} per class"
    fail(where + f"rank {rank} passed {k} numbers into its collectives{what}: macro-F1 is "
                 f"determined by fewer per class, and the contract allows no more than it "
                 f"needs, with a few spare numbers in all (under {limit} here in total, "
                 f"fewer than {_PER_CLASS_LIMIT} per class).",
         fix="each class's F1 is the harmonic mean of its precision and recall, two fractions "
             "with the same numerator (its true positives): write 2·P·R/(P + R) as one fraction "
             "of counts, and exchange the two per-class counts it is made of.")


@recorded
def check_f1(path="train_lab.py", runs=F1_RUNS, timeout: float | None = None) -> None:
    """Call the script's ``evaluate_f1`` on each (world size, test images) of ``runs`` and judge
    it (see :func:`judge_f1`); silent when right. ``timeout``: 90 s per launch, or
    ``DPCOURSE_CHECK_TIMEOUT`` if more."""
    __tracebackhide__ = True
    f1_note(path, runs, timeout)


def f1_note(path="train_lab.py", runs=F1_RUNS, timeout: float | None = None) -> str:
    """:func:`check_f1`, returning the note its ✔ gets ("" or :data:`AVG_NOTE`)."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, 90.0)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no script at {path}: run the cell that writes it first")
    source = path.read_text()
    try:
        ns = _namespace(source, path.name)
    except SyntaxError as exc:
        fail(f"{path.name} does not parse: line {exc.lineno}: {exc.msg}.")
    if not callable(ns.get("evaluate_f1")):
        fail(f"{path.name} defines no function evaluate_f1(model, test_set, rank, world_size, "
             f"device).")
    note = ""
    for world_size, n_test in runs:
        results = run_ranks(
            _f1_worker, world_size, source, n_test, _f1_sets(n_test), timeout=timeout,
            hang=lambda exc: f"evaluate_f1 did not finish within {timeout:g} s on {world_size} "
                             f"ranks: does one rank call a collective (all_reduce) that another "
                             f"never calls, e.g. inside its loop over batches, when the ranks "
                             f"have different numbers of batches?",
            failed=lambda exc: fail(f"evaluate_f1 raised on rank {exc.rank} of {world_size}: "
                                    f"{exc.summary}"),
            todo=f"{path.name} still has a TODO in evaluate_f1: replace the `raise "
                 f"NotImplementedError` with your code, re-run that cell, then this check.")
        note = judge_f1(results, n_test) or note
    return note
