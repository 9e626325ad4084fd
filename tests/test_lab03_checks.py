"""lab03's checks, on 2 gloo ranks: the reference passes; each classic mistake fails with a
sentence naming it; the deadlock ends by the check's timeout instead of hanging."""

import sys
import time

import cloudpickle
import pytest
import torch.distributed as dist
import torch.nn.functional as F

from dpcourse import ddp
from dpcourse.checks import LabCheckError, lab03

# The ranks cannot import this test module, so its functions travel by value — as a notebook
# cell's functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def sum_only(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def rebind_in_list(model):
    # The d2l form: a list of references to the gradients, and a division that rebinds the list
    # slot (grads[i] = ...) instead of writing into the tensor (grads[i][:] = ... or /=).
    world_size = dist.get_world_size()
    grads = [p.grad for p in model.parameters()]
    for i in range(len(grads)):
        dist.all_reduce(grads[i])
        grads[i] = grads[i] / world_size


def rebind_local_name(model):
    world_size = dist.get_world_size()
    for p in model.parameters():
        g = p.grad
        dist.all_reduce(g)
        g = g / world_size


def reduce_a_copy(model):
    world_size = dist.get_world_size()
    for p in model.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        g /= world_size


def divide_only(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()


def rank0_only(model):
    world_size = dist.get_world_size()
    for p in model.parameters():
        if dist.get_rank() == 0:
            dist.all_reduce(p.grad)
        p.grad /= world_size


def raises(model):
    raise KeyError("oops")


def _step_returning_tensor(model, optimizer, X, y):
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    ddp.average_gradients(model)
    optimizer.step()
    return loss


def good_step(model, optimizer, X, y):
    return _step_returning_tensor(model, optimizer, X, y).item()


def average_the_loss(model, optimizer, X, y):
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(X), y)
    dist.all_reduce(loss)                      # a number every rank agrees on ...
    loss = loss / dist.get_world_size()
    loss.backward()                            # ... but each rank's backward sees its own data
    optimizer.step()
    return loss.item()


def no_zero_grad(model, optimizer, X, y):
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    ddp.average_gradients(model)
    optimizer.step()
    return loss.item()


def no_step(model, optimizer, X, y):
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(X), y).backward()
    ddp.average_gradients(model)


def test_reference_average_gradients_passes(capsys):
    assert lab03.check_average_gradients(ddp.average_gradients) is None  # nothing to echo
    out = capsys.readouterr().out
    assert out.startswith("✔") and "mean over 2 ranks" in out and out.count("✔") == 1


@pytest.mark.parametrize("fn, phrase", [
    (sum_only, "divide p.grad by the world size"),
    (rebind_in_list, "divided into a new tensor bound to a name or list slot"),
    (rebind_local_name, "divided into a new tensor bound to a name or list slot"),
    (reduce_a_copy, "not a copy"),
    (divide_only, "the all_reduce did not reach p.grad"),
    (raises, "raised on rank .: KeyError"),
])
def test_wrong_average_gradients(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab03.check_average_gradients(fn)


def test_all_reduce_on_rank0_only_is_a_deadlock_ended_by_timeout():
    assert lab03.DEFAULT_TIMEOUT <= 20
    t0 = time.monotonic()
    # A short timeout keeps the test quick; rank 0 must be named (rank 1 too, on a machine so
    # busy that it had not even finished starting).
    with pytest.raises(LabCheckError, match=r"rank\(s\) 0(, 1)? never finished .* deadlock"):
        lab03.check_average_gradients(rank0_only, timeout=6)
    assert time.monotonic() - t0 < 30


def test_reference_step_passes(capsys):
    lab03.check_data_parallel_step(good_step)
    out = capsys.readouterr().out
    assert "one process on the global batch" in out and out.count("✔") == 1


def returns_nothing(model, optimizer, X, y):
    good_step(model, optimizer, X, y)


def returns_loss_after_step(model, optimizer, X, y):
    good_step(model, optimizer, X, y)
    return F.cross_entropy(model(X), y).item()  # the loss after the update: not this step's


def returns_the_loss_tensor(model, optimizer, X, y):
    # a 0-dim tensor: float() of it is the loss, so this is accepted
    return _step_returning_tensor(model, optimizer, X, y)


def test_returning_the_loss_tensor_is_accepted(capsys):
    lab03.check_data_parallel_step(returns_the_loss_tensor)
    assert capsys.readouterr().out.count("✔") == 1


@pytest.mark.parametrize("fn, phrase", [
    (average_the_loss, "averaging the loss .* does not average the gradients"),
    (no_zero_grad, "zero_grad"),
    (no_step, "never changed"),
    (returns_nothing, "returned nothing"),
    (returns_loss_after_step, "return the loss computed on this rank's shard, before the step"),
])
def test_wrong_step(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab03.check_data_parallel_step(fn)


def todo_average(model):
    # TODO: all_reduce each p.grad with SUM, then divide it in place by the world size
    raise NotImplementedError("TODO: all_reduce each p.grad")


def todo_inside(model):
    for p in model.parameters():
        raise NotImplementedError("not yet")


def test_unfinished_lab_raises_not_implemented_without_launching():
    t0 = time.monotonic()
    with pytest.raises(NotImplementedError, match="replace the TODO"):
        lab03.check_average_gradients(todo_average)
    assert time.monotonic() - t0 < 2


def test_not_implemented_raised_in_a_rank_stays_not_implemented():
    with pytest.raises(NotImplementedError, match="on rank"):
        lab03.check_average_gradients(todo_inside)
