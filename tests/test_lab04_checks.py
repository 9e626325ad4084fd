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
                           "per_rank_batch = args.global_batch"), "global batch doubled"),
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
