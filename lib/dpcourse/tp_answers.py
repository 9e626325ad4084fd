"""Lab 11's answers, claimed on lesson 11's runs (the lesson calls them in folded cells after its
lab's pointer: open them once your lab passes).

A claim's sentence states what it checks, and here that is the lab's answer: which pass of the
tensor-parallel MLP communicates, which dimension torch cuts each weight along, what sequence
parallelism sends, what a Linear saves. In a lesson cell's source that sentence would be in plain
sight on GitHub, which ignores a cell's fold flag; here it is printed inside the lesson's
``viz.folded_output`` block, and this code is shown folded too.
"""

from __future__ import annotations

from dpcourse.checks import claim

__all__ = ["linear_saves_weight", "tp_passes", "torch_sends_what_we_send", "torch_placements",
           "sp_collectives", "mesh_traffic"]


def linear_saves_weight(as_data, as_leaf) -> None:
    """Claims what a Linear(48, 48) saves for its backward (the shapes ``as_data`` on data,
    ``as_leaf`` on an input that requires a gradient).

    Shown in lesson 11, §1."""
    claim(f"a Linear saves its 48 × 48 weight only when its input requires a gradient: "
          f"{as_data} for data, {as_leaf} for an input that requires one",
          (48, 48) not in as_data and (48, 48) in as_leaf)


def tp_passes(tp_runs, cfg) -> None:
    """Claims which collective each pass of the tensor-parallel MLP made on every rank, and its
    size (``tp_runs``: the ranks' recorded calls; ``cfg``: the run's tokens and width d).

    Shown in lesson 11, §2."""
    act_bytes = cfg.tokens * cfg.d * 4
    claim(f"the input requires a gradient here, as it would after another layer: one "
          f"all-reduce in the forward (g) and one in the backward (f), each of the activations' "
          f"size: tokens × d = {cfg.tokens} × {cfg.d} floats ({act_bytes} bytes)",
          all(r["forward"] == [("all_reduce", cfg.tokens * cfg.d, act_bytes)]
              and r["backward"] == [("all_reduce", cfg.tokens * cfg.d, act_bytes)]
              for r in tp_runs))


def torch_sends_what_we_send(tp_runs, cfg) -> None:
    """Claims that torch's ColwiseParallel/RowwiseParallel MLP made the same collectives, pass by
    pass and of the same size, as section 2's (its ``CommDebugMode`` and our recorder agree).

    Shown in lesson 11, §2."""
    act_bytes = cfg.tokens * cfg.d * 4
    claim("torch sends what we send: one all-reduce of the activations in the forward, one in "
          "the backward (CommDebugMode and our recorder agree)",
          all(r["torch_forward_counts"] == {"all_reduce": 1}
              and r["torch_counts"] == {"all_reduce": 2}
              and [c[1:] for c in r["torch_recorded"]] == [("all_reduce", cfg.tokens * cfg.d,
                                                             act_bytes)] * 2 for r in tp_runs))


def torch_placements(r0) -> None:
    """Claims the placements torch's ColwiseParallel and RowwiseParallel gave rank 0's four
    parameters (``r0["torch_params"]``).

    Shown in lesson 11, §2."""
    claim("ColwiseParallel cuts the first weight and bias along dim 0 (Shard(0)); "
          "RowwiseParallel the second weight along dim 1 (Shard(1)) and replicates its bias (R)",
          [p[4] for p in r0["torch_params"]] == ["S(0)", "S(0)", "S(1)", "R"])


def sp_collectives(sp_runs, cfg, share: int, tp_ranks: int) -> None:
    """Claims what sequence parallelism computed, sent and saved on every rank (``sp_runs``),
    against the plain MLP and section 2's all-reduces.

    Shown in lesson 11, §2."""
    claim(f"sequence parallelism on {tp_ranks} ranks == the plain MLP on each rank's tokens: "
          "output, dL/dx and every gradient (to 1e-6)",
          max(max(r["out_diff"], r["input_grad_diff"], r["grad_diff"]) for r in sp_runs) < 1e-6)
    claim(f"each pass makes an all-gather of the token shares ({share} elements in) and a "
          f"reduce-scatter of tokens × d = {cfg.tokens * cfg.d} elements where section 2 made "
          "one all-reduce: the two halves of a ring all-reduce (lesson 06), so the same bytes "
          "sent, and the two patterns async tensor parallelism fuses with their matmuls",
          all(r["forward"] == r["backward"] == [("all_gather", share, share * 4),
                                                ("reduce_scatter", cfg.tokens * cfg.d,
                                                 cfg.tokens * cfg.d * 4)] for r in sp_runs))
    print("saved for the backward, local shapes:", sp_runs[0]["saved_shapes"])
    claim(f"memory: each rank holds {cfg.tokens // tp_ranks} of the {cfg.tokens} tokens, yet "
          f"autograd saves the column layer's input all-gathered, {cfg.tokens} × {cfg.d} — "
          "torch's layout does not divide that input by t",
          all((cfg.tokens, cfg.d) in r["saved_shapes"]
              and (cfg.tokens // tp_ranks, cfg.d) not in r["saved_shapes"] for r in sp_runs))


def mesh_traffic(mesh_runs, cfg, local: int) -> None:
    """Claims one training step's collectives on the 2 × 2 mesh, per mesh dimension, on every
    rank (``local``: the parameters one tensor-parallel rank holds).

    Shown in lesson 11, §4."""
    claim(f"per step, along tp: one all-reduce of the activations ({cfg.tokens // 2} tokens × "
          f"{cfg.d}); along dp: one all-gather and one reduce-scatter of the row's {local} "
          "parameters",
          all(r["traffic"][-1] == [("dp", "all_gather", local // 2, local * 2, local * 4),
                                   ("tp", "all_reduce", cfg.tokens // 2 * cfg.d,
                                    cfg.tokens // 2 * cfg.d * 4, cfg.tokens // 2 * cfg.d * 4),
                                   ("dp", "reduce_scatter", local, local * 4, local * 2)]
              for r in mesh_runs))
