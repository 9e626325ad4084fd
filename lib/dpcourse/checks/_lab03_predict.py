"""Lab 03's predict-then-measure parts: how many collective calls one ``average_gradients``
makes on part 1's model and what each carried, and the bytes a flat buffer sends beside one call
per parameter. Re-exported by :mod:`dpcourse.checks.lab03`."""

from __future__ import annotations

import torch

from . import check_timeout, fail, reveal
from ._lab03_common import DEFAULT_TIMEOUT, ROUTED_HEADS, _launch, _part1_model_after_backward
from ._lab03_placement import _DeviceWatch

def _count_worker(rank: int, world_size: int, fn) -> dict:
    __tracebackhide__ = True
    from .. import ddp

    model = _part1_model_after_backward(rank, ddp.setup_rank())
    named = list(model.named_parameters())
    had = [n for n, p in named if p.grad is not None]
    handed = []   # (op, the first tensor handed over): kept alive until matched below

    def spy(call):
        tensors = [t for v in (call.args or {}).values()
                   for t in (v if isinstance(v, (list, tuple)) else [v])
                   if isinstance(t, torch.Tensor)]
        owner = next((n for n, p in named for t in tensors[:1]
                      if p.grad is not None and t.data_ptr() == p.grad.data_ptr()
                      and t.numel() == p.numel()), None)
        handed.append((call.op, tensors[0] if tensors else None, owner))

    watch = _DeviceWatch(None)
    calls = watch.run(fn, model, before=spy)
    carried = []  # what each call carried: a parameter's gradient (by name) or another tensor
    for op, t, owner in handed:
        if owner is None and t is not None:   # a tensor that became p.grad afterwards
            owner = next((n for n, p in named if p.grad is not None and t.numel() == p.numel()
                          and t.data_ptr() == p.grad.data_ptr()), None)
        carried.append({"op": op, "grad_of": owner,
                        "numel": 0 if t is None else t.numel(),
                        "dtype": None if t is None else str(t.dtype).replace("torch.", "")})
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"calls": len(calls), "bytes": sum(c.nbytes for c in calls),
            "tensors": len(named), "trainable": len(trainable),
            "parameters": sum(p.numel() for p in trainable), "carried": carried,
            "had": had, "nbytes": {n: p.numel() * p.element_size() for n, p in named}}


def count_all_reduces(average_gradients, world_size: int = 2,
                      timeout: float | None = None) -> dict:
    """Run ``average_gradients(model)`` once on ``world_size`` ranks, on part 1's model
    (:func:`part1_model`) after each rank's backward, and return what rank 0 handed to the
    collectives (``dist.all_reduce`` or any other): ``{"calls", "bytes", "tensors", "trainable",
    "parameters", "carried", "used", "used_bytes"}`` (``tensors``: the model's parameter
    tensors, ``trainable``: those that require a gradient, ``parameters``: their elements,
    ``carried``: per call, its op, the parameter whose gradient it carried (None: another
    tensor), its size and dtype; ``used``: the parameters some rank's backward gave a gradient,
    ``used_bytes``: their gradients' bytes)."""
    __tracebackhide__ = True
    if not callable(average_gradients):
        fail(f"count_all_reduces needs your function, got {type(average_gradients).__name__}.")
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    results = _launch(_count_worker, world_size, timeout, average_gradients,
                      name=getattr(average_gradients, "__name__", "your function"))
    out = dict(results[0])
    used = [n for n in out.pop("nbytes") if any(n in r["had"] for r in results)]
    sizes = results[0]["nbytes"]
    out.pop("had")
    return dict(out, used=used, used_bytes=sum(sizes[n] for n in used))


def _describe_calls(measured: dict) -> str:
    """What rank 0's calls carried, grouped: SmallCNN's gradients, each extra parameter's by
    name (with why it matters), and the tensors that were no parameter's gradient."""
    carried = measured.get("carried", [])
    grads = [c["grad_of"] for c in carried if c["grad_of"]]
    cnn = [n for n in grads if n not in ROUTED_HEADS + ("never", "frozen")]
    parts = []
    if cnn:
        parts.append(f"{len(cnn)} on SmallCNN's gradients (a weight and a bias in each of its "
                     f"5 layers)" if len(cnn) == 10 else f"{len(cnn)} on SmallCNN's gradients")
    why = {"head_a": "the head rank 0's batch went through",
           "head_b": "the head only rank 1's batch went through — rank 0's call pairs with "
                     "rank 1's",
           "never": "which no rank used",
           "frozen": "which requires no gradient"}
    for n in ROUTED_HEADS + ("never", "frozen"):
        k = grads.count(n)
        if k:
            parts.append(f"{k} on {n}'s ({why[n]})")
    others = [c for c in carried if not c["grad_of"]]
    if others:
        shown = ", ".join(f"{c['op']} of {c['numel']:,} {c['dtype']} value(s)"
                          for c in others[:4]) + (", ..." if len(others) > 4 else "")
        parts.append(f"{len(others)} on tensors that are no parameter's gradient ({shown})")
    return "; ".join(parts) if parts else "none"


def check_prediction(guess, measured: dict) -> None:
    """Compare the learner's prediction of the number of collective calls one
    ``average_gradients`` makes on rank 0 with :func:`count_all_reduces`'s measurement, and say
    what each call carried and what the calls cost. Never raises for a wrong prediction."""
    __tracebackhide__ = True
    if not isinstance(measured, dict) or "calls" not in measured:
        fail("check_prediction needs what count_all_reduces(...) returned (a dict), got "
             f"{type(measured).__name__}.")
    calls = measured["calls"]
    used = measured.get("used")
    n_used = len(used) if used is not None else measured.get("trainable", measured["tensors"])
    why = (f"On rank 0 your function made {calls} collective call(s): "
           f"{_describe_calls(measured)}. Each call pays the collective's fixed start-up cost "
           f"(lesson 06's α) whatever it carries — one flag or 4,000 gradients — so this "
           f"average pays {calls} times α in every step, on top of what the calls carry. Part 1's "
           f"contract needs a gradient call for each of the {n_used} parameters some rank "
           f"used (a rank without that gradient still makes the call, or the calls pair the "
           f"wrong tensors), none for frozen or for never, and the ranks must first learn "
           f"together which parameters those are: one more call if all the flags travel in "
           f"one tensor, {n_used + 1} in all.")
    reveal(guess, calls, close=bool(guess.value == calls) if hasattr(guess, "value") else False,
           explanation=why)


BYTES_CHOICES = ("fewer", "the same", "more")


def check_bytes_prediction(guess, flat: dict, per_parameter: dict) -> None:
    """Stretch: compare the learner's prediction ("fewer", "the same" or "more" bytes handed to
    the collective by ``average_gradients_flat`` than the gradients of the parameters some rank
    used weigh) with :func:`count_all_reduces`'s measurements, and say why; part 1's
    ``average_gradients`` (``per_parameter``) is shown beside it. Never raises for a wrong
    prediction."""
    __tracebackhide__ = True
    for what, m in (("flat", flat), ("per_parameter", per_parameter)):
        if not isinstance(m, dict) or "bytes" not in m or "used_bytes" not in m:
            fail(f"check_bytes_prediction needs what count_all_reduces(...) returned for "
                 f"{what} (a dict), got {type(m).__name__}.")
    a, used, b = flat["bytes"], flat["used_bytes"], per_parameter["bytes"]
    measured = "fewer" if a < used else "more" if a > used else "the same"
    n_used = len(flat.get("used", ()))
    versus = (f"Part 1's average_gradients handed over {b:,} bytes in {per_parameter['calls']} "
              f"call(s): α paid {per_parameter['calls']} times against once.")
    if measured == "more":
        why = (f"Your one call carried {a:,} bytes; the gradients of the {n_used} parameters "
               f"some rank used weigh {used:,}. The {a - used:,} bytes more are the price of "
               f"one call: it is made before any rank has heard from the others, so every "
               f"rank's buffer needs a slot for every parameter that might have a gradient "
               f"somewhere — never's zeros included, though no rank used it — and room for "
               f"what tells the ranks who used what. A per-parameter loop can learn that first "
               f"and skip never. {versus}")
    elif measured == "the same":
        why = (f"Your one call carried exactly the {used:,} bytes of the gradients of the "
               f"{n_used} parameters some rank used — nothing for never and nothing to tell "
               f"the ranks who used what. {versus}")
    else:
        why = (f"Your one call carried {a:,} bytes, fewer than the {used:,} bytes the "
               f"gradients of the parameters some rank used weigh in their own dtype: it sent "
               f"them in a smaller type (lesson 07's fp16 hook does that on purpose). {versus}")
    reveal(guess, measured, close=getattr(guess, "value", None) == measured, explanation=why)
