"""dpcourse.detectors: each detector fires on its bug from the zoo and stays quiet on the fixed
program (no false alarm); the pure ones are also tested on hand-made inputs."""

import json
import math
import socket

import pytest
import torch

from conftest import listening_ports
from dpcourse import __main__ as cli
from dpcourse import bugzoo, detectors, launch

pytestmark = pytest.mark.usefixtures("no_leftovers")

HANG_S = 3.0


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return launch.spawn(bugzoo.zoo_worker, 2, str(tmp_path_factory.mktemp("zoo")),
                        backend="gloo", timeout=60, show_output=False)


# ---- the collective trace and diagnose, on the programs that hang ---------------------------

@pytest.mark.parametrize("bug, pending, index, stuck_op", [
    (bugzoo.partial_collective, [0], 0, "all_reduce"),
    (bugzoo.collective_order, [0, 1], 0, None),
    (bugzoo.early_stop, [0], 3, "all_reduce"),
])
def test_diagnose_names_the_stuck_ranks_and_their_call(bug, pending, index, stuck_op):
    broken = detectors.diagnose(bug, 2, False, timeout=HANG_S)
    assert broken.status == "hang" and broken.pending == pending
    assert not broken.ok and not broken.trace.ok and broken.trace.index == index
    assert sorted(broken.trace.stuck) == pending
    if stuck_op:
        assert {c["op"] for c in broken.trace.stuck.values()} == {stuck_op}
    else:
        assert {c["op"] for c in broken.trace.stuck.values()} == {"all_reduce", "broadcast"}
    for r in pending:  # the stack dump points at the bug's own line
        assert broken.stacks[r] and broken.stacks[r][-1].startswith("bugzoo.py:")
    assert "HANG" in broken.report() and "stuck in" in broken.report()

    fixed = detectors.diagnose(bug, 2, True, timeout=HANG_S)
    assert fixed.ok and fixed.status == "ok" and fixed.pending == []
    assert fixed.trace.ok and fixed.trace.stuck == {}
    assert "finished" in fixed.report() and "same calls" in fixed.report()


def test_detail_turns_the_order_bug_into_a_named_error():
    d = detectors.diagnose(bugzoo.collective_order, 2, False, timeout=HANG_S, debug_detail=True)
    assert d.status == "failed" and "Detected mismatch between collectives" in d.error
    quiet = detectors.diagnose(bugzoo.collective_order, 2, True, timeout=HANG_S,
                               debug_detail=True)
    assert quiet.ok


@pytest.mark.parametrize("bug", [bugzoo.partial_collective, bugzoo.early_stop])
def test_a_monitored_barrier_names_the_rank_that_never_came(bug):
    d = detectors.diagnose(bug, 2, False, timeout=4 * HANG_S, monitor=1.5)
    assert d.status == "failed" and "Ranks 1 failed to pass monitoredBarrier in 1500 ms" in d.error
    assert detectors.diagnose(bug, 2, True, timeout=4 * HANG_S, monitor=1.5).ok


def test_detail_names_the_missing_rank_of_bug_1_within_the_group_timeout():
    d = detectors.diagnose(bugzoo.partial_collective, 2, False, timeout=4 * HANG_S,
                           debug_detail=True, group_timeout=1.5)
    assert d.status == "failed" and "Ranks 1 failed to pass monitoredBarrier" in d.error


def test_diagnose_a_script_from_the_command_line(tmp_path, capsys):
    script = tmp_path / "s.py"
    body = ("import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "t = torch.ones(2)\n"
            "if dist.get_rank() == {cond}:\n"
            "    dist.all_reduce(t)\n")
    script.write_text(body.format(cond=0))
    assert cli.main(["diagnose", "--timeout", str(HANG_S), str(script)]) == 1
    out = capsys.readouterr().out
    assert "HANG: rank(s) 0" in out and "rank 0 is stuck in all_reduce (call #0) at s.py:5" in out
    script.write_text(body.format(cond="dist.get_rank()"))  # every rank calls it
    assert cli.main(["diagnose", "--timeout", str(HANG_S), str(script)]) == 1
    out = capsys.readouterr().out  # finished, but the group was left up
    assert "finished" in out and "[destroy] end of script (ranks 0, 1)" in out
    script.write_text(body.format(cond="dist.get_rank()") + "assert t[0] == 2\n"
                      "dist.destroy_process_group()\n")
    assert cli.main(["diagnose", "--timeout", str(HANG_S), str(script)]) == 0
    assert "run-time checks: nothing found" in capsys.readouterr().out


def test_trace_collectives_writes_each_call_before_it_returns(tmp_path):
    def worker(rank, world_size, path):
        import torch.distributed as dist

        with detectors.trace_collectives(f"{path}/rank{rank}.trace"):
            dist.all_reduce(torch.ones(3))
            dist.barrier()
        dist.all_reduce(torch.ones(1))  # after the block: not traced
        return None

    launch.spawn(worker, 2, str(tmp_path), backend="gloo", timeout=30, show_output=False)
    traces = detectors.read_traces(tmp_path, 2)
    assert [(c["op"], c["shape"], c["done"]) for c in traces[1]] == [
        ("all_reduce", [3], True), ("barrier", None, True)]
    assert detectors.compare_traces(traces).ok


def test_compare_traces_on_hand_made_traces():
    def call(i, op, shape=(2,), done=True):
        return {"i": i, "op": op, "shape": list(shape), "where": "x.py:1", "done": done}

    same = {0: [call(0, "all_reduce")], 1: [call(0, "all_reduce")]}
    assert detectors.compare_traces(same).ok
    shapes = {0: [call(0, "all_reduce", (2,))], 1: [call(0, "all_reduce", (3,))]}
    assert detectors.compare_traces(shapes).index == 0
    missing = {0: [call(0, "all_reduce"), call(1, "barrier", done=False)],
               1: [call(0, "all_reduce")]}
    rep = detectors.compare_traces(missing)
    assert rep.index == 1 and rep.calls[1] is None and list(rep.stuck) == [0]
    assert "rank 1: made no such call" in rep.message()


def test_read_traces_survives_a_line_cut_short(tmp_path):
    (tmp_path / "rank0.trace").write_text(
        json.dumps({"i": 0, "op": "all_reduce", "shape": [1], "where": "a:1", "event": "start"})
        + "\n" + '{"i": 0, "ev')
    traces = detectors.read_traces(tmp_path, 2)
    assert traces[0][0]["done"] is False and traces[1] == []


# ---- checksums: seeds, averaged loss, BatchNorm ----------------------------------------------

def test_checksums_find_replicas_that_never_agreed(zoo):
    broken = [r["resume"][False] for r in zoo]
    assert all(detectors.compare_checksums(step) for step in zip(*broken))
    fixed = [r["resume"][True] for r in zoo]
    assert not any(detectors.compare_checksums(step) for step in zip(*fixed))


def test_checksums_find_gradients_that_were_never_averaged(zoo):
    broken = [r["averaged_loss"][False] for r in zoo]
    assert detectors.compare_checksums([r["grads"][0] for r in broken])
    assert detectors.compare_checksums([r["weights"][-1] for r in broken])
    fixed = [r["averaged_loss"][True] for r in zoo]
    assert not any(detectors.compare_checksums(s) for s in zip(*[r["grads"] for r in fixed]))
    assert not any(detectors.compare_checksums(s) for s in zip(*[r["weights"] for r in fixed]))


def test_checksums_name_the_batchnorm_buffers(zoo):
    assert detectors.compare_checksums([r["batchnorm"][False] for r in zoo]) == [
        "1.running_mean", "1.running_var"]
    assert detectors.compare_checksums([r["batchnorm"][True] for r in zoo]) == []


def test_state_checksums_see_a_swap_and_nan():
    m = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.0, 2.0]]))
    a = detectors.state_checksums(m)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[2.0, 1.0]]))  # same sum, other places
    b = detectors.state_checksums(m)
    assert detectors.compare_checksums([a, a]) == []
    assert detectors.compare_checksums([a, b]) == ["weight"]
    assert detectors.compare_checksums([{"w": math.nan}, {"w": math.nan}]) == ["w"]


def test_state_checksums_in_chunks_match_one_pass_and_stay_on_the_device():
    m = torch.nn.Linear(300, 7)
    whole = detectors.state_checksums(m)
    chunked = detectors.state_checksums(m, chunk=64)
    assert detectors.compare_checksums([whole, chunked], rtol=1e-12) == []
    flat = m.weight.detach().double().flatten()
    expected = float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum())
    assert whole["weight"] == expected
    if torch.cuda.is_available():            # a CUDA model: summed on its device, no mixing
        on_gpu = detectors.state_checksums(m.cuda(), chunk=64)
        assert detectors.compare_checksums([whole, on_gpu], rtol=1e-9) == []


# ---- NaN, set_epoch, unused parameters, checkpoints, ports ----------------------------------

def test_first_nonfinite_names_the_origin(zoo):
    broken = [r["nan"][False]["local_grad_norm"] for r in zoo]
    assert detectors.first_nonfinite(broken) == (3, [1])
    fixed = [r["nan"][True]["local_grad_norm"] for r in zoo]
    assert detectors.first_nonfinite([v[4:] for v in fixed]) is None
    assert detectors.first_nonfinite([[1.0, 2.0], [0.5]]) is None
    assert detectors.first_nonfinite([[1.0, math.inf], [math.nan, 1.0]]) == (0, [1])


def test_repeated_epoch_orders(zoo):
    for r in zoo:
        assert detectors.repeated_epoch_orders(r["set_epoch"][False]) == [1, 2]
        assert detectors.repeated_epoch_orders(r["set_epoch"][True]) == []


def test_unused_parameters():
    assert detectors.unused_parameters(bugzoo.TwoHeads(), torch.randn(3, 4)) == [
        "head_b.weight", "head_b.bias"]
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    assert detectors.unused_parameters(model, torch.randn(3, 4)) == []
    assert all(p.grad is None for p in model.parameters())


def test_duplicate_writers(zoo):
    clash = detectors.duplicate_writers([r["checkpoint"][False] for r in zoo])
    assert len(clash) == 1 and list(clash.values()) == [[0, 1]]
    assert detectors.duplicate_writers([r["checkpoint"][True] for r in zoo]) == {}


def test_port_owner_sees_a_listener_and_a_free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        owner = detectors.port_owner(port)
        assert owner is not None and owner["port"] == port
    assert detectors.port_owner(port) is None
    assert port not in listening_ports()


def test_diagnose_refuses_a_fixed_port_already_taken(tmp_path, monkeypatch, capsys):
    script = tmp_path / "s.py"
    script.write_text("print('never runs')\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
        assert cli.main(["diagnose", str(script)]) == 2
    assert "already in use" in capsys.readouterr().out


def test_lesson_10_figures_render():
    from dpcourse import viz

    figs = [viz.timeout_behaviour_figure(),
            viz.nan_spread_figure([[1.0, math.nan], [2.0, math.nan]],
                                  {"broken": [2.0, math.nan], "fixed": [2.0, 1.9]}, (1, [0, 1]))]
    assert all(viz.figure_to_png(f).startswith(b"\x89PNG") for f in figs)
