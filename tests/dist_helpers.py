"""Spawn a small gloo world for the CPU distributed tests (torch.multiprocessing.spawn, file rendezvous)."""

from __future__ import annotations

import os
import uuid

import torch


def init(rank: int, world: int, rendezvous: str, backend: str = "gloo") -> None:
    """Join the process group of a spawned test worker (one CPU thread each: CI has two cores)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def spawn(fn, world: int, tmp_path, *args) -> None:
    """``fn(rank, world, rendezvous_file, *args)`` in ``world`` fresh processes; raises if any of them fails."""
    import torch.multiprocessing as mp

    # a fresh file per world: a killed world leaves its file behind
    rendezvous = os.path.join(str(tmp_path), f"rendezvous-{uuid.uuid4().hex}")
    mp.spawn(fn, args=(world, rendezvous, *args), nprocs=world, join=True)
