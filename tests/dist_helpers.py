"""Spawn a small gloo world for the CPU distributed tests (torch.multiprocessing.spawn, file rendezvous)."""

from __future__ import annotations

import os
import sys
import uuid

import torch


def init(rank: int, world: int, rendezvous: str, backend: str = "gloo") -> None:
    """Join the process group of a spawned test worker (one CPU thread each: CI has two cores)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def _run(rank: int, fn, *args) -> None:
    """``fn(rank, *args)``, then leave at once when it returned: the workers hand their results over in files, and
    interpreter finalisation after a gloo world can abort the process (SIGABRT, "terminate called without an
    active exception": gloo's threads still hold tensors while Python tears down; rare, seen under CI load) after
    the test's work is done. An exception in ``fn`` propagates as before (spawn reports it)."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, tmp_path, *args) -> None:
    """``fn(rank, world, rendezvous_file, *args)`` in ``world`` fresh processes; raises if any of them fails."""
    import torch.multiprocessing as mp

    # a fresh file per world: a killed world leaves its file behind
    rendezvous = os.path.join(str(tmp_path), f"rendezvous-{uuid.uuid4().hex}")
    mp.spawn(_run, args=(fn, world, rendezvous, *args), nprocs=world, join=True)
