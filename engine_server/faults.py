"""Test-only fault injection: make the model's forward raise on demand, to test what the engine does then.

Set `LADLE_INJECT_FAULT` to a file path before the engine starts. From then on, every forward of the model
first looks for that file (one stat): while it is absent nothing happens; when it exists the forward raises
`InjectedFault`. A file whose content is `once` is deleted by the forward that raises (one failed step);
any other content leaves it in place, so every forward fails until the test removes it (a broken device). A
test arming a running engine creates the file with its content in one step (a rename): a forward may look at any
moment, and takes a file it finds still empty for one that stays.
Without the variable nothing is installed and the forward is untouched.

The check is a forward pre-hook, so it runs wherever the model's `forward` is called; a decode step replayed
from a CUDA graph does not call it (faults are injected on the CPU, or in eager mode).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

ENV_VAR = "LADLE_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """Raised by a forward while the fault file exists."""


def install_from_env(model: torch.nn.Module) -> None:
    """Install the fault check on `model` when LADLE_INJECT_FAULT names a file; otherwise do nothing."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return
    trigger = Path(path)
    log.warning("fault injection armed: the model's forward fails while this file exists", path=str(trigger))

    def check(module: torch.nn.Module, args: Any) -> None:
        if not trigger.exists():
            return
        with contextlib.suppress(OSError):
            if trigger.read_text().strip() == "once":
                trigger.unlink()
        raise InjectedFault(f"fault injected ({trigger} exists)")

    model.register_forward_pre_hook(check)
