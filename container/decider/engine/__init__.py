"""The llama.cpp decision engine (see CONVENTIONS.md, "Engine interface")."""

from decider.engine.engine import DecisionEngine, ModelInfo
from decider.engine.generation import GenerationEvent, GenerationUsage

__all__ = ["DecisionEngine", "GenerationEvent", "GenerationUsage", "ModelInfo"]
