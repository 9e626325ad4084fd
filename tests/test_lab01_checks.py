"""lab01's checks accept the reference and name each plausible mistake."""

import math

import pytest
import torch

from dpcourse import train
from dpcourse.checks import LabCheckError, lab01


def good_train(model, loader, loss_fn, optimizer, device):
    model.train()
    total, n = 0.0, 0
    for X, y in loader:
        loss = loss_fn(model(X), y)
        if not torch.isfinite(loss):
            raise FloatingPointError("the loss is not finite")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item() * len(y)
        n += len(y)
    return total / n


def back_to_training(model, frozen):
    """The caller's half of the "eval" decision, right: the whole model training, then the
    frozen modules (and what they hold) back in eval mode."""
    model.train()
    for m in frozen:
        m.eval()


def wrapped_library_train(model, loader, loss_fn, optimizer, device):
    return train.train_one_epoch(model, loader, loss_fn, optimizer, device)


def wrapped_library_evaluate(model, loader, loss_fn, device):
    return train.evaluate(model, loader, loss_fn, device)


def aliased_library_train():
    from dpcourse.train import train_one_epoch as mine  # the reference under another name

    def fn(model, loader, loss_fn, optimizer, device):
        return mine(model, loader, loss_fn, optimizer, device)
    return fn


@pytest.mark.parametrize("fn", [train.train_one_epoch, wrapped_library_train,
                                aliased_library_train()],
                         ids=["itself", "wrapped", "aliased"])
def test_the_library_train_one_epoch_is_refused(fn):
    with pytest.raises(LabCheckError, match="library's own dpcourse.train.train_one_epoch"):
        lab01.check_train_one_epoch(fn)


@pytest.mark.parametrize("fn", [train.evaluate, wrapped_library_evaluate],
                         ids=["itself", "wrapped"])
def test_the_library_evaluate_is_refused(fn):
    with pytest.raises(LabCheckError, match="library's own dpcourse.train.evaluate"):
        lab01.check_evaluate(fn)


def no_zero_grad(model, loader, loss_fn, optimizer, device):
    model.train()
    total, n = 0.0, 0
    for X, y in loader:
        loss = loss_fn(model(X), y)
        loss.backward()
        optimizer.step()
        total += loss.item() * len(y)
        n += len(y)
    return total / n


def no_train_mode(model, loader, loss_fn, optimizer, device):
    total, n = 0.0, 0
    for X, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        optimizer.step()
        total += loss.item() * len(y)
        n += len(y)
    return total / n


def no_step(model, loader, loss_fn, optimizer, device):
    model.train()
    total, n = 0.0, 0
    for X, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        total += loss.item() * len(y)
        n += len(y)
    return total / n


def summed_loss_backward(model, loader, loss_fn, optimizer, device):
    model.train()
    total, n = 0.0, 0
    for X, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X), y, reduction="sum")
        loss.backward()
        optimizer.step()
        total += loss.item()
        n += len(y)
    return total / n


def _returning(kind):
    def fn(model, loader, loss_fn, optimizer, device):
        model.train()
        losses, sizes = [], []
        for X, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(X), y)
            loss.backward()
            optimizer.step()
            losses.append(loss)
            sizes.append(len(y))
        if kind == "sum":
            return sum(l.item() for l in losses)
        if kind == "mean_of_means":
            return sum(l.item() for l in losses) / len(losses)
        if kind == "last":
            return losses[-1].item()
        if kind == "tensor":
            return losses[-1]
        raise ValueError(kind)
    return fn


def test_reference_train_passes(capsys):
    lab01.check_train_one_epoch(good_train)
    assert capsys.readouterr().out.startswith("✔")


@pytest.mark.parametrize("fn, phrase", [
    (no_zero_grad, "leaked into each step"),
    (no_train_mode, "ran the model in eval mode"),
    (no_step, "weights did not change"),
    (summed_loss_backward, "your steps grow with the batch size: your weights match steps 16 "
                           "times those of the batch's mean loss"),
    (_returning("sum"), "sum of the batch losses"),
    (_returning("mean_of_means"), "the mean of the 4 batches' mean losses; the mean loss per "
                                  "sample is"),
    (_returning("last"), "last batch's loss"),
    (_returning("tensor"), "autograd graph"),
])
def test_train_mistakes_are_named(fn, phrase):
    with pytest.raises(LabCheckError, match=None) as err:
        lab01.check_train_one_epoch(fn)
    assert phrase in str(err.value), str(err.value)


def _eval(mode=True, no_grad=True, acc_kind="fraction", loss_kind="per_sample",
          restore=False, to_train=False, half=False, finally_=True, grad="block",
          swallow=False, empty="raise"):
    """evaluate written in several ways. ``restore``: put the arriving mode back, each
    submodule's own (True) or one flag for all, model.train(model.training as it arrived)
    ("flag"), in a finally block (``finally_``) or after the loop; ``grad``: autograd off with
    a with-block ("block") or with set_grad_enabled(False) switched back on after the loop
    ("switch") or never ("off"); ``swallow``: catch the loader's error and return what was
    measured so far; ``empty``: what an empty loader gets, ValueError ("raise"), the division
    by zero ("divide") or (0.0, 0.0) ("zeros")."""
    def fn(model, loader, loss_fn, device):
        was_training = model.training
        each = {m: m.training for m in model.modules()}

        def put_back():
            if restore == "flag":
                model.train(was_training)
            else:
                for m, flag in each.items():
                    m.training = flag

        if mode:
            model.eval()
        losses, sizes, hits, accs = [], [], 0, []

        def loop():
            for X, y in loader:
                out = model(X)
                losses.append(loss_fn(out, y).item())
                sizes.append(len(y))
                nonlocal hits
                hits += (out.argmax(1) == y).sum().item()
                accs.append((out.argmax(1) == y).float().mean().item())

        def measure():
            if grad == "block":
                with torch.no_grad() if no_grad else torch.enable_grad():
                    loop()
            else:
                torch.set_grad_enabled(False)
                loop()
                if grad == "switch":
                    torch.set_grad_enabled(True)

        try:
            if restore and finally_:
                try:
                    measure()
                finally:
                    put_back()
            else:
                measure()
        except RuntimeError:
            if not swallow:
                raise
        n = sum(sizes)
        if n == 0 and empty == "raise":
            raise ValueError("evaluate got an empty loader: no sample to measure")
        if n == 0 and empty == "zeros":
            return 0.0, 0.0
        loss = {"per_sample": sum(l * s for l, s in zip(losses, sizes)) / n,
                "sum": sum(losses), "mean_of_means": sum(losses) / len(losses)}[loss_kind]
        acc = {"fraction": hits / n, "count": hits, "percent": 100 * hits / n,
               "mean_of_means": sum(accs) / len(accs),
               "tensor": torch.tensor(hits) / n}[acc_kind]  # hits summed as a tensor
        if restore and not finally_:
            put_back()
        if to_train:  # "back to training" whatever the model arrived in
            model.train()
        if half:  # only the last layer put back
            list(model.modules())[-1].train(was_training)
        return loss, acc
    return fn


def test_reference_evaluate_passes(capsys):
    lab01.check_evaluate(_eval())
    assert capsys.readouterr().out.startswith("✔")


@pytest.mark.parametrize("fn, leaves", [(_eval(), "eval"), (_eval(restore=True), "as found"),
                                        (_eval(restore=True), None)],
                         ids=["eval-eval", "restore-as-found", "restore-undecided"])
def test_evaluate_keeps_its_design_decision(fn, leaves, capsys):
    lab01.check_evaluate(fn, leaves=leaves, back_to_training=back_to_training)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and (leaves is None or "as you decided" in out), out


@pytest.mark.parametrize("fn, leaves, phrase", [
    (_eval(), "as found", "came back in eval mode"),
    (_eval(restore=True), "eval", "came back in training mode"),
    (_eval(to_train=True), "as found", "came back in training mode"),
    (_eval(to_train=True), "eval", "disagree"),
    (_eval(half=True), "as found", "some layers in training mode"),
    (_eval(), "train", "design decision must be one of"),
])
def test_evaluate_breaking_its_design_decision_is_refused(fn, leaves, phrase):
    with pytest.raises(LabCheckError) as err:
        lab01.check_evaluate(fn, leaves=leaves)
    assert phrase in str(err.value), str(err.value)


@pytest.mark.parametrize("fn, phrase", [
    (_eval(mode=False), "dropout was still on"),
    (_eval(no_grad=False), "record a graph"),
    (_eval(acc_kind="count"), "number of correct predictions"),
    (_eval(acc_kind="percent"), "percent"),
    (_eval(acc_kind="mean_of_means"), "per-batch accuracies"),
    (_eval(acc_kind="tensor"), "evaluate's accuracy returned tensor(0."),
    (_eval(loss_kind="sum"), "sum of the batch losses"),
    (_eval(loss_kind="mean_of_means"), "averaged the per-batch mean losses"),
])
def test_evaluate_mistakes_are_named(fn, phrase):
    with pytest.raises(LabCheckError) as err:
        lab01.check_evaluate(fn)
    assert phrase in str(err.value), str(err.value)


# --- the contract's other half: a loader that fails midway --------------------------------

@pytest.mark.parametrize("fn, leaves, phrase", [
    # the mode restored after the loop, not in a finally block: right until the loader fails
    (_eval(restore=True, finally_=False), "as found",
     "when the loader failed on batch 3, a model handed over in training mode reached the "
     "caller in eval mode"),
    (_eval(swallow=True), "eval", "on batch 3 of 5, and evaluate returned (2.33"),
    (_eval(grad="switch"), "eval", "when the loader failed on batch 3, evaluate left "
                                   "autograd switched off"),
    (_eval(grad="off"), "eval", "evaluate returned with autograd switched off for its caller"),
], ids=["restore-without-finally", "swallowed", "grad-switched-back-after-loop",
        "grad-never-switched-back"])
def test_a_failing_loader_finds_what_only_a_normal_return_hides(fn, leaves, phrase):
    with pytest.raises(LabCheckError) as first:
        lab01.check_evaluate(fn, leaves=leaves)
    assert phrase in str(first.value), str(first.value)
    assert torch.is_grad_enabled()  # the check gave the caller autograd back
    with pytest.raises(LabCheckError) as second:
        lab01.check_evaluate(fn, leaves=leaves)
    assert any(w in str(second.value) for w in ("finally", "torch.no_grad()")), str(second.value)


def test_an_error_replaced_without_its_cause_is_named():
    inner = _eval()

    def fn(model, loader, loss_fn, device):
        try:
            return inner(model, loader, loss_fn, device)
        except RuntimeError:
            raise ValueError("evaluation failed") from None
    with pytest.raises(LabCheckError, match="raised ValueError .* in its place"):
        lab01.check_evaluate(fn, leaves="eval")


def test_an_error_re_raised_with_its_cause_passes(capsys):
    inner = _eval(restore=True)

    def fn(model, loader, loss_fn, device):
        try:
            return inner(model, loader, loss_fn, device)
        except RuntimeError as exc:
            raise ValueError("evaluation failed") from exc
    lab01.check_evaluate(fn, leaves="as found")
    assert capsys.readouterr().out.count("✔") == 1


# --- answers only right for one data set, and right answers written differently -----------

def _train(denominator="count", backward="mean", zero="before", loss_out=float,
           guard="finite", set_to_none=True):
    """train_one_epoch written in several ways, right and wrong. ``zero``: where the gradients
    are cleared, "before" backward and after the guard (right: the last step's gradient stays
    in p.grad until the test has passed), "first" (before the forward, as lesson 01's loop:
    the guard then finds p.grad already cleared) or "after" the step (the same, seen from the
    other end); ``set_to_none``: zero_grad's argument. ``guard``: how a loss that is
    not finite is caught: torch.isfinite before backward ("finite"), math.isfinite of the float
    ("isfinite"), torch.isnan alone before backward ("isnan": lets inf through), not finite
    after backward, before the step ("after-backward": NaN left in p.grad), or isnan before
    backward and not finite after the step ("nan-then-after-step": inf reaches Adam's state)."""
    def fn(model, loader, loss_fn, optimizer, device):
        model.train()
        total, n = 0.0, 0
        for X, y in loader:
            if zero == "first":
                optimizer.zero_grad(set_to_none=set_to_none)
            out = model(X)
            if backward == "mean":
                loss = loss_fn(out, y)
                if guard == "finite" and not torch.isfinite(loss):
                    raise FloatingPointError("the loss is not finite")
                if guard in ("isnan", "nan-then-after-step") and torch.isnan(loss):
                    raise FloatingPointError("NaN loss")
                if guard == "isfinite" and not math.isfinite(loss.item()):
                    raise FloatingPointError(f"the loss is {loss.item()}")
                if zero == "before":
                    optimizer.zero_grad(set_to_none=set_to_none)
                loss.backward()
                if guard == "after-backward" and not torch.isfinite(loss):
                    raise FloatingPointError("the loss is not finite")
                batch_total = loss.item() * len(y)
            else:  # reduction="sum" with the matching division: the same gradient
                summed = torch.nn.functional.cross_entropy(out, y, reduction="sum")
                if not torch.isfinite(summed):
                    raise FloatingPointError("the loss is not finite")
                if zero == "before":
                    optimizer.zero_grad(set_to_none=set_to_none)
                (summed / len(y)).backward()
                batch_total = summed.item()
            optimizer.step()
            if guard == "nan-then-after-step" and not math.isfinite(batch_total):
                raise FloatingPointError("the loss is not finite")
            if zero == "after":
                optimizer.zero_grad(set_to_none=set_to_none)
            total += batch_total
            n += len(y)
        if denominator == "count":
            return loss_out(total / n)
        if denominator == "dataset":
            return total / len(loader.dataset)
        if denominator == "fifty":  # hard-coded for the first set-up
            return total / 50
        if denominator == "batches_x_size":
            return total / (len(loader) * loader.batch_size)
        raise ValueError(denominator)
    return fn


def guard_then_zero_grad_in_place(model, loader, loss_fn, optimizer, device):
    """A right answer the other way round: lesson 01's zero_grad first, with a copy of the
    last step's gradients kept aside and put back if the loss is not finite."""
    model.train()
    total, n = 0.0, 0
    for X, y in loader:
        kept = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        optimizer.zero_grad()
        loss = loss_fn(model(X), y)
        if not math.isfinite(loss.item()):
            for p, g in zip(model.parameters(), kept):
                p.grad = g
            raise FloatingPointError(f"the loss is {loss.item()}")
        loss.backward()
        optimizer.step()
        total += loss.item() * len(y)
        n += len(y)
    return total / n


@pytest.mark.parametrize("fn", [
    _train(),
    _train(set_to_none=False),
    _train(denominator="dataset"),
    _train(guard="isfinite"),
    guard_then_zero_grad_in_place,
], ids=["plain", "zeroed-in-place-after-the-guard", "len-dataset", "isfinite-guard",
        "zero-grad-first-with-the-gradients-put-back"])
def test_right_train_variants_pass(fn, capsys):
    lab01.check_train_one_epoch(fn)
    assert capsys.readouterr().out.count("✔") == 1


def test_a_0_dim_tensor_return_is_refused_with_its_cause():
    """The contract says a Python float: a detached 0-dim tensor prints like one, but is not
    one to the caller's code (float arithmetic, json logging, a GPU's memory)."""
    fn = _train(loss_out=torch.tensor)
    with pytest.raises(LabCheckError) as err:
        lab01.check_train_one_epoch(fn)
    first = str(err.value)
    assert "a tensor, where the contract asks for a Python float" in first, first
    assert "json.dumps refuses it (Object of type Tensor is not JSON serializable)" in first
    assert "+ 1.0 is tensor(" in first and ".item()" not in first, first
    with pytest.raises(LabCheckError, match=r"Python float \(\.item\(\)\) once"):
        lab01.check_train_one_epoch(fn)


def _nan(where="before", raises=FloatingPointError, looks_at="loss", rollback=False,
         clear=False):
    """train_one_epoch with a NaN guard in several wrong places: ``where`` the loss is tested
    ("before" backward: right; "after-step"; "end": the epoch's mean, once; "never"; "skip":
    the batch is left out quietly); ``looks_at``: the "loss", the "images" or the "gradients";
    ``rollback``: put back the weights from before the epoch when raising; ``clear``: clear
    p.grad before raising."""
    def fn(model, loader, loss_fn, optimizer, device):
        model.train()
        start = [p.detach().clone() for p in model.parameters()]
        total, n = 0.0, 0

        def stop(message):
            if clear:
                optimizer.zero_grad()
            if rollback:
                with torch.no_grad():
                    for p, s in zip(model.parameters(), start):
                        p.copy_(s)
            if raises is AssertionError:
                assert False, message
            raise raises(message)

        for X, y in loader:
            if looks_at == "images" and torch.isnan(X).any():
                stop("NaN in the images")
            loss = loss_fn(model(X), y)
            if looks_at == "loss" and where == "before" and not torch.isfinite(loss):
                stop("NaN loss")
            if where == "skip" and not torch.isfinite(loss):
                continue
            optimizer.zero_grad()
            loss.backward()
            if looks_at == "gradients" and any(torch.isnan(p.grad).any()
                                               for p in model.parameters()):
                stop("NaN gradient")
            optimizer.step()
            if where == "after-step" and not torch.isfinite(loss):
                stop("NaN loss")
            total += loss.item() * len(y)
            n += len(y)
        if where == "end" and not math.isfinite(total):
            stop("the epoch's loss is NaN")
        return total / n
    return fn


@pytest.mark.parametrize("fn, phrase", [
    (_nan(where="never"), "trained on through it and returned nan. The step on it made 4 of "
                          "the model's 4 parameter tensors NaN"),
    (_nan(where="after-step"), "raised FloatingPointError, but 4 of the model's 4 parameter "
                               "tensors already held NaN when it did"),
    (_nan(where="end"), "parameter tensors already held NaN when it did"),
    (_nan(where="skip"), "left out without a word"),
    (_nan(looks_at="images"), "labels was -100, CrossEntropyLoss's ignore_index"),
    # gradients tested after backward (and cleared before raising): a batch of padding has
    # finite (zero) gradients
    (_nan(looks_at="gradients", clear=True),
     "all 4 of the model's p.grad were None when it raised. The contract says"),
    # the same test, the gradients left as they are: the NaN stays in p.grad
    (_nan(looks_at="gradients"), "4 of the model's 4 gradients (p.grad) held NaN or inf when "
                                 "it did"),
    # not finite, tested between backward and step: Adam's state is safe, p.grad is not
    (_train(guard="after-backward"), "gradients (p.grad) held NaN or inf when it did"),
    # torch.isnan alone: the inf loss of the huge-input batch goes through
    (_train(guard="isnan"), "that batch's loss was inf in float32, not NaN"),
    (_train(guard="isnan"), "The contract's rule is a loss that is not finite"),
    (_train(guard="isnan"), "of Adam's 12 state tensors inf or NaN"),
    # inf caught, but only after the step: the weights are finite, Adam's state is not
    (_train(guard="nan-then-after-step"), "raised FloatingPointError with finite weights, but "
                                          "2 of Adam's 12 state tensors already held inf"),
    # its own summed loss divided by the batch size: 0, not NaN, on a batch of padding
    (_train(backward="sum"), "loss_fn's mean loss on that batch was NaN"),
    (_nan(raises=ValueError), "raised ValueError (NaN loss). The contract's error is "
                              "FloatingPointError"),
    (_nan(raises=AssertionError), "an assert statement is removed when Python runs with -O"),
    (_nan(rollback=True), "those from before the epoch: the steps on batches 1 and 2"),
    # raised between backward and step, and zero_grad only after a step: the NaN gradient waits
    # in p.grad for the caller's next epoch
    (_train(zero="after", guard="after-backward"), "held NaN or inf when it did"),
], ids=["no-guard", "after-step", "end-of-epoch", "skipped-quietly", "images-only",
        "gradients-only-cleared", "gradients-only", "guard-between-backward-and-step",
        "isnan-only-cause", "isnan-only-rule", "isnan-only-adam-state", "inf-after-step",
        "own-summed-loss", "value-error", "assert", "rolled-back-the-epoch",
        "nan-gradient-left-for-the-next-epoch"])
def test_a_nan_loss_reaching_the_weights_or_the_caller_wrongly_is_named(fn, phrase):
    with pytest.raises(LabCheckError) as err:
        lab01.check_train_one_epoch(fn)
    assert phrase in str(err.value), str(err.value)


def test_a_nan_guard_before_backward_passes(capsys):
    lab01.check_train_one_epoch(_nan())
    assert "p.grad, which still holds the last sound step's gradient" in capsys.readouterr().out


# The contract's p.grad: the caller finds the gradient the last sound step used. Lesson 01's
# loop (zero_grad first) with the guard after the loss passes every other test of the contract
# and is refused by what its zero_grad left in p.grad; so is zero_grad at the end of each step.
_CLEARED = [
    (_train(zero="first"),
     "raised FloatingPointError with the weights and Adam's state of the batches before it, but "
     "all 4 of the model's p.grad were None when it raised",
     "between the step on batch 2 and your test of batch 3's loss, a zero_grad() ran (its "
     "default, set_to_none=True, sets p.grad to None)"),
    (_train(zero="first", set_to_none=False),
     "all 4 of the model's p.grad held only zeros when it raised",
     "between the step on batch 2 and your test of batch 3's loss, the gradients were zeroed "
     "in place (zero_grad(set_to_none=False), or p.grad.zero_()), which clears them as surely "
     "as None"),
    (_train(zero="after"), "all 4 of the model's p.grad were None when it raised",
     "between the step on batch 2 and your test of batch 3's loss, a zero_grad() ran"),
    (_train(zero="after", set_to_none=False), "held only zeros when it raised",
     "the gradients were zeroed in place"),
]
_CLEARED_IDS = ["zero-grad-before-the-guard", "zeroed-in-place-before-the-guard",
                "zero-grad-after-each-step", "zeroed-in-place-after-each-step"]


@pytest.mark.parametrize("fn, phrase, mechanism", _CLEARED, ids=_CLEARED_IDS)
def test_a_guard_after_the_gradients_were_cleared_is_named(fn, phrase, mechanism):
    """Learner LR4_01: the first meeting says what the caller found against the contract (with
    the numbers), never the mechanism or the move."""
    with pytest.raises(LabCheckError) as err:
        lab01.check_train_one_epoch(fn)
    first = str(err.value)
    assert phrase in first, first
    assert "each p.grad holding the last sound step's gradient (batch 2's)" in first, first
    assert "batch 3 of 4 held one image with a NaN pixel" in first, first
    for told in ("just before backward", "zero_grad", "between the step", "zeroed in place"):
        assert told not in first, (told, first)


@pytest.mark.parametrize("fn, phrase, mechanism", _CLEARED, ids=_CLEARED_IDS)
def test_a_guard_after_cleared_gradients_gets_mechanism_and_fix_on_the_second_meeting(
        fn, phrase, mechanism):
    with pytest.raises(LabCheckError):
        lab01.check_train_one_epoch(fn)
    with pytest.raises(LabCheckError) as err:
        lab01.check_train_one_epoch(fn)
    second = str(err.value)
    assert phrase in second and mechanism in second, second
    assert ("What to change: test the loss before anything clears or writes p.grad, and clear "
            "the gradients after the test, just before backward") in second, second


def test_gradients_written_over_by_something_else_are_named_with_the_difference():
    """p.grad neither None nor zero, nor the last step's: the check says by how much."""
    def fn(model, loader, loss_fn, optimizer, device):
        model.train()
        total, n = 0.0, 0
        for X, y in loader:
            loss = loss_fn(model(X), y)
            if not torch.isfinite(loss):
                for p in model.parameters():
                    p.grad *= 2  # "rescaled for the log": no longer the step's gradient
                raise FloatingPointError("the loss is not finite")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(y)
            n += len(y)
        return total / n
    with pytest.raises(LabCheckError) as err:
        lab01.check_train_one_epoch(fn)
    assert "p.grad was not the gradient the step on batch 2 used when it raised (largest " \
           "difference" in str(err.value), str(err.value)


def test_the_huge_input_batch_gives_an_inf_loss_with_finite_logits_and_gradients():
    """The check's third spoiling, verified by a run: in float32 the loss is inf (not NaN)
    while the logits and the gradients stay finite, and Adam's state overflows."""
    model, loader, X, y, loss_fn = lab01._spoiled(lab01._SETUPS[0], "huge")
    torch.manual_seed(1)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lab01._LR)
    for i, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        out = model(xb)
        loss = loss_fn(out, yb)
        if i == lab01._BAD:
            assert math.isinf(loss.item()) and bool(torch.isfinite(out).all())
            loss.backward()
            assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            opt.step()
            assert lab01._not_finite(lab01._state(opt)) > 0
            return
        loss.backward()
        opt.step()


def test_an_isnan_only_guard_gets_isfinite_on_the_second_meeting():
    fn = _train(guard="isnan")
    with pytest.raises(LabCheckError) as err:
        lab01.check_train_one_epoch(fn)
    assert "torch.isfinite" not in str(err.value) and "lets inf through" not in str(err.value)
    with pytest.raises(LabCheckError, match=r"test the loss with torch.isfinite .*a test for "
                                            r"NaN alone \(isnan, x != x\) lets inf through"):
        lab01.check_train_one_epoch(fn)


# Learner LR4_01: every code mistake's first meeting is the symptom against the contract; the
# mechanism (and the move) joins only when the same mistake comes back.
@pytest.mark.parametrize("check, fn, leaves, mechanism", [
    ("train", no_zero_grad, None, "backward adds into p.grad"),
    ("train", no_train_mode, None, "cannot rely on the mode its caller left"),
    ("train", no_step, None, "the weights move when the optimizer steps"),
    ("train", summed_loss_backward, None, "summed over the batch"),
    ("train", _returning("mean_of_means"), None, "you averaged the per-batch means"),
    ("train", _nan(where="after-step"), None, "the optimizer step on the spoiled batch had "
                                              "already run"),
    ("train", _train(guard="nan-then-after-step"), None, "the optimizer step on the spoiled "
                                                         "batch had already run"),
    ("train", _train(guard="after-backward"), None, "backward() on the spoiled batch had "
                                                    "already run"),
    ("train", _train(backward="sum"), None, "a loss of your own in place of loss_fn's"),
    ("evaluate", _eval(restore="flag"), "as found", "model.train(flag) sets every submodule"),
    ("evaluate", _eval(restore=True, finally_=False), "as found", "an exception skips it"),
    ("evaluate", _eval(grad="switch"), "eval", "never ran"),
], ids=["leaked-gradients", "eval-mode", "no-step", "summed-loss", "mean-of-means",
        "guard-after-step", "inf-after-step", "guard-after-backward", "own-loss",
        "one-flag-restore", "restore-without-finally", "grad-switched-back-after-loop"])
def test_first_meeting_is_the_symptom_the_second_adds_the_mechanism(check, fn, leaves,
                                                                    mechanism):
    def run():
        with pytest.raises(LabCheckError) as err:
            if check == "train":
                lab01.check_train_one_epoch(fn)
            else:
                lab01.check_evaluate(fn, leaves=leaves)
        return str(err.value)
    first, second = run(), run()
    assert mechanism not in first and "Run the check again" in first, first
    assert mechanism in second and "What to change:" in second, second


def test_a_nan_guard_after_the_step_gets_the_fix_on_the_second_meeting():
    fn = _nan(where="after-step")
    with pytest.raises(LabCheckError) as err:
        lab01.check_train_one_epoch(fn)
    assert "before it reaches backward" not in str(err.value)
    with pytest.raises(LabCheckError, match="loss before it reaches backward and the step"):
        lab01.check_train_one_epoch(fn)


@pytest.mark.parametrize("fn, phrase", [
    (_train(denominator="fifty"), "fixed sample count"),
    (_train(denominator="batches_x_size"), "number of batches × batch size"),
])
def test_answers_fitting_one_data_set_fail(fn, phrase):
    with pytest.raises(LabCheckError) as err:
        lab01.check_train_one_epoch(fn)
    assert phrase in str(err.value), str(err.value)


def eval_inference_mode(model, loader, loss_fn, device):
    model.eval()
    loss_sum, hits = torch.zeros(()), torch.zeros((), dtype=torch.long)
    with torch.inference_mode():
        for X, y in loader:
            out = model(X)
            loss_sum += torch.nn.functional.cross_entropy(out, y, reduction="sum")
            hits += (out.argmax(-1) == y).sum()
    n = len(loader.dataset)
    if n == 0:
        raise ValueError("no samples in the loader")
    return (loss_sum / n).item(), (hits / n).item()  # summed as tensors, returned as floats


@torch.no_grad()
def eval_decorated_one_pass(model, loader, loss_fn, device):
    model.eval()
    outs = [(model(X), y) for X, y in loader]
    if not outs:
        raise ValueError("empty loader")
    logits = torch.cat([o for o, _ in outs])
    y = torch.cat([t for _, t in outs])
    return loss_fn(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def eval_hard_coded(model, loader, loss_fn, device):
    model.eval()
    with torch.no_grad():
        total, hits = 0.0, 0
        for X, y in loader:
            out = model(X)
            total += loss_fn(out, y).item() * len(y)
            hits += (out.argmax(1) == y).sum().item()
    return total / 50, hits / 50


@pytest.mark.parametrize("fn", [eval_inference_mode, eval_decorated_one_pass])
def test_right_evaluate_variants_pass(fn, capsys):
    lab01.check_evaluate(fn)
    assert capsys.readouterr().out.count("✔") == 1


def test_evaluate_fitting_one_data_set_fails():
    with pytest.raises(LabCheckError, match="on 37 samples"):
        lab01.check_evaluate(eval_hard_coded)


# --- stretch: gradient accumulation ----------------------------------------------------------

def _accum(weight="share", step_every=False, zero_every=False, zero_after=True, zero_first=True,
           big_forward=False, style="buffer", report="mean"):
    """train_accumulated written in several ways. ``weight``: what each micro-batch's mean loss
    is multiplied by, "share" (len(y) / the group's sample count: right), "k" (1/k: right only
    for equal micro-batches) or "none"."""
    def fn(model, loader, loss_fn, optimizer, k, device):
        losses = []
        _accum_body(model, loader, loss_fn, optimizer, k, losses)
        if report == "none":
            return None
        total = sum(l * s for l, s in losses)
        n = sum(s for _, s in losses)
        return {"mean": total / n, "scaled": total / n / k, "total": total}[report]

    def _accum_body(model, loader, loss_fn, optimizer, k, losses):
        model.train()
        if zero_first:
            optimizer.zero_grad()
        batches = list(loader)
        groups = [batches[g:g + k] for g in range(0, len(batches), k)]
        if big_forward:  # runs the whole group at once: no memory saved
            for group in groups:
                X = torch.cat([b[0] for b in group])
                y = torch.cat([b[1] for b in group])
                loss = loss_fn(model(X), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append((loss.item(), len(y)))
            return
        if style == "rescale":  # a right answer: summed gradients divided at the group's end
            count = 0
            for i, (X, y) in enumerate(batches):
                loss = loss_fn(model(X), y)
                (loss * len(y)).backward()
                losses.append((loss.item(), len(y)))
                count += len(y)
                if (i + 1) % k == 0:
                    for p in model.parameters():
                        p.grad /= count
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    count = 0
            return
        for group in groups:
            group_n = sum(len(y) for _, y in group)
            for i, (X, y) in enumerate(group):
                if zero_every:
                    optimizer.zero_grad()
                loss = loss_fn(model(X), y)
                scale = {"share": len(y) / group_n, "k": 1 / k, "none": 1.0}[weight]
                (loss * scale).backward()
                losses.append((loss.item(), len(y)))
                if step_every or i == len(group) - 1:
                    optimizer.step()
                    if zero_after:
                        optimizer.zero_grad()
    return fn


def accum_sum_reduction(model, loader, loss_fn, optimizer, k, device):
    # a right answer: summed losses, the group's sample count taken from the loader's batches
    model.train()
    for p in model.parameters():
        p.grad = None
    summed, count = torch.zeros(()), 0
    batches = list(loader)
    for g in range(0, len(batches), k):
        group = batches[g:g + k]
        group_n = sum(len(y) for _, y in group)
        for X, y in group:
            loss = torch.nn.functional.cross_entropy(model(X), y, reduction="sum")
            (loss / group_n).backward()
            summed += loss.detach()
            count += len(y)
        optimizer.step()
        model.zero_grad()
    return (summed / count).item()  # summed as a tensor, returned as a float


def _leftover(choice, count_rest=True):
    """train_accumulated with the full groups right (each micro-batch weighted by its share of
    its group's samples) and the micro-batches left over at the end handled ``choice``: "own"
    (a step on their own samples' mean: right), "merge" (joined to the last full group's step:
    right), "drop" (backward, then cleared unused), "skip" (never run), "left" (backward, no
    step: left in p.grad), "k" (each weighted 1/k), "full" (divided by a full group's sample
    count) or "raise" (ValueError); ``count_rest=False``: the returned loss leaves the
    leftover's samples out."""
    def fn(model, loader, loss_fn, optimizer, k, device):
        model.train()
        optimizer.zero_grad()
        batches = list(loader)
        whole = len(batches) // k * k
        groups = [batches[g:g + k] for g in range(0, whole, k)]
        rest = batches[whole:]
        if choice == "raise" and rest:
            raise ValueError(f"{len(batches)} micro-batches are not a whole number of groups")
        if choice == "merge" and groups:
            groups[-1], rest = groups[-1] + rest, []
        total, count = 0.0, 0
        for group in groups:
            n = sum(len(y) for _, y in group)
            for X, y in group:
                loss = loss_fn(model(X), y)
                (loss * len(y) / n).backward()
                total, count = total + loss.item() * len(y), count + len(y)
            optimizer.step()
            optimizer.zero_grad()
        if rest and choice != "skip":
            n = sum(len(y) for _, y in rest)
            full_n = k * len(batches[0][1])
            for X, y in rest:
                loss = loss_fn(model(X), y)
                weight = {"k": 1 / k, "full": len(y) / full_n}.get(choice, len(y) / n)
                (loss * weight).backward()
                if count_rest:
                    total, count = total + loss.item() * len(y), count + len(y)
            if choice in ("own", "k", "full"):
                optimizer.step()
            if choice != "left":
                optimizer.zero_grad()
        return total / count
    return fn


def accum_rescale_with_leftover(divide=True):
    """The solution's shape: summed per-sample gradients, divided where a group closes, and the
    leftover stepped after the loop (``divide``: divided by its own count; False: never)."""
    def fn(model, loader, loss_fn, optimizer, k, device):
        model.train()
        optimizer.zero_grad()
        total, count, in_group = 0.0, 0, 0

        def step(divisor):
            for p in model.parameters():
                p.grad /= divisor
            optimizer.step()
            optimizer.zero_grad()

        for i, (X, y) in enumerate(loader):
            loss = loss_fn(model(X), y)
            (loss * len(y)).backward()
            in_group += len(y)
            total, count = total + loss.item() * len(y), count + len(y)
            if (i + 1) % k == 0:
                step(in_group)
                in_group = 0
        if in_group:
            step(in_group if divide else 1)
        return total / count
    return fn


@pytest.mark.parametrize("fn", [_accum(), accum_sum_reduction, accum_rescale_with_leftover(),
                                _leftover("own"), _leftover("merge")],
                         ids=["buffered-groups", "sum-reduction", "rescale-at-step",
                              "leftover-own-step", "leftover-merged"])
def test_right_accumulation_passes(fn, capsys):
    lab01.check_train_accumulated(fn)
    assert capsys.readouterr().out.count("✔") == 1


@pytest.mark.parametrize("fn, said", [
    (_leftover("own"), "take a step of their own"),
    (_leftover("merge"), "join the last full group's step"),
])
def test_the_leftover_decision_is_named_on_pass(fn, said, capsys):
    lab01.check_train_accumulated(fn)
    assert said in capsys.readouterr().out


def accum_merge_overwriting_a_group(model, loader, loss_fn, optimizer, k, device):
    """The learner's probe: `groups[-2] += groups.pop()` evaluates its target before the pop,
    so the merged group lands in the place of the group before it."""
    model.train()
    optimizer.zero_grad()
    batches = list(loader)
    groups = [batches[g:g + k] for g in range(0, len(batches), k)]
    if len(groups) > 1 and len(groups[-1]) < k:
        groups[-2] += groups.pop()
    total = count = 0
    for group in groups:
        n = sum(len(y) for _, y in group)
        for X, y in group:
            loss = loss_fn(model(X), y)
            (loss * len(y) / n).backward()
            total, count = total + loss.item() * len(y), count + len(y)
        optimizer.step()
        optimizer.zero_grad()
    return total / count


# The stretch's design decision (learner LR4_01: the contract was silent on a loader whose
# length is not a multiple of k, and a right-looking answer left the leftover's unscaled
# gradients in p.grad): each wrong choice is refused by what the check measured first, and by
# its mechanism on the second meeting.
@pytest.mark.parametrize("fn, first_phrase, mechanism", [
    (_accum(style="rescale"),
     "took 3 optimizer steps, and when it returned p.grad held a gradient (norm",
     "the shorter last group never closes, so its backwards added into p.grad and stayed"),
    (_leftover("left"), "p.grad held a gradient (norm", "never closes"),
    (_leftover("drop"),
     "its weights are those the 3 full group(s) alone give: the last 6 samples contributed "
     "to no step", "their forward and backward ran, and the gradient was cleared unused"),
    (_leftover("skip"), "the last 6 samples contributed to no step",
     "your function ran 9 forwards for 11 micro-batches"),
    (accum_rescale_with_leftover(divide=False),
     "the last one on the leftover (6 samples), but the gradient that step used was 6.00 times "
     "as long as the gradient of those samples' mean loss",
     "its summed gradient was never divided"),
    (_leftover("k"), "the gradient that step used was 0.72 times as long",
     "you gave each 1/k = 1/3 of the weight, but the leftover holds 2 micro-batch(es), of "
     "sizes [4, 2]"),
    (_leftover("full"), "the gradient that step used was 0.50 times as long",
     "you divided by a full group's (12)"),
    (_leftover("raise"), "your function raised ValueError", "an error leaves the caller with "
                                                           "no epoch at all"),
    # learner LR5_01's probe `groups[-2] += groups.pop()` evaluates its target before the pop,
    # so the merged group lands in the place of the group before it: named by its step and by
    # the micro-batches its gradient matches, never a bare '1.00 times as long'
    (accum_merge_overwriting_a_group,
     ("step 2 is the first whose samples are wrong: it should take micro-batches 4 to 6 "
      "(samples 13 to 24)", "it is the gradient of micro-batches 7 to 11 (samples 25 to 42) "
                            "instead"),
     "step 2's list is not [4, 5, 6]"),
], ids=["rescale-left-in-p.grad", "left-in-p.grad", "dropped", "never-run", "never-divided",
        "one-over-k", "full-group-divisor", "raises", "group-overwritten-before-the-leftover"])
def test_each_wrong_leftover_choice_is_refused_by_its_cause(fn, first_phrase, mechanism):
    scene = ("one of the check's loaders held 11 micro-batches of sizes [4, 4, 4, 4, 4, 4, 4, "
             "4, 4, 4, 2] with k = 3: 3 group(s) of 3, and 2 micro-batch(es) (6 samples) left "
             "over at the end")
    with pytest.raises(LabCheckError) as first:
        lab01.check_train_accumulated(fn)
    message = str(first.value)
    phrases = (first_phrase,) if isinstance(first_phrase, str) else first_phrase
    assert scene in message and all(p in message for p in phrases), message
    assert "1.00 times as long" not in message, message
    assert mechanism not in message and "Run the check again" in message, message
    with pytest.raises(LabCheckError) as second:
        lab01.check_train_accumulated(fn)
    assert mechanism in str(second.value), str(second.value)


def test_a_leftover_left_out_of_the_returned_loss_is_refused():
    with pytest.raises(LabCheckError, match="over the epoch's 42 samples, the 6 left over at "
                                            "the end included, is"):
        lab01.check_train_accumulated(_leftover("own", count_rest=False))


@pytest.mark.parametrize("fn, phrase", [
    (_accum(weight="k"), "micro-batches of a group differ in size"),
    (_accum(weight="none"), "times too big"),
    (_accum(step_every=True), "took 12 optimizer steps for 12 micro-batches in 4 groups of "
                              "k = 3"),
    (_accum(step_every=True, weight="k"), "optimizer steps for 12 micro-batches"),
    (_accum(zero_every=True), "as if its group held only its last micro-batch"),
    (_accum(zero_after=False), "carried the gradients of all earlier groups too"),
    (_accum(zero_after=False, weight="k"), "carried the gradients of all earlier groups too"),
    (_accum(zero_first=False), "depend on what p.grad held"),
    (_accum(zero_first=False, weight="k"), "depend on what p.grad held"),
    (_accum(zero_first=False, style="rescale"), "depend on what p.grad held"),
    (_accum(big_forward=True), "never running more than one micro-batch at once"),
    (_accum(report="none"), "returned None"),
    (_accum(report="scaled"), "3 times less than the mean loss per sample"),
    (_accum(report="total"), "total loss over all samples"),
])
def test_accumulation_mistakes_are_named(fn, phrase):
    with pytest.raises(LabCheckError) as err:
        lab01.check_train_accumulated(fn)
    assert phrase in str(err.value), str(err.value)


def test_accumulation_with_leftover_gradients_names_them_not_the_weighting():
    # The learner's round: the rescale-at-step answer without its first zero_grad divides the
    # leftover gradients too, so no replay matches; the check reruns the answer with p.grad
    # empty and names the leftovers as the cause, and that the rest is right.
    wrong = _accum(zero_first=False, style="rescale")
    with pytest.raises(LabCheckError) as first:
        lab01.check_train_accumulated(wrong)
    message = str(first.value)
    assert "depend on what p.grad held" in message, message
    assert "exactly plain training's" in message, message
    assert "mean loss over its group" not in message, message
    assert "Run the check again" in message and "before the first micro-batch" not in message
    with pytest.raises(LabCheckError) as second:
        lab01.check_train_accumulated(wrong)
    assert "clear the gradients once before the first micro-batch" in str(second.value)


def accum_unknown_mistake(model, loader, loss_fn, optimizer, k, device):
    # wrong in a way no replay knows: the group's last micro-batch counted twice
    model.train()
    optimizer.zero_grad()
    total, count, batches = 0.0, 0, list(loader)
    for g in range(0, len(batches), k):
        group = batches[g:g + k]
        group_n = sum(len(y) for _, y in group) + len(group[-1][1])
        for i, (X, y) in enumerate(group):
            loss = loss_fn(model(X), y)
            (loss * len(y) * (2 if i == len(group) - 1 else 1) / group_n).backward()
            total += loss.item() * len(y)
            count += len(y)
        optimizer.step()
        optimizer.zero_grad()
    return total / count


def test_accumulation_unknown_mistake_has_the_same_two_meetings():
    with pytest.raises(LabCheckError) as first:
        lab01.check_train_accumulated(accum_unknown_mistake)
    assert "in none of the ways the check knows" in str(first.value), str(first.value)
    assert "Run the check again" in str(first.value), str(first.value)
    with pytest.raises(LabCheckError) as second:
        lab01.check_train_accumulated(accum_unknown_mistake)
    assert "compare p.grad just before your step" in str(second.value), str(second.value)


def test_accumulation_by_one_over_k_names_the_cause_not_the_code():
    with pytest.raises(LabCheckError) as err:
        lab01.check_train_accumulated(_accum(weight="k"))
    message = str(err.value)
    assert "counted for more" in message and "len(y)" not in message, message
    assert "1/3" not in message, message
    with pytest.raises(LabCheckError) as second:
        lab01.check_train_accumulated(_accum(weight="k"))
    assert "you gave each micro-batch 1/3 of the group's weight" in str(second.value)


@pytest.mark.parametrize("fn, mechanism", [
    (_accum(step_every=True), "you stepped after every micro-batch"),
    (_accum(zero_every=True), "you zeroed them before every micro-batch"),
    (_accum(zero_after=False), "nothing cleared what the previous group left there"),
    (_accum(weight="none"), "backward adds each micro-batch's gradient into p.grad"),
    (_accum(report="scaled"), "you reported the scaled loss you backpropagated"),
], ids=["step-every", "zero-every", "never-zeroed", "unweighted", "scaled-report"])
def test_accumulation_mechanism_waits_for_the_second_meeting(fn, mechanism):
    with pytest.raises(LabCheckError) as first:
        lab01.check_train_accumulated(fn)
    assert mechanism not in str(first.value), str(first.value)
    with pytest.raises(LabCheckError) as second:
        lab01.check_train_accumulated(fn)
    assert mechanism in str(second.value), str(second.value)


# --- predict, then measure ---------------------------------------------------------------------

@pytest.mark.parametrize("value, losses, verdict", [
    ("train_one_epoch's", (1.6, 0.9), "right"),
    ("about the same", (1.6, 0.9), "not what happened"),
    ("evaluate's", (0.9, 1.6), "right"),
    ("about the same", (1.0, 0.95), "right"),
])
def test_prediction_is_compared_and_explained(value, losses, verdict, capsys):
    from dpcourse.checks import predict

    guess = predict("lab01", lab01.PREDICTION_QUESTION, value,
                    choices=lab01.PREDICTION_CHOICES)
    lab01.check_prediction(guess, *losses)
    out = " ".join(capsys.readouterr().out.split())  # reveal wraps its lines
    assert f" — {verdict}." in out, out
    assert "running summary of the epoch" in out, out
    # learner LR4_01: the feedback prints the two numbers it compared
    assert (f"train_one_epoch returned {losses[0]:.3f} and evaluate measured {losses[1]:.3f}"
            in out), out


def test_rerunning_an_unchanged_prediction_is_not_called_late(capsys):
    """Learner LR4_01: re-running the step prediction's cell to re-read it kept the guess but
    called it "made after the measurement"; an unchanged guess is the same prediction."""
    from dpcourse.checks import predict

    guess = predict("lab01", lab01.STEP_QUESTION, "larger", choices=lab01.STEP_CHOICES)
    lab01.check_step_prediction(guess, good_train)
    capsys.readouterr()
    again = predict("lab01", lab01.STEP_QUESTION, "larger", choices=lab01.STEP_CHOICES)
    lab01.check_step_prediction(again, good_train)
    out = capsys.readouterr().out
    assert not again.late and "made after the measurement" not in out, out
    assert "Prediction unchanged" in out and "Now run the measurement" not in out, out
    changed = predict("lab01", lab01.STEP_QUESTION, "smaller", choices=lab01.STEP_CHOICES)
    assert changed.late  # a new guess after the measurement is still not a prediction


def eval_restoring_every_module(model, loader, loss_fn, device):
    # a right "as found" answer written another way: each submodule's flag saved and put back
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.inference_mode():
            outs = [(model(X), y) for X, y in loader]
    finally:
        for m, mode in modes.items():
            m.training = mode
    n = sum(len(y) for _, y in outs)
    if not n:
        raise ValueError("the loader held no sample")
    loss = sum(torch.nn.functional.cross_entropy(o, y, reduction="sum").item() for o, y in outs)
    hits = sum((o.argmax(1) == y).sum().item() for o, y in outs)
    return loss / n, hits / n


def test_right_as_found_variant_passes(capsys):
    lab01.check_evaluate(eval_restoring_every_module, leaves="as found")
    assert capsys.readouterr().out.count("✔") == 1


# --- cause first: the fix joins the sentence only when the same mistake comes back ------------

def test_cause_first_the_fix_on_the_second_meeting():
    with pytest.raises(LabCheckError) as first:
        lab01.check_train_one_epoch(no_zero_grad)
    assert "leaked into each step" in str(first.value), str(first.value)
    assert "Run the check again" in str(first.value) and "zero_grad()" not in str(first.value)
    with pytest.raises(LabCheckError) as second:
        lab01.check_train_one_epoch(no_zero_grad)
    assert "optimizer.zero_grad()" in str(second.value), str(second.value)


def test_prediction_explanation_fits_the_labs_model(capsys):
    from dpcourse.checks import predict

    guess = predict("lab01", lab01.PREDICTION_QUESTION, "evaluate's",
                    choices=lab01.PREDICTION_CHOICES)
    lab01.check_prediction(guess, 1.9, 1.2)
    out = capsys.readouterr().out
    assert "train_one_epoch's" in out and "dropout is 0" in out, out


# --- "as found" for a model whose layers are in different modes (a frozen BatchNorm) ----------

def test_one_flag_restored_to_every_layer_is_refused_with_its_cause():
    # the "as found" answer that restores with model.train(was_training): right for a model in
    # one mode, wrong for a training model with a frozen (eval-mode) BatchNorm
    wrong = _eval(restore="flag")
    with pytest.raises(LabCheckError) as first:
        lab01.check_evaluate(wrong, leaves="as found")
    message = str(first.value)
    assert "frozen in eval mode" in message, message
    assert "came back with that BatchNorm in training mode" in message, message
    assert "(the check took that step: its running mean moved by 0." in message, message
    assert "Run the check again" in message and "model.modules()" not in message, message
    assert "model.train(flag)" not in message, message
    with pytest.raises(LabCheckError) as second:
        lab01.check_evaluate(wrong, leaves="as found")
    assert "remember each submodule's own .training" in str(second.value), str(second.value)
    assert "model.train(flag) sets every submodule" in str(second.value), str(second.value)


def eval_restoring_by_name(model, loader, loss_fn, device):
    # a right "as found" answer written another way: modes by name, put back with .train(flag)
    # on each module from the leaves up (so a parent's train() does not overwrite a child's)
    modes = {name: m.training for name, m in model.named_modules()}
    model.eval()
    try:
        with torch.no_grad():
            total, hits, n = 0.0, 0, 0
            for X, y in loader:
                out = model(X)
                total += loss_fn(out, y).item() * len(y)
                hits += (out.argmax(1) == y).sum().item()
                n += len(y)
    finally:
        for name in sorted(modes, key=len):  # "" (the model) first, its children after
            model.get_submodule(name).train(modes[name])
    if n == 0:
        raise ValueError("empty loader")
    return total / n, hits / n


@pytest.mark.parametrize("fn", [_eval(restore=True), eval_restoring_every_module,
                                eval_restoring_by_name],
                         ids=["each-flag-in-finally", "training-attribute", "by-name-train"])
def test_restoring_each_layers_own_mode_passes(fn, capsys):
    lab01.check_evaluate(fn, leaves="as found")
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "frozen BatchNorm" in out, out


def test_a_frozen_batchnorm_under_the_eval_decision_passes(capsys):
    lab01.check_evaluate(_eval(), leaves="eval", back_to_training=back_to_training)
    assert capsys.readouterr().out.count("✔") == 1


# --- an empty loader: a clear error (the contract says ValueError) -----------------------------

def eval_validating_first(model, loader, loss_fn, device):
    # a right answer written another way: the bad input refused before anything changes
    if len(loader) == 0:
        raise ValueError("evaluate needs at least one batch")
    return _eval()(model, loader, loss_fn, device)


def eval_raising_in_eval_mode(model, loader, loss_fn, device):
    # "as found", but the empty loader's error leaves before the mode is put back
    modes = {m: m.training for m in model.modules()}
    model.eval()
    if len(loader) == 0:
        raise ValueError("evaluate needs at least one batch")
    try:
        return _eval(mode=False)(model, loader, loss_fn, device)
    finally:
        for m, flag in modes.items():
            m.training = flag


@pytest.mark.parametrize("fn, leaves, phrase", [
    (_eval(empty="divide"), "eval", "raised ZeroDivisionError"),
    (_eval(empty="zeros"), "eval", "returned (0.0, 0.0)"),
    (_eval(restore=True, empty="divide"), "as found", "not that the loader was empty"),
    (eval_raising_in_eval_mode, "as found", "reached the caller in eval mode"),
])
def test_an_empty_loader_without_a_clear_error_is_named(fn, leaves, phrase):
    with pytest.raises(LabCheckError) as err:
        lab01.check_evaluate(fn, leaves=leaves)
    assert phrase in str(err.value), str(err.value)
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("fn, leaves", [(eval_validating_first, "eval"),
                                        (eval_validating_first, None),
                                        (_eval(restore=True), "as found")])
def test_an_empty_loader_refused_with_value_error_passes(fn, leaves, capsys):
    lab01.check_evaluate(fn, leaves=leaves, back_to_training=back_to_training)
    assert capsys.readouterr().out.count("✔") == 1


# --- predict, then measure: the short last batch's step ----------------------------------------

@pytest.mark.parametrize("value, verdict", [("larger", "right"),
                                            ("smaller", "not what happened"),
                                            ("about the same", "not what happened")])
def test_short_batch_step_is_measured_with_the_learners_function(value, verdict, capsys):
    from dpcourse.checks import predict

    guess = predict("lab01", lab01.STEP_QUESTION, value, choices=lab01.STEP_CHOICES)
    lab01.check_step_prediction(guess, good_train)
    out = " ".join(capsys.readouterr().out.split())
    assert f" — {verdict}." in out, out
    assert "counts every sample once; the steps do not" in out, out
    # learner LR2_01: the printout must not point at the stretch's per-sample weighting
    assert "stretch" not in out and "same weighting" not in out, out


def test_lab_text_states_the_contract_without_pointing_at_the_move():
    """Learner LR2_01: §1 keeps what must hold afterwards, not a question that names the move."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "solutions" / "lab01_single_device.py").read_text()
    assert "still holds the gradient the last step used" in text
    assert "already changed" not in text
    # learner LR4_01: the choices are listed where the guess is written; the measurement runs
    # in its own cell (the prediction cell's "Now run the measurement." is then true); the
    # stretch names its design decision and the contract's rule for the leftover
    # learner LR5_01: each prediction's TODO names the variable to set
    assert '### BEGIN SOLUTION: my_step_guess = "smaller", "about the same" or "larger"' in text
    assert "### BEGIN SOLUTION: my_guess = " in text
    assert "step_guess = predict(" in text
    cell = text.split("step_guess = predict(", 1)[1].split("# %%", 1)[0]
    assert "check_step_prediction" not in cell, cell
    stretch = text.split("## Stretch", 1)[1]
    assert "**Your design decision:**" in stretch
    assert "every sample of the epoch contributes to exactly one step" in stretch


def test_the_short_batch_step_is_a_full_steps_scale_not_its_share():
    ratio, norms = lab01.short_batch_step(good_train)
    assert len(norms) == 4  # 16, 16, 16 and 2 samples
    assert ratio > 1.5, (ratio, norms)  # not 2/16 of a full step: the loss is the batch's mean


# --- learner LR5_01: the "eval" decision carries its own obligation (the caller's half) ---------

def back_train_only(model, frozen):
    model.train()


def back_frozen_first(model, frozen):
    for m in frozen:
        m.eval()
    model.train()


def back_frozen_only(model, frozen):
    for m in frozen:
        m.eval()


def back_flag_on_the_module(model, frozen):
    model.train()
    for m in frozen:
        m.training = False  # the module alone, not what is inside it


def back_hard_coded(model, frozen):
    model.train()
    model[2].eval()  # the lesson's BatchNorm index, whatever the caller froze


def back_each_module_by_name(model, frozen):
    # right, written another way: every module's flag set, the frozen ones' insides included
    inside = {id(m) for f in frozen for m in f.modules()}
    for m in model.modules():
        m.training = id(m) not in inside


@pytest.mark.parametrize("fn", [back_to_training, back_each_module_by_name],
                         ids=["train-then-freeze", "each-flag"])
def test_the_eval_decision_with_a_right_back_to_training_passes(fn, capsys):
    lab01.check_evaluate(_eval(), leaves="eval", back_to_training=fn)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "back_to_training giving a fine-tuning loop" in out, out


@pytest.mark.parametrize("fn, first_phrase, mechanism", [
    (back_train_only, "1 frozen layer(s) ran that step in training mode (model[2] "
                      "(BatchNorm1d)): model[2] (BatchNorm1d)'s running mean moved by 0.",
     "model.train() reaches every submodule, the frozen ones too"),
    (back_frozen_first, "model[2] (BatchNorm1d)'s running mean moved by 0.",
     "the last call that reaches a layer sets its mode"),
    (back_frozen_only, "6 layer(s) the loop trains were in eval mode for that step",
     "put the whole model in training mode first"),
    (back_flag_on_the_module, "model.block (Sequential) itself was in eval mode, but the 3 "
                              "layer(s) inside it ran that step in training mode",
     "setting .training on a module changes that module alone"),
    (back_hard_coded, "froze model.block (a Linear, a BatchNorm1d and a ReLU",
     "model.train() reaches every submodule"),
    (None, "the check got no back_to_training", "write back_to_training"),
], ids=["train-only", "freeze-then-train", "freeze-only", "flag-on-container", "hard-coded",
        "missing"])
def test_each_wrong_back_to_training_is_refused_by_its_cause(fn, first_phrase, mechanism):
    def run():
        with pytest.raises(LabCheckError) as err:
            lab01.check_evaluate(_eval(), leaves="eval", back_to_training=fn)
        return str(err.value)
    first, second = run(), run()
    assert first_phrase in first and mechanism not in first, first
    assert "Run the check again" in first, first
    assert mechanism in second, second


def test_as_found_needs_no_back_to_training(capsys):
    # the caller's half is the eval decision's; under "as found" evaluate alone hands it back
    lab01.check_evaluate(_eval(restore=True), leaves="as found", back_to_training=None)
    assert capsys.readouterr().out.count("✔") == 1


def test_the_stretch_contract_allows_both_leftover_choices_in_words():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "solutions" / "lab01_single_device.py").read_text()
    stretch = text.split("## Stretch", 1)[1].split("# %%", 1)[0]
    assert "k of them for every step but possibly the last" in stretch
    assert "a step of their own" in stretch and "a place in the last full group's step" in stretch
    assert "k consecutive ones to a step" not in stretch
