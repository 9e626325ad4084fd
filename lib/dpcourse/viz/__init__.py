"""Figures and widgets for the course: ``from dpcourse import viz``, then ``viz.<name>``.

One module for what every lesson uses, one for the widgets, then one module per lesson that
has figures of its own, in lesson order; this file re-exports every public name, so a lesson
never needs to know which file a figure lives in:

* :mod:`.common` — :func:`new_figure`, :func:`figure_to_png`, :func:`show` (a figure as a PNG
  with its caption), :func:`show_code` (the source a lesson's claims depend on).
* :mod:`.interactive` — :func:`widget_with_fallback`, the one way a widget reaches the page
  (followed by a static version for readers without a live kernel), :func:`explorer` (sliders
  that redraw a figure) and :func:`quiz` (the check-yourself questions).
* ``lNN_<lesson name>`` — lesson NN's figures, named after its source ``lessons/NN_<name>.py``,
  in the order the lesson shows them: :mod:`.l00_start_here`, :mod:`.l02_data_parallel`,
  :mod:`.l03_ddp_first_principles`, :mod:`.l04_ddp_in_practice`, :mod:`.l05_mirrored_strategy`,
  :mod:`.l06_ring_allreduce`, :mod:`.l07_inside_ddp`, :mod:`.l08_sharded_data_parallel`,
  :mod:`.l09_beyond_lockstep`, :mod:`.l10_bug_zoo`, :mod:`.l11_beyond_data_parallel`. Lesson
  01 has none of its own.

A new lesson's figures go in a module of their own, ``lNN_<lesson name>.py``: a docstring
naming the lesson, ``__all__`` listing its public figures, helpers from ``.common`` (and
``.interactive`` for a widget); then, here, one import line for its names and the module in
``_MODULES``. ``tests/test_viz.py`` fails when a module of this folder or a name in its
``__all__`` is not re-exported here, or a lesson calls a ``viz.<name>`` missing from
``__all__``.

Two rules keep the notebooks reproducible and nbval-safe (ARCHITECTURE.md at the repository
root has the rest of the library's design): figures are matplotlib ``Figure`` objects shown as
PNG through :func:`show`, and no widget writes into an ipywidgets ``Output``.
"""

from . import (common, interactive, l00_start_here, l02_data_parallel, l03_ddp_first_principles,
               l04_ddp_in_practice, l05_mirrored_strategy, l06_ring_allreduce, l07_inside_ddp,
               l08_sharded_data_parallel, l09_beyond_lockstep, l10_bug_zoo,
               l11_beyond_data_parallel)
from .common import (figure_to_png, folded_code_bundle, folded_output, new_figure, show,
                     show_code)
from .interactive import explorer, quiz, widget_with_fallback
from .l00_start_here import spawn_figure
from .l02_data_parallel import (dp_step_figure, dp_timeline_figure, record_dp_step,
                                traffic_both_ways_figure)
from .l03_ddp_first_principles import (bucket_timelines_figure, collectives_figure,
                                       sampler_grid_figure)
from .l04_ddp_in_practice import (restart_timeline_figure, sampler_index_map_figure,
                                  sampler_slots, torchrun_figure, torchrun_log)
from .l05_mirrored_strategy import mirrored_vs_ddp_figure
from .l06_ring_allreduce import (cost_figure, cost_vs_n_figure, draw_ring_step, fit_figure,
                                 pipeline_figure, rabenseifner_figure, ring_frames, ring_stepper,
                                 ring_steps_figure)
from .l07_inside_ddp import (bucket_sweep_figure, comm_hooks_figure, overlap_model_figure,
                             overlap_timeline_figure, reducer_figure, step_time_bars_figure)
from .l08_sharded_data_parallel import (zero3_timeline_figure, zero_calculator_figure,
                                        zero_holdings_figure, zero_memory_figure,
                                        zero_tradeoff_figure)
from .l09_beyond_lockstep import (large_batch_figure, local_sgd_drift_figure, local_sgd_figure,
                                  ps_traffic_figure, staleness_figure, straggler_gantt_figure,
                                  typical_window)
from .l10_bug_zoo import (collective_trace_figure, collective_traces_figure, nan_spread_figure,
                          replica_checksums_figure, timeout_behaviour_figure)
from .l11_beyond_data_parallel import (bubble_figure, memory_wall_figure, mesh_2d_figure,
                                       noise_scale_figure, pipeline_gantt_figure, planner_figure,
                                       tp_shards_figure)

_MODULES = (common, interactive, l00_start_here, l02_data_parallel, l03_ddp_first_principles,
            l04_ddp_in_practice, l05_mirrored_strategy, l06_ring_allreduce, l07_inside_ddp,
            l08_sharded_data_parallel, l09_beyond_lockstep, l10_bug_zoo, l11_beyond_data_parallel)

__all__ = [name for module in _MODULES for name in module.__all__]
