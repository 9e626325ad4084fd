"""dpcourse.planner: the formulas by hand, the refusals, and the checks lesson 11 makes against
Megatron-LM's published runs (Narayanan et al. 2021: Table 1's 145.6-B row, t = 8, p = 8 on 1536
GPUs; Table 2's GPT-3 175B, PTD parallelism against ZeRO-3 alone)."""

import math

import pytest

from dpcourse import planner, zero

GPT3, A100 = planner.GPT3_175B, planner.MEGATRON_A100_CLUSTER
PUB = planner.MEGATRON_TABLE1_145B
T2 = planner.MEGATRON_TABLE2_175B


def test_gpt3_has_175_billion_parameters():
    assert 174e9 < GPT3.num_params < 176e9
    l, h = GPT3.layers, GPT3.hidden
    assert math.isclose(GPT3.num_params, 12 * l * h * h + 13 * l * h + (51200 + 2048) * h)


def test_activation_bytes_by_hand():
    s, h, a = 2048, 12288, 96
    f = planner.activation_bytes_per_layer
    assert f(GPT3, 1) == s * h * (34 + 5 * a * s / h)          # 2.87 GB
    assert f(GPT3, 2) == 2 * f(GPT3, 1)
    assert f(GPT3, 1, tp=8) == s * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert f(GPT3, 1, tp=8, sequence_parallel=True) == f(GPT3, 1) / 8
    assert f(GPT3, 1, recompute=True) == 2 * s * h
    assert f(GPT3, 1, tp=8, sequence_parallel=True, recompute=True) == 2 * s * h / 8
    assert 275e9 < GPT3.layers * f(GPT3, 1) < 276e9


def test_flash_attention_drops_the_attention_matrix_term():
    s, h, a = 2048, 12288, 96
    f = planner.activation_bytes_per_layer
    assert f(GPT3, 1, flash_attention=True) == s * h * 34 + 4 * a * s      # logsumexp, fp32
    assert f(GPT3, 1) - f(GPT3, 1, flash_attention=True) == 5 * a * s * s - 4 * a * s
    assert f(GPT3, 1, tp=8, flash_attention=True) == s * h * (10 + 24 / 8) + 4 * a * s / 8
    assert f(GPT3, 1, recompute=True, flash_attention=True) == 2 * s * h
    assert 82e9 < GPT3.layers * f(GPT3, 1, flash_attention=True) < 83e9   # still > 80 GB


def test_activation_bytes_refuses_nonsense():
    with pytest.raises(ValueError, match="micro_batch and tp must be >= 1"):
        planner.activation_bytes_per_layer(GPT3, 0)


def test_a_row_by_hand():
    row = planner.plan_row(GPT3, A100, 8, 16, 1536)
    assert (row["dp"], row["micro_batches"]) == (12, 128)
    assert row["state_bytes"] == GPT3.num_params / 128 * 16
    assert row["idle_over_work"] == 15 / 128
    assert row["tp_messages"] == 6 * 128 * 6             # 6 layers, 128 micro-batches, 6 each
    assert row["pp_messages"] == 2 * 128
    assert row["dp_messages"] == math.ceil(GPT3.num_params / 128 * 2 / (25 * 2**20))   # buckets
    assert math.isclose(row["dp_bytes"], 2 * GPT3.num_params / 128 * 2 * 11 / 12)
    assert row["fits"]


def test_plan_row_refusals():
    with pytest.raises(ValueError, match="must divide the 1536 GPUs"):
        planner.plan_row(GPT3, A100, 7, 1, 1536)
    with pytest.raises(ValueError, match="must divide the 96 layers"):
        planner.plan_row(GPT3, A100, 8, 64, 1536)
    with pytest.raises(ValueError, match="does not split into"):
        planner.plan_row(GPT3, A100, 8, 16, 1000)


def test_zero3_row_uses_lesson_08s_bytes_and_adds_its_working_set():
    row = planner.plan_row(GPT3, A100, 1, 1, 1536, stage="zero3")
    assert row["state_bytes"] == GPT3.num_params * zero.bytes_per_param("zero3", 1536)
    assert row["working_bytes"] == 3 * 12 * GPT3.hidden ** 2 * 2
    assert row["dp_messages"] == 3 * GPT3.layers


def test_plan_is_sorted_and_every_row_fits():
    rows = planner.plan(GPT3, A100, 1536)
    assert rows and all(r["fits"] for r in rows)
    assert [r["time_s"] for r in rows] == sorted(r["time_s"] for r in rows)
    assert all(r["tp"] <= A100.gpus_per_node for r in rows)


def test_equation_2_gives_table_1s_145_6_billion():
    assert round(planner.GPT_145B.num_params / 1e9, 1) == 145.6


def test_planner_is_consistent_with_megatrons_table_1_row():
    model = planner.GPT_145B
    rows = planner.plan(model, A100, PUB["global_batch"])
    best = rows[0]
    pub = planner.plan_row(model, A100, PUB["tp"], PUB["pp"], PUB["global_batch"])
    assert pub["dp"] == PUB["dp"] and pub["fits"]
    assert best["tp"] == PUB["tp"] == A100.gpus_per_node
    assert pub["time_s"] < 1.01 * best["time_s"]
    per_t = {}
    for r in rows:
        per_t.setdefault(r["tp"], r["time_s"])           # rows are sorted: first is the best
    assert [per_t[t] for t in sorted(per_t)] == sorted(per_t.values(), reverse=True)


def test_zero3_alone_against_table_2s_model_parallel_96():
    zero3 = planner.plan_row(GPT3, A100, 1, 1, T2["global_batch"], stage="zero3")
    ptd = min((r for r in planner.plan(GPT3, A100, T2["global_batch"])
               if r["tp"] * r["pp"] == T2["model_parallel"]), key=lambda r: r["time_s"])
    assert (ptd["tp"], ptd["pp"]) == (8, 12)
    assert 2 < zero3["time_s"] / ptd["time_s"] < T2["ptd_tflops"] / T2["zero3_tflops"] + 1


def test_data_parallelism_alone_fits_only_as_zero3_and_is_far_slower():
    rows = {s: planner.plan_row(GPT3, A100, 1, 1, 1536, stage=s) for s in zero.STAGES}
    assert [s for s, r in rows.items() if r["fits"]] == ["zero3"]
    best = planner.plan(GPT3, A100, 1536)[0]
    assert rows["zero3"]["time_s"] > 2 * best["time_s"]
    assert rows["zero3"]["dp_bytes"] / A100.inter_bw > rows["zero3"]["compute_s"]


def test_without_recomputation_no_data_parallel_stage_fits_at_batch_1():
    for n in (8, 64, 512, 4096):
        act = GPT3.layers * planner.activation_bytes_per_layer(GPT3, 1)
        assert not any(r["fits"] for r in zero.fits(GPT3.num_params, 80e9, n,
                                                     activation_bytes=act))


def test_within_nodes_needs_a_divisor_of_the_node():
    assert [t for t in range(1, 17) if planner.within_nodes(t, 8)] == [1, 2, 4, 8]


def test_tensor_parallelism_across_a_node_boundary_is_priced_at_the_network():
    model = planner.GPT_145B            # 96 heads: t = 3, 4, 6, 8 all divide them
    inside = planner.plan_row(model, A100, 4, 8, PUB["global_batch"])
    across = planner.plan_row(model, A100, 6, 8, PUB["global_batch"])
    assert inside["tp_link"] == A100.intra_bw
    assert across["tp_link"] == A100.inter_bw          # ranks 6, 7 | 8, 9, 10, 11 of a group
    assert planner.plan_row(model, A100, 3, 8, PUB["global_batch"])["tp_link"] == A100.inter_bw
    assert across["time_s"] > inside["time_s"] + across["tp_bytes"] / A100.inter_bw / 2


def test_plan_keeps_tensor_groups_inside_a_node():
    rows = planner.plan(planner.GPT_145B, A100, PUB["global_batch"])
    assert {r["tp"] for r in rows} == {1, 2, 4, 8}


def test_the_idle_over_work_column_is_p_minus_1_over_m_and_its_idle_share_is_lesson_3s():
    row = planner.plan_row(planner.GPT_145B, A100, 8, 8, PUB["global_batch"])
    m, p = row["micro_batches"], 8
    assert m == 96 and row["idle_over_work"] == (p - 1) / m
    assert math.isclose(row["idle_share"], (p - 1) / (m + p - 1))
    assert math.isclose(row["idle_over_work"] / (1 + row["idle_over_work"]), row["idle_share"])


def test_table_1s_measured_rate_is_below_the_planners_upper_bound():
    model = planner.GPT_145B
    measured_s = (planner.megatron_flops_per_step(model, PUB["global_batch"])
                  / (A100.gpus * PUB["tflops"] * 1e12))
    estimate = planner.plan_row(model, A100, 8, 8, PUB["global_batch"])["time_s"]
    assert 24 < measured_s < 26
    assert measured_s < estimate < 1.2 * measured_s


def test_fp32_gradients_cost_18_bytes_and_twice_the_traffic():
    """Megatron-LM with --bf16 accumulates and all-reduces gradients in fp32: 2 + 4 + 12 bytes
    per parameter and 4-byte gradients on the wire; the fastest 16-bit row no longer fits."""
    model = planner.GPT_145B
    b16 = planner.plan_row(model, A100, 8, 4, PUB["global_batch"])
    b32 = planner.plan_row(model, A100, 8, 4, PUB["global_batch"], grad_bytes=4)
    per_gpu = model.num_params / 32
    assert b16["state_bytes"] == per_gpu * 16 and b32["state_bytes"] == per_gpu * 18
    assert math.isclose(b32["dp_bytes"], 2 * b16["dp_bytes"])
    assert b16["fits"] and not b32["fits"]
    z3 = planner.plan_row(model, A100, 8, 8, PUB["global_batch"], stage="zero3", grad_bytes=4)
    assert math.isclose(z3["dp_bytes"],
                        z3["micro_batches"] * (2 * 2 + 4) * model.num_params / 64 * 23 / 24)
    rows = planner.plan(model, A100, PUB["global_batch"], grad_bytes=4)
    assert (rows[0]["tp"], rows[0]["pp"]) == (PUB["tp"], PUB["pp"])
    with pytest.raises(ValueError, match="grad_bytes must be 2"):
        planner.plan_row(model, A100, 8, 8, PUB["global_batch"], grad_bytes=3)


def test_fp16_main_grad_copy_costs_20_bytes_sharded_with_the_optimizer():
    """Megatron-LM with --fp16 gives its fp32 main weights an fp32 gradient copy: 2 + 2 + 4 + 12
    bytes per parameter, 4 + 16/D with its distributed optimizer; 16-bit gradients on the wire."""
    model = planner.GPT_145B
    per_gpu = model.num_params / 32
    b16 = planner.plan_row(model, A100, 8, 4, PUB["global_batch"])
    f16 = planner.plan_row(model, A100, 8, 4, PUB["global_batch"], optimizer_bytes=16)
    z1 = planner.plan_row(model, A100, 8, 4, PUB["global_batch"], stage="zero1",
                          optimizer_bytes=16)
    assert f16["state_bytes"] == per_gpu * 20 and f16["dp_bytes"] == b16["dp_bytes"]
    assert math.isclose(z1["state_bytes"], per_gpu * (4 + 16 / z1["dp"]))
    assert b16["fits"] and not f16["fits"] and z1["fits"]
    rows = planner.plan(model, A100, PUB["global_batch"], optimizer_bytes=16)
    assert (rows[0]["tp"], rows[0]["pp"], rows[0]["stage"]) == (8, 4, "zero1")


def test_tp_messages_per_layer_are_two_each_way_and_the_recomputed_forward_repeats_its_two():
    # the constant lesson 11 checks (folded) against section 2's run: attention and MLP each
    # make one collective per pass
    assert planner.TP_MESSAGES_PER_LAYER == {"forward": 2, "backward": 2}
    kept = planner.plan_row(GPT3, A100, 8, 16, 1536, recompute=False)
    assert kept["tp_messages"] == 6 * 128 * 4             # 6 layers, 128 micro-batches, 4 each
    assert planner.plan_row(GPT3, A100, 1, 16, 1536)["tp_messages"] == 0   # no t, no messages


def test_equal_estimates_tie_and_the_tie_is_broken_by_messages_then_memory():
    rows = planner.plan(planner.GPT_145B, A100, PUB["global_batch"])
    first, second = rows[0], rows[1]
    # 16-bit gradients: ZeRO-1's reduce-scatter + all-gather weighs what DDP's all-reduce does
    assert (first["tp"], first["pp"]) == (second["tp"], second["pp"])
    assert {first["stage"], second["stage"]} == {"ddp", "zero1"}
    assert first["time_s"] == second["time_s"] and first["tied_with"] == 1
    assert first["stage"] == "ddp" and first["messages"] < second["messages"]   # not list order
    for a, b in zip(rows, rows[1:]):
        assert (a["time_s"], a["messages"], a["total_bytes"]) <= \
            (b["time_s"], b["messages"], b["total_bytes"])
    # the order of the stages asked for no longer decides
    swapped = planner.plan(planner.GPT_145B, A100, PUB["global_batch"],
                           stages=("zero1", "ddp", "zero3"))
    assert [(r["tp"], r["pp"], r["stage"]) for r in swapped] == \
        [(r["tp"], r["pp"], r["stage"]) for r in rows]
    assert sum(r["tied_with"] == 0 for r in rows) > 0


def test_megatron_rank_order_puts_pipeline_neighbours_on_other_nodes():
    model, b = planner.GPT_145B, PUB["global_batch"]
    ours = planner.plan_row(model, A100, 2, 4, b)                      # a pipeline: 8 ranks
    megatron = planner.plan_row(model, A100, 2, 4, b, order="tp-dp-pp")  # neighbours t·D apart
    assert ours["pp_link"] == A100.intra_bw and megatron["pp_link"] == A100.inter_bw
    assert megatron["time_s"] > ours["time_s"]
    assert ours["dp_link"] == megatron["dp_link"] == A100.inter_bw
    small = planner.Cluster(gpu_bytes=80e9, gpus_per_node=8, nodes=2, peak_flops=312e12,
                            intra_bw=300e9, inter_bw=25e9)            # t·D = 2·4 = 8: one node
    row = planner.plan_row(model, small, 2, 2, 64, order="tp-dp-pp")
    assert row["dp_link"] == small.intra_bw and row["pp_link"] == small.inter_bw
    for pp in (1, 2, 4, 8, 16):                    # t = 8: both layouts price every link alike
        a = planner.plan_row(model, A100, 8, pp, b)
        m = planner.plan_row(model, A100, 8, pp, b, order="tp-dp-pp")
        assert a["time_s"] == m["time_s"]
    with pytest.raises(ValueError, match="order"):
        planner.plan_row(model, A100, 8, 8, b, order="pp-dp-tp")


def test_zero3_gathers_and_scatters_once_per_micro_batch():
    """ZeRO-3 reshards between micro-batches (FSDP2's defaults: lesson 08 measures 2k
    all-gathers at k micro-batches), so its traffic and messages are M times one pass's; the
    old pricing (one gather/scatter round per step whatever M) fails here."""
    model = planner.GPT_145B
    one = planner.plan_row(model, A100, 8, 8, 192, stage="zero3")    # D = 24, M = 8
    many = planner.plan_row(model, A100, 8, 8, PUB["global_batch"], stage="zero3")  # M = 96
    assert (one["micro_batches"], many["micro_batches"]) == (8, 96)
    assert many["dp_messages"] == 3 * 10 * 96                # 10 layers, 3 collectives each
    assert math.isclose(many["dp_bytes"], 12 * one["dp_bytes"])
    assert math.isclose(many["dp_bytes"], 96 * (2 * 2 + 2) * model.num_params / 64 * 23 / 24)
    ddp = planner.plan_row(model, A100, 8, 8, PUB["global_batch"], stage="ddp")
    assert ddp["dp_bytes"] == planner.plan_row(model, A100, 8, 8, 192, stage="ddp")["dp_bytes"]


def test_zero2_reduce_scatters_every_micro_batch():
    """ZeRO-2 keeps only its gradient shard, so with M micro-batches it reduce-scatters M times
    and all-gathers the weights once: (M·grad_bytes + 2) bytes per parameter, (M + 1) messages
    per bucket; ZeRO-1 (a full gradient to accumulate into, as DDP's no_sync) stays once a
    step. At M = 1 the two cost the same."""
    model = planner.GPT_145B
    one = {s: planner.plan_row(model, A100, 8, 8, 24, stage=s) for s in ("zero1", "zero2")}
    many = {s: planner.plan_row(model, A100, 8, 8, PUB["global_batch"], stage=s)
            for s in ("zero1", "zero2")}
    assert one["zero1"]["micro_batches"] == 1 and many["zero2"]["micro_batches"] == 96
    assert one["zero2"]["dp_bytes"] == one["zero1"]["dp_bytes"]
    assert one["zero2"]["dp_messages"] == one["zero1"]["dp_messages"]
    assert many["zero1"]["dp_bytes"] == one["zero1"]["dp_bytes"]
    per_gpu, dp = model.num_params / 64, 24
    assert math.isclose(many["zero2"]["dp_bytes"], per_gpu * (96 * 2 + 2) * (dp - 1) / dp)
    buckets = math.ceil(per_gpu * 2 / (25 * 2**20))
    assert many["zero2"]["dp_messages"] == 97 * buckets
    assert many["zero2"]["time_s"] > many["zero1"]["time_s"]
