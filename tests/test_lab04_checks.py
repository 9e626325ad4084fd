"""The lab 04 check: the reference answer passes, each plausible wrong answer fails with a
sentence that names it. Wrong answers are real scripts (the solution with one mistake put back)
run on real ranks; most through dpcourse.launch.spawn (same environment variables as torchrun,
one second to start), a few through torchrun itself, as the lab does.

The lab's answer is ``evaluate_f1`` (macro-F1 over a test set split across the ranks): its
mistakes are tested with ``check_f1``. The training part of the lab's script is given, but a
learner can still break it, so the conversion mistakes stay tested too (with ``f1_runs=()``)."""

import re
from pathlib import Path

import pytest

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
                     "keep drop_last=True"),
    "lr_scaled": (("lr=args.lr,", "lr=args.lr * world_size,"), "multiplied by the world size"),
    "no_set_epoch": (("    sampler.set_epoch(epoch)\n", "    pass\n"), "set_epoch"),
}


def test_reference_answer_passes_under_torchrun(tmp_path, capsys):
    lab04.check(_write(tmp_path, _solution_script()), timeout=120)
    out = capsys.readouterr().out
    assert "✔" in out and out.count("✔") == 1 and "evaluate_f1 equals" in out


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


def test_ending_without_os_exit_passes_under_torchrun(tmp_path, capsys):
    text = _variant("    sys.stdout.flush()\n    os._exit(0)", "")
    lab04.check(_write(tmp_path, text), f1_runs=(), timeout=120)
    assert capsys.readouterr().out.count("✔") == 1


def test_forgetting_ddp_is_named(tmp_path):
    text = _variant("model = DDP(model, device_ids=[local_rank] if device.type == \"cuda\" else None)",
                    "pass")
    text = text.replace("model.module", "model")
    with pytest.raises(LabCheckError, match="wrap the model in DistributedDataParallel"):
        lab04.check(_write(tmp_path, text), **NO_F1)


def test_saving_on_every_rank_is_caught_under_torchrun(tmp_path):
    with pytest.raises(LabCheckError, match="save only where is_main"):
        lab04.check(_write(tmp_path, _variant("if is_main:\n", "if True:\n")), f1_runs=(),
                    timeout=120)


def test_unfinished_training_todo_raises_not_implemented(tmp_path):
    text = _variant("sampler.set_epoch(epoch)", "raise NotImplementedError('TODO')")
    with pytest.raises(NotImplementedError, match="still has a TODO"):
        lab04.check(_write(tmp_path, text), **NO_F1)


def test_crashing_script_names_the_error(tmp_path):
    text = _variant("torch.manual_seed(args.seed)", "raise ValueError('boom')")
    with pytest.raises(LabCheckError, match="failed on rank .*boom"):
        lab04.check(_write(tmp_path, text), **NO_F1)


# --- the lab's answer: evaluate_f1 -----------------------------------------------------------

def _body(new_body: str) -> str:
    """The solution script with evaluate_f1's body replaced (4-space indented lines)."""
    text = _solution_script()
    start = text.index("    # (solution)")
    end = text.index("    #\n", start) + len("    #\n")
    return text[:start] + new_body + text[end:]


_COUNT = """\
    confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64)
    model.eval()
    with torch.no_grad():
        for X, y in DataLoader(share, batch_size=16):
            pairs = y * NUM_CLASSES + model(X).argmax(1)
            confusion += torch.bincount(pairs, minlength=NUM_CLASSES ** 2).view_as(confusion)
"""
STRIDED = "    share = Subset(test_set, range(rank, len(test_set), world_size))\n"
REDUCE = "    dist.all_reduce(confusion)\n    return macro_f1(confusion)\n"

F1_WRONG = {
    "padded_sampler": (
        "    share = Subset(test_set, list(DistributedSampler(test_set, shuffle=False)))\n"
        + _COUNT + REDUCE, "counted twice"),
    "padded_sampler_shuffled": (
        "    sampler = DistributedSampler(test_set)\n"
        "    share = Subset(test_set, list(sampler))\n" + _COUNT + REDUCE, "counted twice"),
    "no_reduction": (STRIDED + _COUNT + "    return macro_f1(confusion)\n",
                     "different numbers"),
    "mean_of_f1": (STRIDED + _COUNT
                   + "    f1 = torch.tensor([macro_f1(confusion)])\n"
                     "    dist.all_reduce(f1)\n    return float(f1) / world_size\n",
                   "F1 scores were averaged"),
    "mean_of_f1_contiguous": (
        "    n = len(test_set)\n"
        "    share = Subset(test_set, range(rank * n // world_size, (rank + 1) * n // world_size))\n"
        + _COUNT + "    f1 = torch.tensor([macro_f1(confusion)])\n"
        "    dist.all_reduce(f1)\n    return float(f1) / world_size\n", "F1 scores were averaged"),
    "sum_of_f1": (STRIDED + _COUNT
                  + "    f1 = torch.tensor([macro_f1(confusion)])\n"
                    "    dist.all_reduce(f1)\n    return float(f1)\n", "added up"),
    "whole_set_everywhere": ("    share = test_set\n" + _COUNT + "    return macro_f1(confusion)\n",
                             "every rank evaluated all"),
    "training_mode": (STRIDED + _COUNT.replace("    model.eval()\n", "") + REDUCE,
                      "training mode"),
    "accuracy": (STRIDED + _COUNT + "    dist.all_reduce(confusion)\n"
                 "    return float(confusion.diagonal().sum() / confusion.sum())\n",
                 "is the accuracy"),
    "remainder_dropped": (
        "    n = len(test_set) // world_size * world_size\n"
        "    share = Subset(test_set, range(rank, n, world_size))\n" + _COUNT + REDUCE,
        "evaluated only"),
    "returns_a_list": (STRIDED + _COUNT + "    dist.all_reduce(confusion)\n"
                       "    return [macro_f1(confusion)]\n", "not a number"),
}


@pytest.mark.parametrize("name", sorted(F1_WRONG))
def test_wrong_f1_is_named(tmp_path, name):
    body, phrase = F1_WRONG[name]
    with pytest.raises(LabCheckError) as err:
        lab04.check_f1(_write(tmp_path, _body(body)), runs=((2, 101),))
    assert phrase in str(err.value), str(err.value)


def test_mean_of_f1_is_named_on_three_ranks_too(tmp_path):
    body, phrase = F1_WRONG["mean_of_f1"]
    with pytest.raises(LabCheckError, match="On 3 ranks with 100 test images: .*averaged"):
        lab04.check_f1(_write(tmp_path, _body(body)), runs=((3, 100),))


F1_RIGHT = {
    "contiguous_shards": (
        "    n = len(test_set)\n"
        "    share = Subset(test_set, range(rank * n // world_size, (rank + 1) * n // world_size))\n"
        + _COUNT + REDUCE),
    "float_matrix_and_tensor_result": (
        STRIDED + _COUNT.replace("dtype=torch.int64", "dtype=torch.float64")
        + "    dist.all_reduce(confusion)\n    return torch.tensor(macro_f1(confusion))\n"),
    "all_gather_predictions": (
        STRIDED + "    model.eval()\n    with torch.no_grad():\n"
        "        mine = [(y, model(X).argmax(1)) for X, y in DataLoader(share, batch_size=32)]\n"
        "    pairs = torch.cat([y * NUM_CLASSES + p for y, p in mine])\n"
        "    gathered = [None] * world_size\n"
        "    dist.all_gather_object(gathered, pairs)\n"
        "    confusion = torch.bincount(torch.cat(gathered), minlength=100).view(10, 10)\n"
        "    return macro_f1(confusion)\n"),
}


@pytest.mark.parametrize("name", sorted(F1_RIGHT))
def test_right_f1_variants_pass(tmp_path, name):
    lab04.check_f1(_write(tmp_path, _body(F1_RIGHT[name])))


def test_f1_todo_raises_not_implemented(tmp_path):
    text = _body("    raise NotImplementedError('TODO: evaluate_f1')\n")
    with pytest.raises(NotImplementedError, match="still has a TODO in evaluate_f1"):
        lab04.check_f1(_write(tmp_path, text), runs=((2, 101),))


def test_f1_collective_on_one_rank_only_is_a_timeout_not_a_hang(tmp_path):
    body = STRIDED + _COUNT + "    if rank == 0:\n        dist.all_reduce(confusion)\n" \
        "    return macro_f1(confusion)\n"
    with pytest.raises(LabCheckError, match="did not finish within 8 s"):
        lab04.check_f1(_write(tmp_path, _body(body)), runs=((2, 101),), timeout=8)


def test_saved_f1_must_be_the_evaluated_one(tmp_path):
    text = _variant('{"model": model.module.state_dict(), "f1": f1}',
                    '{"model": model.module.state_dict(), "f1": 0.5}')
    with pytest.raises(LabCheckError, match="is not one process's F1"):
        lab04.check(_write(tmp_path, text), launcher="spawn", timeout=90, f1_runs=((2, 101),))


def test_unknown_variant_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown variant"):
        lab04.reference_weights(variant="nope")


# --- stretch: resume after a crash ------------------------------------------------------------
# Defined in this file, these functions travel to the ranks by value, as a notebook's do.

from dpcourse.ddp_practice import load_checkpoint, save_checkpoint  # noqa: E402


def save_state(path, model, optimizer, epoch, is_main):
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(),
                               "optimizer": optimizer.state_dict(), "epoch": epoch})


def resume_state(path, model, optimizer):
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"] + 1


def save_with_torch_and_next_epoch(path, model, optimizer, epoch, is_main):
    # right: plain torch.save, storing the next epoch instead of the finished one
    import torch
    if is_main:
        torch.save({"weights": model.module.state_dict(), "opt": optimizer.state_dict(),
                    "next_epoch": epoch + 1}, path)


def resume_from_torch_file(path, model, optimizer):
    import os

    import torch
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.module.load_state_dict(state["weights"])
    optimizer.load_state_dict(state["opt"])
    return state["next_epoch"]


def save_wrapper_state(path, model, optimizer, epoch, is_main):
    # right: the wrapper's keys, loaded back into the wrapper, round-trip too
    if is_main:
        save_checkpoint(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                               "epoch": epoch})


def resume_wrapper_state(path, model, optimizer):
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"] + 1


def save_everywhere(path, model, optimizer, epoch, is_main):
    import os
    save_checkpoint(f"{path}.{os.environ['RANK']}" if not is_main else path,
                    {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch})


def save_weights_only(path, model, optimizer, epoch, is_main):
    if is_main:
        save_checkpoint(path, {"model": model.module.state_dict(), "epoch": epoch})


def resume_weights_only(path, model, optimizer):
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    return state["epoch"] + 1


def resume_same_epoch(path, model, optimizer):
    state = load_checkpoint(path)
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"]


def resume_at_zero(path, model, optimizer):
    resume_state(path, model, optimizer)
    return 0


def resume_epoch_only(path, model, optimizer):
    state = load_checkpoint(path)
    if state is None:
        return 0
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"] + 1


def resume_never(path, model, optimizer):
    return 0


@pytest.mark.parametrize("save, resume", [
    (save_state, resume_state),
    (save_with_torch_and_next_epoch, resume_from_torch_file),
    (save_wrapper_state, resume_wrapper_state),
], ids=["reference", "torch-save-next-epoch", "wrapper-keys-round-trip"])
def test_right_resumes_pass(save, resume, capsys):
    lab04.check_resume(save, resume)
    assert capsys.readouterr().out.count("✔") == 1


@pytest.mark.parametrize("save, resume, phrase", [
    (save_weights_only, resume_weights_only, "optimizer's state was not restored"),
    (save_state, resume_same_epoch, "repeated the epoch"),
    (save_state, resume_at_zero, "started again at epoch 0"),
    (save_state, resume_epoch_only, "continued from fresh weights"),
    (save_state, resume_never, "should have done only epoch 2"),
    (save_everywhere, resume_state, "other than rank 0 saved"),
])
def test_resume_mistakes_are_named(save, resume, phrase):
    with pytest.raises(LabCheckError) as err:
        lab04.check_resume(save, resume)
    assert phrase in str(err.value), str(err.value)
