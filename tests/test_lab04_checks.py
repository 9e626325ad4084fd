"""The lab 04 check: the reference answer passes, each plausible wrong answer fails with a
sentence that names it. Wrong answers are real scripts (the solution with one mistake put back)
run on 2 real ranks; most through dpcourse.launch.spawn (same environment variables as
torchrun, one second to start), one through torchrun itself, as the lab does."""

import re
from pathlib import Path

import pytest

from dpcourse.checks import LabCheckError, lab04

ROOT = Path(__file__).resolve().parents[1]


def _solution_script() -> str:
    text = (ROOT / "solutions" / "lab04_ddp_in_practice.py").read_text()
    m = re.search(r"^# %%writefile \{work\}/train_lab\.py\n(.*?)(?=^# %%)", text, re.S | re.M)
    assert m, "solutions/lab04 has no %%writefile train_lab.py cell"
    return m.group(1)


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
    "sampler_seed_ignored": (("shuffle=True,\n                             seed=args.seed)",
                              "shuffle=True)"), "ignores --seed"),
    "no_drop_last": (("sampler=sampler, drop_last=True)", "sampler=sampler)"),
                     "keep drop_last=True"),
    "lr_scaled": (("lr=args.lr,", "lr=args.lr * world_size,"), "multiplied by the world size"),
    "no_set_epoch": (("    sampler.set_epoch(epoch)\n", "    pass\n"), "set_epoch"),
}


def test_reference_answer_passes(tmp_path, capsys):
    lab04.check(_write(tmp_path, _solution_script()), launcher="spawn", timeout=90)
    out = capsys.readouterr().out
    assert "✔" in out and out.count("✔") == 1


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_answer_is_named(tmp_path, name):
    (old, new), phrase = WRONG[name]
    with pytest.raises(LabCheckError, match=phrase):
        lab04.check(_write(tmp_path, _variant(old, new)), launcher="spawn", timeout=90)


def test_checkpoint_of_the_ddp_wrapper_is_refused(tmp_path):
    text = _variant('{"model": model.module.state_dict()}', '{"model": model.state_dict()}')
    with pytest.raises(LabCheckError, match="keys start with 'module.'"):
        lab04.check(_write(tmp_path, text), launcher="spawn", timeout=90)


RIGHT = {
    # DistributedSampler's own drop_last: 256 samples on 3 ranks keep 85 each, still 5 batches
    "sampler_drop_last": ("shuffle=True,\n                             seed=args.seed)",
                          "shuffle=True,\n                             seed=args.seed, "
                          "drop_last=True)"),
    "world_size_from_dist": ("per_rank_batch = args.global_batch // world_size",
                             "per_rank_batch = args.global_batch // dist.get_world_size()"),
    "plain_torch_save": ('    save_checkpoint(args.out, {"model": model.module.state_dict()})',
                         '    torch.save(model.module.state_dict(), args.out)'),
}


@pytest.mark.parametrize("name", sorted(RIGHT))
def test_right_variants_pass(tmp_path, name, capsys):
    lab04.check(_write(tmp_path, _variant(*RIGHT[name])), launcher="spawn", timeout=90)
    assert capsys.readouterr().out.count("✔") == 1


def test_ending_with_destroy_process_group_passes_under_torchrun(tmp_path, capsys):
    text = _variant("dist.barrier()\nsys.stdout.flush()\nos._exit(0)",
                    "dist.destroy_process_group()")
    lab04.check(_write(tmp_path, text), cfgs=lab04.CONFIGS[0], timeout=120)
    assert capsys.readouterr().out.count("✔") == 1


def test_forgetting_ddp_is_named(tmp_path):
    text = _variant("model = DDP(model, device_ids=[local_rank] if device.type == \"cuda\" else None)",
                    "pass")
    text = text.replace("model.module.state_dict()", "model.state_dict()")
    with pytest.raises(LabCheckError, match="wrap the model in DistributedDataParallel"):
        lab04.check(_write(tmp_path, text), launcher="spawn", timeout=90)


def test_saving_on_every_rank_is_caught_under_torchrun(tmp_path):
    with pytest.raises(LabCheckError, match="save only where is_main"):
        lab04.check(_write(tmp_path, _variant("if is_main:\n", "if True:\n")), timeout=120)


def test_unfinished_todo_raises_not_implemented(tmp_path):
    text = _variant("sampler.set_epoch(epoch)", "raise NotImplementedError('TODO')")
    with pytest.raises(NotImplementedError, match="still has a TODO"):
        lab04.check(_write(tmp_path, text), launcher="spawn")


def test_crashing_script_names_the_error(tmp_path):
    text = _variant("torch.manual_seed(args.seed)", "raise ValueError('boom')")
    with pytest.raises(LabCheckError, match="failed on rank .*boom"):
        lab04.check(_write(tmp_path, text), launcher="spawn", timeout=90)


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
