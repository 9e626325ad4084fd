"""Check for lab 04: a metric that is not a mean (macro-F1), evaluated inside a torchrun DDP
script so that it equals one process.

``check(path)`` does two things:

1. It takes ``evaluate_f1`` (and the given ``macro_f1(y_true, y_pred)``, which defines the
   number) out of the learner's script and calls it on 2 ranks with 301 test images and on 3
   ranks with 302 (neither splits evenly), with a model whose forward counts the images each
   rank evaluates, its mode and whether autograd is on; each rank calls it a second time on a
   test set 4 times larger while the collectives it calls are recorded. Every rank must return
   one process's macro-F1 of the whole test set, each image evaluated exactly once over all
   ranks, in eval mode without autograd, send no more for the larger set, pass fewer than 3
   numbers per class into its collectives (which counts is the learner's decision), and pass
   only tensors
   that would live on ``device`` on a GPU (followed by ``_lab04_exchange``). When it does
   not, the sentence names the mistake: ranks that return their own shard's number (no
   collective), or the sum on one rank only (``dist.reduce``: the destination's F1 is right,
   the others keep a partial sum), images
   counted twice (a second pass over one rank's share, or shares that overlap:
   DistributedSampler's padding is named only where one image is on two ranks), images
   skipped, a rank left idle while another evaluates everything, every rank evaluating
   everything, the ranks' F1 scores averaged (plainly or weighted by their images) or summed,
   the ranks' per-class precisions and recalls
   averaged, the accuracy instead of F1, the labels or
   predictions themselves gathered (what is sent grows with the test set), the confusion
   matrix or three counts per class (over the budget), two counts that give only the
   precision or only the recall, counts passed in a dtype that cannot hold every count of the
   contract's 10^5-image test set exactly (float16, bfloat16, uint8: ``_lab04_exchange``
   records the dtype handed to each collective; float32, exact up to 2^24, and the 32- and
   64-bit integers pass), a tensor made on the host or on a device written out (``"cpu"``:
   NCCL would refuse it), a tensor
   returned instead of a float (the torchrun part names a tensor saved under 'f1' too). Counts averaged with ``ReduceOp.AVG`` pass, and the ✔ says why.
2. It runs the whole script under torchrun (2 processes) and compares the weights it writes to
   ``--out`` with one process trained on the global batch, and the F1 it saved with one
   process's F1 of those weights. A script that fails under torchrun is reported with the
   child's own exception (the rank torchrun names as the root cause), not the agent's
   ``ChildFailedError``. The training part of the script is given; if a learner breaks it, we
   replay the plausible wrong conversions in one process and name the one whose weights the
   script reproduced:

* no DistributedSampler: every rank reads the same batches, so the global batch is halved;
* the per-rank batch left at the global batch: the global batch is multiplied by N;
* the per-rank batch written as ``global_batch // 2`` (right on 2 ranks only);
* the learning rate multiplied by the world size (the global batch did not change);
* ``sampler.set_epoch`` forgotten: every epoch repeats epoch 0's order;
* the sampler's seed left at its default: the data order ignores ``--seed``;
* ``drop_last`` removed: a short last batch the single-device script never takes (3 ranks);
* no DDP wrapper: rank 0 trained alone on its half of the data.

Saving on every rank is caught directly: the check records every ``torch.save`` per rank; a
checkpoint saved from the DDP wrapper (``module.`` keys) is refused, since the plain model that
evaluation and resuming build cannot load it.

``check_prediction`` compares the learner's prediction of the mean of 8 ranks' macro-F1 (a model
that is always right, 101 images dealt round-robin, so each rank lacks some classes) with the
measured mean, and says why. ``check_resume`` (the stretch) trains a model
with dropout, each rank drawing from its own random stream, "crashes" it after epoch 1 and
resumes it; it compares each rank's weights, momentum and generator state after the resume with
what that rank had at the crash (so a mistake is named by its cause: the optimizer or the
weights restored on rank 0 only, rank 0's generator state given to every rank ...), refuses a
checkpoint holding the DDP wrapper's weights or a file written by another rank, compares
the final weights with an uninterrupted run, refuses a save that a crash can split (it stops
one save halfway with a file-size limit and reads what is left at the path; and a checkpoint
rewritten in its own inode), and, with stand-in GPUs behind torch.cuda's random-state
functions, that each rank gets back its own CUDA generator states; given the learner's
recorded plan (what a resume must restore), it compares it with what the runs showed.
For the tests, :func:`f1_results` and :func:`resume_runs` run many answers in one launch per
run (each answer's code in turn in one process group, as a launch of its own would run it: a
launch costs more than the work it runs), judged by :func:`judge_f1` and
:func:`judge_resume_runs`, the judgements the checks make.
Used in solutions/lab04_ddp_in_practice.py; tests in tests/test_lab04_checks.py. This module
holds ``check``, the prediction and the names; the macro-F1 check is in
:mod:`dpcourse.checks._lab04_f1`, running the script and judging its training live in
:mod:`dpcourse.checks._lab04_script`, the stretch in :mod:`dpcourse.checks._lab04_resume`, what
``evaluate_f1`` exchanges in :mod:`dpcourse.checks._lab04_exchange` — every name is importable
from here.
"""

from __future__ import annotations

from dataclasses import asdict

from dpcourse.checks import check_timeout, fail, passed, recorded
from dpcourse.checks._lab04_f1 import (AVG_NOTE, F1_FIXES, F1_MISTAKES, F1_RUNS, NUM_CLASSES,
                                       _f1_of, _namespace, check_f1, f1_note, f1_results,
                                       judge_f1)
from dpcourse.checks._lab04_resume import (RESUME_CFG, RESUME_FIXES, RESUME_MISTAKES, RESUME_PLANS,
                                           RESUME_PLAN_QUESTION, check_resume, judge_resume_runs,
                                           resume_runs)
from dpcourse.checks._lab04_script import (CONFIGS, MISTAKE_FIXES, MISTAKES, Lab04Config,
                                           _last_error_line, _mistake, _spawn_worker, judge,
                                           reference_weights, run_script)

__all__ = ["Lab04Config", "CONFIGS", "F1_RUNS", "reference_weights", "run_script", "judge",
           "check_f1", "f1_note", "f1_results", "judge_f1", "check", "resume_runs",
           "judge_resume_runs", "check_prediction", "check_resume", "MISTAKES",
           "PREDICTION_QUESTION", "PREDICTION_RANKS", "RESUME_PLANS", "RESUME_PLAN_QUESTION",
           "F1_MISTAKES", "RESUME_MISTAKES", "F1_FIXES", "RESUME_FIXES", "MISTAKE_FIXES",
           "AVG_NOTE", "NUM_CLASSES", "RESUME_CFG"]


def _saved_f1_reference(weights: dict, cfg: "Lab04Config", n_test: int = 101) -> float:
    """One process's macro-F1 of the saved weights on the lab script's test set."""
    import torch

    from dpcourse import data, models

    model = models.SmallCNN(width=cfg.width)
    model.load_state_dict(weights)
    ds = data.load("shapes10", n_train=cfg.n_train, n_test=n_test, seed=cfg.seed)
    X, y = data.to_torch(ds.x_test, ds.y_test).tensors
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            pred = model.eval()(X).argmax(1)
    finally:
        torch.set_num_threads(prev)
    return _f1_of(torch.bincount(y * 10 + pred, minlength=100).view(10, 10))


@recorded
def check(path="train_lab.py", cfgs=CONFIGS[:1], launcher: str = "torchrun",
          timeout: float | None = None, f1_runs=F1_RUNS) -> None:
    """The lab's check: ``evaluate_f1`` on 2 and 3 ranks (:func:`check_f1`), then the whole
    script under torchrun (2 ranks; pass ``cfgs=CONFIGS`` for 3 ranks with another seed and
    global batch too), comparing its weights and the F1 it saved with one process.
    ``timeout``: 120 s per run (90 s for the F1 part), or ``DPCOURSE_CHECK_TIMEOUT`` if more."""
    __tracebackhide__ = True
    f1_timeout = check_timeout(timeout, 90.0)
    timeout = check_timeout(timeout, 120.0)
    if isinstance(cfgs, Lab04Config):
        cfgs = (cfgs,)
    note = f1_note(path, f1_runs, timeout=f1_timeout) if f1_runs else ""
    for cfg in cfgs:
        weights, saves, _, f1 = run_script(path, cfg, launcher=launcher, timeout=timeout)
        judge(weights, saves, cfg)
        if f1_runs:
            where = "" if cfg == CONFIGS[0] else f"On {cfg.describe()}: "
            if _is_tensor(f1):
                fail(f"{where}the checkpoint your script wrote to --out holds a tensor under "
                     f"'f1' (shape {tuple(f1.shape)}), not a number: on GPUs it would be a CUDA "
                     f"tensor, which a machine without a GPU cannot load without map_location.",
                     fix="save float(f1): evaluate_f1 returns a Python float, and the script "
                         "saves that value as it is.")
            if not isinstance(f1, (int, float)) or isinstance(f1, bool):
                fail(f"{where}the checkpoint your script wrote to --out holds no number under "
                     f"'f1'.", fix="save {'model': ..., 'f1': f1} on rank 0.")
            want = _saved_f1_reference(weights, cfg)
            if abs(f1 - want) > 1e-6:
                fail(f"{where}the F1 your script saved ({f1:.6f}) is not one process's F1 of the "
                     f"weights it saved ({want:.6f}).",
                     fix="save the value evaluate_f1 returned after training, computed with "
                         "model.module.")
    runs = " and ".join(str(w) for w, _ in f1_runs)
    ranks = " and ".join(str(c.world_size) for c in cfgs)
    passed((f"evaluate_f1 equals one process's macro-F1 on {runs} ranks, each image once; "
            if f1_runs else "") + f"your torchrun script ends with the reference weights on "
           f"{ranks} ranks (DDP == one process on the global batch)." + note)


def _is_tensor(value) -> bool:
    import torch

    return torch.is_tensor(value)


def config_dict(cfg: Lab04Config = Lab04Config()) -> dict:
    return asdict(cfg)


# --- the prediction: the ranks' macro-F1 averaged, on a fair split over many ranks ---------

PREDICTION_RANKS = 8  # the lab's 101 test images dealt round-robin to 8 ranks (12 or 13 each)
PREDICTION_QUESTION = ("mean of 8 ranks' macro-F1, always right, 101 images dealt round-robin")


def check_prediction(guess, labels, per_rank, whole=None) -> None:
    """Compare the learner's prediction of the mean of the ranks' macro-F1 (a model that is
    always right; ``labels`` dealt round-robin, rank r holding ``labels[r::N]`` with N =
    ``len(per_rank)``; ``per_rank`` each rank's measured macro-F1) with the measured mean, and
    explain the gap: every rank scores the classes it holds 1 and the ones it lacks 0.
    ``whole``, the whole set's macro-F1, is printed with the ranks' values, and only after
    ``guess`` is found to be a recorded prediction: nothing measured shows before it is."""
    __tracebackhide__ = True
    import torch

    from dpcourse.checks import Prediction, reveal

    if not isinstance(guess, Prediction):
        fail(f"the measurement needs your prediction first, got {type(guess).__name__}: write "
             f"your number in the prediction cell above, run it, then run this cell again.")
    labels = torch.as_tensor(labels)
    if whole is not None:
        print(f"whole test set: {whole:.2f}; ranks: {', '.join(f'{v:.2f}' for v in per_rank)}")
    N = len(per_rank)
    measured = sum(per_rank) / N
    held = [len(set(labels[r::N].tolist())) for r in range(N)]
    sizes = sorted({len(labels[r::N]) for r in range(N)})
    classes = NUM_CLASSES
    close = isinstance(guess.value, (int, float)) and abs(guess.value - measured) <= 0.1
    reveal(guess, round(measured, 2), close=close, explanation=(
        f"Every prediction is right, so on a rank each class it holds scores F1 1, and each "
        f"class it holds no image of scores 0 (nothing is truly of it, nothing predicted as "
        f"it), while macro_f1 still averages over all {classes}. With only "
        f"{' or '.join(map(str, sizes))} images per rank, a fair deal still leaves classes out: "
        f"the ranks held {', '.join(map(str, held))} of the {classes} classes, so they reported "
        f"{', '.join(f'{v:.1f}' for v in per_rank)}, mean {measured:.2f}, where the whole set's "
        f"macro-F1 is {1.0 if whole is None else whole:.2f}. Nothing was sorted by class: the "
        f"shortcut loses more the more ranks "
        f"share a small test set, and counts added over the ranks lose nothing (a class a rank "
        f"lacks adds zeros)."))
