"""lab09's checks: every plausible wrong answer is named in one sentence, every right variant
passes. Both checks run in this process, so each answer costs milliseconds."""

import collections
import math
import time

import pytest
import torch

from dpcourse import async_sgd
from dpcourse.checks import LabCheckError, lab09

# --------------------------------------------------------------------------------------------
# The worker loop
# --------------------------------------------------------------------------------------------


TooStale = async_sgd.TooStale


def good(server, compute_gradient, batches, tau):
    def land(grad, version, batch):
        while True:
            try:
                server.push(grad, version)
                return
            except TooStale:   # refused: a new gradient for the same batch, on fresh weights
                w, version = server.pull()
                grad = compute_gradient(w, batch)

    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version, batch))
        if len(in_flight) > tau:
            land(*in_flight.popleft())
    while in_flight:
        land(*in_flight.popleft())


def with_a_list(server, compute_gradient, batches, tau):
    pending = []

    def push_oldest():
        grad, v, batch = pending.pop(0)
        done = False
        while not done:
            try:
                server.push(grad, v)
                done = True
            except TooStale:
                w, v = server.pull()
                grad = compute_gradient(w, batch)

    for batch in batches:
        w, version = server.pull()
        pending.append((compute_gradient(w, batch), version, batch))
        if len(pending) == tau + 1:
            push_oldest()
    while pending:
        push_oldest()


def computed_at_push(server, compute_gradient, batches, tau):
    # keeps the pulled weights, computes the gradient when it lands: the same numbers, but the
    # contract computes each gradient right after its own pull (refused, below)
    pending = collections.deque()
    for batch in batches:
        pending.append((batch, *server.pull()))
        if len(pending) > tau:
            batch_, w, v = pending.popleft()
            server.push(compute_gradient(w, batch_), v)
    for batch_, w, v in pending:
        server.push(compute_gradient(w, batch_), v)


def by_index(server, compute_gradient, batches, tau):
    grads = []
    batches = list(batches)

    def send(k):
        grad, version = grads[k]
        try:
            server.push(grad, version)
        except TooStale:
            w, version = server.pull()
            grads[k] = (compute_gradient(w, batches[k]), version)
            send(k)

    for k, batch in enumerate(batches):
        w, version = server.pull()
        grads.append((compute_gradient(w, batch), version))
        if k >= tau:
            send(k - tau)
    for k in range(max(0, len(batches) - tau), len(batches)):
        send(k)


def while_over_tau(server, compute_gradient, batches, tau):
    # a dict keyed by the batch's position, drained with a while: right too
    waiting, first, n = {}, 0, 0

    def land(grad, version, batch):
        try:
            server.push(grad, version)
        except TooStale:
            w, version = server.pull()
            land(compute_gradient(w, batch), version, batch)

    for batch in batches:
        w, version = server.pull()
        waiting[n] = (compute_gradient(w, batch), version, batch)
        n += 1
        while n - first > tau:
            land(*waiting.pop(first))
            first += 1
    while first < n:
        land(*waiting.pop(first))
        first += 1


def retries_later(server, compute_gradient, batches, tau):
    # a refused batch gets a new gradient at once, which waits at the front for the next
    # moment a gradient leaves: right too (each batch once, in order, never staler than allowed)
    in_flight = collections.deque()

    def leave():
        grad, version, batch = in_flight[0]
        try:
            server.push(grad, version)
            in_flight.popleft()
            return True
        except TooStale:
            w, v = server.pull()
            in_flight[0] = (compute_gradient(w, batch), v, batch)
            return False

    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version, batch))
        while len(in_flight) > tau and not leave():
            pass
    while in_flight:
        leave()


RIGHT = [good, with_a_list, by_index, while_over_tau, retries_later]


def no_drain(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())


def off_by_one(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) >= tau:
            server.push(*in_flight.popleft())
    while in_flight:
        server.push(*in_flight.popleft())


def newest_first(server, compute_gradient, batches, tau):
    in_flight = []
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) > tau:
            server.push(*in_flight.pop())
    while in_flight:
        server.push(*in_flight.pop(0))


def drained_backwards(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())
    while in_flight:
        server.push(*in_flight.pop())


def pulls_once(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    w, version = server.pull()
    for batch in batches:
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())
    while in_flight:
        server.push(*in_flight.popleft())


def current_version(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for batch in batches:
        w, _ = server.pull()
        in_flight.append(compute_gradient(w, batch))
        if len(in_flight) > tau:
            server.push(in_flight.popleft(), server.version)
    while in_flight:
        server.push(in_flight.popleft(), server.version)


def ignores_tau(server, compute_gradient, batches, tau):
    for batch in batches:
        w, version = server.pull()
        server.push(compute_gradient(w, batch), version)


def computes_when_it_lands(server, compute_gradient, batches, tau):
    # the gradient is computed on the weights of the push, not of the pull: never stale
    in_flight = collections.deque()
    for batch in batches:
        _, version = server.pull()
        in_flight.append((batch, version))
        if len(in_flight) > tau:
            batch_, v = in_flight.popleft()
            server.push(compute_gradient(server.pull()[0], batch_), v)
    while in_flight:
        batch_, v = in_flight.popleft()
        server.push(compute_gradient(server.pull()[0], batch_), v)


def pushed_twice(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) > tau:
            server.push(*in_flight[0])
    while in_flight:
        server.push(*in_flight.popleft())


def scaled(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch) / (tau + 1), version))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())
    while in_flight:
        server.push(*in_flight.popleft())


def pops_empty(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for k, batch in enumerate(batches):
        w, version = server.pull()
        if k >= tau:
            server.push(*in_flight.popleft())
        in_flight.append((compute_gradient(w, batch), version))
    while in_flight:
        server.push(*in_flight.popleft())


def endless(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version))
    while in_flight:
        server.push(*in_flight[0])


def skips_the_last_batch(server, compute_gradient, batches, tau):
    good(server, compute_gradient, list(batches)[:-1], tau)


def counts_the_batches(server, compute_gradient, batches, tau):
    # right for a list, but asks for len(): the batches may be a one-pass iterator
    in_flight = collections.deque()
    for k in range(len(batches)):
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batches[k]), version))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())
    while in_flight:
        server.push(*in_flight.popleft())



def pushes_between_pull_and_compute(server, compute_gradient, batches, tau):
    # the same numbers (the push lands after the pull), but the gradient waits for the push
    if tau == 0:
        return good(server, compute_gradient, batches, tau)
    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        if len(in_flight) == tau:
            server.push(*in_flight.popleft())
        in_flight.append((compute_gradient(w, batch), version))
    while in_flight:
        server.push(*in_flight.popleft())


WRONG = [
    (no_drain, "the last 3 gradients were never pushed with τ = 3: they were still in flight"),
    (off_by_one, "one update too early with τ = 3"),
    (newest_first, "pushed the newest gradient in flight, not the oldest"),
    (drained_backwards, "pushed the newest gradient in flight, not the oldest"),
    (pulls_once, "you pulled the weights only once with τ = 0"),
    (current_version, "you pushed the server's version at push time"),
    (ignores_tau, "never late with τ = 3"),
    (computes_when_it_lands, "you computed each gradient when it was pushed"),
    (pushed_twice, "a gradient was pushed twice"),
    (scaled, "you pushed something that compute_gradient did not return"),
    (pops_empty, "IndexError.*took a gradient out of an empty container"),
    (endless, "a loop that never ends"),
    (skips_the_last_batch, "computed 9 gradients for 10 batches"),
    (computed_at_push, "you kept the weights of batch 0's pull and computed its gradient only "
                       "after your loop's next pull \\(with τ = 3\\): a worker computes while "
                       "nothing else happens"),
    (pushes_between_pull_and_compute, "computed its gradient only after your loop's next "
                                      "push \\(with τ = 3\\)"),
    (counts_the_batches, "it asked how many batches there are, or for one by its index, but "
                         "the batches may be a stream read once"),
]


@pytest.mark.parametrize("loop", RIGHT, ids=lambda f: f.__name__)
def test_right_loops_pass(loop, capsys):
    lab09.check_async_worker(loop)
    assert capsys.readouterr().out.startswith("✔ every gradient computed right after its pull")


@pytest.mark.parametrize("loop, phrase", WRONG, ids=[f.__name__ for f, _ in WRONG])
def test_wrong_loops_are_named(loop, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab09.check_async_worker(loop)


def test_the_library_loop_itself_is_refused():
    with pytest.raises(LabCheckError, match="async_sgd.async_worker_loop itself"):
        lab09.check_async_worker(async_sgd.async_worker_loop)


def test_a_loop_that_wraps_the_library_loop_is_refused():
    with pytest.raises(LabCheckError, match="calls dpcourse.async_sgd.async_worker_loop"):
        lab09.check_async_worker(lambda *args: async_sgd.async_worker_loop(*args))
    assert async_sgd.async_worker_loop.__name__ == "async_worker_loop"  # restored


def counts_own_pushes(server, compute_gradient, batches, tau):
    in_flight, pushed = collections.deque(), 0
    for batch in batches:
        w, _ = server.pull()
        in_flight.append((compute_gradient(w, batch), pushed))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())
            pushed += 1
    while in_flight:
        server.push(*in_flight.popleft())
        pushed += 1


def pull_unpacked_backwards(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for batch in batches:
        version, w = server.pull()
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())
    while in_flight:
        server.push(*in_flight.popleft())


def compute_swapped(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(batch, w), version))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())
    while in_flight:
        server.push(*in_flight.popleft())


def push_swapped(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) > tau:
            grad, v = in_flight.popleft()
            server.push(v, grad)
    while in_flight:
        grad, v = in_flight.popleft()
        server.push(v, grad)


def computes_on_newest_weights(server, compute_gradient, batches, tau):
    # keeps the batches, computes each on the most recently pulled weights when it lands
    in_flight = collections.deque()
    w = None
    for batch in batches:
        w, version = server.pull()
        in_flight.append((batch, version))
        if len(in_flight) > tau:
            batch_, v = in_flight.popleft()
            server.push(compute_gradient(w, batch_), v)
    while in_flight:
        batch_, v = in_flight.popleft()
        server.push(compute_gradient(server.pull()[0], batch_), v)


@pytest.mark.parametrize("loop, phrase", [
    (counts_own_pushes, "your own count of pushes as the version"),
    (pull_unpacked_backwards, "as the weights: that is the version, the second of the two "
                              "things pull() returns"),
    (compute_swapped, "compute_gradient got Batch(0) where the weights belong (its first "
                      "argument) and the weights where the batch belongs: the two arguments "
                      "are swapped"),
    (push_swapped, "push got a tensor of 4 numbers where the version belongs (its second "
                   "argument): the gradient and the version are swapped"),
    (computes_on_newest_weights, "you computed each gradient when it was pushed"),
], ids=lambda x: getattr(x, "__name__", "phrase"))
def test_issue_37_mistakes_are_named_by_their_cause(loop, phrase):
    with pytest.raises(LabCheckError) as err:
        lab09.check_async_worker(loop)
    assert phrase in str(err.value), str(err.value)


def test_the_trace_is_compared_call_by_call(capsys):
    right = [("pull", 0), ("pull", 0), ("pull", 0), ("push", 0, 0), ("pull", 1),
             ("push", 1, 0), ("pull", 2), ("push", 2, 0), ("push", 3, 1), ("push", 4, 2)]
    lab09.check_trace(right)
    assert "trace is the loop's" in capsys.readouterr().out
    lab09.check_trace([list(c) for c in right])  # lists are fine too
    cases = [
        # one too early: pushed after τ pulls instead of τ + 1
        ([("pull", 0), ("pull", 0), ("push", 0, 0)] + right[2:3] + right[4:], "too early"),
        # the last ones never pushed
        (right[:-2], "exactly once"),
        # newest first
        (right[:-2] + [("push", 4, 2), ("push", 3, 1)], "would land as update 3, not update 4"),
        # the version of the push, not of the pull
        (right[:-1] + [("push", 4, 4)], "that pull returned version 2, not 4"),
        # a pull's version
        (right[:4] + [("pull", 0)] + right[5:], "1 pushes come before this pull"),
        # held too long
        (right[:3] + [("pull", 0)] + right[3:], "pulls 6 times"),
        ([("pull",)], "write each call as"),
    ]
    for trace, phrase in cases:
        with pytest.raises(LabCheckError) as err:
            lab09.check_trace(trace)
        assert phrase in str(err.value), (trace, str(err.value))
    with pytest.raises(NotImplementedError):
        lab09.check_trace(None)


def test_prediction_compares_the_tau_from_which_every_run_ends_above(capsys):
    from dpcourse.checks import predict

    losses = {t: 2.0 + 0.01 * t for t in range(17)}          # all below 2.32: none
    guess = predict("lab09", "τ from which every run is above the start at lr 0.2", 14)
    lab09.check_prediction(guess, {**losses, 14: 2.39, 15: 2.41, 16: 5.3}, 2.32)
    out = " ".join(capsys.readouterr().out.split())
    assert "measured: 14 — right" in out and "from τ = 14 on every run up to τ = 16 ended " \
        "above it (τ = 14 at 2.39), and τ = 13 ended at 2.13" in out, out
    lab09.check_prediction(guess, {**losses, 6: 2.4}, 2.32)   # one stray run, τ = 16 below
    out = " ".join(capsys.readouterr().out.split())
    assert "measured: none up to τ = 16 — not what happened" in out
    assert "τ = 6 ended above the start too" in out, out
    lab09.check_prediction(guess, losses, 2.32)
    out = " ".join(capsys.readouterr().out.split())
    assert "none up to τ = 16 — not what happened" in out and "no τ up to 16 stays above" in out
    assert lab09.first_above_start({0: 3.0, 1: 1.0, 2: 2.5}, 2.4) == 2   # τ = 0 does not count


def test_the_boundary_is_where_the_runs_stay_above_not_the_first_stray_run(capsys):
    # the learner's finding: at 400 updates τ = 8 ended above the start, 9 and 10 below, every
    # τ from 11 above; "the smallest τ above" jumped to 8 on one run's noise
    from dpcourse.checks import predict

    final = {t: 2.0 + 0.01 * t for t in range(11)} | {8: 2.39, 11: 2.36, 12: 2.5, 13: 2.4,
                                                       14: 2.35, 15: 2.44, 16: 280.0}
    assert lab09.first_above_start(final, 2.32) == 8
    assert lab09.above_for_good(final, 2.32) == 11
    assert lab09.above_for_good({1: 2.0, 2: 2.4}, 2.32) == 2
    assert lab09.above_for_good({1: 2.4, 2: 2.0}, 2.32) is None
    guess = predict("lab09", "stray", 11)
    lab09.check_prediction(guess, final, 2.32)
    out = " ".join(capsys.readouterr().out.split())
    assert "measured: 11 — right" in out
    assert "τ = 8 ended above the start too, τ = 9 and 10 below it: one run per τ — one seed, " \
           "one batch order — so near the boundary a single run's end falls on either side" \
           in out, out


def test_prediction_feedback_says_the_boundary_moves_with_the_budget(capsys):
    # the learner's finding: the feedback called one run's boundary a fixed lr · τ; the same
    # runs read after 300 and 400 updates put it at different τ, and the feedback says so
    from dpcourse.checks import predict

    at300 = {t: 2.0 + 0.01 * t for t in range(17)} | {14: 2.39, 15: 2.41, 16: 5.3}
    at400 = {t: 1.9 + 0.01 * t for t in range(17)} | {11: 2.36, 12: 2.5, 13: 2.4, 14: 2.35,
                                                      15: 2.44, 16: 280.0}
    for g, verdict in [(6, "Your τ = 6 is lr · τ = 1.2. The runs: lr · τ = 2.2 (τ = 11); yours "
                           "is 5 τ too low."),
                       (13, "yours is 2 τ too high."),
                       (11, "Your τ = 11 is lr · τ = 2.2. Right on it.")]:
        guess = predict("lab09", f"budget {g}", g)
        lab09.check_prediction(guess, {300: at300, 400: at400}, 2.32)
        out = " ".join(capsys.readouterr().out.split())
        assert "at lr 0.2 after 400 updates" in out and verdict in out, out
        assert "At the same lr, the same runs put the boundary at lr · τ = 2.8 (τ = 14) after " \
               "300 updates and at lr · τ = 2.2 (τ = 11) after 400: it moves with the budget, " \
               "so no fixed lr · τ places it." in out, out
        assert "outweighed" not in out and "The runs put it at" not in out
    guess = predict("lab09", "budget none", 17)
    lab09.check_prediction(guess, {300: at300, 400: at300}, 2.32)   # the same boundary: no claim
    out = " ".join(capsys.readouterr().out.split())
    assert "moves with the budget" not in out and "Your 17 said no τ up to 16" in out


def test_measure_sweep_reads_the_same_runs_along_the_way():
    # the loss read after 10 of 20 updates is the loss of a 10-update run on the same batches
    from dpcourse import async_sgd

    problem = async_sgd.make_problem()
    start, losses = lab09.measure_sweep(problem, async_sgd.async_worker_loop, steps=20,
                                        along=(10,), taus=(0, 3))
    assert set(losses) == {10, 20} and set(losses[10]) == {0, 3}
    batches = async_sgd.batch_schedule(len(problem.x_train), 32, 20)
    for tau in (0, 3):
        assert losses[20][tau] == async_sgd.run_stale(problem, tau, 0.2, batches)["loss"]
        # after 10 updates a τ-late run has applied the same 10 updates, each on the same
        # version's gradient, as a run of 10 batches whose last gradients land at its end
        assert losses[10][tau] == async_sgd.run_stale(problem, tau, 0.2, batches[:10])["loss"]
    assert start == async_sgd.run_stale(problem, 0, 0.2, [])["loss"]


def test_trace_of_the_reference_has_staleness_tau():
    trace = lab09.trace_loop(good, 3)
    assert [at - trace["computed"][k][1] for k, _, at in trace["pushes"]] == \
        [min(k, 3) for k in range(lab09.STEPS)]


def todo_loop(server, compute_gradient, batches, tau):
    raise NotImplementedError("TODO: pull, compute, push")


def test_unfinished_loop_is_not_implemented():
    with pytest.raises(NotImplementedError, match="replace the TODOs"):
        lab09.check_async_worker(todo_loop)


def test_not_a_function_is_named():
    with pytest.raises(LabCheckError, match="your function itself"):
        lab09.check_async_worker("async_worker_loop")


# --------------------------------------------------------------------------------------------
# Stretch: the staleness-aware server
# --------------------------------------------------------------------------------------------

Base = async_sgd.SimulatedServer


class GoodAware(Base):
    def push(self, grad, version):
        staleness = self.version - version
        self.staleness.append(staleness)
        self.w.add_(grad, alpha=-self.lr / max(1, staleness))
        self.version += 1


class BranchAware(Base):
    def push(self, grad, version):
        s = self.version - version
        self.staleness.append(s)
        step = self.lr / s if s > 1 else self.lr
        self.w = self.w - step * grad
        self.version += 1


class SuperAware(Base):
    # scale the gradient, then let the plain server step and do the bookkeeping
    def push(self, grad, version):
        super().push(grad / max(1, self.version - version), version)


class Float32Aware(Base):
    # the step computed through a float32 tensor: ~1e-8 from the float64 rule, and right
    def push(self, grad, version):
        s = self.version - version
        self.staleness.append(s)
        step = torch.tensor(self.lr, dtype=torch.float32) / max(1, s)
        self.w.add_(grad, alpha=-step.item())
        self.version += 1


class Float32Weights(Base):
    # weights and update kept in float32 throughout: right too
    def push(self, grad, version):
        s = self.version - version
        self.staleness.append(s)
        self.w = self.w.float() - (self.lr / max(1, s)) * grad.float()
        self.version += 1


RIGHT_SERVERS = [GoodAware, BranchAware, SuperAware, async_sgd.StalenessAwareServer,
                 Float32Aware, Float32Weights]


def _server(step_rule, before=False, record=True, bump=True, sign=1):
    class Server(Base):
        def push(self, grad, version):
            if before and bump:
                self.version += 1
            s = sign * (self.version - version)
            if record:
                self.staleness.append(s)
            self.w.add_(grad, alpha=-step_rule(self.lr, s))
            if bump and not before:
                self.version += 1
    return Server


WRONG_SERVERS = [
    (_server(lambda lr, s: lr), "the step was not scaled"),
    (_server(lambda lr, s: lr / (s + 1)), "you divided by staleness \\+ 1"),
    (_server(lambda lr, s: lr * s), "you multiplied the lr by the staleness"),
    (_server(lambda lr, s: lr / s), "a fresh gradient has staleness 0 with τ = 2, and lr / s "
                                    "divided by it"),
    (_server(lambda lr, s: lr / max(1, s), sign=-1), "your staleness is negative"),
    (_server(lambda lr, s: lr / max(1, s), before=True), "starts at 1 .*counted after the "
                                                         "version moved on"),
    (_server(lambda lr, s: lr / max(1, s), record=False), "self.staleness is empty"),
    (_server(lambda lr, s: lr / max(1, s), bump=False), "the server's version is 0 after 10"),
    (_server(lambda lr, s: lr / max(1, s) ** 2), "differ from the staleness-aware step"),
    (_server(lambda lr, s: lr / max(1, s) ** 0.5), "you divided the lr by the square root of "
                                                   "the staleness"),
    (_server(lambda lr, s: lr / max(1.0, math.sqrt(s))), "by the square root of the staleness"),
]


class OverwritesLr(Base):
    def push(self, grad, version):
        s = self.version - version
        self.staleness.append(s)
        if s > 1:
            self.lr = self.lr / s
        self.w.add_(grad, alpha=-self.lr)
        self.version += 1


WRONG_SERVERS.append((OverwritesLr, "you divided self.lr itself, so every later step starts "
                                    "from the shrunken lr and the step keeps shrinking for good"))


WHY = [1, 1, 1 / 2, 1 / 3, 1 / 4, 1 / 5, 1 / 5, 1 / 5, 1 / 5, 1 / 5]   # my_steps, τ = 5


@pytest.mark.parametrize("cls", RIGHT_SERVERS, ids=lambda c: c.__name__)
def test_right_servers_pass(cls, capsys):
    lab09.check_staleness_aware(cls, WHY)
    assert "your steps [1, 1, 1/2, 1/3, 1/4, 1/5, 1/5, 1/5, 1/5, 1/5] · lr, as you wrote them: " \
           "updates 0, 1 take the full lr" in capsys.readouterr().out


@pytest.mark.parametrize("cls, phrase", WRONG_SERVERS, ids=[p[:30] for _, p in WRONG_SERVERS])
def test_wrong_servers_are_named(cls, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab09.check_staleness_aware(cls)


class TodoServer(Base):
    def push(self, grad, version):
        raise NotImplementedError("TODO: the staleness-aware step")


def test_unfinished_server_and_an_instance_are_named():
    with pytest.raises(NotImplementedError, match="replace the TODOs"):
        lab09.check_staleness_aware(TodoServer)
    with pytest.raises(LabCheckError, match="your class itself"):
        lab09.check_staleness_aware(GoodAware(torch.zeros(1), 0.1))


def test_the_checks_are_fast():
    t0 = time.monotonic()
    lab09.check_async_worker(good)
    lab09.check_staleness_aware(GoodAware, WHY)
    assert time.monotonic() - t0 < 2


# --------------------------------------------------------------------------------------------
# Part 1's trace is the deliverable the loop is held to; causes first, the fix on a second try
# --------------------------------------------------------------------------------------------

RIGHT_TRACE = [("pull", 0), ("pull", 0), ("pull", 0), ("push", 0, 0), ("pull", 1),
               ("push", 1, 0), ("pull", 2), ("push", 2, 0), ("push", 3, 1), ("push", 4, 2)]


def test_the_loop_is_held_to_the_learners_trace(capsys):
    lab09.check_async_worker(good, RIGHT_TRACE)
    assert "✔" in capsys.readouterr().out
    # a loop one update too early differs from the learner's own trace at call 3
    with pytest.raises(LabCheckError) as err:
        lab09.check_async_worker(off_by_one, RIGHT_TRACE)
    msg = str(err.value)
    # named by its cause, in gradients in flight, for the trace's own τ
    assert "one update too early with τ = 2" in msg and "an off-by-one in the gradients in " \
           "flight — each gradient left while only 1 newer one was in flight behind it, not " \
           "τ = 2" in msg, msg
    # arguments swapped: the cause, not "call 6 differs ... ('push', 0, 0)"
    with pytest.raises(LabCheckError) as err:
        lab09.check_async_worker(compute_swapped, RIGHT_TRACE)
    msg = str(err.value)
    assert "where the weights belong (its first argument)" in msg and "differs" not in msg, msg
    with pytest.raises(LabCheckError, match=r"call compute_gradient\(w, batch\)"):
        lab09.check_async_worker(compute_swapped, RIGHT_TRACE)
    # a trace that does not pass part 1 yet: the loop is not judged against it
    with pytest.raises(LabCheckError, match="does not pass part 1's check yet"):
        lab09.check_async_worker(good, RIGHT_TRACE[:-1])


def test_trace_messages_give_the_cause_then_the_fix():
    early = [("pull", 0), ("pull", 0), ("push", 0, 0)] + RIGHT_TRACE[2:3] + RIGHT_TRACE[4:]
    with pytest.raises(LabCheckError) as first:
        lab09.check_trace(early)
    assert "too early: only 2 gradients are in flight" in str(first.value)
    assert "pull the next batch first" not in str(first.value), str(first.value)
    assert "('pull', 0)" not in str(first.value).split("is ('push', 0, 0)")[1], str(first.value)
    with pytest.raises(LabCheckError, match="pull the next batch first"):
        lab09.check_trace(early)


def test_loop_messages_give_the_cause_then_the_fix():
    with pytest.raises(LabCheckError) as first:
        lab09.check_async_worker(off_by_one)
    assert "one update too early" in str(first.value)
    assert "not when τ are" not in str(first.value)
    with pytest.raises(LabCheckError, match="push when more than τ are waiting, not when τ are"):
        lab09.check_async_worker(off_by_one)


def test_the_fresh_step_is_the_learners_decision():
    # a fresh gradient that takes no step: a τ = 0 run never moves
    with pytest.raises(LabCheckError) as first:
        lab09.check_staleness_aware(_server(lambda lr, s: lr / s if s else 0.0))
    assert "a fresh gradient (staleness 0) took no step at all with τ = 2 (update 0, " \
        "computed on version 0 and applied to it); and in a τ = 0 run, where every gradient " \
        "is fresh, the server would never move" in str(first.value), str(first.value)
    assert "(with τ = 2)" not in str(first.value)      # the learner's finding: τ = 2 after τ = 0
    assert "max(1" not in str(first.value)
    with pytest.raises(LabCheckError) as err:
        lab09.check_staleness_aware(_server(lambda lr, s: lr / s))
    assert "max(1" not in str(err.value), str(err.value)


# --------------------------------------------------------------------------------------------
# A server that refuses a push staler than its bound (async_sgd.TooStale): what the loop does
# with the refused gradient is the learner's decision, and each wrong one is named
# --------------------------------------------------------------------------------------------


def _refusal(handle):
    """The right loop in every respect but what it does when a push is refused."""
    def loop(server, compute_gradient, batches, tau):
        in_flight, now = collections.deque(), {}

        def land(item):
            grad, version, batch, w = item
            try:
                server.push(grad, version)
            except TooStale:
                handle(server, compute_gradient, in_flight, item, now["batch"])

        for batch in batches:
            now["batch"] = batch
            w, version = server.pull()
            in_flight.append((compute_gradient(w, batch), version, batch, w))
            if len(in_flight) > tau:
                land(in_flight.popleft())
        while in_flight:
            land(in_flight.popleft())
    loop.__name__ = handle.__name__
    return loop


def lets_it_escape(server, compute_gradient, in_flight, item, current):
    raise TooStale("passed on")


def drops_it(server, compute_gradient, in_flight, item, current):
    pass


def pushes_it_again(server, compute_gradient, in_flight, item, current):
    grad, version, _, _ = item
    for _ in range(3):
        try:
            server.push(grad, version)
            return
        except TooStale:
            pass


def recomputes_on_old_weights(server, compute_gradient, in_flight, item, current):
    _, version, batch, w = item
    server.push(compute_gradient(w, batch), version)


def recomputes_the_current_batch(server, compute_gradient, in_flight, item, current):
    w, version = server.pull()
    server.push(compute_gradient(w, current), version)


def requeues_at_the_back(server, compute_gradient, in_flight, item, current):
    batch = item[2]
    w, version = server.pull()
    in_flight.append((compute_gradient(w, batch), version, batch, w))


def keeps_the_old_version(server, compute_gradient, in_flight, item, current):
    _, version, batch, _ = item
    w, _ = server.pull()
    server.push(compute_gradient(w, batch), version)


def retries_once(server, compute_gradient, in_flight, item, current):
    batch = item[2]
    w, version = server.pull()
    server.push(compute_gradient(w, batch), version)


def retries_once_then_drops(server, compute_gradient, in_flight, item, current):
    batch = item[2]
    w, version = server.pull()
    try:
        server.push(compute_gradient(w, batch), version)
    except TooStale:
        pass


RETRY_CAUSE = ("the server refused the gradient of batch 2 (computed on version 0, 4 updates "
               "stale at version 4, more than 3); your loop pulled version 4 and computed batch "
               "2's gradient again — then 4 other workers' updates landed before its push, and "
               "the server refused the retry too (4 updates stale at version 8), ")

REFUSALS = [
    (retries_once, RETRY_CAUSE + "and your loop let this second refusal escape as TooStale"),
    (retries_once_then_drops, RETRY_CAUSE + "and your loop went on without batch 2"),
    (lets_it_escape, "the server refused the gradient of batch 2 (computed on version 0, 4 "
                     "updates stale at version 4, more than 3) and your loop stopped there: the "
                     "refusal escaped from it as TooStale"),
    (drops_it, "and your loop went on without batch 2: batches [2, 5, 6] never changed the "
               "weights"),
    (pushes_it_again, "and your loop pushed that same gradient again"),
    (recomputes_on_old_weights, "your loop computed it again on version 0, weights it already "
                                "had before the refusal"),
    (recomputes_the_current_batch, "the next gradient your loop computed was for batch 4, not "
                                   "batch 2: batches [2, 5] never changed the weights, and "
                                   "batches [6, 7] did twice"),
    (requeues_at_the_back, "the updates then landed in the order of batches"),
    (keeps_the_old_version, "a gradient of batch 2 was pushed with version 0, but the pull that "
                            "gave its weights returned"),
]


@pytest.mark.parametrize("handle, phrase", REFUSALS, ids=[h.__name__ for h, _ in REFUSALS])
def test_what_the_loop_does_with_a_refused_gradient_is_named(handle, phrase):
    with pytest.raises(LabCheckError) as err:
        lab09.check_async_worker(_refusal(handle))
    assert phrase in str(err.value), str(err.value)


def test_refusal_messages_give_the_cause_then_the_fix():
    loop = _refusal(drops_it)
    with pytest.raises(LabCheckError) as first:
        lab09.check_async_worker(loop)
    assert "fresh weights" not in str(first.value)
    with pytest.raises(LabCheckError, match="compute that batch's gradient again on fresh"):
        lab09.check_async_worker(loop)


def test_a_retry_that_is_refused_too_gets_its_own_cause_then_the_fix():
    loop = _refusal(retries_once)
    with pytest.raises(LabCheckError) as first:
        lab09.check_async_worker(loop)
    assert "your loop retries once, but a retry is a push like any other" in str(first.value)
    assert "keep retrying" not in str(first.value), str(first.value)
    with pytest.raises(LabCheckError, match="keep retrying the refused batch"):
        lab09.check_async_worker(loop)


def test_the_right_loop_meets_a_refused_retry(capsys):
    trace = lab09.trace_loop(good, lab09.REFUSAL_TAU, bound=lab09.REFUSAL_BOUND,
                             bursts=lab09.REFUSAL_BURSTS, retry_burst=lab09.REFUSAL_RETRY_BURST)
    batch, landed, position = trace["retry_bursts"][0]
    assert (batch, landed) == (2, 4)
    assert [n for n, *_ in trace["refused"]].count(position) == 1   # the retry was refused
    lab09.check_async_worker(good)
    assert "batch 2's retry refused too" in capsys.readouterr().out


def test_the_bounded_server_refuses_and_applies_nothing():
    server = async_sgd.BoundedServer(torch.zeros(2), 0.1, max_staleness=1)
    server.push(torch.ones(2), 0)
    server.push(torch.ones(2), 0)                      # 1 update stale: taken
    with pytest.raises(TooStale, match="2 updates stale at version 2; this server takes at "
                                       "most 1"):
        server.push(torch.ones(2), 0)
    assert server.version == 2 and server.refused == 1 and server.staleness == [0, 1]
    assert torch.equal(server.w, torch.full((2,), -0.2))
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        async_sgd.BoundedServer(torch.zeros(2), 0.1, max_staleness=-1)
    # the lab's right loop on the library's bounded server: every batch once
    a, b, w0, batches = lab09._problem()
    server = async_sgd.BoundedServer(w0, 0.1, max_staleness=0)
    good(server, lambda w, batch: a @ w - b + batch.noise, batches, 3)
    assert server.version == lab09.STEPS and set(server.staleness) == {0} and server.refused > 0


# --------------------------------------------------------------------------------------------
# The stretch's my_steps: the steps of the τ = 5 run, worked out by the learner, measured
# --------------------------------------------------------------------------------------------

RIGHT_STEPS = [WHY, tuple(WHY), [1.0, 1.0, 0.5, 0.333, 0.25, 0.2, 0.2, 0.2, 0.2, 0.2]]


@pytest.mark.parametrize("steps", RIGHT_STEPS, ids=range(len(RIGHT_STEPS)))
def test_the_right_steps_pass(steps, capsys):
    lab09.check_staleness_aware(GoodAware, steps)
    assert "with τ = 0, every gradient fresh, the run is plain SGD" in capsys.readouterr().out


@pytest.mark.parametrize("steps, phrase", [
    ([1, 1, 1 / 2, 1 / 3, 1 / 4, 1 / 5, 1 / 6, 1 / 7, 1 / 8, 1 / 9],
     "shrinks with every update, as if update k were k updates stale"),
    ([1] + [1 / 5] * 9, "as if each gradient were τ = 5 updates stale"),
    ([1, 1 / 2, 1 / 3, 1 / 4, 1 / 5, 1 / 6, 1 / 6, 1 / 6, 1 / 6, 1 / 6],
     "is one update of staleness off: it gives update 1 a step of 0.5·lr, but your server"),
    ([0, 1, 1 / 2, 1 / 3, 1 / 4, 1 / 5, 1 / 5, 1 / 5, 1 / 5, 1 / 5],
     "my_steps starts with 0·lr, but your server gave update 0 — a fresh gradient, staleness "
     "0 — a step of 1·lr"),
    ([1, 1, 1 / 2, 1 / 3, 1 / 4, 1 / 5, 1 / 5, 1 / 5, 1 / 5, 1 / 4],
     "differs from your server's steps from update 9 on"),
    ([1, 1, 0.5], "should be a list of 10 numbers"),
    ("lr / max(1, s)", "should be a list of 10 numbers"),
], ids=["unbounded", "all-tau", "off-by-one", "fresh", "other", "short", "text"])
def test_wrong_steps_are_named(steps, phrase):
    with pytest.raises(LabCheckError) as err:
        lab09.check_staleness_aware(GoodAware, steps)
    assert phrase in str(err.value), str(err.value)


def test_the_steps_are_asked_for_after_the_server_is_right():
    with pytest.raises(NotImplementedError, match="write my_steps"):
        lab09.check_staleness_aware(GoodAware)
    # a wrong server is named before the steps are looked at
    with pytest.raises(LabCheckError, match="the step was not scaled"):
        lab09.check_staleness_aware(_server(lambda lr, s: lr), WHY)
    # the cause first, what to change on a second meeting
    unbounded = [1, 1, 1 / 2, 1 / 3, 1 / 4, 1 / 5, 1 / 6, 1 / 7, 1 / 8, 1 / 9]
    with pytest.raises(LabCheckError) as first:
        lab09.check_staleness_aware(GoodAware, unbounded)
    assert "min(k, τ) first" not in str(first.value)
    with pytest.raises(LabCheckError, match=r"write update k's staleness as min\(k, τ\) first"):
        lab09.check_staleness_aware(GoodAware, unbounded)


def test_server_steps_measures_the_rule():
    assert lab09.server_steps(GoodAware) == pytest.approx(WHY)
    assert lab09.server_steps(_server(lambda lr, s: lr / (s + 1)), tau=2)[:3] == \
        pytest.approx([1, 1 / 2, 1 / 3])


def retries_on_any_exception(server, compute_gradient, batches, tau):
    # `except Exception` around a swapped push: the spy's complaint must not be swallowed
    in_flight = collections.deque()

    def land(grad, version, batch):
        while True:
            try:
                server.push(version, grad)
                return
            except Exception:
                w, version = server.pull()
                grad = compute_gradient(w, batch)

    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version, batch))
        if len(in_flight) > tau:
            land(*in_flight.popleft())
    while in_flight:
        land(*in_flight.popleft())


def test_a_loop_that_catches_everything_still_gets_its_cause():
    with pytest.raises(LabCheckError, match="the gradient and the version are swapped"):
        lab09.check_async_worker(retries_on_any_exception, RIGHT_TRACE)


def test_an_endless_loop_held_to_the_trace_ends():
    t0 = time.monotonic()
    with pytest.raises(LabCheckError, match="a loop that never ends"):
        lab09.check_async_worker(endless, RIGHT_TRACE)
    assert time.monotonic() - t0 < 5


def test_lab_text_cites_no_rule_the_lesson_withdrew():
    """Review R2_01_09 P1: lesson 09 §2 calls 'lr must shrink like 1/τ' a law its few points
    cannot tell from others, so part 3's hint must not send the learner to it; nor read one
    seed's run as the boundary the lesson says a single run is not."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    lab = (root / "solutions" / "lab09_async_worker.py").read_text()
    lesson = (root / "lessons" / "09_beyond_lockstep.py").read_text()
    assert "shrink like 1/τ" in lesson  # the lesson's withdrawal still stands
    assert "shrinks like 1/τ" not in lab and "every τ from 4 on did" not in lab
    assert "over 5 seeds" in lab


# --------------------------------------------------------------------------------------------
# Review 30: the rule a wrong answer broke, not only where it differs (learner_09's probes)
# --------------------------------------------------------------------------------------------


def pulls_ahead(server, compute_gradient, batches, tau):
    # the learner's "pull reuse": the next batch's pull at the end of each pass, one too many
    in_flight = collections.deque()
    w, version = server.pull()
    for batch in batches:
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())
        w, version = server.pull()
    while in_flight:
        server.push(*in_flight.popleft())


def two_gradients_per_pull(server, compute_gradient, batches, tau):
    in_flight = collections.deque()
    for i, batch in enumerate(batches):
        if i % 2 == 0:
            w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())
    while in_flight:
        server.push(*in_flight.popleft())


def test_a_gradient_not_on_its_own_pull_names_the_rule():
    with pytest.raises(LabCheckError) as err:
        lab09.check_async_worker(two_gradients_per_pull, RIGHT_TRACE)
    assert "each gradient must be computed on the weights of its own pull, right after it; " \
           "yours computed gradient 1 on the weights pulled for gradient 0" in str(err.value)
    assert "differs from your own trace" not in str(err.value), str(err.value)
    with pytest.raises(LabCheckError) as err:
        lab09.check_async_worker(pulls_ahead, RIGHT_TRACE)
    msg = str(err.value)
    assert "your loop pulled 6 times, and no gradient was computed on the weights of pull 6 " \
           "(call 9): each gradient must be computed on the weights of its own pull" in msg, msg
    assert "differs from your own trace" not in msg, msg
    with pytest.raises(LabCheckError) as err:   # without the trace: no "batch 10's pull"
        lab09.check_async_worker(pulls_ahead)
    assert "pulled once more after the gradients of all 10 batches" in str(err.value)
    assert "batch 10" not in str(err.value), str(err.value)


def test_a_fresh_step_that_is_not_lr_is_named_by_the_tau_0_run():
    with pytest.raises(LabCheckError) as err:
        lab09.check_staleness_aware(_server(lambda lr, s: 2 * lr if s == 0 else lr / s), WHY)
    assert "at τ = 0 (every gradient fresh) your server must be plain SGD with step lr; yours " \
           "took a different step for a fresh gradient (2·lr)" in str(err.value), str(err.value)
    assert "does not recognise" not in str(err.value)


def test_check_prediction_wants_the_prediction_not_a_number():
    with pytest.raises(TypeError, match=r"the Prediction that predict\(\.\.\.\) returned .*not "
                                        r"int 12: pass guess"):
        lab09.check_prediction(12, {}, 2.3)   # before anything else: the losses are not read
