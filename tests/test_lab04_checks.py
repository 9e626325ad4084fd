"""The lab 04 check: the reference answer passes, each plausible wrong answer fails with a
sentence that names it. Wrong answers are real scripts (the solution with one mistake put back)
run on real ranks; most through dpcourse.launch.spawn (same environment variables as torchrun,
one second to start), a few through torchrun itself, as the lab does. The answers to
evaluate_f1 and to the stretch are judged from batches: each answer's code runs in turn in one
launch per run (lab04.f1_results, lab04.resume_runs), judged as the check judges it; each
check also runs end to end here.

The lab's answer is ``evaluate_f1`` (macro-F1 over a test set split across the ranks): its
mistakes are tested with ``check_f1``. The training part of the lab's script is given, but a
learner can still break it, so the conversion mistakes stay tested too (with ``f1_runs=()``)."""

import functools
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import launches_replayed
from dpcourse.checks import LabCheckError, lab04

ROOT = Path(__file__).resolve().parents[1]


def _solution_script() -> str:
    text = (ROOT / "solutions" / "lab04_ddp_in_practice.py").read_text()
    m = re.search(r"^# %%writefile \{work\}/train_lab\.py\n(.*?)(?=^# %%)", text, re.S | re.M)
    assert m, "solutions/lab04 has no %%writefile train_lab.py cell"
    return m.group(1).replace("### BEGIN SOLUTION", "# (solution)").replace("### END SOLUTION", "#")


def _write(tmp_path, text, name="train_lab.py") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _variant(old: str, new: str) -> str:
    text = _solution_script()
    assert old in text, old
    return text.replace(old, new)


WRONG = {
    "same_data": (("num_replicas=world_size, rank=rank", "num_replicas=1, rank=0"),
                  "same batches"),
    "batch_not_divided": (("per_rank_batch = args.global_batch // world_size",
                           "per_rank_batch = args.global_batch"), "grew world_size times"),
    "batch_fixed_two": (("per_rank_batch = args.global_batch // world_size",
                         "per_rank_batch = args.global_batch // 2"),
                        "On 3 ranks, --seed 1, --global-batch 48: The per-rank batch is "
                        "global_batch // 2"),
    "sampler_seed_ignored": (("shuffle=True,\n                                 seed=args.seed)",
                              "shuffle=True)"), "ignores --seed"),
    "no_drop_last": (("sampler=sampler, drop_last=True)", "sampler=sampler)"),
                     "short last batch"),
    "lr_scaled": (("lr=args.lr,", "lr=args.lr * world_size,"), "multiplied by the world size"),
    "no_set_epoch": (("    sampler.set_epoch(epoch)\n", "    pass\n"), "its epoch stayed 0"),
}


# --- the conversion (given in the lab, but a learner can break it) ---------------------------
NO_F1 = dict(f1_runs=(), launcher="spawn", timeout=90)


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_conversion_is_named(tmp_path, name):
    (old, new), phrase = WRONG[name]
    with pytest.raises(LabCheckError, match=phrase):
        lab04.check(_write(tmp_path, _variant(old, new)), cfgs=lab04.CONFIGS, **NO_F1)


def test_checkpoint_of_the_ddp_wrapper_is_refused(tmp_path):
    text = _variant('{"model": model.module.state_dict(), "f1": f1}',
                    '{"model": model.state_dict(), "f1": f1}')
    with pytest.raises(LabCheckError, match="keys start with 'module.'"):
        lab04.check(_write(tmp_path, text), **NO_F1)


RIGHT = {
    # DistributedSampler's own drop_last: 256 samples on 3 ranks keep 85 each, still 5 batches
    "sampler_drop_last": ("shuffle=True,\n                                 seed=args.seed)",
                          "shuffle=True,\n                                 seed=args.seed, "
                          "drop_last=True)"),
    "world_size_from_dist": ("per_rank_batch = args.global_batch // world_size",
                             "per_rank_batch = args.global_batch // dist.get_world_size()"),
    "plain_torch_save": ('save_checkpoint(args.out, {"model": model.module.state_dict(), "f1": f1})',
                         'torch.save({"model": model.module.state_dict(), "f1": f1}, args.out)'),
}


@pytest.mark.parametrize("name", sorted(RIGHT))
def test_right_conversion_variants_pass(tmp_path, name, capsys):
    lab04.check(_write(tmp_path, _variant(*RIGHT[name])), cfgs=lab04.CONFIGS, **NO_F1)
    assert capsys.readouterr().out.count("✔") == 1


def test_forgetting_ddp_is_named(tmp_path):
    text = _variant("model = DDP(model, device_ids=[local_rank] if device.type == \"cuda\" else None)",
                    "pass")
    text = text.replace("model.module", "model")
    with pytest.raises(LabCheckError, match="trained alone on its half of the data"):
        lab04.check(_write(tmp_path, text), **NO_F1)


def test_saving_on_every_rank_is_caught_under_torchrun(tmp_path):
    # one torchrun run for two points: every rank saves (the runner logs each rank's saves),
    # and the script ends without its os._exit(0) (the runner's own os._exit ends it: the run
    # must have exited cleanly, or the check would name a failure under torchrun, not the
    # saves it judges after). The reference script as written (os._exit included) passes under
    # torchrun, with its F1 part on the lab's F1_RUNS and the saved F1 compared, in
    # solutions/lab04's nbval run; the ✔ after a clean torchrun exit is the same there
    text = _variant("if is_main:\n", "if True:\n")
    assert "    sys.stdout.flush()\n    os._exit(0)" in text
    text = text.replace("    sys.stdout.flush()\n    os._exit(0)", "")
    assert "os._exit" not in text
    with pytest.raises(LabCheckError, match="Rank 1 called torch.save too"):
        lab04.check(_write(tmp_path, text), f1_runs=(), timeout=120)


def test_unfinished_training_todo_raises_not_implemented(tmp_path):
    text = _variant("sampler.set_epoch(epoch)", "raise NotImplementedError('TODO')")
    with pytest.raises(NotImplementedError, match="still has a TODO"):
        lab04.check(_write(tmp_path, text), **NO_F1)


def test_crashing_script_names_the_error(tmp_path):
    text = _variant("torch.manual_seed(args.seed)", "raise ValueError('boom')")
    with pytest.raises(LabCheckError, match="failed on rank .*boom"):
        lab04.check(_write(tmp_path, text), **NO_F1)


def test_crashing_script_under_torchrun_names_the_childs_exception(tmp_path, capsys):
    # rank 1 raises; torchrun's agent then raises ChildFailedError, and rank 0 sees a closed
    # connection: the sentence must name rank 1's own exception, not either of those
    text = _variant("torch.manual_seed(args.seed)",
                    "torch.manual_seed(args.seed)\n    if rank == 1:\n"
                    "        raise ValueError('boom on rank 1')")
    with pytest.raises(LabCheckError) as err:
        lab04.check(_write(tmp_path, text), f1_runs=(), timeout=120)
    assert "rank 1: ValueError: boom on rank 1" in str(err.value), str(err.value)
    assert "ChildFailedError" not in str(err.value)


def test_error_line_of_a_child_killed_without_a_traceback():
    output = ("[rank 0] epoch 0\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "Root Cause (first observed failure):\n[0]:\n  host      : localhost\n"
              "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 12)  (SIGKILL)\n")
    assert lab04._last_error_line(output) == "rank 1 exited with code -9 (SIGKILL)"


# --- the prediction -------------------------------------------------------------------------

@pytest.mark.parametrize("value, verdict", [(0.75, "— right."), (1.0, "— not what happened."),
                                            (0.5, "— not what happened.")])
def test_prediction_is_compared_and_explained(value, verdict, capsys):
    # 101 images on 8 ranks, round-robin, always right: each rank reports the fraction of the
    # classes it holds; 1.0 (a fair split looks safe) and 0.5 (the sorted split) are wrong
    import torch

    from dpcourse import data
    from dpcourse.checks import predict

    ns = _namespace_of_solution()
    labels = torch.as_tensor(data.load("shapes10", n_train=8, n_test=101, seed=0).y_test)
    N = lab04.PREDICTION_RANKS
    per_rank = [ns["macro_f1"](labels[r::N], labels[r::N]) for r in range(N)]
    assert ns["macro_f1"](labels, labels) == 1.0
    held = [len(set(labels[r::N].tolist())) for r in range(N)]
    assert per_rank == [h / 10 for h in held], (per_rank, held)
    guess = predict("lab04", lab04.PREDICTION_QUESTION, value)
    lab04.check_prediction(guess, labels, per_rank)
    out = " ".join(capsys.readouterr().out.split())
    assert f"measured: 0.75 {verdict}" in out, out
    assert f"the ranks held {', '.join(map(str, held))} of the 10 classes" in out, out
    assert "Nothing was sorted by class" in out, out


def test_the_measurement_shows_nothing_before_a_prediction(capsys):
    # the lab's measurement cell prints the ranks' values through check_prediction, which
    # refuses first when the prediction cell has not given it a recorded prediction
    import torch

    from dpcourse import data

    labels = torch.as_tensor(data.load("shapes10", n_train=8, n_test=101, seed=0).y_test)
    per_rank = [0.8] * lab04.PREDICTION_RANKS
    for guess in (None, 0.75):
        with pytest.raises(LabCheckError, match="needs your prediction first"):
            lab04.check_prediction(guess, labels, per_rank, 1.0)
        assert capsys.readouterr().out == ""
    source = (ROOT / "solutions" / "lab04_ddp_in_practice.py").read_text()
    measure = source.index("per_rank = [macro_f1(")
    assert "print(" not in source[measure:source.index("lab04.check_prediction(", measure)]


def _namespace_of_solution() -> dict:
    return lab04._namespace(_solution_script())


def test_given_macro_f1_is_the_checks_definition():
    # the lab defines macro-F1 by precision and recall; the check computes it from a confusion
    # matrix: both must agree, including classes never predicted or never present
    import torch

    macro_f1 = _namespace_of_solution()["macro_f1"]
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 50, 300):
        y = torch.randint(0, 10, (n,), generator=g)
        p = torch.where(torch.rand(n, generator=g) < 0.6, y, torch.randint(0, 7, (n,), generator=g))
        want = lab04._f1_of(torch.bincount(y * 10 + p, minlength=100).view(10, 10))
        assert abs(macro_f1(y, p) - want) < 1e-12


# --- the lab's answer: evaluate_f1 -----------------------------------------------------------

def _body(new_body: str) -> str:
    """The solution script with evaluate_f1's body replaced (4-space indented lines)."""
    text = _solution_script()
    start = text.index("    # (solution)")
    end = text.index("    #\n", start) + len("    #\n")
    # the given script no longer imports Subset (an unused import hinted at the answer)
    return text[:start] + "    from torch.utils.data import Subset\n" + new_body + text[end:]


# the whole confusion matrix (100 numbers: over the contract's bound, fewer than 3 per class)
_COUNT = """\
    confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64, device=device)
    model.eval()
    with torch.no_grad():
        for X, y in DataLoader(share, batch_size=16):
            pairs = y.to(device) * NUM_CLASSES + model(X.to(device)).argmax(1)
            confusion += torch.bincount(pairs, minlength=NUM_CLASSES ** 2).view_as(confusion)
"""
# two counts per class, as the reference: true positives, and predicted + true
_COUNT2 = """\
    counts = torch.zeros(2, NUM_CLASSES, dtype=torch.int64, device=device)
    model.eval()
    with torch.no_grad():
        for X, y in DataLoader(share, batch_size=16):
            predicted, y = model(X.to(device)).argmax(1), y.to(device)
            counts[0] += torch.bincount(y[predicted == y], minlength=NUM_CLASSES)
            counts[1] += torch.bincount(torch.cat([predicted, y]), minlength=NUM_CLASSES)
"""
F1_OF_COUNTS2 = ("    tp, both = counts.double()\n"
                 "    return float((2 * tp / both.clamp(min=1)).mean())\n")
REDUCE2 = "    dist.all_reduce(counts)\n" + F1_OF_COUNTS2
STRIDED = "    share = Subset(test_set, range(rank, len(test_set), world_size))\n"
F1_OF_COUNTS = ("    tp = confusion.diagonal().double()\n"
                "    both = (confusion.sum(0) + confusion.sum(1)).double()\n"
                "    return float((2 * tp / both.clamp(min=1)).mean())\n")
REDUCE = "    dist.all_reduce(confusion)\n" + F1_OF_COUNTS
# this rank's labels and predictions, as a learner who calls the given macro_f1 has them
LOCAL = STRIDED + """\
    model.eval()
    with torch.no_grad():
        seen = [(y, model(X).argmax(1)) for X, y in DataLoader(share, batch_size=16)]
    y_true, y_pred = torch.cat([y for y, _ in seen]), torch.cat([p for _, p in seen])
"""

F1_WRONG = {
    "padded_sampler": (
        "    share = Subset(test_set, list(DistributedSampler(test_set, shuffle=False)))\n"
        + _COUNT + REDUCE, "counted twice"),
    "padded_sampler_shuffled": (
        "    sampler = DistributedSampler(test_set)\n"
        "    share = Subset(test_set, list(sampler))\n" + _COUNT + REDUCE, "counted twice"),
    "no_reduction": (LOCAL + "    return macro_f1(y_true, y_pred)\n", "different numbers"),
    "no_reduction_counts": (STRIDED + _COUNT + F1_OF_COUNTS,
                            "no rank called a collective, so each returned its own share's"),
    # reduce to rank 0, then every rank computes F1 from its tensor: right on rank 0 only
    "reduce_to_rank0": (STRIDED + _COUNT2 + "    dist.reduce(counts, dst=0)\n" + F1_OF_COUNTS2,
                        "Rank 0 returned the whole test set's macro-F1 (0.0771): it is the "
                        "destination of your dist.reduce(..., dst=0), the only rank that "
                        "receives the sum. On rank 1 the tensor was left holding only part"),
    # a collective on a copy: the ranks exchanged, but computed from their own counts
    "all_reduce_of_a_copy": (STRIDED + _COUNT2 + "    dist.all_reduce(counts.clone())\n"
                             + F1_OF_COUNTS2, "after your collectives the ranks did not hold "
                                              "the same sums"),
    # the ranks' F1 weighted by their number of images: still a mean of F1s
    "weighted_mean_of_f1": (
        LOCAL + "    f1 = torch.tensor([macro_f1(y_true, y_pred) * len(y_true), len(y_true)],\n"
                "                      dtype=torch.float64, device=device)\n"
                "    dist.all_reduce(f1)\n    return float(f1[0] / f1[1])\n",
        "is the ranks' F1 scores (0.0489 on 51 images, 0.0744 on 50 images) averaged with each "
        "rank weighted by its number of images, where one process's is 0.077118"),
    "mean_of_f1": (LOCAL + "    f1 = torch.tensor([macro_f1(y_true, y_pred)])\n"
                           "    dist.all_reduce(f1)\n    return float(f1) / world_size\n",
                   "F1 scores were averaged"),
    "mean_of_f1_contiguous": (
        "    n = len(test_set)\n"
        "    share = Subset(test_set, range(rank * n // world_size, (rank + 1) * n // world_size))\n"
        + _COUNT + "    tp = confusion.diagonal().double()\n"
        "    both = (confusion.sum(0) + confusion.sum(1)).double()\n"
        "    f1 = (2 * tp / both.clamp(min=1)).mean().reshape(1)\n"
        "    dist.all_reduce(f1)\n    return float(f1) / world_size\n", "F1 scores were averaged"),
    "sum_of_f1": (LOCAL + "    f1 = torch.tensor([macro_f1(y_true, y_pred)])\n"
                          "    dist.all_reduce(f1)\n    return float(f1)\n", "added up"),
    # rank 0 evaluates every image and broadcasts the F1: right number, rank 1 idle
    "rank0_does_all": (
        "    share = test_set if rank == 0 else Subset(test_set, [])\n" + _COUNT
        + "    result = torch.zeros(1, dtype=torch.float64)\n"
        "    if rank == 0:\n"
        "        tp = confusion.diagonal().double()\n"
        "        result[0] = (2 * tp / (confusion.sum(0) + confusion.sum(1)).clamp(min=1)).mean()\n"
        "    dist.broadcast(result, src=0)\n"
        "    return float(result)\n", "rank 1 ran the model on no image (rank 0 101 of the 101)"),
    # a second forward over the rank's own share: duplicates on one rank, no padding at all
    "forward_twice": (
        STRIDED + _COUNT + "            model(X)  # a second pass, e.g. for logits to log\n"
        + REDUCE, "rank 0 evaluated 51 of its 51 images more than once"),
    "overlapping_shares": (
        "    n = len(test_set)\n"
        "    share = Subset(test_set, range(max(0, rank * n // world_size - 5), (rank + 1) * n // world_size))\n"
        + _COUNT + REDUCE, "the ranks' shares overlap"),
    "whole_set_everywhere": ("    share = test_set\n" + _COUNT + F1_OF_COUNTS,
                             "every rank evaluated all"),
    "training_mode": (STRIDED + _COUNT.replace("    model.eval()\n", "") + REDUCE,
                      "training mode"),
    "autograd_on": (STRIDED + _COUNT.replace("    with torch.no_grad():\n", "    if True:\n")
                    + REDUCE, "built a graph"),
    # fixed size (20 numbers), but fractions over different numbers of images averaged
    "mean_of_precision_recall": (
        STRIDED + _COUNT + "    c = confusion.double()\n"
        "    tp = c.diagonal()\n"
        "    pr = torch.stack([torch.where(c.sum(0) > 0, tp / c.sum(0).clamp(min=1), 0.0),\n"
        "                      torch.where(c.sum(1) > 0, tp / c.sum(1).clamp(min=1), 0.0)])\n"
        "    dist.all_reduce(pr)\n"
        "    p, r = pr / world_size\n"
        "    return float(torch.where(p + r > 0, 2 * p * r / (p + r).clamp(min=1e-12), 0.0).mean())\n",
        "precisions and recalls were averaged"),
    "accuracy": (STRIDED + _COUNT + "    right = torch.stack([confusion.diagonal().sum(), confusion.sum()])\n"
                 "    dist.all_reduce(right)\n"
                 "    return float(right[0] / right[1])\n",
                 "is the accuracy"),
    # two counts per class, but the wrong two: true positives and predicted (or true) counts
    "precision_only": (
        STRIDED + _COUNT2.replace("torch.cat([predicted, y])", "predicted") + REDUCE2.replace(
            "2 * tp / both", "tp / both"), "mean over the classes of each class's precision"),
    "recall_only": (
        STRIDED + _COUNT2.replace("torch.cat([predicted, y])", "y") + REDUCE2.replace(
            "2 * tp / both", "tp / both"), "the balanced accuracy"),
    # right value, over the budget: the whole confusion matrix, or three counts per class
    "confusion_matrix": (STRIDED + _COUNT + REDUCE,
                         "rank 0 passed 100 numbers into its collectives, a 10 × 10 table"),
    "all_gather_matrices": (
        STRIDED + _COUNT + "    everyone = [torch.zeros_like(confusion) for _ in range(world_size)]\n"
        "    dist.all_gather(everyone, confusion)\n"
        "    confusion = sum(everyone)\n" + F1_OF_COUNTS, "a 10 × 10 table"),
    "tp_fp_fn": (
        LOCAL + "    c = torch.arange(NUM_CLASSES).unsqueeze(1)\n"
        "    counts = torch.stack([((y_pred == c) & (y_true == c)).sum(1),\n"
        "                          ((y_pred == c) & (y_true != c)).sum(1),\n"
        "                          ((y_pred != c) & (y_true == c)).sum(1)]).double().to(device)\n"
        "    dist.all_reduce(counts)\n"
        "    tp, fp, fn = counts\n"
        "    den = 2 * tp + fp + fn\n"
        "    return float(torch.where(den > 0, 2 * tp / den.clamp(min=1), 0.0).mean())\n",
        "rank 0 passed 30 numbers into its collectives, 3 per class"),
    # right value and size here, but counted and exchanged in a dtype whose whole numbers stop
    # far below the contract's 10^5 images (float16 at 2048, bfloat16 at 256, uint8 at 255)
    "float16_counts": (
        STRIDED + _COUNT2.replace("dtype=torch.int64", "dtype=torch.float16") + REDUCE2,
        "the tensor of shape (2, 10) that rank 0 passed to all_reduce is torch.float16, which "
        "holds whole numbers exactly only up to 2,048 (2,049 becomes 2,048). Every count of "
        "these 101 images stays under that, so your macro-F1 came out right here; on the "
        "contract's real test set of 100,000 images a class's counts go past 2,048"),
    "bfloat16_counts": (
        STRIDED + _COUNT2.replace("dtype=torch.int64", "dtype=torch.bfloat16") + REDUCE2,
        "is torch.bfloat16, which holds whole numbers exactly only up to 256 (257 becomes 256)"),
    # uint8 (gloo and NCCL reduce it; neither reduces int16): 255, then it wraps
    "uint8_counts": (
        STRIDED + _COUNT2.replace("dtype=torch.int64", "dtype=torch.uint8") + REDUCE2,
        "is torch.uint8, which holds whole numbers exactly only up to 255 (256 becomes 0)"),
    # counted in int64, but handed to the collective as float16 (inside an object collective)
    "float16_gathered_objects": (
        STRIDED + _COUNT2 + "    everyone = [None] * world_size\n"
        "    dist.all_gather_object(everyone, counts.half())\n"
        "    counts = sum(everyone)\n" + F1_OF_COUNTS2,
        "that rank 0 passed to all_gather_object is torch.float16"),
    # right value and size, but made on the host: NCCL would refuse it on GPUs
    "counts_on_the_host": (
        STRIDED + _COUNT2.replace("dtype=torch.int64, device=device)", "dtype=torch.int64)")
        + REDUCE2, "the tensor of shape (2, 10) that rank 0 passed to all_reduce is not on "
                   "`device`"),
    # right value and size, but made on a device written out: "cpu" is the host on GPUs too
    "counts_on_a_written_cpu": (
        STRIDED + _COUNT2.replace("device=device)", 'device="cpu")') + REDUCE2,
        "the tensor of shape (2, 10) that rank 0 passed to all_reduce was made on the CPU by "
        "name (device='cpu')"),
    # the learner's pD: "cpu" everywhere, predictions and labels moved there before counting
    "everything_on_a_written_cpu": (
        STRIDED + _COUNT2.replace("device=device)", "device=torch.device('cpu'))")
        .replace("model(X.to(device)).argmax(1), y.to(device)",
                 "model(X.to(device)).argmax(1).cpu(), y.cpu()") + REDUCE2,
        "on NCCL every tensor a collective gets must be on this rank's GPU; yours was made on "
        "the CPU"),
    "result_tensor_on_the_host": (
        STRIDED + _COUNT2 + "    dist.all_reduce(counts)\n"
        "    tp, both = counts.double()\n"
        "    f1 = torch.tensor([float((2 * tp / both.clamp(min=1)).mean())])\n"
        "    dist.broadcast(f1, src=0)\n"
        "    return float(f1)\n",
        "shape (1,) that rank 0 passed to broadcast is not on `device`"),
    "remainder_dropped": (
        "    n = len(test_set) // world_size * world_size\n"
        "    share = Subset(test_set, range(rank, n, world_size))\n" + _COUNT + REDUCE,
        "evaluated only"),
    # the right value as a 0-d tensor: it passes for a number until the checkpoint holds it
    "returns_a_0d_tensor": (
        STRIDED + _COUNT2.replace("dtype=torch.int64", "dtype=torch.float64")
        + "    dist.all_reduce(counts)\n"
          "    return (2 * counts[0] / counts[1].clamp(min=1)).mean()\n",
        "evaluate_f1 returned a tensor (shape (), torch.float64), not a Python float"),
    "returns_a_list": (STRIDED + _COUNT + "    dist.all_reduce(confusion)\n"
                       "    return [float(confusion.diagonal().sum())]\n", "not a number"),
    # right value, but every label and prediction travels: grows with the test set
    "all_gather_predictions": (
        LOCAL + "    gathered = [None] * world_size\n"
        "    dist.all_gather_object(gathered, (y_true, y_pred))\n"
        "    return macro_f1(torch.cat([t for t, _ in gathered]), torch.cat([p for _, p in gathered]))\n",
        "grows with the test set"),
    "all_gather_packed_pairs": (
        LOCAL + "    pairs = (y_true * NUM_CLASSES + y_pred).to(torch.uint8)\n"
        "    gathered = [None] * world_size\n"
        "    dist.all_gather_object(gathered, pairs)\n"
        "    everything = torch.cat(gathered).long()\n"
        "    return macro_f1(everything // NUM_CLASSES, everything % NUM_CLASSES)\n",
        "grows with the test set"),
}


# on 101 images the random check model is right at most twice per class, often on one rank
# only, and averaging fractions then equals averaging F1: the lab's own test sets tell them apart
F1_RUNS_OF = {"mean_of_precision_recall": lab04.F1_RUNS[:1]}

# Every right and wrong body below is judged from ONE launch per (world size, test images) it
# runs on: lab04.f1_results runs each script's evaluate_f1 in turn in one process group, as
# check_f1 runs it alone (a fresh counting model and spy each), and lab04.judge_f1 is
# check_f1's judgement of the ranks' results. A launch costs more than an evaluation (about 60
# launches became 3). check_f1 itself runs end to end further down: the reference on the
# lab's runs and on 1 and 4 ranks, a TODO, a deadlock, a mistake met twice, 3 ranks and 100
# images.
F1_BATCHES = {
    (2, 101): [name for name in sorted(F1_WRONG) if name not in F1_RUNS_OF],
    (2, 301): ["mean_of_precision_recall", "F1_RIGHT"],
    (3, 302): ["mean_of_precision_recall", "reduce_to_rank0", "weighted_mean_of_f1", "F1_RIGHT"],
}


@functools.lru_cache(maxsize=None)
def _f1_batch(run) -> dict:
    names = [n for name in F1_BATCHES[run] for n in (sorted(F1_RIGHT) if name == "F1_RIGHT"
                                                      else [name])]
    bodies = {**{name: body for name, (body, _) in F1_WRONG.items()}, **F1_RIGHT}
    results = lab04.f1_results([_body(bodies[name]) for name in names], *run, timeout=90)
    return dict(zip(names, results))


def _judge_f1(name, run=(2, 101)) -> str:
    """check_f1's verdict on body ``name`` on ``run`` (world size, test images): the ✔'s note,
    or the LabCheckError it raises."""
    return lab04.judge_f1(_f1_batch(run)[name], run[1])


@pytest.mark.parametrize("name", sorted(F1_WRONG))
def test_wrong_f1_is_named(name):
    body, phrase = F1_WRONG[name]
    with pytest.raises(LabCheckError) as err:
        _judge_f1(name, F1_RUNS_OF.get(name, ((2, 101),))[0])
    assert phrase in str(err.value), str(err.value)


def test_padding_is_named_only_where_the_images_show_it():
    # the sampler's padding: one image on two ranks, every share equally long
    with pytest.raises(LabCheckError) as err:
        _judge_f1("padded_sampler")
    assert "image 0 on ranks 0 and 1" in str(err.value), str(err.value)
    assert "DistributedSampler pads" in str(err.value), str(err.value)
    # a second forward over each rank's own share is no padding: the sentence does not say so
    with pytest.raises(LabCheckError) as err:
        _judge_f1("forward_twice")
    message = str(err.value)
    assert "ran the model on 202 images for 101" in message, message
    assert "DistributedSampler" not in message and "pad" not in message, message


def test_the_rng_cause_keeps_the_design_for_the_second_meeting():
    message = lab04.RESUME_MISTAKES["rng_rank0"]
    assert "stream of its own" not in message and "hold every" not in message, message
    assert "stream of its own" in lab04.RESUME_FIXES["rng_rank0"]


@pytest.mark.parametrize("name, cause, fix", [
    ("reduce_to_rank0", "'Only the process with rank dst is going to receive the final result'",
     "use a collective that leaves its result on every rank, all_reduce"),
    ("weighted_mean_of_f1", "no mean of the shards' F1, weighted or not, is the F1 of the whole",
     "compute F1 once from the sums"),
])
def test_reduce_and_weighted_mean_get_their_fix_the_second_time(name, cause, fix):
    for attempt in range(2):
        with pytest.raises(LabCheckError) as err:
            _judge_f1(name, (3, 302))
        message = " ".join(str(err.value).split())
        assert message.startswith("On 3 ranks with 302 test images: "), message
        assert cause in message, message
        assert (fix in message) == (attempt == 1), message


def test_mean_of_precision_recall_is_named_on_three_ranks_too():
    with pytest.raises(LabCheckError, match="On 3 ranks with 302 test images: .*recalls"):
        _judge_f1("mean_of_precision_recall", lab04.F1_RUNS[1])


def test_mean_of_f1_is_named_on_three_ranks_too(tmp_path):
    body, phrase = F1_WRONG["mean_of_f1"]
    with pytest.raises(LabCheckError, match="On 3 ranks with 100 test images: .*averaged"):
        lab04.check_f1(_write(tmp_path, _body(body)), runs=((3, 100),))


F1_RIGHT = {
    # the lab says the mode the model is left in does not matter: putting it back is right too
    "back_in_train_mode": (STRIDED + _COUNT2 + "    model.train()\n" + REDUCE2),
    "contiguous_shards": (
        "    n = len(test_set)\n"
        "    share = Subset(test_set, range(rank * n // world_size, (rank + 1) * n // world_size))\n"
        + _COUNT2 + REDUCE2),
    "float_counts": (
        STRIDED + _COUNT2.replace("dtype=torch.int64", "dtype=torch.float64")
        + "    dist.all_reduce(counts)\n"
          "    return (2 * counts[0] / counts[1].clamp(min=1)).mean().item()\n"),
    # 20 counts and 3 more numbers (a count and a broadcast pair): under 30, within the bound
    "twenty_three_numbers": (
        STRIDED + _COUNT2 + "    n = torch.tensor([len(share)], device=device)\n"
        "    dist.all_reduce(counts)\n    dist.all_reduce(n)\n"
        "    tp, both = counts.double()\n"
        "    result = torch.stack([(2 * tp / both.clamp(min=1)).mean(), n[0].double()])\n"
        "    dist.broadcast(result, src=0)\n"
        "    return float(result[0])\n"),
    # the other pair of counts: true positives and errors (FP + FN): F1 = 2TP / (2TP + FP + FN)
    "tp_and_errors": (
        STRIDED + _COUNT2.replace("torch.cat([predicted, y])",
                                  "torch.cat([predicted, y])[torch.cat([predicted != y] * 2)]")
        + "    dist.all_reduce(counts)\n"
          "    tp, errors = counts.double()\n"
          "    return float((2 * tp / (2 * tp + errors).clamp(min=1)).mean())\n"),
    # averaged instead of summed: F1 is a ratio of counts, so it is unchanged (the ✔ says why)
    "avg_of_float_counts": (
        STRIDED + _COUNT2.replace("dtype=torch.int64", "dtype=torch.float64")
        + "    dist.all_reduce(counts, op=dist.ReduceOp.AVG)\n" + F1_OF_COUNTS2),
    # reduce to rank 0, which computes F1 and broadcasts it: rank 0 sends 20 + 1 numbers
    "reduce_then_broadcast": (
        STRIDED + _COUNT2 + "    dist.reduce(counts, dst=0)\n"
        "    result = torch.zeros(1, dtype=torch.float64, device=device)\n"
        "    if rank == 0:\n"
        "        tp, both = counts.double()\n"
        "        result[0] = (2 * tp / both.clamp(min=1)).mean()\n"
        "    dist.broadcast(result, src=0)\n"
        "    return float(result)\n"),
    # the ranks' counts gathered (size grows with the ranks, not the images), then added
    "all_gather_counts": (
        STRIDED + _COUNT2 + "    everyone = [torch.zeros_like(counts) for _ in range(world_size)]\n"
        "    dist.all_gather(everyone, counts)\n"
        "    counts = sum(everyone)\n" + F1_OF_COUNTS2),
    "two_all_reduces": (
        STRIDED + _COUNT2 + "    tp, both = counts[0].clone(), counts[1].clone()\n"
        "    dist.all_reduce(tp)\n    dist.all_reduce(both)\n"
        "    return float((2 * tp.double() / both.double().clamp(min=1)).mean())\n"),
    # an object collective: its numbers count, its device is torch's business
    "all_gather_object_lists": (
        STRIDED + _COUNT2 + "    everyone = [None] * world_size\n"
        "    dist.all_gather_object(everyone, counts.tolist())\n"
        "    counts = torch.tensor(everyone).sum(0)\n" + F1_OF_COUNTS2),
    # float32 holds every whole number up to 2^24 = 16,777,216: exact for 10^5 images
    "float32_counts": (
        STRIDED + _COUNT2.replace("dtype=torch.int64", "dtype=torch.float32") + REDUCE2),
    # the device read back from a tensor on it, or written as its name: both are `device`
    "device_of_the_predictions": (
        STRIDED + _COUNT2.replace("    counts = torch.zeros(2, NUM_CLASSES, dtype=torch.int64, "
                                  "device=device)\n", "    counts = None\n")
        .replace("            counts[0] +=",
                 "            if counts is None:\n"
                 "                counts = torch.zeros(2, NUM_CLASSES, dtype=torch.int64,\n"
                 "                                     device=predicted.device)\n"
                 "            counts[0] +=") + REDUCE2),
    "device_as_a_string": (
        STRIDED + _COUNT2.replace("device=device)", "device=str(device))") + REDUCE2),
    "int32_counts": (STRIDED + _COUNT2.replace("dtype=torch.int64", "dtype=torch.int32") + REDUCE2),
    # counted on the host, moved to the device for the collective
    "host_counts_moved": (
        STRIDED + _COUNT2.replace("dtype=torch.int64, device=device)", "dtype=torch.int64)")
        .replace("model(X.to(device)).argmax(1), y.to(device)",
                 "model(X.to(device)).argmax(1).cpu(), y")
        .replace("torch.no_grad()", "torch.inference_mode()")
        + "    counts = counts.to(device)\n" + REDUCE2),
}


@pytest.mark.parametrize("name", sorted(F1_RIGHT))
def test_right_f1_variants_pass(name):
    note = ""
    for run in lab04.F1_RUNS:  # as f1_note: the note of any run
        note = _judge_f1(name, run) or note
    assert (note == lab04.AVG_NOTE) == (name == "avg_of_float_counts"), note


@pytest.mark.parametrize("name, cause, fix", [
    ("confusion_matrix", "a 10 × 10 table", "write 2·P·R/(P + R) as one fraction"),
    ("tp_fp_fn", "3 per class", "write 2·P·R/(P + R) as one fraction"),
    ("counts_on_the_host", "No backend type associated with device type cpu",
     "torch.zeros(..., device=device)"),
    ("counts_on_a_written_cpu", "yours was made on the CPU", "never write a device out"),
    ("float16_counts", "is torch.float16, which holds whole numbers exactly only up to 2,048",
     "float32 (exact up to 2^24 = 16,777,216)"),
])
def test_budget_and_device_mistakes_get_their_fix_the_second_time(name, cause, fix):
    for attempt in range(2):
        with pytest.raises(LabCheckError) as err:
            _judge_f1(name)
        message = str(err.value)
        assert cause in message, message
        assert (fix in message) == (attempt == 1), message


def test_reference_f1_passes_on_one_and_four_ranks_without_a_note(tmp_path):
    # world sizes the lab never names: one rank (nothing to combine) and four (101 = 4 x 25 + 1);
    # f1_note is check_f1 returning the ✔'s note: the reference gets none (on the lab's 2 and 3
    # ranks too: solutions/lab04's ✔ line, which nbval compares, ends without it)
    assert lab04.f1_note(_write(tmp_path, _solution_script()), runs=((1, 50), (4, 101))) == ""


def test_f1_todo_raises_not_implemented(tmp_path):
    text = _body("    raise NotImplementedError('TODO: evaluate_f1')\n")
    with pytest.raises(NotImplementedError, match="still has a TODO in evaluate_f1"):
        lab04.check_f1(_write(tmp_path, text), runs=((2, 101),))


def test_f1_collective_on_one_rank_only_is_a_timeout_not_a_hang(tmp_path):
    body = STRIDED + _COUNT + "    if rank == 0:\n        dist.all_reduce(confusion)\n" \
        + F1_OF_COUNTS
    with pytest.raises(LabCheckError, match="did not finish within 8 s") as err:
        lab04.check_f1(_write(tmp_path, _body(body)), runs=((2, 101),), timeout=8)
    # rank 1 had returned: a diagnosed deadlock, so no hint that a longer timeout could help
    assert "no longer timeout can help" in str(err.value), str(err.value)
    assert "slowness" not in str(err.value), str(err.value)


def test_saved_f1_must_be_the_evaluated_number(tmp_path):
    # two scripts whose evaluate_f1 is the reference's: their F1 part launches once (the second
    # check's is replayed, its judgement run again); each script runs, and is judged, on its own
    with launches_replayed(_f1_run):
        text = _variant('{"model": model.module.state_dict(), "f1": f1}',
                        '{"model": model.module.state_dict(), "f1": 0.5}')
        with pytest.raises(LabCheckError, match="is not one process's F1"):
            lab04.check(_write(tmp_path, text), launcher="spawn", timeout=90,
                        f1_runs=((2, 101),))
        # evaluate_f1 is right; the main part saves torch.tensor(f1): the file does hold an 'f1'
        text = _variant('{"model": model.module.state_dict(), "f1": f1}',
                        '{"model": model.module.state_dict(), "f1": torch.tensor(f1)}')
        with pytest.raises(LabCheckError) as err:
            lab04.check(_write(tmp_path, text), launcher="spawn", timeout=90,
                        f1_runs=((2, 101),))
    message = str(err.value)
    assert "holds a tensor under 'f1' (shape ()), not a number" in message, message
    assert "holds no number" not in message, message


def test_tensor_return_gets_its_fix_the_second_time():
    for attempt in range(2):
        with pytest.raises(LabCheckError) as err:
            _judge_f1("returns_a_0d_tensor")
        message = str(err.value)
        assert "a CUDA tensor where a number belongs" in message, message
        assert ("float(...)" in message) == (attempt == 1), message


def test_unknown_variant_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown variant"):
        lab04.reference_weights(variant="nope")


# --- stretch: resume after a crash ------------------------------------------------------------
# Defined in this file, these functions travel to the ranks by value, as a notebook's do.

from dpcourse.ddp_practice import load_checkpoint, save_checkpoint  # noqa: E402


def _rng_states():
    import torch
    import torch.distributed as dist

    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, torch.get_rng_state())
    return states


def _cuda_states():
    # every rank's CUDA generators (an empty list on these CPU ranks): what a GPU run needs too
    import torch
    import torch.distributed as dist

    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, torch.cuda.get_rng_state_all())
    return states


def _restore_cuda(state):
    import torch
    import torch.distributed as dist

    torch.cuda.set_rng_state_all(state["cuda"][dist.get_rank()])


def save_cpu_rng_only(path, model, optimizer, epoch, is_main):
    # exact on CPUs; on GPUs dropout's masks come from CUDA's generators, never saved here
    rng = _rng_states()
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch, "rng": rng})


def resume_cpu_rng_only(path, model, optimizer):
    import torch
    import torch.distributed as dist

    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"][dist.get_rank()])
    return state["epoch"] + 1


def save_state(path, model, optimizer, epoch, is_main):
    rng, cuda = _rng_states(), _cuda_states()
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch, "rng": rng,
                               "cuda": cuda})


def resume_state(path, model, optimizer):
    import torch
    import torch.distributed as dist

    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"][dist.get_rank()])
    if "cuda" in state:
        _restore_cuda(state)
    return state["epoch"] + 1


def _gathered_state(model, optimizer, epoch, is_main):
    # gather_object to rank 0 only, the next epoch stored (None on the other ranks)
    import torch
    import torch.distributed as dist

    from torch.cuda import get_rng_state_all as cuda_states  # imported under another name

    rng = [None] * dist.get_world_size() if is_main else None
    dist.gather_object((torch.get_rng_state(), cuda_states()), rng, dst=0)
    return {"weights": model.module.state_dict(), "opt": optimizer.state_dict(),
            "next_epoch": epoch + 1, "generators": rng} if is_main else None


def save_gathered_to_rank0(path, model, optimizer, epoch, is_main):
    # right: torch.save to a file beside the checkpoint, then os.rename over it
    import os

    import torch

    state = _gathered_state(model, optimizer, epoch, is_main)
    if is_main:
        torch.save(state, f"{path}.partial")
        os.rename(f"{path}.partial", path)


def save_named_temporary(path, model, optimizer, epoch, is_main):
    # right: a NamedTemporaryFile in the checkpoint's folder, flushed, then os.replace
    import os
    import tempfile

    import torch

    state = _gathered_state(model, optimizer, epoch, is_main)
    if is_main:
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), delete=False) as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f.name, path)


def save_bytes_then_replace(path, model, optimizer, epoch, is_main):
    # right: serialized in memory, written to a temporary file, pathlib's replace over path
    import io
    from pathlib import Path

    import torch

    state = _gathered_state(model, optimizer, epoch, is_main)
    if is_main:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_bytes(buffer.getvalue())
        tmp.replace(path)


def save_plain_torch_save(path, model, optimizer, epoch, is_main):
    # wrong: torch.save straight to the checkpoint's path (truncates it, then writes)
    import torch

    state = _gathered_state(model, optimizer, epoch, is_main)
    if is_main:
        torch.save(state, path)


def save_bytes_in_place(path, model, optimizer, epoch, is_main):
    # wrong: serialized in memory first, then written over the checkpoint where it stands
    import io

    import torch

    state = _gathered_state(model, optimizer, epoch, is_main)
    if is_main:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        with open(path, "wb") as f:
            f.write(buffer.getvalue())


def save_remove_first(path, model, optimizer, epoch, is_main):
    # wrong: the old checkpoint deleted, then the new one written under its name
    import os

    import torch

    state = _gathered_state(model, optimizer, epoch, is_main)
    if is_main:
        if os.path.exists(path):
            os.remove(path)
        torch.save(state, path)


def save_then_copy(path, model, optimizer, epoch, is_main):
    # wrong: a complete temporary file, then copied over the checkpoint (not renamed)
    import shutil

    import torch

    state = _gathered_state(model, optimizer, epoch, is_main)
    if is_main:
        torch.save(state, f"{path}.tmp")
        shutil.copyfile(f"{path}.tmp", path)


def resume_gathered(path, model, optimizer):
    import os

    import torch
    import torch.distributed as dist
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.module.load_state_dict(state["weights"])
    optimizer.load_state_dict(state["opt"])
    cpu, cuda = state["generators"][dist.get_rank()]
    torch.random.set_rng_state(cpu)
    for device, generator in enumerate(cuda):
        torch.cuda.set_rng_state(generator, device)
    return state["next_epoch"]


def save_stacked_tensor(path, model, optimizer, epoch, is_main):
    # right: the generator states gathered as tensors (all_gather), stacked into one
    import torch
    import torch.distributed as dist

    mine = torch.get_rng_state()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    cuda = _cuda_states()
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch,
                               "rng": torch.stack(everyone), "cuda": cuda})


def resume_stacked(path, model, optimizer):
    import torch
    import torch.distributed as dist

    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"][dist.get_rank()].clone())
    _restore_cuda(state)
    return state["epoch"] + 1


def save_wrapper_state(path, model, optimizer, epoch, is_main):
    rng = _rng_states()
    if is_main:
        save_checkpoint(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                               "epoch": epoch, "rng": rng})


def resume_wrapper_state(path, model, optimizer):
    import torch
    import torch.distributed as dist

    state = load_checkpoint(path)
    if state is None:
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"][dist.get_rank()])
    return state["epoch"] + 1


def save_everywhere(path, model, optimizer, epoch, is_main):
    import os
    save_checkpoint(f"{path}.{os.environ['RANK']}" if not is_main else path,
                    {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch})


def save_own_rng_file(path, model, optimizer, epoch, is_main):
    # one file per rank for the generator: not the one file the task asks for
    import torch
    import torch.distributed as dist
    torch.save(torch.get_rng_state(), f"{path}.rng{dist.get_rank()}")
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch})


def save_no_rng(path, model, optimizer, epoch, is_main):
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch})


def resume_no_rng(path, model, optimizer):
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"] + 1


def save_rank0_rng(path, model, optimizer, epoch, is_main):
    import torch
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch,
                               "rng": torch.get_rng_state()})


def resume_rank0_rng(path, model, optimizer):
    import torch
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return state["epoch"] + 1


def save_weights_only(path, model, optimizer, epoch, is_main):
    rng = _rng_states()
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(), "epoch": epoch, "rng": rng})


def resume_weights_only(path, model, optimizer):
    import torch
    import torch.distributed as dist
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    torch.set_rng_state(state["rng"][dist.get_rank()])
    return state["epoch"] + 1


def _resume_variant(weights=True, optimizer_on="all", rng=True, offset=1):
    def resume(path, model, optimizer):
        import torch
        import torch.distributed as dist
        state = load_checkpoint(path)
        if state is None:
            return 0
        rank = dist.get_rank()
        if weights == "all" or (weights == "rank0" and rank == 0) or weights is True:
            model.module.load_state_dict(state["model"])
        if optimizer_on == "all" or (optimizer_on == "rank0" and rank == 0):
            optimizer.load_state_dict(state["optimizer"])
        if rng:
            torch.set_rng_state(state["rng"][rank])
        return state["epoch"] + offset
    return resume


def resume_never(path, model, optimizer):
    return 0


def _resume_pairs() -> dict:
    """Every (save, resume) the tests judge whose first run passes and whose code raises
    nowhere, by the test id that judges it."""
    return {
        "reference": (save_state, resume_state),
        "gather-to-rank0-rename-next-epoch": (save_gathered_to_rank0, resume_gathered),
        "named-temporary-file-replace": (save_named_temporary, resume_gathered),
        "bytes-in-memory-path-replace": (save_bytes_then_replace, resume_gathered),
        "all-gather-stacked": (save_stacked_tensor, resume_stacked),
        "current-gpu-gathered": (save_cuda_current, resume_cuda_current),
        "guarded-by-is-available": (save_cuda_if_available, resume_cuda_if_available),
        "cpu-rng-only": (save_cpu_rng_only, resume_cpu_rng_only),
        "rank0-cuda-everywhere": (save_cuda_rank0_only, resume_cuda_everywhere),
        "learner-lr2-04-guarded": (save_lr2_04, resume_lr2_04),
        "gpu0-on-every-rank": (save_cuda_device0, resume_cuda_device0),
        "saved-not-restored": (save_state, resume_cuda_not_restored),
        "no-optimizer": (save_weights_only, resume_weights_only),
        "optimizer-rank0-only": (save_state, _resume_variant(optimizer_on="rank0")),
        "weights-rank0-only": (save_state, _resume_variant(weights="rank0")),
        "no-weights": (save_state, _resume_variant(weights=False)),
        "repeat-epoch": (save_state, _resume_variant(offset=0)),
        "from-zero": (save_state, lambda p, m, o: _resume_variant()(p, m, o) and 0),
        "never": (save_state, resume_never),
        "no-rng": (save_no_rng, resume_no_rng),
        "rng-not-loaded": (save_state, _resume_variant(rng=False)),
        "rank0-rng-everywhere": (save_rank0_rng, resume_rank0_rng),
        "plain-torch-save": (save_plain_torch_save, resume_gathered),
        "bytes-written-in-place": (save_bytes_in_place, resume_gathered),
        "removed-then-saved": (save_remove_first, resume_gathered),
        "copied-over": (save_then_copy, resume_gathered),
    }


@functools.lru_cache(maxsize=None)
def _resume_batch() -> dict:
    """check_resume's runs of every pair of _resume_pairs, from four launches in all
    (lab04.resume_runs: the first runs, the runs after the crash, the uninterrupted runs, the
    stopped saves), each pair's functions run in turn in one process group, as check_resume
    runs them alone; about 100 launches before."""
    pairs = _resume_pairs()
    folder = tempfile.mkdtemp(prefix="dpcourse-test-lab04-resume-")
    try:
        runs = lab04.resume_runs(list(pairs.values()), folder, timeout=90)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return dict(zip(pairs, runs))


def _judge_resume(name, plan=None) -> None:
    """check_resume's verdict on pair ``name`` (judge_resume_runs: what check_resume judges
    once the first run passed), from the batch: its ✔ or the LabCheckError it raises."""
    r = _resume_batch()[name]
    lab04.judge_resume_runs(r["first"], r["second"], r["whole"], r["crash"], plan)


# check_resume end to end on the reference (its launches one after another, the ✔ with "2
# stand-in GPUs ... each rank got back the CUDA generator states it had at the crash" and "a
# save stopped halfway left the previous checkpoint readable"): solutions/lab04's nbval run
# (its save_training_state and resume_training_state are save_state and resume_state, one
# gather instead of two); the tests below judge the same runs of many answers from one batch
# (_judge_resume), and test_resume_mistakes_of_the_first_run_are_named runs check_resume itself.


@pytest.mark.parametrize("name", ["reference", "gather-to-rank0-rename-next-epoch",
                                  "named-temporary-file-replace", "bytes-in-memory-path-replace",
                                  "all-gather-stacked"])
def test_right_resumes_pass(name, capsys):
    _judge_resume(name)
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("✔") == 1, out
    assert ("with 2 stand-in GPUs on each rank behind torch.cuda's random-state functions: "
            "each rank got back the CUDA generator states it had at the crash") in out, out
    assert "read in your code" not in out, out
    assert "a save stopped halfway left the previous checkpoint readable" in out, out


def test_a_resume_exact_on_cpus_only_is_refused_for_gpus():
    # the CPU runs pass; the code never touches CUDA's generators: cause, then the fix
    for attempt in range(2):
        with pytest.raises(LabCheckError) as err:
            _judge_resume("cpu-rng-only")
        message = str(err.value)
        assert ("save_training_state reads and resume_training_state restores no state of "
                "CUDA's generators") in message, message
        assert "stood in 2 GPUs on each rank behind those functions" in message, message
        assert "it never called them" in message, message
        assert ("torch.cuda.get_rng_state_all()" in message) == (attempt == 1), message


def save_cuda_rank0_only(path, model, optimizer, epoch, is_main):
    # wrong (learner LR2_04): the CPU states gathered, CUDA's read on rank 0 only
    import torch
    rng = _rng_states()
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch, "rng": rng,
                               "cuda": torch.cuda.get_rng_state_all()})


def resume_cuda_everywhere(path, model, optimizer):
    import torch
    import torch.distributed as dist
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"][dist.get_rank()])
    torch.cuda.set_rng_state_all(state["cuda"])
    return state["epoch"] + 1


def save_cuda_device0(path, model, optimizer, epoch, is_main):
    # wrong: every rank's GPU 0 gathered (rank 1 runs on GPU 1)
    import torch
    import torch.distributed as dist
    rng = _rng_states()
    cuda = [None] * dist.get_world_size()
    dist.all_gather_object(cuda, torch.cuda.get_rng_state(0))
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch, "rng": rng,
                               "cuda": cuda})


def resume_cuda_device0(path, model, optimizer):
    import torch
    import torch.distributed as dist
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"][dist.get_rank()])
    torch.cuda.set_rng_state(state["cuda"][dist.get_rank()], 0)
    return state["epoch"] + 1


def save_cuda_current(path, model, optimizer, epoch, is_main):
    # right: each rank's current GPU (its own), gathered beside the CPU states
    import torch
    import torch.distributed as dist
    mine = (torch.get_rng_state(), torch.cuda.get_rng_state())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch,
                               "rng": everyone})


def resume_cuda_current(path, model, optimizer):
    import torch
    import torch.distributed as dist
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    cpu, cuda = state["rng"][dist.get_rank()]
    torch.set_rng_state(cpu)
    torch.cuda.set_rng_state(cuda)
    return state["epoch"] + 1


def save_cuda_if_available(path, model, optimizer, epoch, is_main):
    # right: CUDA's states read only where there is a GPU (the stand-ins say there is)
    import torch
    import torch.distributed as dist
    mine = {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch,
                               "rng": everyone})


def resume_cuda_if_available(path, model, optimizer):
    import torch
    import torch.distributed as dist
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    mine = state["rng"][dist.get_rank()]
    torch.set_rng_state(mine["cpu"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all(mine["cuda"])
    return state["epoch"] + 1


def resume_cuda_not_restored(path, model, optimizer):
    # wrong: CUDA's states saved, but only read back into a variable
    import torch
    import torch.distributed as dist
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"][dist.get_rank()])
    return state["epoch"] + 1


@pytest.mark.parametrize("name", ["current-gpu-gathered", "guarded-by-is-available"])
def test_more_right_cuda_resumes_pass(name, capsys):
    _judge_resume(name)
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("✔") == 1 and "each rank got back the CUDA generator states" in out, out


def save_lr2_04(path, model, optimizer, epoch, is_main):
    # learner LR2_04's code as written: CUDA's states read on rank 0 only, if there is a GPU
    import torch
    import torch.distributed as dist
    rng = {"cpu": torch.get_rng_state()}
    all_rng = [None] * dist.get_world_size()
    dist.all_gather_object(all_rng, rng)
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch,
                               "rng": all_rng, "cuda_rng": torch.cuda.get_rng_state_all()
                               if torch.cuda.is_available() else []})
    dist.barrier()


def resume_lr2_04(path, model, optimizer):
    import torch
    import torch.distributed as dist
    ckpt = load_checkpoint(path)
    if ckpt is None:
        return 0
    model.module.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"][dist.get_rank()]["cpu"])
    if ckpt["cuda_rng"]:
        torch.cuda.set_rng_state_all(ckpt["cuda_rng"])  # rank 0's GPU state, on every rank
    return ckpt["epoch"] + 1


@pytest.mark.parametrize("name", ["rank0-cuda-everywhere", "learner-lr2-04-guarded"])
def test_rank0s_cuda_state_on_every_rank_is_refused_by_running_it(name):
    # learner LR2_04: get_rng_state_all() from rank 0 only, set_rng_state_all on every rank
    for attempt in range(2):
        with pytest.raises(LabCheckError) as err:
            _judge_resume(name)
        message = " ".join(str(err.value).split())
        assert re.search(r"After the resume rank 1's CUDA generators held rank 0's states at "
                         r"the crash \(GPU 0: seed 1, offset \d+, GPU 1: seed 1, offset 0\), "
                         r"not the ones rank 1 itself had \(GPU 0: seed 2, offset 0, GPU 1: "
                         r"seed 2, offset \d+\)", message), message
        assert "rank 1 would from then on draw the dropout masks rank 0 draws" in message
        assert ("give each rank its own back" in message) == (attempt == 1), message


@pytest.mark.parametrize("name", ["gpu0-on-every-rank", "saved-not-restored"])
def test_a_cuda_state_not_given_back_is_refused_with_the_rank_named(name):
    with pytest.raises(LabCheckError) as err:
        _judge_resume(name)
    message = " ".join(str(err.value).split())
    if name == "saved-not-restored":
        assert "resume_training_state restores no state of CUDA's generators" in message
        return
    assert re.search(r"After the resume rank 1's CUDA generators held GPU 0: seed 2, offset 0, "
                     r"GPU 1: seed 2, offset 0, not the states they had at the crash \(GPU 0: "
                     r"seed 2, offset 0, GPU 1: seed 2, offset \d+;", message), message


def test_the_stand_in_gpus_replace_torch_cuda_only_while_the_code_runs():
    import torch

    from dpcourse.checks._lab04_fakecuda import FakeCuda

    from torch.cuda import get_rng_state_all as imported

    def save():
        return imported(), torch.cuda.get_rng_state(1)

    real = torch.cuda.get_rng_state_all
    gpus = FakeCuda(2, 1, 7)
    gpus.draw()
    with gpus.installed(save):
        states, one = save()
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2
        torch.cuda.manual_seed_all(3)
        assert gpus.states() == [(3, 0), (3, 0)]
        torch.cuda.set_rng_state_all(states)
    assert gpus.got and gpus.set and gpus.states() == [(7, 0), (7, 4)]
    assert torch.equal(one, states[1]) and one.dtype == torch.uint8 and one.numel() == 16
    assert torch.cuda.get_rng_state_all is real and save.__closure__[0].cell_contents is real
    with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):
        gpus.set_rng_state(states)


@pytest.mark.parametrize("choice, verdict", [
    ("weights, optimizer state, epoch, each rank's random state", "— right."),
    ("weights, optimizer state, epoch, each rank's random state, the data order",
     "— not what happened."),
])
def test_the_resume_plan_is_compared_with_what_the_runs_showed(choice, verdict, capsys):
    from dpcourse.checks import predict

    plan = predict("lab04", lab04.RESUME_PLAN_QUESTION, choice, choices=lab04.RESUME_PLANS)
    _judge_resume("reference", plan)
    out = " ".join(capsys.readouterr().out.split())
    assert ("measured: weights, optimizer state, epoch, each rank's random state "
            + verdict) in out, out
    assert "set_epoch(2) dealt the same indices" in out, out
    assert "differed from each other (yes)" in out, out


RESUME_MISTAKE_PHRASES = {
    "no-optimizer": "optimizer's state was not restored",
    "optimizer-rank0-only": "restored on rank 0 only: the other ranks' momentum",
    "weights-rank0-only": "weights were restored on rank 0 only",
    "no-weights": "continued from fresh weights",
    "repeat-epoch": "repeated the epoch",
    "from-zero": "started again at epoch 0",
    "never": "started from scratch",
    "no-rng": "random state was not restored",
    "rng-not-loaded": "random state was not restored",
    "rank0-rng-everywhere": "rank 1's random generator held rank 0's state",
}


@pytest.mark.parametrize("name", list(RESUME_MISTAKE_PHRASES))
def test_resume_mistakes_are_named(name):
    with pytest.raises(LabCheckError) as err:
        _judge_resume(name)
    assert RESUME_MISTAKE_PHRASES[name] in str(err.value), str(err.value)


# named by check_resume itself: its first run (one launch) or the resumed run's raise
@pytest.mark.parametrize("save, resume, phrase", [
    (save_everywhere, resume_state, "rank 1 wrote a file"),
    (save_own_rng_file, resume_no_rng, "rank 1 wrote a file"),
    (save_wrapper_state, resume_wrapper_state, "keys start with 'module.'"),
    (save_stacked_tensor, resume_state, "storage offset"),
], ids=["save-everywhere", "rng-file-per-rank", "wrapper-keys", "rng-row-view"])
def test_resume_mistakes_of_the_first_run_are_named(save, resume, phrase):
    with pytest.raises(LabCheckError) as err:
        lab04.check_resume(save, resume)
    assert phrase in str(err.value), str(err.value)


@pytest.mark.parametrize("name, how", [
    ("plain-torch-save", "the old file was emptied and written again where it stood"),
    ("bytes-written-in-place", "the old file was emptied and written again where it stood"),
    ("removed-then-saved", "the old file was deleted before the new one was complete"),
])
def test_a_save_that_a_crash_can_split_is_refused(name, how):
    # the resume is exact, but the save stopped halfway leaves no checkpoint: cause, then fix
    for attempt in range(2):
        with pytest.raises(LabCheckError) as err:
            _judge_resume(name)
        message = " ".join(str(err.value).split())
        assert "A crash while saving destroys your checkpoint" in message, message
        assert re.search(r"a complete checkpoint \(([\d,]+) bytes, epoch 0\), then stopped its "
                         r"next save halfway", message), message
        assert re.search(r"refused writes past [\d,]+ bytes\)\. Afterwards the file at path "
                         r"held [\d,]+ bytes that torch\.load cannot read", message), message
        assert how in message, message
        assert ("os.replace it over path" in message) == (attempt == 1), message


def test_a_checkpoint_copied_over_in_place_is_refused():
    # the temporary file is complete before the copy, so the stopped save leaves the old
    # checkpoint; but the copy rewrites the checkpoint's own file: the inode shows it
    with pytest.raises(LabCheckError) as err:
        _judge_resume("copied-over")
    message = str(err.value)
    assert re.search(r"Rank 0's save at the end of epoch 1 rewrote the checkpoint where it "
                     r"stood: the file at path was the same file \(inode \d+\) before and "
                     r"after", message), message


def test_resume_refuses_an_unfilled_todo():
    def save(path, model, optimizer, epoch, is_main):
        raise NotImplementedError("TODO")

    with pytest.raises(NotImplementedError, match="save_training_state still raises"):
        lab04.check_resume(save, resume_state)


def _f1_run(worker, world_size, args, kwargs, timeout):
    """The key of one check_f1 launch (conftest.launches_replayed): what the ranks run of the
    script (its source less what _namespace leaves out: the main part), the world size, the
    test images; None for any other launch."""
    import ast

    from dpcourse.checks import _lab04_f1

    if worker is not _lab04_f1._f1_worker:
        return None
    source, n_test = args[:2]
    kept = [ast.dump(node) for node in ast.parse(source).body
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef,
                                 ast.Assign, ast.AnnAssign))]
    return (world_size, tuple(kept), n_test, timeout)


def test_a_repeated_f1_mistake_gets_its_fix_the_second_time(tmp_path):
    # the same script checked twice: launched once, the ranks' results replayed the second
    # time; check_f1's judgement and its memory of the mistake run again on them
    body, _ = F1_WRONG["mean_of_f1"]
    path = _write(tmp_path, _body(body))
    with launches_replayed(_f1_run):
        for attempt in range(2):
            with pytest.raises(LabCheckError) as err:
                lab04.check_f1(path, runs=((2, 101),))
            message = str(err.value)
            assert "F1 scores were averaged" in message
            assert ("compute F1 once from the sums" in message) == (attempt == 1), message


# --- where the exchanged tensors would live (checks/_lab04_exchange.py) ---------------------

def test_the_device_spy_follows_where_tensors_would_live():
    import torch

    from dpcourse.checks._lab04_exchange import WhereTensorsLive, count_numbers, mark, on_device

    device = torch.device("cpu")
    weight = torch.ones(3)
    mark(weight, True)  # a parameter of the model, which lives on the device
    with WhereTensorsLive(device):
        host = torch.zeros(3)
        made_there = torch.zeros(3, device=device)
        moved = torch.arange(3).to(device)
        computed = weight * torch.arange(3) + 1
        back_on_host = computed.cpu()
        host += computed  # in place: stays where it was (on a GPU this line raises)
        like = torch.zeros_like(computed)
        tp, both = torch.stack([computed, computed]).double()
    assert [on_device(t) for t in (host, made_there, moved, computed, back_on_host, like, tp,
                                   both)] == [False, True, True, True, False, True, True, True]
    assert count_numbers([[1, 2.0], {"a": torch.zeros(2, 3)}, "text"]) == 8


def test_the_device_spy_tells_a_written_cpu_from_the_device_the_check_gives():
    import torch

    from dpcourse.checks._lab04_exchange import _NAMED, WhereTensorsLive, mark, on_device

    device = torch.device("cpu", 0)  # what the check hands evaluate_f1
    weight = torch.ones(3)
    mark(weight, True)
    with WhereTensorsLive(device):
        written = torch.zeros(3, device="cpu")
        read_back = torch.zeros(3, device=(weight * 2).device)
        named = torch.zeros(3, device=str(device))
        moved_to_cpu = weight.to("cpu")
    assert [on_device(t) for t in (written, read_back, named, moved_to_cpu)] == [
        False, True, True, False]
    assert getattr(written, _NAMED) == "cpu" and getattr(moved_to_cpu, _NAMED) == "cpu"


def test_the_spys_shortcut_finds_the_tensors_pytree_finds():
    # WhereTensorsLive reads plain arguments without torch's pytree (_tensors_in, for speed):
    # the same tensors in the same order, whether it reads them or hands them to pytree
    import collections

    import torch
    from torch.utils._pytree import tree_leaves

    from dpcourse.checks._lab04_exchange import _tensors_in

    a, b, p = torch.zeros(2), torch.ones(3), torch.nn.Parameter(torch.zeros(1))
    pair = collections.namedtuple("Pair", "x y")(a, b)
    for args, kwargs in [((a, 1, slice(0, 2)), {}), ((a, (2, 3)), {"dim": 0}),
                         (([a, b], 0), {"out": None}), ((p, torch.float16, torch.Size([2])), {}),
                         ((pair,), {}), ((b, [a, (p, "s")]), {"d": {"k": a}}),
                         ((..., [b, [a]]), {"device": torch.device("cpu")}), ((), {})]:
        want = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        got = _tensors_in(args, kwargs)
        assert len(got) == len(want) and all(g is w for g, w in zip(got, want)), (args, kwargs)
