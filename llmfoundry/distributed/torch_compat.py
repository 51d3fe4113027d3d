"""What moved in torch's distributed internals between the floor pyproject states (torch 2.11,
what GPU images ship) and the torch `make setup` installs (2.13), one function per concern.

Each says which versions take which path, and what to delete when the floor rises past it. The
paths are chosen by what the installed torch has, not by its version string, so a torch between
the two takes whichever its API matches. `make test-torch-min` runs the fast suite on 2.11.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState


def fsdp_param_groups(unit: FSDPModule) -> list:
    """The FSDP parameter groups of one `fully_shard` unit (FSDP's per-parameter state lives in
    them). torch 2.13: a list, `_fsdp_param_groups` (a unit may hold several); torch 2.11: one
    `_fsdp_param_group`, None for a unit without parameters of its own."""
    return _param_groups(unit._get_fsdp_state())


def _param_groups(state: Any) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def reset_fsdp_iter_state(root: FSDPModule) -> None:
    """After an exception cut a forward or backward short: wait for FSDP's in-flight
    collectives, reshard every unit, and clear its per-iteration trackers, so the next forward
    starts as the first one of a step. torch 2.13: `FSDPModule.reset_iter_state()`. torch 2.11
    has no such call; `_reset_iter_state_2_11` does what 2.13's does with 2.11's attributes
    (delete it when the floor reaches 2.13). Without it (only the parameter groups found under
    2.11's name) the retry leaves FSDP mid-step (training states, `iter_forward_root`, gathered
    blocks): tests/distributed/test_fsdp.py's two-rank out-of-memory runs then wait on each
    other until gloo's timeout."""
    if hasattr(root, "reset_iter_state"):
        root.reset_iter_state()
    else:
        _reset_iter_state_2_11(root)


def _reset_iter_state_2_11(root: FSDPModule) -> None:
    """torch 2.13's `FSDPState._reset_iter_state` (with its `FSDPParamGroup._reset_iter_state`)
    on torch 2.11's FSDP2: one reduce-scatter state per communication context instead of a list,
    no per-stream post-reduce events, one parameter group per state."""
    state = root._get_fsdp_state()
    if state._is_root is None:  # no forward has run under FSDP: nothing to reset
        return
    if state._is_root is False:
        raise RuntimeError("reset_fsdp_iter_state must be called on the root FSDP module")
    stream = state._device_handle.current_stream()
    comm = state._comm_ctx
    for pending in (comm.all_gather_state, comm.reduce_scatter_state):
        if pending is not None and pending.event is not None:
            stream.wait_event(pending.event)
    comm.all_gather_state = comm.reduce_scatter_state = None
    comm.post_forward_order.clear()
    for each in state._state_ctx.all_states:
        each._modules_to_run_forward.clear()
        each._training_state = TrainingState.IDLE
        for group in _param_groups(each):
            _reset_param_group_2_11(group, stream)
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


def _reset_param_group_2_11(group: Any, stream: torch.Stream) -> None:
    """torch 2.13's `FSDPParamGroup._reset_iter_state` with torch 2.11's attributes."""
    if (gathered := group._all_gather_result) is not None:
        if gathered.all_gather_event is not None:
            stream.wait_event(gathered.all_gather_event)
        if isinstance(gathered.all_gather_work, torch.distributed.distributed_c10d.Work):
            gathered.all_gather_work.wait()
        group._all_gather_result = None
    if group._post_reduce_event is not None:
        stream.wait_event(group._post_reduce_event)
        group._post_reduce_event = None
    if group._all_reduce_state is not None and group._all_reduce_state.event is not None:
        stream.wait_event(group._all_reduce_state.event)
    group._all_reduce_state = None
    if group._reshard_after_forward_event is not None:
        group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
        group._reshard_after_forward_event = None
    group._partial_reduce_output = None
    group._post_forward_indices.clear()
    group._training_state = TrainingState.IDLE
    group._to_sharded()


def forget_meshes() -> None:
    """Drop what DTensor cached about the device meshes of a process group about to be
    destroyed. DTensor caches per mesh what it derives for an operation or a redistribution
    (its sharding propagation; torch 2.13's redistribution planners too), holding the mesh,
    and finds it again by the mesh's layout and axis names: a later process group's mesh of
    the same layout (the next training in the same process, as the multi-process tests run
    them) got the destroyed one's, and so its process groups ("Could not resolve the process
    group"; or another group's, had the names come out alike). torch 2.13 clears the
    propagation caches (Python and C++) with `_clear_sharding_prop_cache`; a torch without it
    has only the Python one, cleared directly, and no planners."""
    from torch.distributed.tensor import DTensor, _redistribute, debug

    clear_propagation = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear_propagation is not None:
        clear_propagation()
    else:  # its per-thread LRU cache: `cache_clear` itself, or on its `cache` (torch 2.7)
        cache = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
        (getattr(cache, "cache_clear", None) or cache.cache.cache_clear)()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()


def all_gather_autograd(tensor: torch.Tensor, gather_dim: int, group: Any) -> torch.Tensor:
    """All-gather `tensor` along `gather_dim` over `group`, differentiable (backward: a
    reduce-scatter of the gradient). torch 2.13: `all_gather_single_autograd` (it deprecates
    the old name); torch 2.11: `all_gather_tensor_autograd` (same arguments; use the new one
    alone when the floor reaches 2.13)."""
    gather = (
        getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    )
    return gather(tensor, gather_dim=gather_dim, group=group)
