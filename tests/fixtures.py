"""Fixtures the pytest suites share that are not vLLM objects (those are in
:mod:`hscache_tools.testing`): the project's examples loaded as modules, and the devices the
tensor tests run on (CUDA where one is present; CI's CPU machine runs the CPU half)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(stem: str, module_name: str | None = None) -> ModuleType:
    """``examples/<stem>.py`` as a module registered under ``module_name`` (default: the
    stem), so that the dataclasses it defines pickle and compare by their module."""
    spec = importlib.util.spec_from_file_location(module_name or stem, EXAMPLES / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def devices() -> list[object]:
    """``cpu``, and ``cuda`` marked ``gpu`` (skipped without a CUDA device)."""
    import torch

    return [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ]
