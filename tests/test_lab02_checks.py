"""lab02's checks: the reference passes; each plausible mistake fails with a sentence naming it."""

import copy

import pytest
import torch
import torch.nn.functional as F

from dpcourse import dp
from dpcourse.checks import LabCheckError, _lab02_state, lab02


def refusing_empty(split):
    """A scatter built on ``split`` that refuses an empty batch and zero devices, as the
    contract asks."""
    def scatter(X, n):
        if X.shape[0] == 0:
            raise ValueError("the batch is empty")
        if n < 1:
            raise ValueError("no devices")
        return split(X, n)
    return scatter


good_scatter = refusing_empty(lambda X, n: list(torch.chunk(X, n)))


def good_gather(outputs):
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    return tuple(good_gather(list(parts)) for parts in zip(*outputs))


def by_position(join, container=tuple):
    """A gather that joins single tensors with ``join`` and tuples position by position."""
    def gather(outputs):
        if isinstance(outputs[0], torch.Tensor):
            return join(outputs)
        return container(join(list(parts)) for parts in zip(*outputs))
    return gather


def make_step(combine="sum", loss_per_chunk=False, per_device=False, held="add",
              buffers="replica 0"):
    def step(model, X, y, n):
        chunks = good_scatter(X, n)
        reps = [copy.deepcopy(model) for _ in (range(n) if per_device else chunks)]
        outs = dp.parallel_apply(reps, chunks)
        if loss_per_chunk:
            loss = sum(F.cross_entropy(o, yc) for o, yc in zip(outs, good_scatter(y, n)))
        else:
            loss = F.cross_entropy(good_gather(outs), y)
        loss.backward()
        for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps)):
            gs = [c.grad for c in cs]
            if combine == "sum":
                new = sum(gs)
            elif combine == "mean":
                new = sum(gs) / len(gs)
            elif combine == "first":
                new = gs[0].clone()
            else:
                continue
            if held == "add":
                p.grad = new if p.grad is None else p.grad + new
            elif held == "in-place":  # fails on None: no gradient held yet
                p.grad += new
            else:  # "replace"
                p.grad = new
        _bring_back_buffers(model, reps, buffers)
        return loss.item()
    return step


def _bring_back_buffers(model, reps, how="replica 0"):
    """What a step does with the BatchNorm buffers its copies updated: "replica 0" (right:
    what nn.DataParallel keeps), "none" (left on the copies), "last", "mean" (the copies'
    average) or "count off" (replica 0's statistics, but one count per copy)."""
    if how == "none":
        return
    for b, *bs in zip(model.buffers(), *(r.buffers() for r in reps)):
        if how == "replica 0":
            b.copy_(bs[0])
        elif how == "last":
            b.copy_(bs[-1])
        elif how == "mean":
            b.copy_(sum(x.double() for x in bs) / len(bs) if b.is_floating_point() else bs[0])
        elif how == "count off":
            b.copy_(bs[0] if b.is_floating_point() else b + len(bs))


def test_reference_answers_pass(capsys):
    lab02.check_scatter(good_scatter)
    lab02.check_gather(good_gather)
    lab02.check_dp_forward_backward(make_step())
    out = capsys.readouterr().out.splitlines()
    assert [line[:1] for line in out] == ["✔"] * 3, out  # one line each, printed once
    assert "scatter" in out[0] and "gather" in out[1] and "DataParallel by hand" in out[2]


@pytest.mark.parametrize("wrong, phrase", [
    (lambda X, n: list(torch.chunk(X, n, dim=1)), "split along dim 1"),
    (lambda X, n: [X[i::n] for i in range(n)], "every n-th sample"),
    (lambda X, n: list(torch.split(X, X.shape[0] // n))[:n], "lost 2 of 10 samples"),
    (lambda X, n: list(torch.chunk(X, n))[:-1], "lost 4 of 8 samples"),
    (lambda X, n: list(torch.chunk(X, n))[::-1], "not the original batch"),
    (lambda X, n: X, "list or tuple of tensors"),
    (lambda X, n: [c.reshape(-1) for c in torch.chunk(X, n)], "changed the number of dimensions"),
])
def test_wrong_scatter(wrong, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab02.check_scatter(wrong)


# Part 2 also hands gather a model's tuple of outputs, (logits, features), on 3 devices: each
# wrong way of handling it is named by its cause, and the fix comes on the second meeting.
@pytest.mark.parametrize("wrong, cause, fix", [
    (lambda o: torch.cat(o, dim=0), "raised TypeError",
     "gather the tensors at each position of the tuples"),
    (lambda o: torch.cat([x if isinstance(x, torch.Tensor) else x[0] for x in o]),
     "returned the logits alone, shape (8, 10)", "return a tuple: one gathered tensor per"),
    (lambda o: torch.cat(o) if isinstance(o[0], torch.Tensor) else tuple(t for x in o for t in x),
     "returned 6 tensors", "join the tensors position by position"),
    (lambda o: torch.cat(o) if isinstance(o[0], torch.Tensor) else tuple(o),
     "returned 3 items, one per device", "join the tensors position by position"),
    (lambda o: torch.cat(o) if isinstance(o[0], torch.Tensor) else tuple(
        torch.cat(p[::-1]) for p in zip(*o)),
     "gather's item 0 is (8, 10)", "join the tensors at position 0 of the tuples"),
    (lambda o: torch.cat(o) if isinstance(o[0], torch.Tensor) else {
        i: torch.cat(p) for i, p in enumerate(zip(*o))},
     "gather returned a dict", "return a tuple: one gathered tensor per"),
], ids=["cat-of-tuples", "logits-only", "flattened", "one-per-device", "reversed", "dict"])
def test_wrong_gather_of_tuples_is_named_then_fixed(wrong, cause, fix):
    with pytest.raises(LabCheckError) as first:
        lab02.check_gather(wrong)
    message = " ".join(str(first.value).split())
    assert cause in message and fix not in message, message
    assert "(logits, features)" in message, message
    with pytest.raises(LabCheckError) as second:
        lab02.check_gather(wrong)
    assert fix in " ".join(str(second.value).split()), str(second.value)


@pytest.mark.parametrize("wrong, phrase", [
    (lambda o: torch.cat(o, dim=1), "along dim 1"),
    (lambda o: torch.stack(o), "stacked"),
    (lambda o: torch.cat(o[::-1]), "reverse device order"),
    (lambda o: torch.cat(o[:2]), "returned shape"),
])
def test_wrong_gather(wrong, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab02.check_gather(wrong)


@pytest.mark.parametrize("step, phrase", [
    (make_step("mean"), "4 times too small: what your step added to p.grad is 1/4"),
    (make_step("first"), "replica 0's alone"),
    (make_step("none"), "no gradients"),
    (make_step(loss_per_chunk=True), "about 4 times too big"),
    (make_step(per_device=True), "copies and the chunks were not paired one to one"),
    (make_step(held="replace"), "holds this batch.s gradient alone: what it held is gone"),
    (make_step(held="in-place"), "p.grad is None, not zeros"),
])
def test_wrong_dp_step(step, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab02.check_dp_forward_backward(step)


def test_wrong_loss_value_is_named():
    def step(model, X, y, n):
        make_step()(model, X, y, n)
        return 123.0
    with pytest.raises(LabCheckError, match="not the mean loss on the whole batch"):
        lab02.check_dp_forward_backward(step)


@pytest.mark.parametrize("detach, phrase", [
    (True, "detached, it is still a tensor"),
    (False, "it still carries its graph"),
])
def test_loss_returned_as_a_tensor_is_refused(detach, phrase):
    # wrong: the contract says a float; a 0-d tensor (detached or not) is not one
    def step(model, X, y, n):
        chunks = good_scatter(X, n)
        reps = [copy.deepcopy(model) for _ in chunks]
        loss = F.cross_entropy(good_gather(dp.parallel_apply(reps, chunks)), y)
        loss.backward()
        for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps)):
            new = sum(c.grad for c in cs)
            p.grad = new if p.grad is None else p.grad + new
        _bring_back_buffers(model, reps)
        return loss.detach() if detach else loss
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_forward_backward(step)
    message = str(err.value)
    assert "returned a 0-d tensor" in message and "as a float" in message, message
    assert phrase in message, message
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_forward_backward(step)
    assert "Tensor.item()" in str(err.value), str(err.value)


def test_unfinished_lab_propagates_not_implemented():
    def todo(X, n):
        raise NotImplementedError("TODO")
    with pytest.raises(NotImplementedError):
        lab02.check_scatter(todo)


def scatter_refusing_one_per_device(X, n_devices):
    if X.shape[0] <= n_devices:  # off by one: a batch of exactly n_devices is fine
        raise ValueError("batch too small")
    return list(torch.chunk(X, n_devices, dim=0))


def test_scatter_that_refuses_one_sample_per_device_is_named():
    with pytest.raises(LabCheckError, match=r"one sample per device is a valid split"):
        lab02.check_scatter(scatter_refusing_one_per_device)



# --- skipping the idea, answers tied to one set-up, and right answers written differently ---

def no_scatter(model, X, y, n):
    loss = F.cross_entropy(model(X), y)  # right gradients, but no data parallelism at all
    loss.backward()
    return loss.item()


def one_model_for_all_chunks(model, X, y, n):
    outs = [model(c) for c in torch.chunk(X, n)]  # no copies: one "device" does all the work
    loss = F.cross_entropy(torch.cat(outs), y)
    loss.backward()
    return loss.item()


def four_devices_always(model, X, y, n):
    return make_step()(model, X, y, 4)  # ignores n_devices


def mean_of_chunk_losses(model, X, y, n):
    chunks, ys = torch.chunk(X, n), torch.chunk(y, n)
    reps = [copy.deepcopy(model) for _ in chunks]
    outs = dp.parallel_apply(reps, list(chunks))
    loss = sum(F.cross_entropy(o, t) for o, t in zip(outs, ys)) / len(chunks)  # equal only for even chunks
    loss.backward()
    for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps)):
        s = sum(c.grad for c in cs)
        p.grad = s if p.grad is None else p.grad + s
    return loss.item()


def mean_of_balanced_chunk_means(model, X, y, n):
    # the learner's round: a balanced scatter of their own (10 on 3: 4, 3, 3), one copy per
    # chunk, and the mean of the per-chunk mean losses
    chunks, ys = torch.tensor_split(X, n), torch.tensor_split(y, n)
    reps = [copy.deepcopy(model) for _ in chunks]
    outs = dp.parallel_apply(reps, list(chunks))
    loss = torch.stack([F.cross_entropy(o, t) for o, t in zip(outs, ys)]).mean()
    loss.backward()
    for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps)):
        s = sum(c.grad for c in cs)
        p.grad = s if p.grad is None else p.grad + s
    return loss.item()


def test_mean_of_chunk_means_on_the_learners_own_chunks_is_named_with_a_fix_it_supports():
    with pytest.raises(LabCheckError) as first:
        lab02.check_dp_forward_backward(mean_of_balanced_chunk_means)
    message = str(first.value)
    assert "weigh the samples of your uneven chunks" in message, message
    assert "mean of the chunks' mean losses" not in message, message
    assert "[4, 3, 3] samples of 10" in message and "none of the ways" not in message, message
    assert "Run the check again" in message, message
    with pytest.raises(LabCheckError) as second:
        lab02.check_dp_forward_backward(mean_of_balanced_chunk_means)
    assert "mean of the chunks' mean losses" in str(second.value), str(second.value)
    assert "one mean loss on the gathered outputs" in str(second.value), str(second.value)
    assert "order" not in str(second.value).split("uneven chunks")[0]


def doubled_last_copy(model, X, y, n):
    # wrong in no known way: the last copy's gradient counted twice
    chunks = torch.chunk(X, n)
    reps = [copy.deepcopy(model) for _ in chunks]
    loss = F.cross_entropy(torch.cat(dp.parallel_apply(reps, list(chunks))), y)
    loss.backward()
    for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps)):
        s = sum(c.grad for c in cs) + cs[-1].grad
        p.grad = s if p.grad is None else p.grad + s
    return loss.item()


def test_unknown_dp_gradient_mistake_gets_no_fix_it_cannot_support():
    for _ in range(2):
        with pytest.raises(LabCheckError) as err:
            lab02.check_dp_forward_backward(doubled_last_copy)
    message = str(err.value)
    assert "in none of the ways the check knows" in message, message
    assert "scatter and gather keep the order" not in message, message
    assert "compare its p.grad with what your function left" in message, message


def sequential_copies_accumulating(model, X, y, n):
    # wrong: right numbers, but no threads (the copies run one after another in a loop)
    chunks = torch.tensor_split(X, n)
    reps = [copy.deepcopy(model) for _ in chunks]
    loss = F.cross_entropy(torch.concat([r(c) for r, c in zip(reps, chunks)]), y)
    loss.backward()
    for r in reps:
        for p, c in zip(model.parameters(), r.parameters()):
            p.grad = c.grad.clone() if p.grad is None else p.grad + c.grad
    model.load_state_dict({k: v for k, v in reps[0].state_dict().items()
                           if k in dict(model.named_buffers())}, strict=False)
    return loss.item()


def original_as_replica_zero(model, X, y, n):
    # wrong: device 0 uses the original model, the others copies; p.grad then already holds
    # replica 0's share and the copies' are added to it, and the buffers need no bringing back:
    # the two things the part asks for, skipped
    chunks = list(torch.chunk(X, n))
    reps = [model] + [copy.deepcopy(model) for _ in chunks[1:]]
    outs = dp.parallel_apply(reps, chunks)
    loss = F.cross_entropy(torch.vstack(outs), y)
    loss.backward()
    for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps[1:])):
        p.grad += sum(c.grad for c in cs)
    return loss.item()


def with_course_replicate(model, X, y, n):
    # right: dp.replicate ties the copies to the original by autograd, so backward fills p.grad
    chunks = dp.scatter(X, dp.devices_for(n, "cpu"))
    reps = dp.replicate(model, dp.devices_for(n, "cpu")[:len(chunks)])
    outs = dp.parallel_apply(reps, chunks)
    loss = F.cross_entropy(dp.gather(outs), y)
    loss.backward()
    return loss.item()


def with_course_data_parallel(model, X, y, n):
    loss = F.cross_entropy(dp.data_parallel(model, X, dp.devices_for(n, "cpu")), y)
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("step", [with_course_replicate, with_course_data_parallel],
                         ids=["dp.replicate", "dp.data_parallel"])
def test_dp_steps_on_the_library_replicas_are_refused(step):
    with pytest.raises(LabCheckError, match="plain copies"):
        lab02.check_dp_forward_backward(step)


def with_course_scatter_and_gather(model, X, y, n):
    # wrong: plain copies, but the library's scatter and gather instead of the learner's
    devs = dp.devices_for(n, "cpu")
    chunks = dp.scatter(X, devs)
    reps = [copy.deepcopy(model) for _ in chunks]
    loss = F.cross_entropy(dp.gather(dp.parallel_apply(reps, chunks)), y)
    loss.backward()
    for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps)):
        s = sum(c.grad for c in cs)
        p.grad = s if p.grad is None else p.grad + s
    _bring_back_buffers(model, reps)
    return loss.item()


@pytest.mark.parametrize("step, cause, fix", [
    (sequential_copies_accumulating, "ran one after another in your function's own thread",
     "dp.parallel_apply"),
    (original_as_replica_zero, "`model` itself ran a forward (on 4 sample(s))",
     "run chunk 0 on a deep copy too"),
    (with_course_scatter_and_gather, "called the library's dpcourse.dp.scatter: the lab asks "
     "for your own scatter and gather", "do in your own code what dp.scatter did"),
], ids=["sequential-loop", "original-as-replica-0", "library-scatter-gather"])
def test_dp_steps_that_break_the_parts_contract_are_refused(step, cause, fix):
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_forward_backward(step)
    assert cause in str(err.value) and fix not in str(err.value), str(err.value)
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_forward_backward(step)
    assert fix in str(err.value), str(err.value)


@pytest.mark.parametrize("step", [make_step()], ids=["reference"])
def test_right_dp_steps_pass(step, capsys):
    lab02.check_dp_forward_backward(step)
    assert capsys.readouterr().out.count("✔") == 1


@pytest.mark.parametrize("step, phrase", [
    (no_scatter, "ran a forward on the whole batch of 16"),
    (one_model_for_all_chunks, "through 1 model object"),
    (four_devices_always, "4 forward pass(es) for 3 devices"),
    (mean_of_chunk_losses, "uneven chunks ([4, 4, 2] samples of 10)"),
])
def test_dp_steps_that_skip_the_idea_or_fit_one_setup_fail(step, phrase):
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_forward_backward(step)
    assert phrase in str(err.value), str(err.value)


@pytest.mark.parametrize("wrong", [
    refusing_empty(lambda X, n: [c for c in torch.tensor_split(X, n) if len(c)]),
    refusing_empty(lambda X, n: list(torch.split(X, -(-X.shape[0] // n)))),
    refusing_empty(lambda X, n: [c for c in (X[i * len(X) // n:(i + 1) * len(X) // n]
                                             for i in range(n)) if len(c)]),
    refusing_empty(lambda X, n: torch.split(X, -(-X.shape[0] // n))),  # a tuple: a sequence
    refusing_empty(lambda X, n: torch.chunk(X, n)),
], ids=["tensor_split-nonempty", "split-ceil", "slices-nonempty", "split-tuple", "chunk-tuple"])
def test_right_scatters_pass(wrong, capsys):
    lab02.check_scatter(wrong)
    assert capsys.readouterr().out.count("✔") == 1


@pytest.mark.parametrize("right", [
    by_position(lambda o: torch.concat(o)), by_position(lambda o: torch.vstack(o)),
    by_position(lambda o: torch.cat(list(o), dim=-2)), by_position(torch.cat, list), good_gather,
], ids=["concat", "vstack", "dim=-2", "a-list-of-positions", "recursive"])
def test_right_gathers_pass(right, capsys):
    lab02.check_gather(right)
    assert capsys.readouterr().out.count("✔") == 1


# --- stretch: threaded_apply ------------------------------------------------------------------

import threading  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402


def _threads(order="index", join="after", grad="caller", errors="raise", n_threads=None,
             catch=BaseException):
    def apply(replicas, inputs):
        mode = torch.is_grad_enabled()
        results, errs, done = [None] * len(replicas), [], []

        def work(i):
            try:
                ctx = (torch.set_grad_enabled(mode) if grad == "caller" else
                       torch.enable_grad() if grad == "on" else torch.no_grad())
                with ctx:
                    out = replicas[i](inputs[i])
                results[i] = out
                done.append(out)
            except catch as exc:  # noqa: BLE001
                errs.append((i, exc))

        if n_threads == 1:
            for i in range(len(replicas)):
                work(i)
        elif join == "raise early":  # joins in order, raises at the first failed replica
            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
            for t in threads:
                t.start()
            for i, t in enumerate(threads):
                t.join()
                failed = [e for j, e in errs if j == i]
                if failed:
                    raise failed[0]
        else:
            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
            for t in threads:
                t.start()
                if join == "each":
                    t.join()
            if join == "after":
                for t in threads:
                    t.join()
        if errs and errors == "raise":  # the lowest-numbered failing replica's, as torch's
            raise min(errs, key=lambda e: e[0])[1]
        if errs and errors == "first":  # the first to fail in time
            raise errs[0][1]
        if errs and errors == "last":  # one slot, overwritten by each failing thread
            raise errs[-1][1]
        if errs and errors == "highest":  # a learner's: the highest-numbered failing replica's
            raise max(errs, key=lambda e: e[0])[1]
        return done if order == "finished" else results
    return apply


def pool_apply(replicas, inputs):
    mode = torch.is_grad_enabled()

    def run(pair):
        with torch.set_grad_enabled(mode):
            return pair[0](pair[1])

    with ThreadPoolExecutor(max_workers=len(replicas)) as pool:
        return list(pool.map(run, zip(replicas, inputs)))  # re-raises a worker's error


def pool_of_two(replicas, inputs):
    with ThreadPoolExecutor(max_workers=2) as pool:  # the third replica waits for a free thread
        return list(pool.map(lambda pair: pair[0](pair[1]), zip(replicas, inputs)))


def caller_runs_replica_zero(replicas, inputs):
    mode = torch.is_grad_enabled()
    results, errors = [None] * len(replicas), [None] * len(replicas)

    def work(i):
        try:
            with torch.set_grad_enabled(mode):
                results[i] = replicas[i](inputs[i])
        except BaseException as exc:  # noqa: BLE001
            errors[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(1, len(replicas))]
    for t in threads:
        t.start()
    work(0)  # the caller's thread takes replica 0 while the others run
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return results


@pytest.mark.parametrize("fn", [_threads(), pool_apply, caller_runs_replica_zero],
                         ids=["threads", "pool", "caller-takes-0"])
def test_right_threaded_apply_passes(fn, capsys):
    lab02.check_threaded_apply(fn)
    assert capsys.readouterr().out.count("✔") == 1


@pytest.mark.parametrize("fn, phrase", [
    (_threads(order="finished"), "order the threads finished"),
    (_threads(join="never"), "before its threads finished"),
    (_threads(join="each"), "never ran at the same time"),
    (_threads(n_threads=1), "one after another in the caller's thread"),
    (_threads(grad="on"), "under torch.no_grad(), the outputs of your threads carry"),
    (_threads(errors="swallow"), "as if nothing happened"),
    (_threads(errors="first"), "replica 2's error, the first to fail"),
    (_threads(errors="last"), "replica 2's error, the last to fail"),
    (_threads(errors="highest"), "replica 2's error, whichever thread failed first: the highest"),
    (pool_of_two, "ran in 2 thread(s)"),
    (_threads(catch=Exception), "`except Exception` let it end replica 1's thread"),
    (_threads(join="raise early"), "while replica 1's thread was still running"),
])
def test_threaded_apply_mistakes_are_named(fn, phrase):
    with pytest.raises(LabCheckError) as err:
        lab02.check_threaded_apply(fn)
    assert phrase in str(err.value), str(err.value)


# --- batches that run out before the devices do: (6, 4), (5, 4), (2, 3) ---------------------

def ceil_slices_for_every_device(X, n):
    s = -(-X.shape[0] // n)
    return [X[i * s:(i + 1) * s] for i in range(n)]  # (6, 4) -> 2, 2, 2, 0


def refuses_fewer_chunks(X, n):
    chunks = list(torch.chunk(X, n))
    if len(chunks) != n:  # the first reference's mistake: nn.DataParallel uses fewer devices
        raise ValueError(f"a batch of {X.shape[0]} does not split into {n} chunks")
    return chunks


def refuses_small_batch(X, n):
    if X.shape[0] < n:
        raise ValueError("batch smaller than the device count")
    return list(torch.chunk(X, n))


@pytest.mark.parametrize("wrong, phrase", [
    (ceil_slices_for_every_device, "gave a device an empty chunk (sizes [2, 2, 2, 0])"),
    (lambda X, n: list(torch.tensor_split(X, n)), "gave a device an empty chunk (sizes [1, 1, 0])"),
    (refuses_fewer_chunks, "raised ValueError for a batch of 6 on 4 devices"),
    (refuses_small_batch, "raised ValueError for a batch of 2 on 3 devices"),
    (lambda X, n: [X], "left devices idle that nn.DataParallel would use (2 chunks)"),
    (lambda X, n: [X[:len(X) - n + 1]] + [X[i:i + 1] for i in range(len(X) - n + 1, len(X))],
     "unbalanced (sizes [7, 1]"),
    (lambda X, n: list(torch.chunk(X, n)) + [X[:0]], "returned 3 chunk(s)"),
], ids=["ceil-slices-empty", "tensor_split-empty", "refuses-fewer-chunks", "refuses-small-batch",
        "one-chunk", "unbalanced", "extra-empty"])
def test_scatter_when_the_batch_runs_out_before_the_devices(wrong, phrase):
    with pytest.raises(LabCheckError) as err:
        lab02.check_scatter(wrong)
    assert phrase in str(err.value), str(err.value)


def test_balanced_split_with_every_device_passes(capsys):
    @refusing_empty
    def balanced(X, n):  # (6, 4) -> 2, 2, 1, 1: all four devices busy, none over ceil(B/N)
        return [c for c in torch.tensor_split(X, n) if len(c)]
    lab02.check_scatter(balanced)
    assert capsys.readouterr().out.count("✔") == 1


def test_torch_chunk_gives_fewer_chunks_than_devices():
    # the fact the lab is built on, in the installed torch
    assert [c.shape[0] for c in torch.chunk(torch.zeros(6), 4)] == [2, 2, 2]
    assert [c.shape[0] for c in torch.chunk(torch.zeros(5), 4)] == [2, 2, 1]
    assert [c.shape[0] for c in torch.chunk(torch.zeros(2), 3)] == [1, 1]


# --- the design decision: chunk sizes ---------------------------------------------------------

@refusing_empty
def balanced(X, n):
    return [c for c in torch.tensor_split(X, n) if len(c)]


@refusing_empty
def balanced_larger_last(X, n):  # balanced sizes, the extra samples on the last chunks
    b = X.shape[0]
    k = min(n, b)
    sizes = [b // k + (i >= k - b % k) for i in range(k)]
    return list(torch.split(X, sizes))


@pytest.mark.parametrize("fn, sizes", [(good_scatter, "like DataParallel"),
                                       (balanced, "balanced")])
def test_scatter_keeping_its_decision_passes(fn, sizes, capsys):
    lab02.check_scatter(fn, sizes=sizes)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "as you decided" in out, out


@pytest.mark.parametrize("fn, sizes, phrase", [
    (balanced, "like DataParallel", "gave [3, 3, 2, 2], and 'like DataParallel' gives [3, 3, 3, 1]"),
    (good_scatter, "balanced", "gave [3, 3, 3, 1], and 'balanced' gives [3, 3, 2, 2]"),
    (good_scatter, "even", "choice of chunk sizes must be"),
    (balanced_larger_last, "balanced", "gave [2, 2, 3, 3]: balanced, but the larger chunks come "
                                       "after smaller ones"),
])
def test_scatter_breaking_its_decision_is_refused(fn, sizes, phrase):
    with pytest.raises(LabCheckError) as err:
        lab02.check_scatter(fn, sizes=sizes)
    assert phrase in str(err.value), str(err.value)


# --- the library's own answers are refused -----------------------------------------------------

def wrapped_dp_scatter(X, n):
    return dp.scatter(X, n)


def wrapped_dp_gather(outputs):
    return dp.gather(outputs)


def wrapped_dp_parallel_apply(replicas, inputs):
    return dp.parallel_apply(replicas, inputs)


@pytest.mark.parametrize("check, fn, name", [
    (lab02.check_scatter, dp.scatter, "dp.scatter"),
    (lab02.check_scatter, wrapped_dp_scatter, "dp.scatter"),
    (lab02.check_gather, dp.gather, "dp.gather"),
    (lab02.check_gather, wrapped_dp_gather, "dp.gather"),
    (lab02.check_threaded_apply, dp.parallel_apply, "dp.parallel_apply"),
    (lab02.check_threaded_apply, wrapped_dp_parallel_apply, "dp.parallel_apply"),
], ids=["scatter", "scatter-wrapped", "gather", "gather-wrapped", "apply", "apply-wrapped"])
def test_the_library_answer_is_refused(check, fn, name):
    with pytest.raises(LabCheckError) as err:
        check(fn)
    assert f"library's own dpcourse.{name}" in str(err.value) or (
        f"called the library's dpcourse.{name}" in str(err.value)), str(err.value)
    assert "write it yourself" in str(err.value), str(err.value)


# --- predict, then measure ---------------------------------------------------------------------

@pytest.mark.parametrize("value, verdict", [(0.1, "right"), (0.25, "not what happened"),
                                            (1, "not what happened")])
def test_prediction_is_measured_and_explained(value, verdict, capsys):
    from dpcourse.checks import predict

    guess = predict("lab02", "the 1-sample copy's fraction of the whole batch's gradient", value)
    lab02.check_prediction(guess)
    out = " ".join(capsys.readouterr().out.split())
    assert f"measured: 0.1 — {verdict}." in out, out
    # right or wrong and the measured value, then a question: the why waits for part 4's pass
    assert "A question to take into part 4" in out and out.rstrip().endswith("?"), out
    for said in ("divided by", "1/10 of", "AccumulateGrad"):
        assert said not in out, (said, out)


def step_with_autograd_grad(model, X, y, n):
    # right, written another way: balanced chunks, torch.autograd.grad per copy's parameters,
    # added in place where a gradient is held
    chunks = balanced(X, n)
    reps = [copy.deepcopy(model) for _ in chunks]
    loss = F.cross_entropy(torch.cat(dp.parallel_apply(reps, chunks)), y)
    per_copy = torch.autograd.grad(loss, [q for r in reps for q in r.parameters()])
    k = len(list(model.parameters()))
    for j, p in enumerate(model.parameters()):
        g = sum(per_copy[i * k + j] for i in range(len(reps)))
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.add_(g)
    for name, buf in reps[0].named_buffers():  # replica 0's updates, as nn.DataParallel keeps
        model.get_buffer(name).copy_(buf)
    return loss.item()


def test_right_dp_step_written_another_way_passes(capsys):
    lab02.check_dp_forward_backward(step_with_autograd_grad)
    assert capsys.readouterr().out.count("✔") == 1


def test_part_4s_pass_line_explains_part_3s_measurements(capsys):
    # what part 3's feedback held back, once the rule has been worked out
    lab02.check_dp_forward_backward(make_step())
    out = " ".join(capsys.readouterr().out.split())
    assert "divided by the batch's size, not by its chunk's" in out, out
    assert "at a leaf autograd adds what arrives into what .grad already held" in out, out


def test_a_wrong_step_is_not_told_the_why(capsys):
    with pytest.raises(LabCheckError):
        lab02.check_dp_forward_backward(make_step(combine="mean"))
    assert "AccumulateGrad" not in capsys.readouterr().out


# --- predict, then measure: the scatter decision's consequence, what a deep copy carries --------

@pytest.mark.parametrize("fn, value, verdict, phrase", [
    (good_scatter, 22, "right", "22 of the 32 batch sizes (1-7, 9-14, 17-21, 25-28)"),
    # the 10-on-8 count (3 idle devices), a number of devices rather than of batch sizes
    (good_scatter, 3, "not what happened", "only B > 7c feeds all 8 devices"),
    # only the batches smaller than the devices: the answer of a balanced split
    (good_scatter, 7, "not what happened", "the idle stretch after each multiple of 8 shrinks"),
    (balanced, 7, "right", "DataParallel's rule would idle one for 22 sizes"),
    (balanced, 22, "not what happened", "feeds every device once B >= 8"),
])
def test_idle_prediction_counts_the_learners_scatter(fn, value, verdict, phrase, capsys):
    from dpcourse.checks import predict

    guess = predict("lab02", "batch sizes 1-32 on 8 devices that leave a device idle", value,
                    unit="batch sizes")
    lab02.check_idle_prediction(guess, fn)
    out = " ".join(capsys.readouterr().out.split())
    assert f"— {verdict}." in out and phrase in out, out


def test_the_lab_names_part_5_as_its_decision_and_part_4_lists_no_candidate_rule():
    from pathlib import Path

    text = (Path(__file__).parent.parent / "solutions" / "lab02_data_parallel.py").read_text()
    part1, rest = text.split("# ## 1. `scatter`")[1].split("# ## 2. `gather`")
    part4 = text.split("# ## 4. `dp_forward_backward`")[1].split("# <details><summary>▶ Hint 1")[0]
    part5 = text.split("# ## 5. What survives a replica")[1].split("# <details><summary>▶ Hint 1")[0]
    # §1's choice passes both ways: it is not called a decision, and the lab says both pass
    assert "decision" not in part1.split("# <details><summary>▶ Hint 1")[0] and "both are accepted" in part1
    # part 4 names no candidate combining rule; part 5 holds the decision, stated as what must
    # hold (as nn.DataParallel(model) leaves it), not as a list of what to bring back
    for candidate in ("their sum", "their mean", "one copy's"):
        assert candidate not in part4, (candidate, part4)
    assert "decision" not in part4, part4
    assert "**Your design decision:** what of the copies' state comes back" in part5, part5
    assert "as\n# `nn.DataParallel(model)` would leave them" in part5, part5
    for told in ("in place", "in-place", "persistent=False, which", "dropped"):
        assert told not in part5.split("**The contract.**")[1], (told, part5)


def step_subtracting_what_copies_never_held(model, X, y, n):
    # believes each copy carried model's p.grad: takes it out of the sum n - 1 times
    chunks = good_scatter(X, n)
    reps = [copy.deepcopy(model) for _ in chunks]
    loss = F.cross_entropy(good_gather(dp.parallel_apply(reps, chunks)), y)
    loss.backward()
    for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps)):
        new = sum(c.grad for c in cs)
        p.grad = new if p.grad is None else new - (len(reps) - 1) * p.grad
    return loss.item()


def test_step_that_thinks_copies_carry_gradients_is_named():
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_forward_backward(step_subtracting_what_copies_never_held)
    assert "gradient minus 2 times what it held" in str(err.value), str(err.value)
    assert "a deep copy of a parameter leaves its .grad behind" not in str(err.value)
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_forward_backward(step_subtracting_what_copies_never_held)
    assert "a deep copy of a parameter leaves its .grad behind" in str(err.value), str(err.value)


# --- the buffers: BatchNorm's running statistics end as nn.DataParallel leaves them -----------

@pytest.mark.parametrize("how, phrase", [
    ("none", "did not move"),
    ("last", "last chunk's copy"),
    ("mean", "average of the copies'"),
    ("count off", "num_batches_tracked is"),
])
def test_buffers_left_otherwise_than_dataparallel_are_named(how, phrase):
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_forward_backward(make_step(buffers=how))
    assert phrase in str(err.value), str(err.value)
    assert "Run the check again" in str(err.value), str(err.value)


def whole_batch_statistics(model, X, y, n):
    # wrong: a forward of the original on the whole batch to "update the statistics"
    loss = make_step(buffers="none")(model, X, y, n)
    with torch.no_grad():
        model(X)
    return loss


def test_statistics_of_the_whole_batch_are_named():
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_forward_backward(whole_batch_statistics)
    assert "forward on the whole batch of 16" in str(err.value), str(err.value)


def batchnorm_buffers_only(model, X, y, n):
    # wrong: brings back BatchNorm's statistics alone, module by module; other buffers stay
    chunks = good_scatter(X, n)
    reps = [copy.deepcopy(model) for _ in chunks]
    loss = F.cross_entropy(good_gather(dp.parallel_apply(reps, chunks)), y)
    loss.backward()
    for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps)):
        new = sum(c.grad for c in cs)
        p.grad = new if p.grad is None else p.grad + new
    for m, m0 in zip(model.modules(), reps[0].modules()):
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            for b, b0 in zip(m.buffers(), m0.buffers()):
                b.copy_(b0)
    return loss.item()


def counter_sums_the_copies(model, X, y, n):
    # wrong: the counter takes every copy's samples (the whole batch), the rest as DP leaves it
    loss = shared_copy_zero(model, X, y, n)
    if isinstance(model, lab02.SampleCounter):
        model.seen.fill_(lab02.STATE_CASE[2] + X.shape[0])
    return loss


@pytest.mark.parametrize("fn, phrase", [
    (batchnorm_buffers_only, "seen holds 7, what the model held before the step, where "
                             "nn.DataParallel(model) leaves 10"),
    (counter_sums_the_copies, "seen holds 17, the value of one forward over the whole batch"),
])
def test_buffer_that_is_not_batchnorms_is_checked(fn, phrase):
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_state(fn)
    assert phrase in str(err.value), str(err.value)
    assert "Run the check again" in str(err.value), str(err.value)
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_state(fn)
    assert "What to change:" in str(err.value), str(err.value)


# --- part 5: what of the copies' state comes back (torch's own replicate is the reference) ---

def _step_on_copies(model, X, y, n, memo_for_copy_0=None):
    chunks = good_scatter(X, n)
    reps = [copy.deepcopy(model, memo_for_copy_0 if i == 0 else None)
            for i in range(len(chunks))]
    started = dict(reps[0].named_buffers())
    loss = F.cross_entropy(good_gather(dp.parallel_apply(reps, chunks)), y)
    loss.backward()
    for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps)):
        new = sum(c.grad for c in cs)
        p.grad = new if p.grad is None else p.grad + new
    return loss.item(), reps, started


def shared_copy_zero(model, X, y, n):
    # right: copy 0 is handed model's own buffer tensors, as replica 0 is
    return _step_on_copies(model, X, y, n, {id(b): b for b in model.buffers()})[0]


def the_tensors_copy_0_started_with(model, X, y, n):
    # right: brings back what copy 0 wrote into the buffer tensors it started with (kept before
    # the forward), whatever it holds under the names at the end
    loss, reps, started = _step_on_copies(model, X, y, n)
    for name, b in model.named_buffers():
        b.copy_(started[name])
    return loss


def rebinding_models_buffers(model, X, y, n):
    # wrong: the right values, but model's buffers rebound to copy 0's starting tensors instead
    # of written into the tensors model holds
    loss, reps, started = _step_on_copies(model, X, y, n)
    for name in dict(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, started[name])
    return loss


def test_buffers_rebound_to_new_tensors_are_named_then_fixed():
    with pytest.raises(LabCheckError) as first:
        lab02.check_dp_state(rebinding_models_buffers)
    message = " ".join(str(first.value).split())
    assert "the values are right, but model's seen and peak are other tensors" in message, message
    assert "copy_" not in message, message
    with pytest.raises(LabCheckError) as second:
        lab02.check_dp_state(rebinding_models_buffers)
    assert "write the values into the buffer tensors model already holds" in " ".join(
        str(second.value).split()), str(second.value)


def still_the_same_tensor(model, X, y, n):
    # wrong (the learner's variant): brings back a buffer of copy 0 only if copy 0 still holds
    # the tensor it started with, so a write in place followed by a rebinding is lost
    loss, reps, started = _step_on_copies(model, X, y, n)
    for name, b in model.named_buffers():
        if reps[0].get_buffer(name) is started[name]:
            b.copy_(started[name])
    return loss


def state_dict_of_copy_zero(model, X, y, n):
    loss, reps, _ = _step_on_copies(model, X, y, n)
    model.load_state_dict(reps[0].state_dict())
    return loss


def calls_brought_back(model, X, y, n):
    # wrong: copy 0's plain attributes (its calls among them) brought back with its buffers
    loss, reps, _ = _step_on_copies(model, X, y, n, {id(b): b for b in model.buffers()})
    for k, v in vars(reps[0]).items():
        if not k.startswith("_") and isinstance(v, int) and not isinstance(v, bool):
            setattr(model, k, v)
    return loss


def by_buffer_name(model, X, y, n):
    # learned "peak does not come back" as a name, not as what the forward did
    loss, reps, _ = _step_on_copies(model, X, y, n)
    for name, b in model.named_buffers():
        if name != "peak":
            b.copy_(reps[0].get_buffer(name))
    return loss


def copy_zero_on_models_parameters(model, X, y, n):
    # copy 0 holds model's own parameters (and buffers): autograd puts its share, added to what
    # model held, into model's p.grad; the code then adds the other copies' shares alone
    chunks = good_scatter(X, n)
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    reps = [copy.deepcopy(model, memo if i == 0 else None) for i in range(len(chunks))]
    loss = F.cross_entropy(good_gather(dp.parallel_apply(reps, chunks)), y)
    loss.backward()
    for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps[1:])):
        p.grad = p.grad + sum(c.grad for c in cs)
    return loss.item()


@pytest.mark.parametrize("step", [shared_copy_zero, the_tensors_copy_0_started_with])
def test_right_state_steps_pass_both_checks(step, capsys):
    lab02.check_dp_forward_backward(step)
    lab02.check_dp_state(step)
    out = capsys.readouterr().out
    assert "seen 10, peak 0.50, calls 5" in out, out
    assert "written in place then rebound" in out and "part 4's check still passes" in out, out
    assert out.count("✔") == 2, out  # part 4's check, rerun by part 5, prints nothing


def test_a_buffer_written_in_place_then_rebound_is_named_then_fixed():
    # the learner's variant passes parts 4 and 5's first two modules; torch's replicate keeps
    # the in-place write of a buffer the forward then rebinds
    lab02.check_dp_forward_backward(still_the_same_tensor)
    with pytest.raises(LabCheckError) as first:
        lab02.check_dp_state(still_the_same_tensor)
    said = str(first.value)
    assert "adds to `seen` in place and then binds a new tensor to `seen`" in said, said
    assert ("seen holds 7, what the model held before the step, where nn.DataParallel(model) "
            "leaves 10 (chunk 0's copy's value)") in said, said
    assert "Run the check again" in said and "started with" not in said, said
    with pytest.raises(LabCheckError) as second:
        lab02.check_dp_state(still_the_same_tensor)
    assert "whatever it holds at the end" in str(second.value), str(second.value)


def test_torchs_replicate_keeps_an_in_place_write_the_forward_then_rebinds():
    model, X, _ = _lab02_state._case(_lab02_state._InPlaceThenRebound)
    state = lab02.state_after_dp(copy.deepcopy(model), X, 4)
    assert int(state["seen"]) == 10 and state["calls"] == 5, state


def serial(model, X, y, n):
    # right state (copy 0 shares model's buffers), but the copies run in a loop, not threads
    chunks = good_scatter(X, n)
    memo = {id(b): b for b in model.buffers()}
    reps = [copy.deepcopy(model, memo if i == 0 else None) for i in range(len(chunks))]
    loss = F.cross_entropy(good_gather([r(c) for r, c in zip(reps, chunks)]), y)
    loss.backward()
    for p, *cs in zip(model.parameters(), *(r.parameters() for r in reps)):
        new = sum(c.grad for c in cs)
        p.grad = new if p.grad is None else p.grad + new
    return loss.item()


@pytest.mark.parametrize("step, cause", [
    (make_step(combine="mean"), "the gradients are 4 times too small"),
    (serial, "one after another in your function's own thread"),
], ids=["averaged", "serial"])
def test_part_5_runs_part_4s_check_first(step, cause):
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_state(step)
    assert "no longer passes part 4's check" in str(err.value) and cause in str(err.value), \
        str(err.value)


@pytest.mark.parametrize("step, cause, mechanism", [
    (make_step(), "peak holds 3.09, chunk 0's copy's value, where nn.DataParallel(model) "
                  "leaves 0.50 (what the model held before the step)",
     "a _buffers dict of its own"),
    (state_dict_of_copy_zero, "seen holds 7, what the model held before the step, where "
                              "nn.DataParallel(model) leaves 10",
     "persistent=False, which state_dict() leaves out"),
    (calls_brought_back, "calls holds 6, chunk 0's copy's value, where nn.DataParallel(model) "
                         "leaves 5", "binds a new int in that replica's own __dict__"),
    (by_buffer_name, "a counter whose forward writes `peak` in place and binds a new tensor to "
                     "`seen`", "same names and dtypes"),
], ids=["every buffer of copy 0", "state_dict", "calls", "by name"])
def test_state_brought_back_otherwise_than_dataparallel_is_named(step, cause, mechanism):
    # the first meeting: what differs, with the numbers, and no mechanism or fix
    with pytest.raises(LabCheckError) as first:
        lab02.check_dp_state(step)
    assert cause in str(first.value), str(first.value)
    assert "Run the check again" in str(first.value), str(first.value)
    assert mechanism not in str(first.value), str(first.value)
    # the second: the mechanism and what to change
    with pytest.raises(LabCheckError) as second:
        lab02.check_dp_state(step)
    assert mechanism in str(second.value) and "What to change:" in str(second.value), \
        str(second.value)


def test_every_buffer_of_copy_zero_passes_part_4_then_part_5_refuses_it():
    # the lesson's rule (replica 0's buffers) is right for BatchNorm, not for every buffer
    lab02.check_dp_forward_backward(make_step())
    with pytest.raises(LabCheckError):
        lab02.check_dp_state(make_step())


def test_torchs_replicate_on_the_cpu_keeps_replica_zeros_in_place_writes_only():
    # the facts part 5 is built on, from torch's own replicate: seen += 3 on the module's own
    # tensor (chunk 0 of 10 on 4), peak rebound in replica 0's dict, calls in its __dict__
    model, X, _ = _lab02_state._case(lab02.SampleCounter)
    state = lab02.state_after_dp(copy.deepcopy(model), X, 4)
    assert (int(state["seen"]), round(float(state["peak"]), 2), state["calls"]) == (10, 0.5, 5)
    assert "seen" not in model.state_dict() and "peak" in model.state_dict()
    # the lesson's dp.data_parallel (deep copies sharing replica 0's buffers) agrees
    twin = copy.deepcopy(model)
    dp.data_parallel(twin, X, dp.devices_for(4, kind="cpu"))
    assert all(torch.equal(state[k], b) for k, b in twin.named_buffers())
    # replica 0 really is handed the module's own buffer tensors, in a dict of its own
    replicas = _lab02_state._torch_replicate(model, 2)
    assert replicas[0].seen is model.seen and replicas[1].seen is not model.seen
    assert replicas[0]._buffers is not model._buffers


@pytest.mark.parametrize("value, verdict", [("G + g", "right"), ("g", "not what happened"),
                                            ("4G + g", "not what happened")])
def test_held_prediction_is_measured_and_explained(value, verdict, capsys):
    from dpcourse.checks import predict

    guess = predict("lab02", "p.grad after a DataParallel step on a model that held G", value,
                    choices=lab02.HELD_CHOICES)
    lab02.check_held_prediction(guess)
    out = " ".join(capsys.readouterr().out.split())
    assert f"measured: G + g — {verdict}." in out, out
    assert "A question to take into part 4" in out and out.rstrip().endswith("?"), out
    # the mechanism (autograd's accumulation at a leaf) waits for part 4's pass line
    assert "AccumulateGrad" not in out and "adds what arrives" not in out, out
    # what DataParallel leaves, not how plain copies get there
    for said in ("deepcopy", "copy", "sum", "None"):
        assert said not in out.split("measured:")[-1], (said, out)


def test_sample_counter_under_dataparallel_keeps_chunk_0():
    # the fact part 4's counter case is built on: replica 0 shares the module's buffers
    assert lab02.counted_after_dp() == (10, [3, 3, 3, 1])


def test_a_python_attribute_is_lost_on_every_replica_under_torchs_replicate():
    # the fact part 5's calls is built on, with torch's own replica builder: each replica
    # counted its forward in its own __dict__, and the module kept its 5
    assert lab02.calls_after_dp() == (5, [6, 6, 6, 6])


def _state_guesses(seen, peak, rebound):
    from dpcourse.checks import predict

    return (predict("lab02", "SampleCounter's seen after one DataParallel forward", seen,
                    unit="samples"),
            predict("lab02", "SampleCounter's peak after that forward", peak,
                    choices=lab02.PEAK_CHOICES),
            predict("lab02", "seen of the counter that adds in place then rebinds", rebound,
                    unit="samples"))


def test_the_state_predictions_are_torchs_replicate():
    # seen: replica 0 added its chunk's 3 into the module's own tensor; peak: the new tensor
    # replica 0 bound stayed in its own _buffers dict; the counter that adds then rebinds: the
    # addition stays although replica 0 ends holding another tensor
    assert lab02.state_predictions_measured() == (10, "0.5, as before", 10)


@pytest.mark.parametrize("seen, peak, rebound, verdicts", [
    (10, "0.5, as before", 10, ["right"] * 3),
    (17, "the batch's largest |x|", 10, ["not what happened"] * 2 + ["right"]),
    (10, "chunk 0's largest |x|", 7, ["right"] + ["not what happened"] * 2),
], ids=["right", "whole-batch", "identity-rule"])
def test_state_predictions_are_measured_and_the_why_waits_for_the_contract(
        seen, peak, rebound, verdicts, capsys):
    lab02.check_state_predictions(*_state_guesses(seen, peak, rebound))
    out = " ".join(capsys.readouterr().out.split())
    import re

    assert re.findall(r"— (right|not what happened)\.", out) == verdicts, out
    assert "measured: 10 samples" in out and "measured: 0.5, as before" in out, out
    assert "A question to take into the contract" in out, out
    # the mechanism is the contract's answer: it waits for part 5's pass line
    assert "_replicate_for_data_parallel" not in out and "nothing needs detecting" not in out, out


def test_part_5s_pass_line_explains_the_predictions(capsys):
    lab02.check_dp_state(shared_copy_zero)
    out = " ".join(capsys.readouterr().out.split())
    assert "Why, from your predictions" in out and "7 + 3 = 10" in out, out
    assert "nothing needs detecting" in out, out


def test_a_wrong_state_step_is_not_told_the_why():
    with pytest.raises(LabCheckError) as err:
        lab02.check_dp_state(make_step())
    assert "Why, from your predictions" not in str(err.value), str(err.value)


def test_buffer_mistake_met_twice_says_what_to_change():
    for attempt in (1, 2):
        with pytest.raises(LabCheckError) as err:
            lab02.check_dp_forward_backward(make_step(buffers="none"))
    assert "which replica's, and how do its updates reach the model?" in str(err.value), (
        str(err.value))
    # which copy's buffers survive is part 5's question: the sentence asks it, never answers it
    # (a fresh learner passed part 4 by copying "chunk 0's" out of the old sentence)
    assert "chunk 0" not in str(err.value) and "Run the check again" not in str(err.value), (
        str(err.value))


def test_cause_first_the_fix_on_the_second_meeting():
    def averaged(model, X, y, n):
        return make_step(combine="mean")(model, X, y, n)
    with pytest.raises(LabCheckError) as first:
        lab02.check_dp_forward_backward(averaged)
    assert "times too small" in str(first.value) and "sum the" not in str(first.value)
    with pytest.raises(LabCheckError) as second:
        lab02.check_dp_forward_backward(averaged)
    assert "Sum the replicas' gradients" in str(second.value), str(second.value)


# --- cause first, the fix on the second meeting (the sentences converted this round) ----------

def shuffled_gather(outputs):
    joined = torch.cat(outputs)
    return joined[torch.randperm(joined.shape[0], generator=torch.Generator().manual_seed(0))]


# Each: the check, the answer, the cause the first meeting names, words of the fix it must not
# say yet, and the fix the second meeting says.
@pytest.mark.parametrize("check, fn, cause, not_yet, fix", [
    (lab02.check_dp_forward_backward, copy_zero_on_models_parameters,
     "holds `model`'s own parameter tensors, not copies of them", "memo",
     "leave model's parameters out"),
    (lab02.check_gather, shuffled_gather, "not the outputs concatenated in device order",
     "device 0's first", "join the outputs along dim 0, device 0's first"),
    (lab02.check_threaded_apply, _threads(errors="swallow"), "an exception ends its thread",
     "raise it in the caller after join", "raise it in the caller after join"),
], ids=["copy-0-on-models-parameters", "gather-out-of-order", "threads-swallow-errors"])
def test_cause_first_then_the_fix_on_the_second_meeting(check, fn, cause, not_yet, fix):
    with pytest.raises(LabCheckError) as first:
        check(fn)
    assert cause in str(first.value), str(first.value)
    assert not_yet not in str(first.value), str(first.value)
    with pytest.raises(LabCheckError) as second:
        check(fn)
    assert fix in str(second.value), str(second.value)


# --- a replica that ends with SystemExit (a BaseException, not an Exception) -------------------

def missing_output_detected(replicas, inputs):
    # catches Exception only, but notices the empty slot and raises its own error, without the
    # replica's: the caller cannot tell what ended replica 1
    results = _threads(catch=Exception)(replicas, inputs)
    if any(r is None for r in results):
        raise RuntimeError("a replica gave no output")
    return results


def test_a_system_exit_lost_in_its_thread_is_named_then_fixed():
    wrong = _threads(catch=Exception)
    with pytest.raises(LabCheckError) as first:
        lab02.check_threaded_apply(wrong)
    message = str(first.value)
    assert "SystemExit is a BaseException, not an Exception" in message, message
    assert "returned ['Tensor', None]" in message, message
    assert "Run the check again" in message and "catch BaseException" not in message, message
    with pytest.raises(LabCheckError) as second:
        lab02.check_threaded_apply(wrong)
    assert "catch BaseException in each worker" in str(second.value), str(second.value)


def test_an_error_that_hides_the_system_exit_is_named():
    with pytest.raises(LabCheckError) as err:
        lab02.check_threaded_apply(missing_output_detected)
    assert "neither is that error nor carries it" in str(err.value), str(err.value)


def chained_base_exceptions(replicas, inputs):
    # wrong: every thread's ending kept, but re-raised as a RuntimeError whose cause is the
    # lowest replica's: the caller gets another error than the replica's
    errors = {}
    results = [None] * len(replicas)
    mode = torch.is_grad_enabled()

    def work(i):
        try:
            with torch.set_grad_enabled(mode):
                results[i] = replicas[i](inputs[i])
        except BaseException as exc:  # noqa: BLE001
            errors[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        i = min(errors)
        raise RuntimeError(f"replica {i} failed") from errors[i]
    return results


@pytest.mark.parametrize("fn", [_threads(), pool_apply, caller_runs_replica_zero],
                         ids=["threads-base-exception", "thread-pool", "caller-takes-0"])
def test_a_system_exit_reaching_the_caller_passes(fn, capsys):
    lab02.check_threaded_apply(fn)
    assert "a SystemExit included" in capsys.readouterr().out


def wrapped_in_message(replicas, inputs):
    # wrong: the lowest replica's error, but as a RuntimeError that quotes it
    try:
        return _threads()(replicas, inputs)
    except BaseException as exc:  # noqa: BLE001
        raise RuntimeError(f"replica failed: {exc}") from None


def system_exit_wrapped(replicas, inputs):
    # wrong only for SystemExit: an Exception comes back as it is, a SystemExit wrapped
    try:
        return _threads()(replicas, inputs)
    except SystemExit as exc:
        raise RuntimeError("a replica exited") from exc


@pytest.mark.parametrize("fn, got, cls", [
    (chained_base_exceptions, "RuntimeError (replica 1 failed)", "ValueError"),
    (wrapped_in_message, "RuntimeError (replica failed: replica 1 broke)", "ValueError"),
    (system_exit_wrapped, "RuntimeError (a replica exited)", "SystemExit"),
], ids=["raised-from", "quoted", "system-exit-raised-from"])
def test_an_error_wrapping_the_replicas_is_refused_by_its_types(fn, got, cls):
    with pytest.raises(LabCheckError) as first:
        lab02.check_threaded_apply(fn)
    message = " ".join(str(first.value).split())
    assert f"a replica raised {cls}" in message and f"the caller got {got}, which carries " \
        f"it but is not it" in message, message
    assert f"code around the call that catches {cls}" in message, message
    assert "not a new one around it" not in message, message
    with pytest.raises(LabCheckError) as second:
        lab02.check_threaded_apply(fn)
    assert "raise the exception object the replica raised" in str(second.value), str(second.value)


# --- an empty batch: refused with a ValueError (a mean loss over 0 samples is nan) ------------

def test_the_empty_batch_is_why_the_contract_refuses_it():
    assert torch.isnan(F.cross_entropy(torch.empty(0, 10), torch.empty(0, dtype=torch.long)))


def divmod_balanced(X, n):
    # the learner's scatter: right for every batch with samples, ZeroDivisionError for none
    q, r = divmod(X.shape[0], min(n, X.shape[0]))
    return list(torch.split(X, [q + (i < r) for i in range(min(n, X.shape[0]))]))


@pytest.mark.parametrize("wrong, cause, fix", [
    (lambda X, n: list(torch.chunk(X, n)),
     "on a batch of 0 samples returned [0, 0, 0, 0] instead of refusing it",
     "raise ValueError, saying the batch is empty"),
    (lambda X, n: [c for c in torch.tensor_split(X, n) if len(c)],
     "on a batch of 0 samples returned [] instead of refusing it",
     "raise ValueError, saying the batch is empty"),
    (divmod_balanced,
     "on a batch of 0 samples raised ZeroDivisionError",
     "test for an empty batch before any arithmetic on B"),
], ids=["chunk-empties", "no-chunks", "divides-by-zero"])
def test_an_empty_batch_not_refused_is_named(wrong, cause, fix):
    with pytest.raises(LabCheckError) as first:
        lab02.check_scatter(wrong)
    message = " ".join(str(first.value).split())
    assert cause in message and fix not in message, message
    with pytest.raises(LabCheckError) as second:
        lab02.check_scatter(wrong)
    assert fix in " ".join(str(second.value).split()), str(second.value)


# --- zero devices: refused with a ValueError (no chunk has a device to run on) -------------------

def refusing_only_empty(split):
    def scatter(X, n):
        if X.shape[0] == 0:
            raise ValueError("the batch is empty")
        return split(X, n)
    return scatter


def divmod_balanced_guarded(X, n):
    # refuses the empty batch, then divides by min(n, B) = 0 on zero devices
    if X.shape[0] == 0:
        raise ValueError("the batch is empty")
    return divmod_balanced(X, n)


@pytest.mark.parametrize("wrong, cause, fix", [
    (refusing_only_empty(lambda X, n: list(torch.chunk(X, n))),
     "scatter(X, 0) on a batch of 4 samples raised RuntimeError",
     "test for a device count below 1 before using it"),
    (divmod_balanced_guarded,
     "scatter(X, 0) on a batch of 4 samples raised ZeroDivisionError",
     "test for a device count below 1 before using it"),
    (refusing_only_empty(lambda X, n: [X] if n <= 1 else list(torch.chunk(X, n))),
     "scatter(X, 0) on a batch of 4 samples returned [4] instead of refusing it",
     "raise ValueError, saying there are no devices"),
], ids=["chunk-runtime-error", "divides-by-zero", "one-chunk-anyway"])
def test_zero_devices_not_refused_is_named(wrong, cause, fix):
    with pytest.raises(LabCheckError) as first:
        lab02.check_scatter(wrong)
    message = " ".join(str(first.value).split())
    assert cause in message and fix not in message, message
    with pytest.raises(LabCheckError) as second:
        lab02.check_scatter(wrong)
    assert fix in " ".join(str(second.value).split()), str(second.value)


def test_a_scatter_refusing_one_device_is_named():
    # a guard written n_devices <= 1: one device holds the whole batch, a valid split
    @refusing_only_empty
    def wrong(X, n):
        if n <= 1:
            raise ValueError("no devices")
        return list(torch.chunk(X, n))

    with pytest.raises(LabCheckError) as err:
        lab02.check_scatter(wrong)
    assert "scatter(X, 1) raised ValueError" in str(err.value), str(err.value)


def test_a_scatter_returning_a_tuple_passes(capsys):
    lab02.check_scatter(refusing_empty(lambda X, n: torch.chunk(X, n)), sizes="like DataParallel")
    assert capsys.readouterr().out.count("✔") == 1


def test_part_3s_feedback_stops_at_the_measured_share(capsys):
    from dpcourse.checks import predict

    lab02.check_prediction(predict("lab02", "the 1-sample copy's fraction", 0.25))
    out = " ".join(capsys.readouterr().out.split())
    assert "measured: 0.1 — not what happened." in out, out
    # part 4's rule (how the copies' gradients combine) stays the learner's conclusion
    for said in ("together", "make the whole", "equal shares", "sum", "mean over its own chunk"):
        assert said not in out.split("measured:")[-1], (said, out)


def pool_that_cancels_the_queued(replicas, inputs):
    # right: a pool of one thread, replica 0 first; its error cancels replica 1's task, still
    # queued, so replica 1 never runs and no thread is left running when the caller gets it
    # (what ThreadPoolExecutor.map does under load when a task has not started yet)
    mode = torch.is_grad_enabled()

    def run(pair):
        with torch.set_grad_enabled(mode):
            return pair[0](pair[1])

    with ThreadPoolExecutor(max_workers=1) as pool:
        futures = [pool.submit(run, pair) for pair in zip(replicas, inputs)]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()


def test_a_replica_cancelled_before_it_ran_is_no_thread_left_running():
    for _ in range(3):  # replica 1 cancelled, or run and joined: both leave no thread running
        lab02._check_no_thread_left(pool_that_cancels_the_queued)  # raises LabCheckError if not


@pytest.mark.parametrize("fn, symptom", [
    (_threads(grad="on"), "under torch.no_grad(), the outputs of your threads carry an autograd "
                          "graph"),
    (_threads(grad="off"), "the outputs of your threads carry no autograd graph"),
], ids=["on under no_grad", "off under grad"])
def test_grad_mode_in_threads_symptom_first_then_mechanism_and_fix(fn, symptom):
    with pytest.raises(LabCheckError) as first:
        lab02.check_threaded_apply(fn)
    said = str(first.value)
    assert symptom in said and "Run the check again" in said, said
    assert "per thread" not in said and "set_grad_enabled" not in said, said
    with pytest.raises(LabCheckError) as second:
        lab02.check_threaded_apply(fn)
    said = str(second.value)
    assert "grad mode is per thread in torch" in said and "set_grad_enabled" in said, said
