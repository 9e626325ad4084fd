"""Checks for lab 06 (``solutions/lab06_ring_allreduce.py``): the ring, simulated then real.

* :func:`check_worker0_sends` judges the paper answer asked before part 1 (the chunks worker 0
  sends at steps 1, 2 and 3 on a 4-ring with owner = [2, 0, 3, 1]) by where its chunks would end;
* :func:`check_scatter_reduce` and :func:`check_all_gather` run the learner's NumPy phases on a
  few worker counts, lengths (uneven ones too) and layouts: ``owner[i]`` is the chunk worker i
  must finish, and some layouts are not rotations, so no shifted copy of lesson 06's formula
  passes; the layout ignored, lesson 06's layout, arithmetic on owner's chunk index and owner
  read backwards are each named by their cause, and so are an index into owner off by one,
  sums computed without a ring, and an all-gather that copies chunks from anyone but the left
  neighbour (its writes are watched on tracked arrays);
* :func:`check_ring_allreduce` runs the learner's ``ring_allreduce(tensor, op)`` — defined in a
  notebook cell — in 3, 2 and then 4 processes through :func:`dpcourse.launch.spawn`
  (cloudpickle ships it), compares every rank's tensor with the sum / average, and spies on
  what it sends (no built-in collective; blocking ``send``/``recv`` only, so the order of a
  step's two calls is the learner's decision; 2(N-1) messages of about K/N elements per rank);
  :func:`demo_ring` runs given demo code and explains a deadlock by its cause, with no fix.
  The order of each step's calls is judged by the whole ring's time in transfer times divided
  by its 2(N-1) steps, an average (:func:`_rounds`: one unit per transfer, a gloo send waiting
  for its receiver; the ✔ line shows the slowest single step beside it), from the calls
  the ranks made on 3, 2 and 4 ranks and, on 5, 7, 8 and 16 ranks, from a dry run of the learner's
  code with stand-ins that only note the calls (:func:`_dry_orders`): an order whose average
  time per step grows with N is refused. Gloo ranks do not wait for one another between steps, so a
  start-up chain is paid once: measured with gloo on 8 and 12 ranks, each transfer padded to
  20 ms, "the first half of the ranks send first" took 2.36 transfer times per step on both
  (even/odd 2.24 and 2.19; rank 0 alone sending first 8.3 and 12.8; ranks 0 and 1 sending
  first 4.2 and 6.3), as the model says (2.2; 2.0; 8 and 12; 4.1 and 6.0);
* :func:`check_step_prediction` compares the learner's predicted time per step of their own
  order on 3 and 5 ranks (recorded before the ring is written) with the model run on the order
  their code makes its calls in, on 3, 5 and 7 ranks (4 and 8 beside them), and explains the
  gap: 2 per step is the floor, and where two neighbours make the same first call (on odd N an
  alternating rule always has such a seam) a delay is paid once, spread over 2(N-1) steps
  (even/odd: 4N in all on odd N, so 3, 2.5 and 2.33 per step);
* :func:`check_segmented_ring` (the stretch) does the same for a ring whose reduce-scatter sends
  each chunk in segments.

Wrong answers are recognised by simulating each plausible mistake and matching the learner's
numbers: a chunk index off by one, a wrong number of steps, a layout misread, a missing
all-gather, an all-gather that adds, summing where the average is asked. A ring in which every rank calls a
blocking ``dist.send`` before its ``dist.recv`` deadlocks: measured with gloo (torch 2.14, CPU),
two ranks doing that hang at *every* size we tried, from 1 element to 16 Mi elements — gloo's
send does not return before the peer has posted the matching receive. The check notices which
call each rank is stuck in, stops the ranks once every one has sat in the same blocking call for
2 s with none returning (within ``timeout`` seconds in any case; the demo waits for its
timeout) and says so; every rank
calling ``dist.recv`` first deadlocks the same way. A second ``wait()`` on the same ``Work``
never returns either (measured, torch 2.14 gloo): the spy on the stretch's works names it.
The spy also notes the memory each non-blocking receive writes into, so that one buffer shared
by receives in flight (a race whose sum may come out right on one run) is named by its cause.
The stretch's design decision, the receives kept in flight, is declared before the ring is
written and held: the first number compared with the ring is kept, another one refused.

The checks live in modules of one idea each, every name importable from here:
:mod:`._lab06_numpy` (parts 1 and 2 and the paper question), :mod:`._lab06_ring` (part 3 and
the bytes prediction), :mod:`._lab06_order` (the order of a step's calls, timed in transfer
times), :mod:`._lab06_spawn` (running a ring in gloo processes and spying on it; the deadlock
demo), :mod:`._lab06_segmented` (the stretch).
"""

from __future__ import annotations

from dpcourse.checks import LabCheckError
from dpcourse.checks._lab06_numpy import (PAPER_OWNER, _all_gather, _scatter_reduce,
                                          check_all_gather, check_scatter_reduce,
                                          check_worker0_sends, reference_all_gather,
                                          reference_scatter_reduce)
from dpcourse.checks._lab06_order import (DRY_SIZES, STEP_QUESTION, _dry_orders,
                                          _refuse_growing_steps, _rounds, _slowest_step,
                                          check_step_prediction)
from dpcourse.checks._lab06_ring import (RING_WORLD_SIZES, WORLD_SIZES, check_prediction,
                                         check_ring_allreduce, measure_bytes_sent)
from dpcourse.checks._lab06_segmented import IN_FLIGHT_QUESTION, check_segmented_ring
from dpcourse.checks._lab06_spawn import demo_ring

__all__ = ["LabCheckError", "check_worker0_sends", "check_scatter_reduce", "check_all_gather",
           "check_ring_allreduce", "check_segmented_ring", "measure_bytes_sent",
           "check_prediction", "reference_scatter_reduce", "reference_all_gather",
           "IN_FLIGHT_QUESTION", "demo_ring", "WORLD_SIZES", "RING_WORLD_SIZES", "DRY_SIZES",
           "PAPER_OWNER", "STEP_QUESTION", "check_step_prediction"]

# Internals the tests call by these names (the simulated mistakes and the step-time model).
_INTERNALS = (_all_gather, _scatter_reduce, _dry_orders, _refuse_growing_steps, _rounds,
              _slowest_step)
