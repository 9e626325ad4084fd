"""lab03's checks, on 2 gloo ranks: the reference passes; each classic mistake fails with a
sentence naming it; the deadlock ends by the check's timeout instead of hanging."""

import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpcourse import ddp
from dpcourse.checks import LabCheckError, lab03

from conftest import answers_in_one_launch, distinct_run, launches_replayed

# The ranks cannot import this test module, so its functions travel by value — as a notebook
# cell's functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- one launch per distinct run, replayed for the tests that repeat it -------------------------
# (as tests/test_lab06_checks.py does) A mistake met twice (the cause, then the fix on the second
# meeting), a prediction revealed on a run another test already made, the same right answer
# checked again with another argument of the check: each distinct run (worker, world size, its
# arguments: the learner's function or class itself, and the backend) is launched for real the
# first time, and a repeat gets what the ranks returned then (a copy), or the same
# RankFailedError. Everything after the launch — the check's judgement, its memory of the
# learner's mistakes, its sentence — runs again each time. A launch that timed out is never
# replayed, and answers built inside a test (new objects each time) always launch
# (conftest.launches_replayed, conftest.distinct_run).
@pytest.fixture(autouse=True, scope="module")
def _launch_each_run_once():
    with launches_replayed(distinct_run):
        yield


# --- several answers judged in one launch -------------------------------------------------------
# A launch is most of a test's cost here, and the answers are stateless: the groups in ONE_LAUNCH
# (at the end of this file) each run in one launch, and the check gets each answer's results
# (conftest.answers_in_one_launch says what still launches alone).
@pytest.fixture(autouse=True, scope="module")
def _answers_in_one_launch(_launch_each_run_once):
    with answers_in_one_launch(ONE_LAUNCH):
        yield


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


def _global_loss(loss):
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def good_step(model, optimizer, X, y):
    return _global_loss(_step_returning_tensor(model, optimizer, X, y)).item()


def average_the_loss(model, optimizer, X, y):
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(X), y)
    dist.all_reduce(loss)                      # a number every rank agrees on ...
    loss = loss / dist.get_world_size()
    loss.backward()                            # ... but each rank's backward sees its own data
    optimizer.step()
    return loss.item()


def average_the_loss_and_gradients(model, optimizer, X, y):
    # a learner's step: the loss averaged over the ranks before backward AND the gradients
    # averaged after it: every gradient divided by the world size twice
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(X), y)
    dist.all_reduce(loss)
    loss = loss / dist.get_world_size()
    loss.backward()
    ddp.average_gradients(model)
    optimizer.step()
    return loss.item()


def divides_by_four(model, optimizer, X, y):
    # a fixed 4: on 2 ranks the same steps as dividing by the world size twice, not on 3
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 4
    optimizer.step()
    return _global_loss(loss).item()


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


def reference_average(model):
    # the lab's answer, written in the learner's cell (the library's own is refused): the ranks
    # first agree on which parameters some rank has a gradient for (one flags all_reduce);
    # a parameter this rank did not use contributes zeros, so every rank makes the same calls;
    # one no rank used keeps None
    world_size = dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(got)
    for p, n in zip(params, got.tolist()):
        if n == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size


def zeros_for_never_too(model):
    # the previous round's answer: zeros for every missing gradient that requires one — right
    # for the heads, wrong for never, which no rank used (one process leaves it None)
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size


def _zeros_where_unused(model):
    # part 1's decision as one step of a right answer: one flags all_reduce, then zeros where
    # this rank has no gradient but some rank has; a parameter no rank used keeps None
    params = [p for p in model.parameters() if p.requires_grad]
    flags = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8,
                         device=params[0].device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    for p, f in zip(params, flags.tolist()):
        if f and p.grad is None:
            p.grad = torch.zeros_like(p)


def _fold(model):
    """One flat buffer for the stretch: every trainable parameter's gradient (zeros where this
    rank has none), then one flag per parameter; returns (params, buffer)."""
    params = [p for p in model.parameters() if p.requires_grad]
    dev = params[0].device
    pieces = [(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params]
    flags = torch.tensor([float(p.grad is not None) for p in params], device=dev)
    return params, torch.cat(pieces + [flags])


def _unfold(params, flat, assign=False):
    """Copy each slice of the reduced buffer back; a parameter no rank had keeps None."""
    flags = flat[-len(params):].tolist()
    offset = 0
    for p, f in zip(params, flags):
        piece = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if f == 0:
            continue
        if assign or p.grad is None:
            p.grad = piece if assign else piece.clone()
        else:
            p.grad.copy_(piece)


def test_reference_average_gradients_passes(capsys):
    assert lab03.check_average_gradients(reference_average) is None  # nothing to echo
    out = capsys.readouterr().out
    assert out.startswith("✔") and "on 2 and 3 ranks" in out and out.count("✔") == 1
    assert "in place (each p.grad is still the tensor the backward filled)" in out


def test_the_librarys_own_average_gradients_is_refused():
    t0 = time.monotonic()
    with pytest.raises(LabCheckError, match=r"library's own reference answer "
                                            r"\(dpcourse\.ddp\.average_gradients\).*your own"):
        lab03.check_average_gradients(ddp.average_gradients)
    assert time.monotonic() - t0 < 2  # refused before any rank starts


@pytest.mark.parametrize("fn, phrase", [
    (sum_only, "nothing divided the result"),
    (rebind_in_list, "divided into a new tensor bound to a name or list slot"),
    (rebind_local_name, "divided into a new tensor bound to a name or list slot"),
    (reduce_a_copy, "that tensor was a copy"),
    (divide_only, "the all_reduce did not reach p.grad"),
    (raises, "raised on rank .: KeyError"),
])
def test_wrong_average_gradients(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab03.check_average_gradients(fn)


class _FakeTimeout:
    def __init__(self, pending, finished):
        self.pending, self.finished = pending, finished


def test_a_diagnosed_deadlock_never_suggests_slowness():
    # what the check says when rank 1 has returned and rank 0 still waits (deterministic)
    with pytest.raises(LabCheckError) as err:
        lab03._hang("average_gradients", 20)(_FakeTimeout([0], [1]))
    message = str(err.value)
    assert message.startswith("deadlock: rank(s) 1 returned from average_gradients")
    assert "A longer timeout would not end it" in message and "slowness" not in message
    # no rank returned: it may be slowness, and run_ranks adds that clause after this sentence
    sentence = lab03._hang("average_gradients", 20)(_FakeTimeout([0, 1], []))
    assert sentence.startswith("rank(s) 0, 1 never finished within 20 s — a deadlock")


@pytest.mark.usefixtures("rank0_only_deadlock")  # (its idle wait overlaps this test's work)
def test_reference_step_passes(capsys):
    lab03.check_data_parallel_step(good_step)
    out = capsys.readouterr().out
    assert "one process on the global batch" in out and out.count("✔") == 1


def _raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test says which exception it expected
        return exc
    return None


@pytest.fixture(scope="module")
def rank0_only_deadlock():
    """The deadlock's check, started in a thread: its ranks sit idle for the 8 s timeout, so
    test_reference_step_passes, which starts it, does its own work in that wait. The call, its
    launch and its timeout are the test's as before; the test asserts on what it raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(_raised, lambda: lab03.check_average_gradients(rank0_only, timeout=8))


def test_all_reduce_on_rank0_only_is_a_deadlock_ended_by_timeout(rank0_only_deadlock):
    assert lab03.DEFAULT_TIMEOUT <= 20
    # A short timeout keeps the test quick. Rank 1 returns at once and rank 0 waits: the check
    # says it is a deadlock, and nothing about slowness (a longer timeout would not help). On a
    # machine so busy that rank 1 had not even finished starting, both are named as waiting and
    # the slowness clause is honest.
    err = rank0_only_deadlock.result()
    assert isinstance(err, LabCheckError), repr(err)
    message = str(err)
    # the 8 s timeout passed here is what ended the wait (the ranks' start-up is bounded by the
    # launch itself; how long it takes depends on the machine's load, not on the check)
    assert "after 8 s" in message or "within 8 s" in message, message
    if "returned from" in message:
        assert message.startswith("deadlock: rank(s) 1 returned from average_gradients while "
                                  "rank(s) 0 still waited"), message
        assert "slowness" not in message and "timeout=" not in message, message
    else:
        assert "rank(s) 0, 1 never finished" in message and "deadlock" in message, message


def returns_nothing(model, optimizer, X, y):
    good_step(model, optimizer, X, y)


def returns_loss_after_step(model, optimizer, X, y):
    good_step(model, optimizer, X, y)
    return F.cross_entropy(model(X), y).item()  # the loss after the update: not this step's


def returns_the_loss_tensor(model, optimizer, X, y):
    # the right number in a 0-dim tensor: the contract says a Python float
    return _global_loss(_step_returning_tensor(model, optimizer, X, y))


def returns_own_shard_loss(model, optimizer, X, y):
    return _step_returning_tensor(model, optimizer, X, y).item()


def returns_summed_loss(model, optimizer, X, y):
    loss = _step_returning_tensor(model, optimizer, X, y).detach()
    dist.all_reduce(loss)
    return loss.item()


def averages_the_weights(model, optimizer, X, y):
    # each rank steps with its own gradients, then the weights are averaged: equal to the
    # global step for plain SGD only
    optimizer.zero_grad()
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p)
            p /= dist.get_world_size()
    return _global_loss(loss).item()


def averages_the_weights_data(model, optimizer, X, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    optimizer.step()
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()
    return _global_loss(loss).item()


def step_loss_averaged_first(model, optimizer, X, y):
    # right: the global loss formed before the backward, from a detached copy
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(X), y)
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    loss.backward()
    rebind_attribute(model)
    optimizer.step()
    return float(logged) / dist.get_world_size()


def test_step_with_the_loss_averaged_before_the_backward_passes(capsys):
    lab03.check_data_parallel_step(step_loss_averaged_first)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "Adam" in out, out


@pytest.mark.parametrize("fn, phrase", [
    (average_the_loss, "averaging the loss .* does not average the gradients"),
    (no_zero_grad, "piled up from step to step"),
    (no_step, "never changed"),
    (returns_nothing, "returned nothing"),
    (returns_loss_after_step, "a loss computed at another moment"),
    (returns_the_loss_tensor, "returned a torch.Tensor .*, not a Python float"),
    (returns_own_shard_loss, "that rank's own shard's loss, where the global batch's loss"),
    (returns_summed_loss, "the sum of the ranks' shard losses"),
    (averages_the_weights, "all-reduced the weights themselves"),
    (averages_the_weights_data, "all-reduced the weights themselves"),
])
def test_wrong_step(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab03.check_data_parallel_step(fn)


def test_a_loss_returned_after_the_step_gets_its_fix_on_the_second_meeting():
    with pytest.raises(LabCheckError) as err:
        lab03.check_data_parallel_step(returns_loss_after_step, world_sizes=(2,))
    assert "return the loss computed before the step" not in str(err.value), str(err.value)
    with pytest.raises(LabCheckError) as err:
        lab03.check_data_parallel_step(returns_loss_after_step, world_sizes=(2,))
    assert "return the loss computed before the step" in str(err.value), str(err.value)


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



# --- answers tied to 2 ranks, right answers written differently, and the flat stretch ---------

def divide_by_two(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2  # right on 2 ranks only


def rebind_attribute(model):
    n = dist.get_world_size()
    _zeros_where_unused(model)
    for p in (p for p in model.parameters() if p.grad is not None):
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad = p.grad / n  # a new tensor, but bound to p.grad itself: right


def div_underscore_then_reduce(model):
    n = dist.get_world_size()
    _zeros_where_unused(model)
    for p in model.parameters():
        if p.grad is None:
            continue
        p.grad.div_(n)  # dividing first is just as right
        dist.all_reduce(p.grad)


def flat_with_torch_helpers(model):
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.mul_(1.0 / dist.get_world_size())
    for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(avg)


def flat_with_torch_helpers_all_ranks_alike(model):
    # right: the flags ride in the same buffer, packed and unpacked by torch's helpers
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    params = [p for p in model.parameters() if p.requires_grad]
    parts = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    parts.append(torch.tensor([float(p.grad is not None) for p in params],
                              device=parts[0].device))
    flat = _flatten_dense_tensors(parts)
    dist.all_reduce(flat)
    flat.mul_(1.0 / dist.get_world_size())
    *means, flags = _unflatten_dense_tensors(flat, parts)
    for p, mean, f in zip(params, means, flags.tolist()):
        if f > 0:
            p.grad = mean.clone()


@pytest.mark.parametrize("fn", [rebind_attribute, div_underscore_then_reduce,
                                flat_with_torch_helpers_all_ranks_alike])
def test_right_average_gradients_variants_pass(fn, capsys):
    lab03.check_average_gradients(fn)
    assert capsys.readouterr().out.count("✔") == 1


def test_rebinding_p_grad_passes_and_the_line_does_not_say_in_place(capsys):
    # lab03's contract is the values p.grad holds; p.grad = p.grad / n meets it, and the success
    # line must not then claim the division was in place (issue 31)
    lab03.check_average_gradients(rebind_attribute, world_sizes=(3,))
    out = capsys.readouterr().out
    assert "in new tensors bound to p.grad" in out and "in place (" not in out, out


def test_prediction_of_the_all_reduce_calls(capsys):
    from dpcourse.checks import predict

    # part 1's model: SmallCNN's 10 tensors, head_a, head_b, never (10 values each) and frozen;
    # the reference exchanges 13 flags, then reduces the 12 gradients some rank has
    measured = lab03.count_all_reduces(reference_average)
    small = {k: measured[k] for k in ("calls", "bytes", "tensors", "trainable", "parameters",
                                      "used_bytes")}
    assert small == {"calls": 13, "bytes": 4 * 13 + 4 * 18814, "tensors": 14, "trainable": 13,
                     "parameters": 18824, "used_bytes": 4 * 18814}, measured
    assert {"head_a", "head_b"} <= set(measured["used"]) and len(measured["used"]) == 12
    assert "never" not in measured["used"] and "frozen" not in measured["used"]
    assert measured["carried"][0] == {"op": "all_reduce", "grad_of": None, "numel": 13,
                                      "dtype": "float32"}, measured["carried"][0]
    assert sorted(c["grad_of"] for c in measured["carried"][1:]) == sorted(measured["used"])
    lab03.check_prediction(predict("lab03", "collective calls", 13, unit="calls"), measured)
    out = " ".join(capsys.readouterr().out.split())
    assert "measured: 13 calls — right." in out and "13 times α" in out, out
    assert "10 on SmallCNN's gradients (a weight and a bias in each of its 5 layers)" in out
    assert "1 on head_b's (the head only rank 1's batch went through" in out, out
    assert "1 on tensors that are no parameter's gradient (all_reduce of 13 float32" in out, out
    assert "never's" not in out, out
    assert "bytes" not in out and "75,2" not in out and "75,3" not in out, out  # the stretch's
    lab03.check_prediction(predict("lab03", "collective calls", 12, unit="calls"), measured)
    out = " ".join(capsys.readouterr().out.split())
    assert "measured: 13 calls — not what happened." in out, out
    assert "for each of the 12 parameters some rank used" in out and "13 in all" in out, out
    # lesson 03's loop, which skips a None gradient: 11 calls on rank 0 (10 + head_a)
    skipping = lab03.count_all_reduces(skip_none)
    assert skipping["calls"] == 11, skipping
    lab03.check_prediction(predict("lab03", "collective calls", 11, unit="calls"), skipping)
    out = " ".join(capsys.readouterr().out.split())
    assert "made 11 collective call(s)" in out and "head_b's" not in out, out
    # the previous round's zeros for never: a call on never's gradient, named
    lab03.check_prediction(predict("lab03", "collective calls", 13, unit="calls"),
                           lab03.count_all_reduces(zeros_for_never_too))
    assert "1 on never's (which no rank used)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(LabCheckError, match="what count_all_reduces"):
        lab03.check_prediction(predict("lab03", "collective calls", 10), 10)


def test_the_call_count_names_other_collectives_and_rebound_zeros(capsys):
    from dpcourse.checks import predict

    # one flag exchange per parameter (13) + 12 gradients; head_b's zeros on rank 0 are a new
    # tensor when reduced and p.grad afterwards: still named as head_b's gradient
    measured = lab03.count_all_reduces(flags_one_call_each)
    assert measured["calls"] == 25, measured
    lab03.check_prediction(predict("lab03", "collective calls", 13, unit="calls"), measured)
    out = " ".join(capsys.readouterr().out.split())
    assert "25 times α" in out and "13 on tensors that are no parameter's gradient" in out, out
    assert "1 on head_b's" in out, out
    gathered = lab03.count_all_reduces(flat_flags_all_gathered)
    assert gathered["calls"] == 2, gathered
    lab03.check_prediction(predict("lab03", "collective calls", 1, unit="calls"), gathered)
    assert "all_gather of 13 float32 value(s)" in capsys.readouterr().out


def test_dividing_by_a_fixed_two_fails_on_three_ranks():
    with pytest.raises(LabCheckError, match="a fixed 2 is the mean only on 2 ranks"):
        lab03.check_average_gradients(divide_by_two)


def step_dividing_by_two(model, optimizer, X, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    divide_by_two(model)
    optimizer.step()
    return _global_loss(loss).item()


def step_with_sum_reduction(model, optimizer, X, y):
    # right: a summed loss divided by the shard size is the mean loss
    optimizer.zero_grad()
    loss = F.cross_entropy(model(X), y, reduction="sum") / len(y)
    loss.backward()
    rebind_attribute(model)
    optimizer.step()
    return _global_loss(loss).item()


def test_step_dividing_by_two_fails_on_three_ranks():
    with pytest.raises(LabCheckError, match="divided by 2, not by the world size"):
        lab03.check_data_parallel_step(step_dividing_by_two)


def test_loss_and_gradients_both_averaged_is_named_as_a_double_division():
    with pytest.raises(LabCheckError) as err:
        lab03.check_data_parallel_step(average_the_loss_and_gradients)
    message = str(err.value)
    assert "divided by the world size squared" in message, message
    assert "2 (2 x 2 = 4) and 3 (3 x 3 = 9)" in message, message
    assert "loss averaged over the ranks before backward" in message, message
    assert "not by the world size" not in message, message


def test_a_fixed_four_is_not_called_a_double_division():
    with pytest.raises(LabCheckError) as err:
        lab03.check_data_parallel_step(divides_by_four)
    message = str(err.value)
    assert "divided by 4, not by the world size" in message, message
    assert "squared" not in message, message


def test_step_with_a_summed_loss_divided_is_accepted(capsys):
    lab03.check_data_parallel_step(step_with_sum_reduction)
    assert capsys.readouterr().out.count("✔") == 1


def flat_reference(model):
    # the same layout on every rank, the flags in the same buffer: one call
    params, flat = _fold(model)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    _unfold(params, flat)


def flat_assigning_views(model):
    # right: p.grad rebound to views of the averaged buffer (divided before the reduction)
    params, flat = _fold(model)
    flat = flat / dist.get_world_size()
    dist.all_reduce(flat)
    _unfold(params, flat, assign=True)


def flat_zeros_for_never(model):
    # the previous round's flat answer: zeros for every missing gradient, no flags
    grads = []
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def flat_none_where_the_mean_is_zero(model):
    # one call and no flags: a slice that sums to zeros is taken for "no rank used it" — a
    # parameter every rank used with a zero derivative loses its gradient
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                      for p in params])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p in params:
        piece = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        p.grad = piece.clone() if torch.any(piece) else None


def flat_flags_in_a_second_call(model):
    # right values, but the flags travel in their own collective: two calls
    _zeros_where_unused(model)
    flat_with_torch_helpers(model)


def flat_never_copied_back(model):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()


def flat_two_buffers(model):
    for group in ([p for p in model.parameters() if p.dim() > 1],
                  [p for p in model.parameters() if p.dim() == 1]):
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for p, piece in zip(group, flat.split([p.numel() for p in group])):
            p.grad.copy_(piece.view_as(p))


def flat_without_division(model):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


@pytest.mark.parametrize("fn", [flat_reference, flat_assigning_views,
                                flat_with_torch_helpers_all_ranks_alike])
def test_right_flat_averages_pass(fn, capsys):
    lab03.check_average_gradients_flat(fn)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "one all_reduce" in out


@pytest.mark.parametrize("fn, phrase", [
    (ddp.average_gradients, "made 10 collective calls (10 all_reduce), one per parameter"),
    (flat_two_buffers, "made 2 collective calls (2 all_reduce)"),
    (flat_never_copied_back, "never travelled back into the gradients"),
    (flat_without_division, "nothing divided the result"),
])
def test_flat_mistakes_are_named(fn, phrase):
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients_flat(fn)
    assert phrase in str(err.value), str(err.value)


def test_a_flat_buffer_that_skips_none_gradients_pairs_part_1s_heads():
    # flat_with_torch_helpers leaves out a None gradient: right when every rank used every
    # parameter, wrong on part 1's model, where even and odd ranks skip different heads
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients_flat(flat_with_torch_helpers, world_sizes=(2,))
    first = str(err.value)
    assert "left out of its flat buffer the head whose p.grad was None" in first, first
    assert "same offset" in first and "matches positions" in first, first
    assert "same layout" not in first, first          # the fix waits for the second meeting
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients_flat(flat_with_torch_helpers, world_sizes=(2,))
    assert "give every rank's buffer the same layout" in str(err.value), str(err.value)


# --- unequal shards: average_gradients_weighted(model, n_local) ---

def weighted_reference(model, n_local):
    n = torch.tensor([float(n_local)], device=next(model.parameters()).device)
    dist.all_reduce(n)
    _zeros_where_unused(model)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(n_local)
            dist.all_reduce(p.grad)
            p.grad.div_(n)


def weighted_via_weights(model, n_local):
    # Equivalent: each rank's weight n_local / N, then one plain sum.
    total = torch.tensor(float(n_local)).to(next(model.parameters()))
    dist.all_reduce(total)
    _zeros_where_unused(model)
    for p in (p for p in model.parameters() if p.grad is not None):
        p.grad *= n_local / total.item()
        dist.all_reduce(p.grad)


def weighted_plain_mean(model, n_local):
    ddp.average_gradients(model)


def weighted_sum_only(model, n_local):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def weighted_not_divided(model, n_local):
    for p in model.parameters():
        p.grad *= n_local
        dist.all_reduce(p.grad)


def weighted_by_world_size(model, n_local):
    for p in model.parameters():
        p.grad *= n_local
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def weighted_assumes_equal_totals(model, n_local):
    for p in model.parameters():
        p.grad *= n_local
        dist.all_reduce(p.grad)
        p.grad /= n_local * dist.get_world_size()


def weighted_by_own_count(model, n_local):
    for p in model.parameters():
        p.grad *= n_local
        dist.all_reduce(p.grad)
        p.grad /= n_local


def weighted_on_a_copy(model, n_local):
    for p in model.parameters():
        g = p.grad * n_local
        dist.all_reduce(g)


@pytest.mark.parametrize("fn", [weighted_reference, weighted_via_weights])
def test_right_weighted_averages_pass(fn, capsys):
    lab03.check_average_gradients_weighted(fn)
    out = capsys.readouterr().out
    assert out.startswith("✔") and "on 2 and 3 ranks" in out and out.count("✔") == 1


@pytest.mark.parametrize("fn, phrase", [
    (weighted_plain_mean, "plain mean over the ranks"),
    (weighted_sum_only, "plain sum over the ranks"),
    (weighted_not_divided, "not yet divided"),
    (weighted_by_world_size, "sample-weighted sum was divided by the world size"),
    (weighted_assumes_equal_totals, r"as if every rank had this rank's number of samples"),
    (weighted_by_own_count, "this rank's own n_local"),
    (weighted_on_a_copy, "still that rank's own gradient"),
])
def test_weighted_mistakes_are_named(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab03.check_average_gradients_weighted(fn)


def weighted_count_without_device(model, n_local):
    # right on the CPU, refused by NCCL on GPUs: the count follows the default device
    n = torch.tensor([float(n_local)])
    dist.all_reduce(n)
    for p in model.parameters():
        p.grad.mul_(n_local)
        dist.all_reduce(p.grad)
        p.grad.div_(n)


def weighted_count_without_device_then_float(model, n_local):
    # a dtype change names no device: still the default device's
    n = torch.ones(1).to(torch.float64) * n_local
    dist.all_reduce(n)
    for p in model.parameters():
        p.grad.mul_(n_local)
        dist.all_reduce(p.grad)
        p.grad.div_(n.item())


def weighted_count_moved_to_the_gradients(model, n_local):
    # made without device=, then moved where the gradients are: right
    dev = next(model.parameters()).device   # part 1's head_a has no grad on odd ranks
    n = torch.tensor([float(n_local)]).to(dev)
    dist.all_reduce(n)
    _zeros_where_unused(model)
    for p in (p for p in model.parameters() if p.grad is not None):
        p.grad.mul_(n_local)
        dist.all_reduce(p.grad)
        p.grad.div_(n)


@pytest.mark.parametrize("fn", [weighted_count_without_device,
                                weighted_count_without_device_then_float])
def test_a_count_tensor_without_a_device_is_refused(fn):
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients_weighted(fn, world_sizes=(2,))
    first = str(err.value)
    assert "without a device=" in first and "NCCL refuses a CPU tensor" in first, first
    assert "to dist.all_reduce" in first, first
    assert "device=p.grad.device" not in first, first      # the fix waits for the second time
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients_weighted(fn, world_sizes=(2,))
    assert "device=p.grad.device" in str(err.value), str(err.value)


def test_a_count_tensor_moved_to_the_gradients_device_passes(capsys):
    lab03.check_average_gradients_weighted(weighted_count_moved_to_the_gradients)
    assert capsys.readouterr().out.count("✔") == 1


def test_weighted_shard_sizes_are_unequal_and_cover_three_ranks():
    assert len(set(lab03.SHARD_SIZES[:3])) == 3 and max(lab03.WORLD_SIZES) <= len(lab03.SHARD_SIZES)


def test_bytes_prediction_of_the_flat_stretch(capsys):
    from dpcourse.checks import predict

    part1 = lab03.count_all_reduces(reference_average)
    flat = lab03.count_all_reduces(flat_reference)
    assert flat["calls"] == 1 and flat["bytes"] == 4 * (18824 + 13), flat
    guess = predict("lab03", "flat bytes", "the same", choices=lab03.BYTES_CHOICES)
    lab03.check_bytes_prediction(guess, flat, part1)
    out = " ".join(capsys.readouterr().out.split())
    assert "measured: more — not what happened." in out, out
    assert "Your one call carried 75,348 bytes; the gradients of the 12 parameters some rank " \
           "used weigh 75,256. The 92 bytes more" in out, out
    assert "never's zeros included" in out and "75,308 bytes in 13 call(s)" in out, out
    guess = predict("lab03", "flat bytes", "more", choices=lab03.BYTES_CHOICES)
    lab03.check_bytes_prediction(guess, flat, part1)
    assert "measured: more — right." in capsys.readouterr().out
    lab03.check_bytes_prediction(guess, dict(flat, bytes=flat["used_bytes"]), part1)
    assert "measured: the same — not what happened." in capsys.readouterr().out
    lab03.check_bytes_prediction(guess, dict(flat, bytes=flat["used_bytes"] // 2), part1)
    assert "in a smaller type" in capsys.readouterr().out
    with pytest.raises(LabCheckError, match="count_all_reduces"):
        lab03.check_bytes_prediction(guess, 1, part1)


# --- right answers written in ways the lab's reference does not (issue 31: a check accepts
#     every correct answer) ---

def weighted_counts_gathered(model, n_local):
    # every rank learns every count (all_gather), then weights its gradient by its share
    grad = next(model.parameters())   # a parameter: its gradient may be None (part 1's heads)
    counts = [torch.zeros_like(grad.reshape(-1)[:1]) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, grad.new_tensor([float(n_local)]))
    share = n_local / float(sum(c.item() for c in counts))
    _zeros_where_unused(model)
    for p in (p for p in model.parameters() if p.grad is not None):
        p.grad.mul_(share)
        dist.all_reduce(p.grad)


def weighted_one_collective(model, n_local):
    # the count and the flags travel in the same buffer as the scaled gradients: one
    # all_reduce in all
    params, flat = _fold(model)
    n = len(params)
    flat[:-n] *= n_local
    flat = torch.cat([flat, torch.full((1,), float(n_local), device=flat.device)])
    dist.all_reduce(flat)
    total = flat[-1].clone()
    flat = flat[:-1]
    flat[:-n] /= total
    _unfold(params, flat)


def flat_parameters_to_vector(model):
    # right: torch's vector helpers, the flags as the buffer's last elements; a parameter no
    # rank had gets its slice assigned and then dropped again
    from torch.nn.utils import parameters_to_vector, vector_to_parameters
    params = [p for p in model.parameters() if p.requires_grad]
    had = [p.grad is not None for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([parameters_to_vector(grads),
                      torch.tensor([float(h) for h in had], device=grads[0].device)])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    vector_to_parameters(flat[:-len(params)], grads)   # rebinds each gradient's .data
    for p, n in zip(params, flat[-len(params):].tolist()):
        if n == 0:
            p.grad = None


@pytest.mark.parametrize("fn", [weighted_counts_gathered, weighted_one_collective])
def test_more_right_weighted_averages_pass(fn, capsys):
    lab03.check_average_gradients_weighted(fn)
    assert capsys.readouterr().out.count("✔") == 1


def test_flat_through_parameters_to_vector_passes(capsys):
    lab03.check_average_gradients_flat(flat_parameters_to_vector)
    assert capsys.readouterr().out.count("✔") == 1


def test_average_gradients_on_four_ranks(capsys):
    lab03.check_average_gradients(reference_average, world_sizes=(4,))
    assert "on 4 ranks" in capsys.readouterr().out


# --- a parameter without a gradient; part 4's unscaled sum; part 2's message ---------------------

def no_none_guard(model):
    world_size = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size


def guard_on_requires_grad(model):
    # requires_grad is True for a parameter the forward never used: its p.grad is still None
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.requires_grad:
            dist.all_reduce(p.grad)
            p.grad /= world_size


def flat_no_none_guard(model):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


@pytest.mark.parametrize("fn", [no_none_guard, guard_on_requires_grad])
def test_a_missing_none_guard_is_refused(fn):
    with pytest.raises(LabCheckError, match="failed on a parameter whose p.grad is None"):
        lab03.check_average_gradients(fn, world_sizes=(2,))


def test_a_missing_none_guard_is_refused_in_the_flat_stretch():
    with pytest.raises(LabCheckError, match="failed on a parameter whose p.grad is None"):
        lab03.check_average_gradients_flat(flat_no_none_guard, world_sizes=(2,))


def weighted_count_summed_but_gradients_not_scaled(model, n_local):
    total = torch.tensor([float(n_local)], device=next(model.parameters()).device)
    dist.all_reduce(total)
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= total


def weighted_scaled_after_the_sum(model, n_local):
    total = torch.tensor([float(n_local)], device=next(model.parameters()).device)
    dist.all_reduce(total)
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad *= n_local / total


@pytest.mark.parametrize("fn, phrase", [
    (weighted_count_summed_but_gradients_not_scaled, "was not multiplied by its own n_local"),
    (weighted_scaled_after_the_sum, "multiplied by this rank's own n_local"),
])
def test_weighted_scaling_mistakes_are_named(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab03.check_average_gradients_weighted(fn)


def test_the_call_count_message_does_not_answer_the_bytes_prediction(capsys):
    from dpcourse.checks import predict

    measured = lab03.count_all_reduces(reference_average)
    lab03.check_prediction(predict("lab03", "collective calls", 13, unit="calls"), measured)
    out = capsys.readouterr().out
    assert "stretch" not in out and "same bytes" not in out and "flat" not in out, out


# --- part 1's routed heads: ranks that used different parameters -------------------------------

def skip_none(model):
    # lesson 03's loop: right when every rank used every parameter, wrong here
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size


def zeros_not_kept(model):
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.requires_grad:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            g /= world_size          # in place: right where g is p.grad, lost where it is not


def mean_over_the_users(model):
    for p in model.parameters():
        if p.requires_grad:
            used = torch.tensor([0.0 if p.grad is None else 1.0], device=p.device)
            dist.all_reduce(used)
            if used.item() == 0:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= used           # the ranks that used it, not all of them


def zeros_for_the_frozen_too(model):
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world_size


def used_mask_first(model):
    # right too: agree first on which parameters any rank used (DDP's find_unused_parameters
    # all-reduces such a map), leave the ones no rank used None
    params = [p for p in model.parameters() if p.requires_grad]
    used = torch.tensor([0.0 if p.grad is None else 1.0 for p in params],
                        device=params[0].device)
    dist.all_reduce(used)
    for p, u in zip(params, used.tolist()):
        if u == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


@pytest.mark.parametrize("fn, phrase", [
    (skip_none, r"even ranks' head_a gradients and the odd ranks' head_b gradients added "
                r"together.*paired different parameters"),
    (zeros_not_kept, r"head_b\.grad is still None after average_gradients, though 1 other "
                     r"rank\(s\) computed a gradient for it"),
    (mean_over_the_users, r"the sum over the 1 rank\(s\) that used it divided by 1, not by 2"),
    (zeros_for_the_frozen_too, r"the frozen parameter \(requires_grad=False\) ends with a "
                               r"p\.grad"),
])
def test_routed_heads_mistakes_are_named_by_their_cause(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase) as err:
        lab03.check_average_gradients(fn, world_sizes=(2,))
    assert "Run the check again after your change" in str(err.value)


def test_the_plain_mean_gets_its_fix_on_the_second_meeting():
    for _ in range(2):
        with pytest.raises(LabCheckError) as err:
            lab03.check_average_gradients(skip_none, world_sizes=(2,))
    assert "contributes zeros to the sum" in str(err.value), str(err.value)


def test_divide_over_the_users_is_named_on_three_ranks_too():
    with pytest.raises(LabCheckError, match=r"over the 2 rank\(s\) that used it divided by 2, "
                                            r"not by 3"):
        lab03.check_average_gradients(mean_over_the_users, world_sizes=(3,))


def test_a_used_mask_first_passes(capsys):
    lab03.check_average_gradients(used_mask_first)
    assert capsys.readouterr().out.count("✔") == 1


def test_a_sum_without_division_says_what_to_change_on_the_second_meeting():
    for attempt in range(2):
        with pytest.raises(LabCheckError) as err:
            lab03.check_average_gradients(sum_only, world_sizes=(2,))
        message = str(err.value)
        assert "nothing divided the result" in message
        assert ("divide by the world size" in message) == (attempt == 1), message


# --- part 4 on part 1's two-head model: unequal shards and a head some ranks did not use -------

def weighted_skip_none(model, n_local):
    # right on SmallCNN, where every rank has every gradient; pairs the heads on part 1's model
    n = torch.tensor([float(n_local)], device=next(model.parameters()).device)
    dist.all_reduce(n)
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= n_local
            dist.all_reduce(p.grad)
            p.grad /= n


def weighted_no_none_guard(model, n_local):
    n = torch.tensor([float(n_local)], device=next(model.parameters()).device)
    dist.all_reduce(n)
    for p in model.parameters():
        if p.requires_grad:
            p.grad *= n_local
            dist.all_reduce(p.grad)
            p.grad /= n


def weighted_over_the_users_samples(model, n_local):
    # zeros for a missing gradient, but that rank's samples left out of the divisor: the mean
    # over the samples that went through the head, not over the global batch
    for p in model.parameters():
        if p.requires_grad:
            count = torch.tensor([0.0 if p.grad is None else float(n_local)], device=p.device)
            dist.all_reduce(count)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad *= n_local
            dist.all_reduce(p.grad)
            p.grad /= max(count.item(), 1.0)


def weighted_zeros_for_the_frozen_too(model, n_local):
    n = torch.tensor([float(n_local)], device=next(model.parameters()).device)
    dist.all_reduce(n)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad *= n_local
        dist.all_reduce(p.grad)
        p.grad /= n


def weighted_zeros_without_device(model, n_local):
    # the zeros for a missing gradient follow the default device: NCCL would refuse them
    n = torch.tensor([float(n_local)], device=next(model.parameters()).device)
    dist.all_reduce(n)
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros(p.shape)
            p.grad *= n_local
            dist.all_reduce(p.grad)
            p.grad /= n


def test_a_weighted_loop_that_skips_none_gradients_pairs_part_1s_heads():
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients_weighted(weighted_skip_none, world_sizes=(2,))
    first = str(err.value)
    assert "on part 1's model with shards of 3, 5 samples" in first, first
    assert "each times its rank's n_local, added together and divided by 8" in first, first
    assert "paired different parameters" in first, first
    assert "contribute zeros" not in first, first      # the fix waits for the second meeting
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients_weighted(weighted_skip_none, world_sizes=(2,))
    second = str(err.value)
    assert "this rank's samples contribute zeros to the weighted sum" in second, second
    assert "total count of all the samples" in second, second


def test_a_weighted_loop_that_skips_none_is_named_on_three_ranks_too():
    with pytest.raises(LabCheckError, match=r"shards of 3, 5, 8 samples.*divided by 16"):
        lab03.check_average_gradients_weighted(weighted_skip_none, world_sizes=(3,))


@pytest.mark.parametrize("fn, world_sizes, phrase", [
    (weighted_no_none_guard, (2,), "average_gradients_weighted failed on a parameter whose "
                                   "p.grad is None"),
    (weighted_over_the_users_samples, (2,), r"head_a's weighted sum was divided by the 3 = 3 "
                                            r"samples of the rank\(s\) whose batch went "
                                            r"through head_a, not by all 8"),
    (weighted_over_the_users_samples, (3,), r"head_a's weighted sum was divided by the 3 \+ 8 "
                                            r"= 11 samples"),
    (weighted_zeros_for_the_frozen_too, (2,), r"on part 1's model, on rank 0 the frozen parameter \(requires_grad="
                                              r"False\) ends with a p\.grad"),
    (weighted_zeros_without_device, (2,), r"tensor of shape \(10,\) handed to "
                                          r"dist\.all_reduce was made by a factory function"),
])
def test_weighted_mistakes_on_part_1s_model_are_named(fn, world_sizes, phrase):
    with pytest.raises(LabCheckError, match=phrase) as err:
        lab03.check_average_gradients_weighted(fn, world_sizes=world_sizes)
    assert "Run the check again after your change" in str(err.value)


def test_the_users_samples_divisor_gets_its_fix_on_the_second_meeting():
    for _ in range(2):
        with pytest.raises(LabCheckError) as err:
            lab03.check_average_gradients_weighted(weighted_over_the_users_samples,
                                                   world_sizes=(2,))
    assert "by the total count of all the ranks' samples (8 here)" in str(err.value)


# --- part 1's real design decision: a parameter NO rank used keeps p.grad None ------------------

def flags_without_device(model):
    # right on the CPU; the flags follow the default device, which NCCL would refuse on GPUs
    params = [p for p in model.parameters() if p.requires_grad]
    used = torch.tensor([0.0 if p.grad is None else 1.0 for p in params])
    dist.all_reduce(used)
    for p, u in zip(params, used.tolist()):
        if u == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def flags_int_max(model):
    # right: int64 flags reduced with MAX (1 where some rank had the gradient)
    params = [p for p in model.parameters() if p.requires_grad]
    dev = params[0].device
    used = torch.tensor([int(p.grad is not None) for p in params], dtype=torch.int64, device=dev)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    for p, u in zip(params, used.tolist()):
        if not u:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())


def flags_bool_summed(model):
    # right: a bool mask per parameter, summed over the ranks as integers
    params = [p for p in model.parameters() if p.requires_grad]
    mask = torch.tensor([p.grad is not None for p in params], device=params[0].device)
    counts = mask.to(torch.int32)
    dist.all_reduce(counts)
    world_size = dist.get_world_size()
    for p, c in zip(params, counts.tolist()):
        if c > 0:
            if p.grad is None:
                p.grad = p.new_zeros(p.shape)
            dist.all_reduce(p.grad)
            p.grad = p.grad / world_size


def flags_one_call_each(model):
    # right, if costly: one flag exchange per parameter, then its gradient
    for p in model.parameters():
        if not p.requires_grad:
            continue
        had = p.new_tensor([1.0 if p.grad is not None else 0.0])
        dist.all_reduce(had)
        if had.item() == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def none_where_the_mean_is_zero(model):
    # no flags: a mean of zeros is taken for "no rank used it"
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world_size
            if not torch.any(p.grad):
                p.grad = None


@pytest.mark.parametrize("fn", [reference_average, flags_int_max, flags_bool_summed,
                                flags_one_call_each, used_mask_first])
def test_right_ways_to_leave_never_none_pass(fn, capsys):
    lab03.check_average_gradients(fn)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "never (used by no rank)" in out, out


def _never_sentence(message: str, name: str, rank: int = 0):
    assert (f"`never`, which no rank's batch went through, ends with a p.grad of 10 zeros on "
            f"rank {rank} after {name}") in message, message
    assert "one process on the global batch leaves its p.grad None" in message, message
    # computed by a real SGD step on never's 0.5: 0.5 - 0.1 * 0.01 * 0.5
    assert "takes never from 0.5 to 0.4995 with that gradient, where one process leaves it at " \
           "0.5" in message, message


def test_zeros_for_never_are_refused_in_part_1_with_the_fix_on_the_second_meeting():
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients(zeros_for_never_too, world_sizes=(2,))
    first = str(err.value)
    _never_sentence(first, "average_gradients")
    assert "on 2 ranks, " in first and "Run the check again after your change" in first, first
    assert "keep p.grad None on every rank" not in first, first
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients(zeros_for_never_too, world_sizes=(2,))
    assert "keep p.grad None on every rank for one that got none on any rank" in str(err.value)


def weighted_zeros_for_never(model, n_local):
    # the previous round's part 4 answer: zeros for every missing gradient that requires one
    total = torch.tensor([float(n_local)], device=next(model.parameters()).device)
    dist.all_reduce(total)
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad *= n_local
            dist.all_reduce(p.grad)
            p.grad /= total


def test_zeros_for_never_are_refused_in_part_4():
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients_weighted(weighted_zeros_for_never, world_sizes=(2,))
    message = str(err.value)
    assert message.startswith("on part 1's model, `never`"), message
    _never_sentence(message, "average_gradients_weighted")


def test_zeros_for_never_are_refused_in_the_flat_stretch():
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients_flat(flat_zeros_for_never, world_sizes=(2,))
    _never_sentence(str(err.value), "average_gradients_flat")


def test_a_flags_tensor_without_a_device_is_refused_in_part_1():
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients(flags_without_device, world_sizes=(2,))
    first = str(err.value)
    # (SmallCNN first: its 10 parameters' flags)
    assert "the tensor of shape (10,) handed to dist.all_reduce was made by a factory " \
           "function" in first and "NCCL refuses a CPU tensor" in first, first
    assert "device=p.grad.device" not in first, first
    with pytest.raises(LabCheckError) as err:
        lab03.check_average_gradients(flags_without_device, world_sizes=(2,))
    assert "device=p.grad.device" in str(err.value), str(err.value)


@pytest.mark.parametrize("fn, check, name", [
    (none_where_the_mean_is_zero, lab03.check_average_gradients, "average_gradients"),
    (flat_none_where_the_mean_is_zero, lab03.check_average_gradients_flat,
     "average_gradients_flat"),
])
def test_none_from_a_zero_mean_is_refused(fn, check, name):
    with pytest.raises(LabCheckError) as err:
        check(fn, world_sizes=(2,))
    message = str(err.value)
    assert "a parameter that every rank's backward gave a gradient of exactly zero" in message
    assert f"has p.grad None after {name}: a gradient of zeros is still a gradient" in message


def test_flat_flags_in_a_second_collective_are_refused():
    with pytest.raises(LabCheckError, match=r"made 2 collective calls \(2 all_reduce\)"):
        lab03.check_average_gradients_flat(flat_flags_in_a_second_call, world_sizes=(2,))


def flat_flags_all_gathered(model):
    # the flags by all_gather, the gradients by all_reduce: two collectives
    params = [p for p in model.parameters() if p.requires_grad]
    mine = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    used = sum(every)
    flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                      for p in params])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    _unfold(params, torch.cat([flat, used]))


def test_flat_flags_all_gathered_count_as_a_second_collective():
    with pytest.raises(LabCheckError, match=r"made 2 collective calls \(1 all_gather, "
                                            r"1 all_reduce\)"):
        lab03.check_average_gradients_flat(flat_flags_all_gathered, world_sizes=(2,))


def weighted_flags_with_the_count(model, n_local):
    # right: the count and the flags in one exchange, int64, summed
    params = [p for p in model.parameters() if p.requires_grad]
    shared = torch.tensor([n_local] + [int(p.grad is not None) for p in params],
                          device=params[0].device)
    dist.all_reduce(shared)
    total = shared[0].item()
    for p, n in zip(params, shared[1:].tolist()):
        if n == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.mul_(n_local / total)
        dist.all_reduce(p.grad)


def test_weighted_flags_with_the_count_pass(capsys):
    lab03.check_average_gradients_weighted(weighted_flags_with_the_count)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "never (used by no rank)" in out, out


# --------------------------------------------------------------------------------------------
# The runs judged in one launch (see _answers_in_one_launch): (worker, world size) -> the
# arguments of each run the tests above ask the checks for. Each check still asks for its runs
# one by one; a run not listed here (rank0_only's deadlock, the answers that raise, 4 ranks)
# launches on its own, as the check a learner runs does.
# --------------------------------------------------------------------------------------------


def _runs():
    from dpcourse.checks import _lab03_predict, _lab03_step, _lab03_weighted

    avg, step = lab03._avg_worker, _lab03_step._step_worker
    weighted, count = _lab03_weighted._weighted_worker, _lab03_predict._count_worker
    right_avg = [reference_average, rebind_attribute, div_underscore_then_reduce,
                 flat_with_torch_helpers_all_ranks_alike, flat_reference, flat_assigning_views,
                 flat_parameters_to_vector, used_mask_first, flags_int_max, flags_bool_summed,
                 flags_one_call_each]
    wrong_avg = [sum_only, rebind_in_list, rebind_local_name, reduce_a_copy, divide_only,
                 divide_by_two, ddp.average_gradients, flat_two_buffers, flat_never_copied_back,
                 flat_without_division, flat_with_torch_helpers, no_none_guard,
                 guard_on_requires_grad, flat_no_none_guard, skip_none, zeros_not_kept,
                 mean_over_the_users, zeros_for_the_frozen_too, zeros_for_never_too,
                 flat_zeros_for_never, flags_without_device, none_where_the_mean_is_zero,
                 flat_none_where_the_mean_is_zero, flat_flags_in_a_second_call,
                 flat_flags_all_gathered]
    right_steps = [good_step, step_loss_averaged_first, step_with_sum_reduction]
    # answers that pass on 2 ranks and are named on 3 (or by Adam) need those runs too
    steps_on_three = right_steps + [averages_the_weights, averages_the_weights_data,
                                    step_dividing_by_two, average_the_loss_and_gradients,
                                    divides_by_four]
    wrong_steps = [average_the_loss, no_zero_grad, no_step, returns_nothing,
                   returns_loss_after_step, returns_the_loss_tensor, returns_own_shard_loss,
                   returns_summed_loss]
    right_weighted = [weighted_reference, weighted_via_weights,
                      weighted_count_moved_to_the_gradients, weighted_counts_gathered,
                      weighted_one_collective, weighted_flags_with_the_count]
    wrong_weighted = [weighted_plain_mean, weighted_sum_only, weighted_not_divided,
                      weighted_by_world_size, weighted_assumes_equal_totals, weighted_by_own_count,
                      weighted_on_a_copy, weighted_count_without_device,
                      weighted_count_without_device_then_float,
                      weighted_count_summed_but_gradients_not_scaled,
                      weighted_scaled_after_the_sum, weighted_skip_none, weighted_no_none_guard,
                      weighted_over_the_users_samples, weighted_zeros_for_the_frozen_too,
                      weighted_zeros_without_device, weighted_zeros_for_never]
    on_three_weighted = right_weighted + [weighted_skip_none, weighted_over_the_users_samples]
    sizes = lambda n: tuple(lab03.SHARD_SIZES[:n])      # noqa: E731
    return {
        (avg, 2): [(fn, True, True) for fn in right_avg + wrong_avg],
        (avg, 3): [(fn, True, True) for fn in right_avg + [divide_by_two, mean_over_the_users]],
        (step, 2): ([(fn,) for fn in steps_on_three + wrong_steps]
                    + [(fn, "adam") for fn in right_steps + [averages_the_weights,
                                                             averages_the_weights_data]]),
        (step, 3): [(fn,) for fn in steps_on_three],
        (weighted, 2): [(fn, sizes(2)) for fn in right_weighted + wrong_weighted],
        (weighted, 3): [(fn, sizes(3)) for fn in on_three_weighted],
        (count, 2): [(fn,) for fn in (reference_average, skip_none, zeros_for_never_too,
                                      flags_one_call_each, flat_flags_all_gathered,
                                      flat_reference)],
    }


ONE_LAUNCH = _runs()
