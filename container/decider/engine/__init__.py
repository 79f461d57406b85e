"""The llama.cpp decision engine (see docs/engine.md).

The package's names are imported lazily, so a module of it that needs no model (the readout math,
the schema limits, the scheduler's pieces) can be imported without loading llama.cpp.

Layers, each importing only those below it (tests/engine/test_import_layers.py): `decider.errors`
and `decider.invariance`; `decider.settings`; `decider.engine` and `decider.schemas`; `decider.server`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from decider.engine.engine import DecisionEngine, ModelInfo
    from decider.engine.works.generation import GenerationEvent, GenerationUsage

__all__ = ["DecisionEngine", "GenerationEvent", "GenerationUsage", "ModelInfo"]
_HOMES = {
    "DecisionEngine": "decider.engine.engine",
    "ModelInfo": "decider.engine.engine",
    "GenerationEvent": "decider.engine.works.generation",
    "GenerationUsage": "decider.engine.works.generation",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'decider.engine' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)
