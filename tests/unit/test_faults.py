"""The test-only fault hook (engine_server/faults.py): inert without its variable, one-shot or sticky with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_server import faults


def model() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


def test_nothing_is_installed_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    layer = model()
    faults.install_from_env(layer)
    assert not layer._forward_pre_hooks
    layer(torch.ones(2))


def test_a_once_file_fails_one_forward(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    trigger = tmp_path / "fault"
    monkeypatch.setenv(faults.ENV_VAR, str(trigger))
    layer = model()
    faults.install_from_env(layer)
    layer(torch.ones(2))  # no file: no fault
    trigger.write_text("once")
    with pytest.raises(faults.InjectedFault):
        layer(torch.ones(2))
    assert not trigger.exists()
    layer(torch.ones(2))


def test_any_other_content_fails_every_forward_until_removed(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    trigger = tmp_path / "fault"
    monkeypatch.setenv(faults.ENV_VAR, str(trigger))
    layer = model()
    faults.install_from_env(layer)
    trigger.write_text("always")
    for _ in range(3):
        with pytest.raises(faults.InjectedFault):
            layer(torch.ones(2))
    trigger.unlink()
    layer(torch.ones(2))
