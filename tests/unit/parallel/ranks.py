"""Running a test's ranks as forks of the engine's worker forkserver (`engine_server.workers.worker_context`).

The server imported torch and the engine once for the test process; a rank forked from it starts in milliseconds,
where a spawned one imports torch again (seconds of CPU apiece on a loaded 2-core machine). A rank's function and
arguments are pickled as for a spawned one, so the function must be importable (a test module's top level).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from engine_server.workers import worker_context


def run_ranks(target: Callable[..., None], args: tuple[Any, ...], size: int) -> None:
    """Run `target(rank, *args)` in `size` forked processes and wait for all; raise if any rank fails."""
    worker_context()  # names the forkserver's preload, should this start it
    mp.start_processes(target, args=args, nprocs=size, join=True, start_method="forkserver")
