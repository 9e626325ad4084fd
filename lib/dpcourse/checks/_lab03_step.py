"""Lab 03 part 3: ``data_parallel_step``, a training step without DDP that must leave every rank
with the weights one process reaches on the global batch (with SGD and with Adam), and return
that batch's loss. Re-exported by :mod:`dpcourse.checks.lab03`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import check_timeout, fail, passed, recorded
from ._lab03_common import DEFAULT_TIMEOUT, WORLD_SIZES, _launch

_STEPS = 3


def _cfg():
    from ..ddp import StepConfig

    # 24 samples split evenly over both world sizes tried (2 and 3 ranks)
    return StepConfig(global_batch=24, steps=_STEPS, lr=0.1, width=4, n_train=96)


def _optimizer(name: str, params, cfg):
    if name == "adam":   # not linear in the gradient: averaging the weights differs from it
        return torch.optim.Adam(params, lr=ADAM_LR)
    return torch.optim.SGD(params, lr=cfg.lr)


ADAM_LR = 0.01


def _step_worker(rank: int, world_size: int, step_fn, opt_name: str = "sgd") -> dict:
    __tracebackhide__ = True
    from .. import ddp
    from ..collectives import record_collectives

    cfg = _cfg()
    dev = ddp.setup_rank()
    model = ddp.make_model(cfg).to(dev)
    opt = _optimizer(opt_name, model.parameters(), cfg)
    weights = {p.data_ptr() for p in model.parameters()}
    touched = []   # did a collective receive a parameter itself (not its gradient)?

    def spy(call):
        for v in (call.args or {}).values():
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor) and t.data_ptr() in weights:
                    touched.append(call.op)

    returned, expected = [], []
    for step in range(cfg.steps):
        X, y = ddp.shard_of(*ddp.global_batch_for_step(cfg, step), rank, world_size)
        X, y = X.to(dev), y.to(dev)
        with torch.no_grad():  # this rank's loss before the step
            expected.append(F.cross_entropy(model(X), y).item())
        with record_collectives(before=spy):
            out = step_fn(model, opt, X, y)
        if out is None or isinstance(out, float):
            returned.append(out)
        elif isinstance(out, torch.Tensor):
            returned.append(f"a torch.Tensor ({out.detach().cpu().float().reshape(-1)[0]:.4f})"
                            if out.numel() else "an empty torch.Tensor")
        else:
            returned.append(f"a {type(out).__name__}")
    return {"params": ddp.flat_params(model), "returned": returned, "expected": expected,
            "weights_reduced": bool(touched)}


def _simulate(world_size: int, rank: int | None, scale: float = 1.0,
              zero_grad: bool = True, opt_name: str = "sgd") -> torch.Tensor:
    """Final weights of a single process that trains on rank ``rank``'s shard only (None: the
    whole global batch), with gradients multiplied by ``scale``, with or without zero_grad.
    (Its ``world_size`` only picks the shard.)"""
    from .. import ddp

    cfg = _cfg()
    model = ddp.make_model(cfg)
    opt = _optimizer(opt_name, model.parameters(), cfg)
    for step in range(cfg.steps):
        X, y = ddp.global_batch_for_step(cfg, step)
        if rank is not None:
            X, y = ddp.shard_of(X, y, rank, world_size)
        if zero_grad:
            opt.zero_grad(set_to_none=True)
        (F.cross_entropy(model(X), y) * scale).backward()
        opt.step()
    return ddp.flat_params(model)


_WEIGHTS = ("the ranks all-reduced the weights themselves, after each rank stepped with its own "
            "gradients, instead of the gradients before the step: that matches one process on "
            "the global batch only while the update is linear in the gradient, as plain SGD's "
            "is — with Adam the mean of the ranks' updates is not the update of the mean "
            "gradient.")


_WEIGHTS_FIX = ("average the gradients between backward and the optimizer step; nobody sends "
                "weights after the start (lesson 03).")


@recorded
def check_data_parallel_step(data_parallel_step, world_sizes=WORLD_SIZES,
                             timeout: float | None = None) -> None:
    """Run ``data_parallel_step(model, optimizer, X, y)`` for 3 steps on 2 and on 3 ranks, each
    on its shard of the global batch; the final weights must be equal on every rank and equal
    to one process trained on the whole global batch."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    if not callable(data_parallel_step):
        fail(f"check_data_parallel_step needs your function, got "
             f"{type(data_parallel_step).__name__}.")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the simulations are tiny: extra threads only add contention
    try:
        # A step 1/world_size too small on 2 ranks is also 1/4, a fixed 4: only every world
        # size together shows a division by the world size done twice.
        doubled = []
        for world_size in world_sizes:
            results = _launch(_step_worker, world_size, timeout, data_parallel_step,
                              name="data_parallel_step")
            args = ([r["params"] for r in results], world_size, _returned_loss_problem(results),
                    any(r["weights_reduced"] for r in results))
            if world_size > 1 and all(
                    torch.allclose(p, _simulate(world_size, None, scale=1.0 / world_size),
                                   rtol=1e-4, atol=1e-6) for p in args[0]):
                doubled.append(args)
                continue
            _diagnose_step(*args)
        if doubled and len(doubled) == len(world_sizes):
            sizes = " and ".join(f"{a[1]} ({a[1]} x {a[1]} = {a[1] ** 2})" for a in doubled)
            fail(f"on {sizes} ranks the gradients were divided by the world size squared: the "
                 f"world size was divided out twice, e.g. the loss averaged over the ranks "
                 f"before backward (which divides this rank's gradients by the world size) AND "
                 f"the gradients averaged after it.",
                 fix="divide by the world size once: backward this rank's own mean loss, then "
                     "average the gradients; all-reduce a detached copy of the loss only to "
                     "report it.")
        for args in doubled:
            _diagnose_step(*args)
        # The same step with Adam, whose update is not linear in the gradient.
        world_size = min(world_sizes)
        results = _launch(_step_worker, world_size, timeout, data_parallel_step, "adam",
                          name="data_parallel_step")
        reference = _simulate(world_size, None, opt_name="adam")
        if not all(torch.allclose(r["params"], reference, rtol=1e-4, atol=1e-6)
                   for r in results):
            if any(r["weights_reduced"] for r in results):
                fail(_WEIGHTS, fix=_WEIGHTS_FIX)
            fail(f"with plain SGD the weights matched one process on the global batch, but with "
                 f"Adam (lr {ADAM_LR}) they do not: Adam's update is not linear in the "
                 f"gradient, so whatever the step averages after the optimizer does not average "
                 f"the gradients it was fed.",
                 fix="give every rank the averaged gradients before the optimizer step.")
    finally:
        torch.set_num_threads(threads)
    passed(f"data-parallel step on {' and '.join(map(str, world_sizes))} ranks == one process "
           f"on the global batch (with SGD, and with Adam on {min(world_sizes)} ranks), weights "
           f"equal on every rank, the global batch's loss returned")


_LOSS_FIX = ("return a Python float: the global batch's loss before the step, from a detached "
             "copy of this rank's loss summed over the ranks and divided by their number.")


def _returned_loss_problem(results: list) -> tuple[str, str] | None:
    """None if every call returned the global batch's loss as a float, else (the cause, the
    fix)."""
    world_size = len(results)
    for step in range(len(results[0]["expected"])):
        own = [r["expected"][step] for r in results]
        want = sum(own) / world_size          # equal shards: the mean of the shards' means
        for rank, r in enumerate(results):
            got = r["returned"][step]
            if got is None:
                return ("data_parallel_step returned nothing: the contract asks for the global "
                        "batch's loss as a Python float.", _LOSS_FIX)
            if isinstance(got, str):
                return (f"data_parallel_step returned {got}, not a Python float: the contract "
                        f"asks for a float, which a caller can log or compare without keeping "
                        f"a tensor (its autograd graph, its device) alive.",
                        "return the tensor's number: .item() (or float(...)) of the global "
                        "loss.")

            def near(a, b):
                return abs(a - b) <= 1e-4 * max(1.0, abs(b))

            if near(got, want):
                continue
            if near(got, own[rank]) and not near(own[rank], want):
                return (f"data_parallel_step returned {got:.4f} on rank {rank}, that rank's own "
                        f"shard's loss, where the global batch's loss was {want:.4f}: the "
                        f"contract asks for the loss of the whole global batch, the same number "
                        f"on every rank, and no rank's loss is that without the others'.",
                        _LOSS_FIX)
            if near(got, sum(own)):
                return (f"data_parallel_step returned {got:.4f}, the sum of the ranks' shard "
                        f"losses, {world_size} times the global batch's loss ({want:.4f}).",
                        "divide the sum of the ranks' losses by the number of ranks.")
            return (f"data_parallel_step returned {got:.4f} on rank {rank} where the global "
                    f"batch's loss before this step was {want:.4f}: neither this rank's shard "
                    f"loss nor the sum over the ranks, so a loss computed at another moment "
                    f"(after the optimizer step?) or over other samples.",
                    "return the loss computed before the step, over every rank's shard.")
    return None


def _diagnose_step(params: list, world_size: int, loss_problem: tuple | None = None,
                   weights_reduced: bool = False) -> None:
    __tracebackhide__ = True
    from .. import ddp

    reference = _simulate(world_size, None)
    start = ddp.flat_params(ddp.make_model(_cfg()))

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-4, atol=1e-6)

    if all(close(p, reference) for p in params):
        if loss_problem:
            fail(loss_problem[0], fix=loss_problem[1])
        return
    if all(torch.equal(p, start) for p in params):
        fail("the weights never changed in 3 steps: the averaged gradients never reached an "
             "optimizer step.", fix="call optimizer.step() after averaging the gradients.")
    own = [[_simulate(world_size, r, scale) for r in range(world_size)]
           for scale in (1.0, 1.0 / world_size)]
    for sims in own:
        if all(close(p, s) for p, s in zip(params, sims)):
            fail("each rank stepped with its own gradients and the ranks' weights drifted apart: "
                 "averaging the loss (or not averaging at all) does not average the gradients, "
                 "since each rank's backward still differentiates its own shard's loss.",
                 fix="call average_gradients(model) between loss.backward() and "
                     "optimizer.step().")
    if all(close(p, _simulate(world_size, None, zero_grad=False)) for p in params):
        fail("the gradients piled up from step to step: backward adds into p.grad, so each "
             "step also applied the previous steps' gradients.",
             fix="call optimizer.zero_grad() before each backward.")
    for k in sorted({2, 3, 4} - {world_size}):
        if all(close(p, _simulate(world_size, None, scale=world_size / k)) for p in params):
            fail(f"on {world_size} ranks the steps are {world_size}/{k} of the right size: the "
                 f"gradients were divided by {k}, not by the world size.",
                 fix="divide by dist.get_world_size(), not a fixed number.")
    if weights_reduced:
        fail(_WEIGHTS, fix=_WEIGHTS_FIX)
    if not all(close(p, params[0]) for p in params):
        fail("after 3 steps the ranks hold different weights: they did not all apply the same "
             "averaged gradients.", fix="average the gradients on every rank before its step.")
    fail("the weights are equal on every rank but differ from one process trained on the global "
         "batch.", fix="use the mean loss on the rank's shard, backward, average_gradients, "
                       "step.")
