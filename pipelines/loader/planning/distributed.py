"""Ranks and collectives: where a dataset finds its local rank and world size, and the one
all-reduce by which the ranks of several nodes agree on an epoch's batch counts.

Everything else the ranks agree on they compute alone (the plan is a pure function of the
shards' metadata, :mod:`plan`); only when ``torch.distributed`` spans more ranks than one
node's do they exchange anything: the batches per set, once per epoch (:func:`agree_targets`).

Example::

    rank, world = rank_world()            # LOCAL_RANK / LOCAL_WORLD_SIZE, else torch.distributed
    if spans_nodes(world):
        targets = agree_targets(targets)  # the max over every node, one all-reduce
"""

from __future__ import annotations

import os

import torch

__all__ = ["rank_world", "collective_device", "spans_nodes", "agree_targets"]


def rank_world() -> tuple[int, int]:
    """(local rank, local world size): env LOCAL_RANK/LOCAL_WORLD_SIZE (torchrun),
    else torch.distributed's rank/world when initialised, else (0, 1)."""
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def collective_device(group=None) -> torch.device:
    """Where the tensor of a collective over ``group`` (default the whole job) must be: the CPU
    when the group has a CPU backend (gloo, mpi, ucc, or a group of several such as
    ``"cpu:gloo,cuda:nccl"``: a few integers travel best without a device copy), else the
    backend's accelerator: the device the group is bound to (``init_process_group(device_id=)``),
    else the current one (NCCL: ``torch.cuda.current_device()``, which the trainer sets with
    ``torch.cuda.set_device(local_rank)``; NCCL takes no CPU tensors)."""
    d = torch.distributed
    backend = str(d.get_backend(group)).lower()
    devices: list[str] = []
    for part in backend.split(","):
        dev, sep, name = part.strip().partition(":")
        if sep:  # "cuda:nccl": this device type through that backend
            devices.append(dev)
        else:  # "nccl": the device types the backend serves
            devices += d.Backend.backend_capability.get(dev, ["cpu"])
    if "cpu" in devices or not devices:
        return torch.device("cpu")
    kind = devices[0]
    pg = group if group is not None else d.group.WORLD
    bound = getattr(pg, "bound_device_id", None)
    if isinstance(bound, torch.device) and bound.type == kind and bound.index is not None:
        return bound
    return torch.device(kind, getattr(torch, kind).current_device())


def spans_nodes(world_size: int, all_reduce_targets: bool = True) -> bool:
    """Planning an epoch takes one all-reduce: ``torch.distributed`` spans more ranks than the
    ``world_size`` ranks of this node, and ``all_reduce_targets`` is on."""
    d = torch.distributed
    return bool(all_reduce_targets and d.is_available() and d.is_initialized() and d.get_world_size() > world_size)


def agree_targets(targets: dict[int, int]) -> dict[int, int]:
    """The batches per set every rank of the job agrees on: the max of each set's count over
    all ranks (one all-reduce, on the backend's device; every rank passes the same sets)."""
    d = torch.distributed
    sets = list(targets)
    t = torch.tensor([targets[s] for s in sets], dtype=torch.long, device=collective_device())
    d.all_reduce(t, op=d.ReduceOp.MAX)
    return {s: int(v) for s, v in zip(sets, t.tolist())}
