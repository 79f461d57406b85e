"""What the scheduler drives: the `Work` protocol every unit of engine work implements (a decision,
decider.engine.works.decision_work; a chat, decider.engine.works.chat), and the `Footprint` it
reports of what it holds in the context.

A work never calls `llama_decode` itself. Each step, the scheduler asks it for rows (`plan_step`)
within the step's token, sequence and memory-cell budgets; after the decode, each row's `on_done`
feeds its readout back. The protocol lives here, beside the loop that drives it, so scheduling
never imports the works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from decider.engine.memory.prefix_cache import Caches
from decider.engine.memory.sequences import SeqPool
from decider.engine.scheduling.cost import Cost
from decider.engine.scheduling.steps import Step


@dataclass(frozen=True)
class Footprint:
    """What a work holds in the context now: everything the scheduler's memory accounting reads.

    Cells: `future` are reserved and not decoded yet, `live` decoded and still owned, `dead`
    (cumulative) released into the graveyards (batch-invariant mode)."""

    live: int = 0
    future: int = 0
    dead: int = 0
    seqs: tuple[int, ...] = ()  # every sequence it holds, whatever its role
    prefix_seqs: int = 0  # sequences its prefixes still need to open their branches (Step.branch_reserve)
    holds_epoch_cells: bool = False  # a started, open decision state: a memory epoch must keep its cells
    streams_alone: bool = False  # a state too large for one epoch runs: no other state may start

    @property
    def held(self) -> int:
        return self.live + self.future


class Work(Protocol):
    """What the scheduler drives."""

    kind: str
    decodes: int
    timing: dict[str, float]

    @property
    def cost(self) -> Cost:
        """What it costs the engine at most (the wait estimates of the work behind it)."""
        ...

    @property
    def least_cost(self) -> Cost:
        """What it costs the engine at least (whether it can meet its own deadline)."""
        ...

    def costs_given(self, caches: Caches | None) -> tuple[Cost, Cost]:
        """`cost` and `least_cost` less what the caches hold now (admission, before it is submitted)."""
        ...

    @property
    def started(self) -> bool: ...

    @property
    def wants_start(self) -> bool:
        """It has a unit of work (a state, a chat) that has not started yet."""
        ...

    @property
    def started_units(self) -> int:
        """Its units (states, a chat) that have started (the scheduler's per-unit fairness)."""
        ...

    @property
    def finished(self) -> bool: ...

    def footprint(self) -> Footprint: ...

    def plan_step(self, step: Step) -> None: ...

    def outcome(self) -> Any: ...

    def abandon(self, seqs: SeqPool) -> None: ...
