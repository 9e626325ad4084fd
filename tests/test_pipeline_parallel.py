"""dpcourse.pipeline_parallel: schedules, the ideal timeline and bubble, and real pipelines on 2,
3 and 4 gloo ranks equal to the unsplit model (loss and gradients), with activations and
messages counted; torch's own torch.distributed.pipelining on the same model."""

import pytest
import torch

from dpcourse import pipeline_parallel as pp


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,m", [(2, 1), (2, 4), (3, 5), (4, 2), (4, 8)])
def test_every_schedule_runs_each_forward_then_its_backward_once(name, stages, m):
    for k in range(stages):
        order = pp.SCHEDULES[name](stages, m, k)
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        for i in range(m):
            assert order.index(("F", i)) < order.index(("B", i))


def test_gpipe_is_all_forwards_then_all_backwards():
    assert pp.gpipe_schedule(3, 2, 1) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_one_f_one_b_warms_up_with_k_minus_stage_minus_one_forwards():
    assert pp.one_f_one_b_schedule(4, 6, 0)[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)]
    assert pp.one_f_one_b_schedule(4, 6, 0)[4] == ("B", 0)
    assert pp.one_f_one_b_schedule(4, 6, 3)[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


@pytest.mark.parametrize("stages,m", [(2, 1), (2, 8), (4, 4), (4, 8), (3, 2)])
def test_peak_in_flight_is_m_for_gpipe_and_k_minus_stage_for_1f1b(stages, m):
    for k in range(stages):
        assert pp.peak_in_flight(pp.gpipe_schedule(stages, m, k)) == m
        assert pp.peak_in_flight(pp.one_f_one_b_schedule(stages, m, k)) == min(stages - k, m)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 6)])
def test_simulated_timeline_has_the_ideal_bubble(name, stages, m):
    events = pp.simulate_timeline(stages, m, name, t_forward=1.0, t_backward=2.0)
    assert len(events) == 2 * stages * m
    assert pp.measured_bubble(events) == pytest.approx(pp.ideal_bubble(stages, m))
    assert max(e[4] for e in events) == pytest.approx(3.0 * (m + stages - 1))


def test_ideal_bubble_values():
    assert pp.ideal_bubble(4, 1) == 0.75
    assert pp.ideal_bubble(2, 1) == 0.5
    assert pp.ideal_bubble(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError):
        pp.ideal_bubble(0, 4)


def test_split_stages_is_contiguous_and_shares_parameters():
    model = pp.make_mlp(8, 5, seed=3)
    stages = pp.split_stages(model, 3)
    assert [len(s) for s in stages] == [2, 2, 1]
    ours = [p for s in stages for p in s.parameters()]
    assert all(a is b for a, b in zip(ours, model.parameters()))
    with pytest.raises(ValueError, match="at least one block"):
        pp.split_stages(model, 6)


def test_make_mlp_is_the_same_for_a_seed_and_leaves_the_global_rng():
    torch.manual_seed(1)
    before = torch.rand(1)
    torch.manual_seed(1)
    a, b = pp.make_mlp(8, 2, seed=4), pp.make_mlp(8, 2, seed=4)
    assert torch.rand(1) == before
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_micro_batches_refuses_an_uneven_cut():
    assert [t.shape[0] for t in pp.micro_batches(torch.zeros(12, 3), 4)] == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="equal"):
        pp.micro_batches(torch.zeros(10, 3), 4)


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        pp.run_pipeline(2, (2,), ("interleaved",))


def test_messages_per_step():
    assert pp.messages_per_step(4, 8) == 48


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipeline_equals_the_unsplit_model(stages):
    runs = pp.run_pipeline(stages, (1, 4), ("gpipe", "1f1b"), width=16, blocks=4, batch=8,
                           repeats=0, timeout=60)
    for r in runs:
        assert r.equal, (r.schedule, r.m, r.max_grad_diff)
        assert r.loss == pytest.approx(r.reference_loss, rel=pp.RTOL, abs=pp.ATOL)
        expected = [pp.peak_in_flight(pp.SCHEDULES[r.schedule](stages, r.m, k))
                    for k in range(stages)]
        assert r.peak_in_flight == expected
        assert r.messages == pp.messages_per_step(stages, r.m)
        assert r.message_bytes == r.messages * (8 // r.m) * 16 * 4
        assert len(r.events) == 2 * stages * r.m
        assert 0.0 <= r.bubble < 1.0
    gpipe4 = next(r for r in runs if r.schedule == "gpipe" and r.m == 4)
    one4 = next(r for r in runs if r.schedule == "1f1b" and r.m == 4)
    assert max(gpipe4.peak_in_flight) == 4 and one4.peak_in_flight[-1] == 1
    for k in range(stages):   # autograd's saved bytes scale with the micro-batches held
        assert (gpipe4.peak_activation_bytes[k] * one4.peak_in_flight[k]
                == one4.peak_activation_bytes[k] * 4)


def test_measured_bubble_follows_the_formula_with_device_time():
    # 50 ms per forward, 100 ms per backward slept, as a GPU computes without a CPU core. The
    # overhead (messages, wake-ups) must stay small beside it: at 10 ms and repeats=2 (each
    # rank keeping its own fastest attempt, so stages mixed attempts) CI at load measured
    # M=4's bubble above M=1's. One attempt, and the band below holds with the overhead at
    # tens of milliseconds per step.
    runs = pp.run_pipeline(2, (1, 4), ("gpipe",), width=16, blocks=2, batch=8,
                           delay_s=0.05, repeats=1, timeout=60)
    one, four = runs
    assert one.bubble > four.bubble
    for r in runs:
        assert r.ideal - 0.05 <= r.bubble <= r.ideal + 0.25, (r.m, r.bubble, r.ideal)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_torch_pipelining_equals_ours(name):
    out = pp.compare_with_torch_pipelining(2, 4, name, width=16, blocks=2, batch=8, timeout=60)
    assert out["torch_vs_ours"] <= 1e-6
    assert out["torch_vs_reference"] <= 1e-5
    assert out["torch_loss"] == pytest.approx(out["reference_loss"], rel=1e-5)
    assert out["torch_messages"] == out["our_messages"] == pp.messages_per_step(2, 4)
    assert out["torch_message_bytes"] == out["our_message_bytes"] == 8 * 16 * 4 * 2
    assert out["torch_setup_messages"] > 0


def test_repeated_steps_keep_the_same_attempt_on_every_stage():
    # With several measured steps, every rank must keep the same one: stage 1's forward of a
    # micro-batch can only start once stage 0 has sent it (its forward ended). Ranks that kept
    # different attempts each (their own shortest) broke this and inflated the bubble.
    (run,) = pp.run_pipeline(2, (4,), ("gpipe",), width=16, blocks=2, batch=8,
                             delay_s=0.02, repeats=3, timeout=60)
    forward_end = {i: end for stage, kind, i, start, end in run.events
                   if stage == 0 and kind == "F"}
    later = [(i, start, forward_end[i]) for stage, kind, i, start, end in run.events
             if stage == 1 and kind == "F"]
    assert len(later) == 4
    assert all(start >= end - 1e-4 for i, start, end in later), later
    assert run.ideal - 0.05 <= run.bubble <= run.ideal + 0.25, (run.bubble, run.ideal)
