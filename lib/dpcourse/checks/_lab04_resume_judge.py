"""How lab 04's stretch check reads its runs (resume after a crash): the plans a learner may
record, each mistake's cause and its fix, and the judges that compare each rank's weights,
momentum and random state after the resume with what that rank had at the crash, the stopped
save's file with the checkpoint it should have left, and the final weights with an
uninterrupted run's. :mod:`dpcourse.checks._lab04_resume` runs the learner's code and calls
these; kept apart so that each file holds one idea: running the stretch, and reading what it did.
"""

from __future__ import annotations

import os

from dpcourse.checks import fail
from dpcourse.checks._lab04_script import Lab04Config, _distance, _mistake


# The resumed run and the uninterrupted one are the same 2-rank DDP computation (one thread per
# rank), so a right resume ends with bit-identical weights; the bound only absorbs a kernel
# that is not deterministic. Every resume mistake lands 1e-3 or more away.
RESUME_TOL = 1e-5
_CRASH_AFTER = 1  # the first run stops after epoch 1 of 0, 1, 2 (as if killed right then)

# The stretch's decision, recorded before the code: the least a resumed run must restore, on
# the check's loop (CPU, dropout, each rank seeded seed + 1 + rank), to continue bit for bit.
RESUME_PLAN_QUESTION = "the least a resume must restore to continue bit for bit (the check's loop)"
_W = "weights, optimizer state, epoch"
RESUME_PLANS = (
    _W,
    f"{_W}, the data order",
    f"{_W}, rank 0's random state",
    f"{_W}, each rank's random state",
    f"{_W}, each rank's random state, the data order",
)

RESUME_MISTAKES = {  # the cause; what to change is in RESUME_FIXES (the second meeting)
    "wrapper_keys": "The checkpoint holds the DDP wrapper's weights (their keys start with "
                    "'module.'), though the task says to save the unwrapped weights: a plain "
                    "model, for evaluation or a run without DDP, cannot load them.",
    "no_optimizer": "The optimizer's state was not restored: SGD's momentum restarted from zero "
                    "after the crash.",
    "optimizer_rank0": "The optimizer's state was restored on rank 0 only: the other ranks' "
                       "momentum restarted from zero, and every rank steps its own copy of the "
                       "weights with its own optimizer, so the ranks drift apart.",
    "repeat_epoch": "The resumed run repeated the epoch it had already finished.",
    "from_zero": "The resumed run started again at epoch 0 (with the saved weights).",
    "no_weights": "The resumed run continued from fresh weights.",
    "weights_rank0": "The weights were restored on rank 0 only: the other ranks continued from "
                     "fresh weights. DDP copies rank 0's weights to the others when it wraps "
                     "the model, not when you load them later.",
    "no_rng": "The ranks' random state was not restored: after the crash, dropout drew masks "
              "the uninterrupted run never drew, so the weights differ.",
    "rng_rank0": "After the resume rank 1's random generator held rank 0's state at the crash, "
                 "not the state rank 1 itself had: from then on rank 1 draws the dropout masks "
                 "rank 0 draws, which the uninterrupted run never did.",
}
RESUME_FIXES = {
    "wrapper_keys": "Save model.module.state_dict().",
    "no_optimizer": "Save optimizer.state_dict() and load it back.",
    "optimizer_rank0": "Load the optimizer's state on every rank.",
    "repeat_epoch": "Return the first epoch still to do, the saved epoch + 1.",
    "from_zero": "Return the first epoch still to do, the saved epoch + 1.",
    "no_weights": "Load the saved model weights (model.module.load_state_dict(...)).",
    "weights_rank0": "Load the weights on every rank.",
    "no_rng": "Save each rank's random number generator state and restore it.",
    "rng_rank0": "Each rank has a random stream of its own: make the one file hold every "
                 "rank's random state, and each rank restore its own.",
}


def _same(a, b) -> bool:
    import torch

    if a is None or b is None:
        return a is None and b is None
    return all(x is not None and y is not None and x.shape == y.shape and torch.equal(x, y)
               for x, y in zip(a, b)) and len(a) == len(b)


def _wrapper_keys(state) -> bool:
    """True if the checkpoint holds a state_dict saved from the DDP wrapper ('module.' keys)."""
    if isinstance(state, dict):
        if any(isinstance(k, str) and k.startswith("module.") for k in state):
            return True
        return any(_wrapper_keys(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(_wrapper_keys(v) for v in state)
    return False


def _reveal_plan(plan, first, second, whole, cfg) -> None:
    """Compare the learner's recorded plan with the least the runs showed a resume needs."""
    import torch

    from dpcourse.checks import reveal

    last = cfg.epochs - 1
    moved = [not torch.equal(r["crashed"]["rng"], r["seeded"]) for r in first]
    own = not torch.equal(first[0]["crashed"]["rng"], first[1]["crashed"]["rng"])
    same_order = all(a["orders"].get(last) == b["orders"].get(last)
                     for a, b in zip(second, whole))
    needed = _W
    if any(moved):
        needed += ", each rank's random state" if own else ", rank 0's random state"
    if not same_order:
        needed += ", the data order"
    reveal(plan, needed, close=plan.value == needed, explanation=(
        f"The weights and the optimizer's momentum are the same on every rank, and the epoch "
        f"says where to start. The check's model has dropout, and each rank was seeded "
        f"{cfg.seed} + 1 + rank: at the crash the ranks' generators had moved from their seeded "
        f"start ({', '.join('yes' if m else 'no' for m in moved)}) and differed from each other "
        f"({'yes' if own else 'no'}), so each rank needs its own state back; rank 0's alone "
        f"makes rank 1 draw rank 0's masks. The data order needs nothing saved: "
        f"DistributedSampler shuffles with seed + epoch, and set_epoch({last}) dealt "
        f"{'the same' if same_order else 'other'} indices in the resumed run as in the "
        f"uninterrupted one. On GPUs, dropout on CUDA tensors draws from the GPU's own "
        f"generator: that state is part of 'each rank's random state' there."))


def _gpu_states(states) -> str:
    return ", ".join(f"GPU {i}: seed {seed}, offset {offset}"
                     for i, (seed, offset) in enumerate(states))


_CUDA_FIX = ("save each rank's torch.cuda.get_rng_state_all() beside its CPU state (in the list "
             "that reaches rank 0) and give each rank its own back with "
             "torch.cuda.set_rng_state_all(...).")


def _judge_cuda(first: list, second: list) -> None:
    """Fail unless every rank's stand-in GPUs (:mod:`dpcourse.checks._lab04_fakecuda`) hold,
    after the resume, the states that rank's GPUs had at the crash: on GPUs, dropout draws
    from each device's own generator, which torch.get_rng_state does not hold. The check
    stood them in behind torch.cuda's random-state functions while the learner's code ran."""
    __tracebackhide__ = True
    missing = [what for called, what in
               (((any(r["save_got"] for r in first) or any(r["save_got"] for r in second)),
                 "save_training_state reads"),
                (any(r["resume_set"] for r in second), "resume_training_state restores"))
               if not called]
    if missing:
        fail(f"On these CPU ranks your resume is exact. But {' and '.join(missing)} no state of "
             f"CUDA's generators (torch.cuda's get_rng_state / set_rng_state or their _all "
             f"forms; the check stood in {len(first)} GPUs on each rank behind those functions "
             f"while your code ran, and it never called them): on GPUs, dropout on a CUDA "
             f"tensor draws its masks from the generator of the GPU it runs on, one per device, "
             f"not from the CPU generator that torch.get_rng_state holds, so a resumed GPU run "
             f"would draw masks the uninterrupted run never drew.", fix=_CUDA_FIX)
    crashed = [r["crashed"]["cuda"] for r in first]
    wrong = [rank for rank, r in enumerate(second) if r["resumed"]["cuda"] != crashed[rank]]
    if not wrong:
        return
    rank = wrong[0]
    got = second[rank]["resumed"]["cuda"]
    donors = [other for other in range(len(first)) if other != rank and got == crashed[other]]
    if donors:
        fail(f"After the resume rank {rank}'s CUDA generators held rank {donors[0]}'s states "
             f"at the crash ({_gpu_states(got)}), not the ones rank {rank} itself had "
             f"({_gpu_states(crashed[rank])}): the check stood in {len(first)} GPUs on each "
             f"rank, seeded as torch.manual_seed seeds them and moved by each step's dropout on "
             f"the rank's own GPU. On GPUs, rank {rank} would from then on draw the dropout "
             f"masks rank {donors[0]} draws, which the uninterrupted run never did.",
             fix=_CUDA_FIX)
    fail(f"After the resume rank {rank}'s CUDA generators held {_gpu_states(got)}, not the "
         f"states they had at the crash ({_gpu_states(crashed[rank])}; seeded: "
         f"{_gpu_states(first[rank]['cuda_seeded'])}): the check stood in {len(first)} GPUs on "
         f"each rank, moved by each step's dropout on the rank's own GPU. On GPUs, rank {rank} "
         f"would draw dropout masks the uninterrupted run never drew.", fix=_CUDA_FIX)


_ATOMIC_FIX = ("write the checkpoint to a temporary file in the same folder and, once it is "
               "complete, os.replace it over path (one step, which a crash cannot split): "
               "dpcourse.ddp_practice.save_checkpoint does this.")


def _judge_atomic(crash: dict, in_place: list) -> None:
    """Fail if a save stopped halfway left no readable checkpoint at the path, or if rank 0
    rewrote the checkpoint where it stood (the same inode before and after, new contents)."""
    __tracebackhide__ = True
    if not crash.get("skipped") and not crash["same"] and not crash["readable"]:
        if crash["left"] is None:
            after, how = ("there was no file at path at all",
                          "the old file was deleted before the new one was complete")
        else:
            after = (f"the file at path held {crash['left']:,} bytes that torch.load cannot "
                     f"read")
            how = ("the old file was deleted before the new one was complete"
                   if crash["deleted"] else
                   "the old file was emptied and written again where it stood"
                   if crash["same_file"] else
                   "the old file was gone before the new one was complete")
        fail(f"A crash while saving destroys your checkpoint: the check let "
             f"save_training_state write a complete checkpoint ({crash['size']:,} bytes, epoch "
             f"0), then stopped its next save halfway, as a crash or a full disk would (the "
             f"file system refused writes past {crash['limit']:,} bytes). Afterwards "
             f"{after}, and epoch 0's complete checkpoint was gone: {how}, so a job killed "
             f"in that moment restarts from nothing (lesson 04, §3).", fix=_ATOMIC_FIX)
    if in_place:
        epoch, inode = in_place[0]
        fail(f"Rank 0's save at the end of epoch {epoch} rewrote the checkpoint where it stood: "
             f"the file at path was the same file (inode {inode}) before and after, with new "
             f"contents, so while it was being written it held part of a checkpoint, and a "
             f"crash in that moment leaves none to restart from (lesson 04, §3).",
             fix=_ATOMIC_FIX)


def _judge_first_run(first: list, ckpt: str) -> None:
    __tracebackhide__ = True
    import torch

    if first[0]["start"] != 0:
        fail(f"with no checkpoint yet, resume_training_state returned {first[0]['start']}: "
             f"where no file exists yet, so no epoch has been done.",
             fix="return 0 when the file does not exist (a fresh start).")
    for rank, r in enumerate(first[1:], 1):
        if r["writes"]:
            fail(f"rank {rank} wrote a file ({os.path.basename(r['writes'][0])}): ranks "
                 f"writing one file race, and that one file must hold what every rank needs.",
                 fix="only rank 0 writes, and only the one file at path.")
    if not first[0]["writes"]:
        fail("rank 0 saved nothing, so a crash would lose every finished epoch.",
             fix="save the checkpoint at the end of each epoch when is_main is true.")
    if not os.path.exists(ckpt):
        fail(f"no file at the path save_training_state was given ({os.path.basename(ckpt)}), "
             f"where resume_training_state will look.", fix="save the checkpoint there.")
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
    except Exception:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
    if _wrapper_keys(state):
        _mistake(RESUME_MISTAKES, RESUME_FIXES, "wrapper_keys")


def _judge_resume(first: list, second: list, cfg: Lab04Config) -> None:
    """The resumed run's own state against the crash: where it started, its weights, its
    momentum, its random state."""
    __tracebackhide__ = True
    cause = _resume_cause(first, second)
    if cause is not None:
        fail(cause[0], fix=cause[1])


def _mistaken(key: str) -> tuple:
    return RESUME_MISTAKES[key], RESUME_FIXES[key]


def _resume_cause(first: list, second: list):
    """(sentence, fix) of the first mistake the resumed run's own state shows, or None: what
    :func:`_judge_resume` refuses, without raising (the batch skips the runs it needs no more)."""
    starts = {r["start"] for r in second}
    if len(starts) != 1:
        return (f"after the crash the ranks would resume at different epochs {sorted(starts)}, "
                f"so their collectives would no longer pair up.",
                "make every rank read the same checkpoint.")
    start = starts.pop()
    if start == _CRASH_AFTER:
        return _mistaken("repeat_epoch")
    if start == 0:
        if not _same(second[0]["resumed"]["weights"], first[0]["crashed"]["weights"]):
            return ("After the crash the run started from scratch (epoch 0, fresh weights), "
                    "though the checkpoint file existed.",
                    "when the file exists, load it in resume_training_state and return the "
                    "first epoch still to do.")
        return _mistaken("from_zero")
    if start != _CRASH_AFTER + 1:
        return (f"after a crash at the end of epoch {_CRASH_AFTER}, resume_training_state "
                f"returned {start}, which is not the first epoch still to do.",
                f"return the first epoch still to do, {_CRASH_AFTER + 1}.")
    crashed = [r["crashed"] for r in first]
    for what, everywhere, rank0 in (("weights", "no_weights", "weights_rank0"),
                                    ("momentum", "no_optimizer", "optimizer_rank0")):
        wrong = [rank for rank, r in enumerate(second)
                 if not _same(r["resumed"][what], crashed[rank][what])]
        if wrong:
            return _mistaken(rank0 if 0 not in wrong else everywhere)
    import torch

    rng_wrong = [rank for rank, r in enumerate(second)
                 if not torch.equal(r["resumed"]["rng"], crashed[rank]["rng"])]
    if rng_wrong:
        if 0 not in rng_wrong and all(torch.equal(second[r]["resumed"]["rng"], crashed[0]["rng"])
                                      for r in rng_wrong):
            return _mistaken("rng_rank0")
        return _mistaken("no_rng")
    return None


def _judge_uninterrupted(second: list, whole: list, cfg: Lab04Config) -> None:
    """The resumed run's end against the uninterrupted run's."""
    __tracebackhide__ = True
    got, want = second[0]["weights"], whole[0]["weights"]
    d = _distance(got, want)
    if d > RESUME_TOL:
        fail(f"every rank resumed with its weights, momentum and random state, but the final "
             f"weights differ from an uninterrupted run by up to {d:.3g}.",
             fix="does resume_training_state change anything else (the learning rate, the "
                 "model)?")
    if second[0]["epochs"] != [cfg.epochs - 1]:
        fail(f"the weights are right, but the resumed run trained epochs "
             f"{second[0]['epochs']}, where only epoch {cfg.epochs - 1} was left to do.",
             fix="start the loop at the epoch resume_training_state returns.")
