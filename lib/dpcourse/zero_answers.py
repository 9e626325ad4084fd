"""Lab 08's answers, claimed on lesson 08's runs and on the installed torch (the lesson calls
them in folded cells after its lab's pointer: open them once your lab passes).

The claims' sentences, and the arithmetic behind them, state the lab's answer (what a ZeRO-2
step holds at its collective; in which order FSDP2 waits for and drops its reduce-scatter
buffers). In a lesson cell's source they would be in plain sight on GitHub, which ignores a
cell's fold flag; here they print inside the lesson's ``viz.folded_output`` block, and this code
is shown folded too.
"""

from __future__ import annotations

import inspect

from dpcourse import zero
from dpcourse.checks import claim

__all__ = ["grad_bytes_in_step", "fsdp2_drop_order"]


def grad_bytes_in_step(at_collective: dict, n_params: int, world_size: int) -> None:
    """Claims the gradient bytes alive inside each wrapper's ``step()`` just before its
    collective (``at_collective``: DDP's, ZeRO-1's and ZeRO-2's, measured).

    Shown in lesson 08, §3."""
    flat = 4 * zero.shard_numel(n_params, world_size) * world_size   # the padded copy, in bytes
    sharded = 4 * n_params + flat + flat // world_size
    claim("inside step() every p.grad is still alive beside the flat copy step() sends: DDP "
          "2 × 4Ψ, ZeRO-1 and ZeRO-2 4Ψ + the padded copy + the slice it receives",
          at_collective == {"ddp": 8 * n_params, "zero1": sharded, "zero2": sharded})


def fsdp2_drop_order() -> None:
    """Claims, from the installed torch's source, the order in which FSDP2's ``post_backward``
    waits for, drops and keeps reduce-scatter input buffers, and where the cap is set.

    Shown in lesson 08, §5."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import (FSDPCommContext,
                                                                       FSDPParamGroup)
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    group_src = inspect.getsource(FSDPParamGroup.post_backward)
    final_src = inspect.getsource(FSDPState._root_post_backward_final_callback)
    claim("FSDP2's post_backward drops the earlier groups' reduce-scatter inputs (after a wait "
          "on their event) before its own foreach_reduce, then keeps its own; the root's final "
          "callback drops the rest, on the last backward only; the default cap is 1, set "
          "through FSDPModule.set_reduce_scatter_max_input_buffers; only a call's last "
          "parameter group drops",
          "self._param_group_index == self._num_param_groups - 1" in group_src
          and "fsdp_param_group.reduce_scatter_max_input_buffers" in inspect.getsource(
              FSDPModule.set_reduce_scatter_max_input_buffers)
          and "fsdp_param_group.reduce_scatter_max_input_buffers" in inspect.getsource(
              FSDPState._init_shared_state)
          and group_src.index("wait_event(oldest.event)") < group_src.index("del oldest")
          < group_src.index(") = foreach_reduce(")
          < group_src.index("reduce_scatter_states.append(")
          and "self._comm_ctx.reduce_scatter_states.clear()" in final_src
          and final_src.rindex("if self._state_ctx.is_last_backward:")
          < final_src.index("self._comm_ctx.reduce_scatter_states.clear()")
          and "self.reduce_scatter_max_input_buffers: int = 1"
          in inspect.getsource(FSDPCommContext))
