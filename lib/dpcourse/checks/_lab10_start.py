"""Lab 10, bug 4 (solutions/lab10_bug_hunt.py, "Bug 4"): where the replicas' first weights come
from, read off a fix's text before any launch.

Script 4 seeds each rank with args.seed + rank on purpose (its comment: a random stream per
rank, for dropout or augmentation), and the broadcast is what makes the replicas start from
one rank's weights. A fix that deletes the broadcast, sends after the first forward, or names
a sender the group does not have is refused by its text, before any launch, with the numbers
the ranks would hold (drawn here exactly as the script draws them: same seeds, same model).

A run that hangs or fails while src still differs from rank to rank is named by
:func:`_name_hang`. Called from :mod:`dpcourse.checks.lab10` (``_read_fix``, ``check_fix``,
``check_fixes``).
"""

from __future__ import annotations

from dpcourse.checks import fail
from dpcourse.checks._lab10_scripts import SEED, WORLD_SIZES
from dpcourse.checks._lab10_simulate import _distance, _simulate

_SYNC_CALLS = {"broadcast", "broadcast_object_list", "all_gather", "all_gather_into_tensor",
               "all_gather_object", "scatter", "recv", "irecv", "load_state_dict",
               "all_reduce", "gather", "reduce_scatter"}


def _lab_weights(seed: int, draws_before: int = 0) -> dict:
    """The weights script 4's model starts from after torch.manual_seed(seed), with
    ``draws_before`` random numbers drawn first."""
    import torch

    torch.manual_seed(seed)
    torch.rand(draws_before)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _start_gap(draws_before: int = 0) -> float:
    """How far apart (the largest difference of one weight) rank 0's and rank 1's first
    weights are: seeded args.seed + rank as script 4 does, or (``draws_before``) both seeded
    alike with rank 0 alone drawing that many numbers first."""
    if draws_before:
        return _distance(_lab_weights(SEED, draws_before), _lab_weights(SEED))
    return _distance(_lab_weights(SEED), _lab_weights(SEED + 1))


def _end_gap() -> float:
    """How far apart rank 0's and rank 1's weights are after the 3 epochs of script 4 run with
    no broadcast: every step applies the same averaged update to both."""
    return _distance(_simulate(2, SEED, "no_broadcast", None, 0, 0),
                     _simulate(2, SEED, "no_broadcast", None, 0, 1))


def _data_loss(state: dict) -> float:
    """The mean squared error of script 4's model with weights ``state`` on the 48 examples."""
    import torch
    import torch.nn.functional as F

    from dpcourse.checks._lab10_simulate import _data

    X, y = _data()
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model.load_state_dict(state)
    with torch.no_grad():
        return float(F.mse_loss(model(X), y))


def _losses_without_broadcast() -> list[tuple[float, float]]:
    """(loss before, loss after the 3 epochs) of rank 0's and rank 1's replicas when script 4
    runs with no broadcast, and the loss a correct run ends with: what the run shows."""
    return [(_data_loss(_lab_weights(SEED + r)),
             _data_loss(_simulate(2, SEED, "no_broadcast", None, 0, r))) for r in (0, 1)]


def _mask_agreement(seeds) -> int:
    """In how many of 32 places a p = 0.5 dropout mask over a batch of 4 × 8 hidden units,
    drawn right after the model is built, agrees on two ranks seeded ``seeds``."""
    import torch

    masks = []
    for seed in seeds:
        _lab_weights(seed)
        masks.append(torch.rand(4, 8) < 0.5)
    return int((masks[0] == masks[1]).sum())


def _calls(tree, names) -> list:
    import ast

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in names:
                out.append(node)
    return sorted(out, key=lambda c: c.lineno)


def _mentions_rank(node) -> bool:
    import ast

    return any((isinstance(x, ast.Name) and x.id == "rank") or
               (isinstance(x, ast.Attribute) and x.attr == "get_rank") for x in ast.walk(node))


def _src_per_rank(text: str, call) -> tuple[str, list] | None:
    """The src expression of a broadcast call and what it is on each of script 4's 2 ranks
    (with the check's --seed), or None where it cannot be worked out here."""
    import ast
    import types

    node = next((k.value for k in call.keywords if k.arg == "src"),
                call.args[1] if len(call.args) > 1 else None)
    if node is None:
        return None
    expr = ast.get_source_segment(text, node) or ast.unparse(node)
    ws = WORLD_SIZES[4]
    values = []
    for r in range(ws):
        space = {"rank": r, "world_size": ws, "args": types.SimpleNamespace(seed=SEED,
                                                                            out="final.pt"),
                 "dist": types.SimpleNamespace(get_rank=lambda r=r: r,
                                               get_world_size=lambda: ws)}
        try:
            # compiled from its text, not from the node: turning Python AST objects back into
            # C ones uses CPython 3.11's per-process recursion counter, which the checks run
            # in threads by test_lab10 would share ("AST ... recursion depth mismatch")
            value = eval(compile(expr, "<src>", "eval"), {"__builtins__": {}}, space)
        except Exception:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        values.append(value)
    return expr, values


def _read_fix_4(text: str) -> None:
    """Refuse, by its text, a fix 4 that deletes the broadcast, sends after the first forward,
    or names a sender the group does not have (each with its own cause)."""
    __tracebackhide__ = True
    import ast

    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    ws = WORLD_SIZES[4]
    broadcasts = _calls(tree, {"broadcast"})
    for call in broadcasts:
        src = _src_per_rank(text, call)
        if src and any(not 0 <= v < ws for v in src[1]):
            expr, values = src
            said = (f"{values[0]} on every rank" if len(set(values)) == 1 else
                    ", ".join(f"{v} on rank {r}" for r, v in enumerate(values)))
            ranks = f"{', '.join(map(str, range(ws - 1)))} and {ws - 1}"
            fail(f"Fix 4: the broadcast's src = `{expr}` is {said}, and a group of {ws} ranks "
                 f"has ranks {ranks} only: it names a sender the group does not have"
                 + (", and it changes with --seed (the check runs --seed 3)"
                    if "seed" in expr else "") + ".",
                 fix=f"src is a rank of the group (0 to world_size − 1), the same on every "
                     f"rank.")
    forwards = [c.lineno for c in _calls(tree, {"model"})]
    forward = min(forwards, default=None)
    syncs = [c for c in _calls(tree, _SYNC_CALLS)
             if forward is None or c.lineno < forward]
    # torch's own seed, not a torch.Generator's (the data's generator is seeded 1234 everywhere)
    seeds = [c for c in _calls(tree, {"manual_seed"}) if ast.unparse(c.func) in
             ("torch.manual_seed", "torch.random.manual_seed", "manual_seed")]
    build = min((c.lineno for c in _calls(tree, {"Sequential"})), default=None)
    at_build = [c for c in seeds if build is None or c.lineno < build]
    per_rank_at_build = bool(at_build) and _mentions_rank(at_build[-1])
    per_rank_stream = any(_mentions_rank(c) for c in seeds)
    lost = ("the random stream the script keeps per rank (its comment: dropout, augmentation) "
            "is now one stream on every rank: drawn right after the model is built, a p = 0.5 "
            "dropout mask over a batch of 4 × 8 hidden units is the same on rank 0 and rank 1 "
            f"in {_mask_agreement((SEED, SEED))} of 32 places (with args.seed + rank, in "
            f"{_mask_agreement((SEED, SEED + 1))}). This model has no dropout, so its weights "
            f"cannot show it; a model with dropout would drop the same units on every rank")
    if not syncs and broadcasts and forward is not None:
        line = broadcasts[0].lineno
        loop_end = max((node.end_lineno for node in tree.body if isinstance(node, ast.For)
                        and node.lineno <= forward <= node.end_lineno), default=None)
        after = loop_end is not None and line > loop_end
        fail(f"Fix 4: the broadcast now runs after the first forward (line {line} of your "
             f"script comes after line {forward}, `model(xb)`): the first gradients were taken "
             f"on the weights each rank's own seed drew, up to {_start_gap():.2f} apart with "
             f"--seed 3, so the first averaged gradient mixes the gradients of two different "
             f"models" + ("; and after the training loop it only copies rank 0's weights over "
                          "replicas that trained apart" if after else "") + ".",
             fix="Every replica must hold the same weights before its first forward: send "
                 "them before the training loop.")
    if not syncs and per_rank_at_build:
        losses = ", ".join(f"rank {r}: {a:.2f} → {b:.2f}"
                           for r, (a, b) in enumerate(_losses_without_broadcast()))
        fail(f"Fix 4: the broadcast is gone, and the replicas no longer start from the same "
             f"weights: each rank builds its model after torch.manual_seed(args.seed + rank), "
             f"so with --seed 3 rank 0's and rank 1's first weights differ by up to "
             f"{_start_gap():.2f}. Every step then applies the same averaged update to both, "
             f"which moves them together and never closer: after the 3 epochs they still "
             f"differ by up to {_end_gap():.2f}, while the loss on the 48 examples falls on "
             f"both ({losses}) — the run looks healthy, and rank 0 saves one of two models "
             f"that were never the same.",
             fix="Every replica must start from one rank's weights, sent to the others before "
                 "the first forward (the same sender named on every rank).")
    if not syncs and per_rank_stream:
        fail(f"Fix 4: the broadcast is gone: the replicas start equal only because every rank "
             f"seeds torch alike and draws nothing else before building the model — an "
             f"accident of the code's order that nothing in the run checks. One random number "
             f"more drawn on rank 0 alone before the model (a look at a random sample, say) "
             f"would start the replicas up to {_start_gap(draws_before=1):.2f} apart, and the "
             f"run would end, its loss falling, without a word. DDP, however the ranks were "
             f"seeded, sends rank 0's weights to every rank when it is built.",
             fix="Make the replicas equal by sending one rank's weights to the others, not by "
                 "seeding them alike.")
    if not syncs and not seeds:
        fail("Fix 4: the broadcast is gone, and nothing seeds torch any more: torch seeds its "
             "default generator at random in each process, so every rank draws its first "
             "weights from a seed of its own, and the replicas start apart — by a different "
             "amount in every run.",
             fix="Every replica must start from one rank's weights, sent to the others before "
                 "the first forward (the same sender named on every rank).")
    if not syncs:
        fail(f"Fix 4: the broadcast is gone and every rank now seeds torch with args.seed "
             f"alone: the replicas start equal, but {lost}.",
             fix="Keep args.seed + rank for each rank's own stream, and make the replicas "
                 "equal by sending one rank's weights to the others.")
    if seeds and not per_rank_stream:
        fail(f"Fix 4: every rank now seeds torch with args.seed alone: {lost}.",
             fix="Keep args.seed + rank: the bug is not the seeding.")


def _name_hang(n: int, text, result):
    """A fix 4 that hung or failed while its src still differs from rank to rank: the run's
    sentence, and what src is on each rank."""
    import ast

    if n != 4 or not isinstance(result, str):
        return result
    try:
        calls = _calls(ast.parse(text), {"broadcast"})
    except SyntaxError:
        return result
    for call in calls:
        src = _src_per_rank(text, call)
        if src and len(set(src[1])) > 1:
            expr, values = src
            said = " and ".join(f"{v} on rank {r}" for r, v in enumerate(values))
            return (f"{result.rstrip('.')}. Here src = `{expr}` is {said}: the ranks still "
                    f"disagree about which one sends.")
    return result
