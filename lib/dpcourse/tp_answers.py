"""Lab 11's answers, claimed on lesson 11's runs (the lesson calls them in folded cells after its
lab's pointer: open them once your lab passes).

A claim's sentence states what it checks, and here that is the lab's answer: which pass of the
tensor-parallel MLP communicates, which dimension torch cuts each weight along, what sequence
parallelism sends, what a Linear saves. In a lesson cell's source that sentence would be in plain
sight on GitHub, which ignores a cell's fold flag; here it is printed inside the lesson's
``viz.folded_output`` block, and this code is shown folded too.
"""

from __future__ import annotations

import torch

from dpcourse.checks import claim

__all__ = ["saved_by_linear", "linear_saves_weight", "whole_weights_referenced",
           "activation_all_reduce", "tp_passes",
           "tp_messages_weighed", "torch_sends_what_we_send", "torch_placements",
           "torch_tp_redistributions", "sp_collectives", "mesh_traffic", "planner_per_layer",
           "planner_tp_columns"]


def saved_by_linear(x) -> list:
    """The shapes a Linear(48, 48) saves for its backward, on input ``x``.

    Shown in lesson 11, §1."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t,
                                                  lambda t: t):
        torch.nn.Linear(48, 48)(x)
    return shapes


def linear_saves_weight(data) -> None:
    """Claims what a Linear(48, 48) saves for its backward, on ``data`` (8 × 48 numbers) and on a
    copy of it that requires a gradient.

    Shown in lesson 11, §1."""
    as_data, as_leaf = saved_by_linear(data), saved_by_linear(data.clone().requires_grad_())
    claim(f"a Linear saves its 48 × 48 weight only when its input requires a gradient: "
          f"{as_data} for data, {as_leaf} for an input that requires one",
          (48, 48) not in as_data and (48, 48) in as_leaf)


def whole_weights_referenced(held) -> None:
    """Prints the bytes autograd referenced besides the activations in
    ``tensor_parallel.activation_memory_worker``'s runs (``held``: per rank count, each rank's
    result) and claims they are three whole 48 × 48 fp32 weights of the four.

    Shown in lesson 11, §1."""
    print("saved besides the activations:", {n: rs[0]["other_saved"] for n, rs in held.items()},
          "bytes referenced")
    claim("the whole weights autograd references are three of the four 48 × 48 fp32 weights, "
          "at N = 2 and 4", all(r["other_saved"] == 3 * 48 * 48 * 4
                                for rs in held.values() for r in rs))


def activation_all_reduce(cfg) -> tuple:
    """One all-reduce of the MLP's float32 activations as our recorder writes it, (op, numbers,
    bytes): tokens × d numbers (``cfg``: the run's tokens and width d).

    Shown in lesson 11, §2."""
    return ("all_reduce", cfg.tokens * cfg.d, cfg.tokens * cfg.d * 4)


def tp_passes(tp_runs, cfg) -> None:
    """Claims which collective each pass of the tensor-parallel MLP made on every rank, and its
    size (``tp_runs``: the ranks' recorded calls; ``cfg``: the run's tokens and width d).

    Shown in lesson 11, §2."""
    one = activation_all_reduce(cfg)
    claim(f"the input requires a gradient here, as it would after another layer: one "
          f"all-reduce in the forward (g) and one in the backward (f), each of the activations' "
          f"size: tokens × d = {cfg.tokens} × {cfg.d} floats ({one[2]} bytes)",
          all(r["forward"] == [one] and r["backward"] == [one] for r in tp_runs))


def tp_messages_weighed(cfg, gpt3) -> None:
    """Weighs one tensor-parallel message against data parallelism's per-step bytes, on this
    run's MLP (``cfg``) and on GPT-3's MLP (``gpt3``: a planner model, one sequence).

    Shown in lesson 11, §2."""
    dp_bytes = cfg.num_params * 4
    tp_one = cfg.tokens * cfg.d * 4
    d_gpt, s_gpt = gpt3.hidden, gpt3.seq_len
    mlp_params = 8 * d_gpt * d_gpt
    tp_elems = s_gpt * d_gpt
    print(f"this MLP: DP all-reduces {dp_bytes} bytes per step; one TP message is over "
          f"{tp_one} ({tp_one / dp_bytes:.2f}×)")
    claim(f"GPT-3's MLP (d = {d_gpt}), one sequence of {s_gpt} tokens: one tensor-parallel "
          f"message is over s·d = {tp_elems / 1e6:.0f} M numbers, data parallelism the "
          f"{mlp_params / 1e9:.2f} B weights' gradients once per step — "
          f"{mlp_params / tp_elems:.0f}× one sequence's", mlp_params / tp_elems > 20)


def torch_sends_what_we_send(tp_runs, cfg) -> None:
    """Claims that torch's ColwiseParallel/RowwiseParallel MLP made the same collectives, pass by
    pass and of the same size, as section 2's (its ``CommDebugMode`` and our recorder agree).

    Shown in lesson 11, §2."""
    claim("torch sends what we send: one all-reduce of the activations in the forward, one in "
          "the backward (CommDebugMode and our recorder agree)",
          all(r["torch_forward_counts"] == {"all_reduce": 1}
              and r["torch_counts"] == {"all_reduce": 2}
              and [c[1:] for c in r["torch_recorded"]] == [activation_all_reduce(cfg)] * 2
              for r in tp_runs))


def torch_placements(r0) -> None:
    """Claims the placements torch's ColwiseParallel and RowwiseParallel gave rank 0's four
    parameters (``r0["torch_params"]``).

    Shown in lesson 11, §2."""
    claim("ColwiseParallel cuts the first weight and bias along dim 0 (Shard(0)); "
          "RowwiseParallel the second weight along dim 1 (Shard(1)) and replicates its bias (R)",
          [p[4] for p in r0["torch_params"]] == ["S(0)", "S(0)", "S(1)", "R"])


def sp_collectives(sp_runs, cfg, tp_ranks: int) -> None:
    """Claims what sequence parallelism computed, sent and saved on every rank (``sp_runs``),
    against the plain MLP and section 2's all-reduces.

    Shown in lesson 11, §2."""
    share = cfg.tokens // tp_ranks * cfg.d
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


def mesh_traffic(mesh_runs, cfg) -> None:
    """Prints and claims one training step's collectives on the 2 × 2 mesh, per mesh dimension,
    on every rank.

    Shown in lesson 11, §4."""
    local = cfg.num_params // 2 + cfg.d // 2          # what one tp rank of the library's MLP holds
    for dim, op, numel, nbytes, out_nbytes in mesh_runs[0]["traffic"][-1]:
        print(f"{dim}: {op:>14}, {numel:5d} elements in, {out_nbytes:5d} bytes out")
    claim(f"per step, along tp: one all-reduce of the activations ({cfg.tokens // 2} tokens × "
          f"{cfg.d}); along dp: one all-gather and one reduce-scatter of the row's {local} "
          "parameters",
          all(r["traffic"][-1] == [("dp", "all_gather", local // 2, local * 2, local * 4),
                                   ("tp", "all_reduce", cfg.tokens // 2 * cfg.d,
                                    cfg.tokens // 2 * cfg.d * 4, cfg.tokens // 2 * cfg.d * 4),
                                   ("dp", "reduce_scatter", local, local * 4, local * 2)]
              for r in mesh_runs))


def torch_tp_redistributions() -> None:
    """Reads, in the installed torch, where *f* and *g* of ColwiseParallel/RowwiseParallel
    redistribute and whether they ask for ``async_op=True``.

    Shown in lesson 11, §2."""
    import inspect

    from torch.distributed.tensor import Replicate, _api, _redistribute
    from torch.distributed.tensor.parallel import style

    col_in = inspect.getsource(style.ColwiseParallel._prepare_input_fn)
    row_out = inspect.getsource(style.RowwiseParallel._prepare_output_fn)
    f_back = inspect.getsource(_api._FromTorchTensor.backward)
    params = inspect.signature(_redistribute.redistribute_local_tensor).parameters
    guard = col_in.index("if input_layouts != desired_input_layouts:")
    plain = style.ColwiseParallel()
    claim("ColwiseParallel redistributes its input (async_op=True) only if input_layouts != "
          "desired_input_layouts, and both are Replicate() in the plain layout",
          col_in.find("async_op=True", guard) > guard and "async_op=True" not in col_in[:guard]
          and plain.input_layouts == plain.desired_input_layouts == (Replicate(),))
    claim("RowwiseParallel's output hook (g's forward) redistributes with async_op=True",
          "outputs.redistribute(placements=output_layouts, async_op=True)" in row_out)
    claim("f's backward, _FromTorchTensor.backward, calls redistribute_local_tensor without "
          "async_op, whose default is False: a synchronous all-reduce",
          "redistribute_local_tensor(" in f_back and "async_op" not in f_back
          and params["async_op"].default is False)


def planner_per_layer(r0) -> None:
    """Prints and claims ``planner.TP_MESSAGES_PER_LAYER``, the tensor-parallel collectives
    ``plan_row`` counts per layer and micro-batch, against section 2's MLP (``r0``: rank 0's
    recorded passes).

    Shown in lesson 11, §5."""
    from dpcourse import planner

    per_layer = planner.TP_MESSAGES_PER_LAYER
    print("tensor-parallel collectives per layer and micro-batch:", per_layer)
    claim(f"the planner's per-layer count, {per_layer} (the forward's once more when "
          f"recomputed), is twice what section 2's MLP made (forward {len(r0['forward'])}, "
          f"backward {len(r0['backward'])}); no attention is built here: that Megatron's "
          "attention has the same f/g pair is assumed, from Shoeybi et al. 2019, §3",
          per_layer == {"forward": 2 * len(r0["forward"]), "backward": 2 * len(r0["backward"])})


def planner_tp_columns(options, pub, model, gb: float) -> None:
    """Prints the planner ranking's TP msgs and TP GB columns (``options[:6]`` and the published
    row ``pub``, for ``model``; bytes shown in units of ``gb``) and claims what TP msgs counts.

    Shown in lesson 11, §5."""
    print("    t   p    M  TP msgs  TP GB   (the ranking's rows, per GPU per step)")
    for r in options[:6] + [pub]:
        print(f"{r['tp']:5d} {r['pp']:3d} {r['micro_batches']:4d}  {r['tp_messages']:7d}"
              f" {r['tp_bytes'] / gb:6.0f}")
    claim("TP msgs = (layers / p) × M × 6: with recomputation (every row here) a layer makes 6 "
          "tensor-parallel collectives per micro-batch (lab 11 counts them only for MLPs, in "
          "part 6 for two stacked ones; attention and recomputation are the planner's); the "
          "folded cell above shows the 6 (planner.TP_MESSAGES_PER_LAYER: twice section 2's "
          "measured MLP, assuming attention has the same f/g pair, Shoeybi et al. 2019, §3), "
          "with which collectives they are and their split by pass",
          all(r["tp_messages"] == model.layers // r["pp"] * r["micro_batches"] * 6
              for r in options if r["tp"] > 1) and any(r["tp"] > 1 for r in options))
