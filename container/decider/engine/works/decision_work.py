"""A decision request as a unit of engine work: a state machine over decode steps
(`decider.engine.scheduling.work.Work`; a chat completion is `decider.engine.works.chat.ChatWork`).

A work never calls `llama_decode` itself. Each step, the scheduler asks it for rows (`plan_step`)
within the step's token, sequence and memory-cell budgets; after the decode, each row's `on_done`
feeds its readout back. So one decode can carry rows of many requests: the prefill of one state,
the question branches of another and the next token of a chat.

Decisions, shared mode: the constant prompt head lives in sequence HEAD_SEQ (computed once). Each
state gets a sequence copied from it with the state's tokens appended (its prefix); each question
branch is a copy of that sequence plus the question's tail, read at its last token. Labels of more
than one token need one more position per distinct label prefix: a copy of the branch plus that
prefix's last token. Sequences are always removed whole, never truncated (recurrent and hybrid
models cannot truncate). Fresh mode decodes each question's whole prompt in its own sequence.
"""

from __future__ import annotations

from collections import deque

from decider.engine.memory.prefix_cache import Caches, RepeatCache
from decider.engine.memory.sequences import SeqPool
from decider.engine.model.labels import READOUT_CHAIN
from decider.engine.model.native import OutputSpec, Row
from decider.engine.scheduling.cost import Cost
from decider.engine.scheduling.steps import Step, Unit
from decider.engine.scheduling.work import Footprint
from decider.engine.works.decisions import DecisionOutcome, DecisionPlan, DecisionPlanner, Item, Prefix
from decider.engine.works.state_run import Branch, Fill, StateRun
from decider.invariance import HEAD_SEQ


class DecisionWork:
    """One decision request (or a batch of states sharing its questions) on the shared context."""

    kind = "decision"

    def __init__(self, plan: DecisionPlan, planner: DecisionPlanner) -> None:
        self.plan = plan
        self.planner = planner
        self.head = list(planner.builder.head_tokens)
        fresh = plan.mode == "fresh"
        self.states = []
        for state in plan.states:
            before = len(self.head) + len(state.prefix) if fresh else 0  # prompt tokens in each branch
            cells = {id(item): before + len(item.tokens) + len(item.trie.nodes) - 1 for item in state.items}
            prefix_cells = 0 if fresh else len(state.prefix)
            run = StateRun(state, deque(state.items), len(state.items), cells, prefix_cells)
            run.branch_seqs = 2 if any(item.trie.children(()) for item in state.items) else 1
            if not fresh and state.items and state.prompt.canonical:
                run.boundary = len(state.prompt.tokens)
            self.states.append(run)
        for run in self.states:
            run.streaming = bool(run.item_cells) and run.need > planner.room
        self.decodes = 0
        self.rows = 0
        self.timing: dict[str, float] = {}  # filled by the scheduler when the work completes
        self._held: set[int] = set()  # every sequence this request holds, whatever its role
        self._caches: Caches | None = None  # the scheduler's, seen at the first step

    def _acquire(self, step: Step) -> int:
        """An empty sequence (callers check step.seqs.available first)."""
        seq = step.seqs.acquire()
        assert seq is not None, "callers check step.seqs.available first"
        self._held.add(seq)
        return seq

    def _fork(self, step: Step, src: int) -> int:
        """A new sequence sharing `src`'s cells (callers check step.seqs.available first)."""
        seq = step.seqs.fork(src)
        self._held.add(seq)
        return seq

    def _free(self, step: Step, seq: int) -> None:
        self._held.discard(seq)
        step.seqs.release(seq)

    @property
    def cost(self) -> Cost:
        return self.plan.cost

    @property
    def least_cost(self) -> Cost:
        return self.plan.cost

    @property
    def finished(self) -> bool:
        return all(state.open_items == 0 for state in self.states)

    @property
    def started(self) -> bool:
        return any(state.started for state in self.states)

    @property
    def wants_start(self) -> bool:
        return any(not state.started and state.open_items and not state.following for state in self.states)

    @property
    def started_units(self) -> int:
        return sum(1 for state in self.states if state.started)

    def footprint(self) -> Footprint:
        running = [state for state in self.states if state.started and state.open_items]
        return Footprint(
            live=sum(state.decoded - state.released for state in self.states),
            future=sum(state.future for state in self.states),
            dead=sum(state.dead for state in self.states),
            seqs=tuple(sorted(self._held)),
            prefix_seqs=sum(state.branch_seqs for state in self.states if state.seq is not None),
            holds_epoch_cells=bool(running),
            streams_alone=any(state.streaming for state in running),
        )

    def outcome(self) -> DecisionOutcome:
        """The readouts, handed back as they are: the response is made off the engine thread."""
        return self.planner.outcome(
            self.plan,
            {"decodes": self.decodes, "rows": self.rows, "timing": self.timing},
            [state.cached_tokens for state in self.states],
        )

    # --- planning ---------------------------------------------------------------------------------
    def plan_step(self, step: Step) -> None:
        before = len(step.rows)
        self._caches = step.caches
        for state in self.states:
            if not state.repeats_checked:
                state.answer_repeats(*self._repeats(step.caches))
            if state.open_items == 0 or state.following:
                continue
            if not state.started and not self._start_state(state, step):
                continue
            if self.plan.mode == "shared":
                self._plan_shared(state, step)
            else:
                self._plan_fresh(state, step)
        if len(step.rows) > before:
            self.decodes += 1
            self.rows += len(step.rows) - before

    # --- kept across requests -------------------------------------------------------------------
    def _repeats(self, caches: Caches | None) -> tuple[RepeatCache | None, str]:
        """The repeat cache (shared mode only), and what this work's keys are digested under: the
        model and prompt version, extensions, the cache space."""
        if caches is None or caches.repeats is None or self.plan.mode != "shared":
            return None, ""
        return (
            caches.repeats,
            f"{caches.namespace}|extensions={bool(self.plan.options.extensions)}|{self.plan.space}",
        )

    def costs_given(self, caches: Caches | None) -> tuple[Cost, Cost]:
        """What it costs beside what the caches hold now: each state's kept prefix and the items that
        are exact repeats decode nothing. Admission asks it on the event loop before the work is
        submitted; both caches answer a peek (decider.engine.memory.prefix_cache), so it is an estimate."""
        if caches is None or self.plan.mode != "shared":
            return self.cost, self.least_cost
        cached: list[int] = []
        repeated: list[set[int]] = []
        for state in self.states:
            cached.append(
                caches.states.peek(state.plan.prefix, state.boundary, space=self.plan.space)
                if caches.states
                else 0
            )
            repeated.append(state.peek_repeats(*self._repeats(caches)))
        cost = self.plan.cost_given(cached, repeated)
        return cost, cost

    def _unpin(self, state: StateRun) -> None:
        if state.entry is not None:
            states = self._caches.states if self._caches is not None else None
            if states is not None:
                states.unpin(state.entry)
            state.entry = None

    def _start_state(self, state: StateRun, step: Step) -> bool:
        """Reserve the state's cells (all of them; a streaming state: its prefix and one branch).

        A kept state that begins this one's prefix (restored from host memory if need be) is
        pinned before the reservation (so making room cannot evict it), and its cells are left out
        of the reservation: they are its own."""
        shared = self.plan.mode == "shared"
        kept = step.caches.states if shared and step.caches is not None else None
        unit = Unit.STREAMING_STATE if state.streaming else Unit.STATE
        cells = state.prefix_cells + state.largest_item if state.streaming else state.need
        hit = None
        if kept is not None:
            hit = kept.lookup(state.plan.prefix, state.boundary, space=self.plan.space, room=step, then=cells)
        cached = hit.length if hit is not None else 0
        if hit is not None:
            hit.entry.pins += 1
        # shared: its prefix, held across steps, and its first branch; fresh: the first branch
        started = step.try_start(unit, cells - cached, sequences=state.branch_seqs + (1 if shared else 0))
        if not started:
            if hit is not None:
                hit.entry.pins -= 1
            return False
        state.started = True
        if shared:
            if hit is not None and kept is not None:
                seq = self._acquire(step)
                kept.take(hit, seq)  # shares the hit's cells and pins once more: drop the reservation's pin
                hit.entry.pins -= 1
                state.entry = hit.entry
                state.cached = state.prefilled = cached
                state.prefix_cells -= cached
            else:
                seq = self._fork(step, HEAD_SEQ)
                if kept is not None:
                    kept.missed()
            state.seq = seq
            step.branch_reserve += state.branch_seqs
        return True

    def _keep_state(self, step: Step, state: StateRun) -> None:
        """The prefix has reached its canonical boundary (or, where a copy may be cut, its end):
        the cache keeps a copy of the state."""
        kept = step.caches.states if step.caches is not None else None
        if kept is None or state.boundary is None or state.cached >= state.boundary or state.seq is None:
            return
        if state.prefilled == state.boundary or (kept.partial and state.prefilled == len(state.plan.prefix)):
            kept.store(
                state.plan.prefix[: state.boundary],
                state.seq,
                longer=state.prefilled > state.boundary,
                space=self.plan.space,
            )

    def _plan_shared(self, state: StateRun, step: Step) -> None:
        prefix = state.plan.prefix
        if state.prefilled < len(prefix):
            end = len(prefix)
            kept = step.caches.states if step.caches is not None else None
            boundary = state.boundary
            if kept is not None and not kept.partial and boundary is not None and state.prefilled < boundary:
                end = boundary  # a copy cannot be cut on this model: the prefill stops at the boundary once
            take = step.take(end - state.prefilled, alone=True)
            if take > 0:
                start = state.prefilled
                assert state.seq is not None
                row = Row(state.seq, prefix[start : start + take], len(self.head) + start)
                step.add(self, row, lambda _row: self._prefilled(step, state, take))
            return  # branches are copied only from a fully decoded prefix
        self._plan_children(state, step)
        if not step.equal_rows:
            self._plan_fills(state, step)
        base = len(self.head) + len(prefix)
        room = self._room(state, step)
        while state.pending and room > 0 and self._fits(step, state):
            item = state.pending.popleft()
            assert state.seq is not None
            seq = self._fork(step, state.seq)
            self._open_branch(step, state, Fill(item, seq, item.tokens, base))
            room = self._room(state, step) if not step.equal_rows else room - len(item.tokens)
        if step.equal_rows:
            self._plan_fills(state, step)  # the open branches and those just opened, longest first
        if not state.pending and state.seq is not None:
            self._free(step, state.seq)  # every branch holds the prefix's cells now
            state.seq = None
            step.branch_reserve -= state.branch_seqs

    def _prefilled(self, step: Step, state: StateRun, take: int) -> None:
        state.prefilled += take
        state.decoded += take
        self._keep_state(step, state)

    def _plan_fresh(self, state: StateRun, step: Step) -> None:
        self._plan_children(state, step)
        if not step.equal_rows:
            self._plan_fills(state, step)
        before = [*self.head, *state.plan.prefix]
        room = self._room(state, step)
        while state.pending and room > 0 and self._fits(step, state):
            item = state.pending.popleft()
            self._open_branch(step, state, Fill(item, self._acquire(step), [*before, *item.tokens], 0))
            room = self._room(state, step) if not step.equal_rows else room - len(before) - len(item.tokens)
        if step.equal_rows:
            self._plan_fills(state, step)

    @staticmethod
    def _room(state: StateRun, step: Step) -> int:
        """Tokens of this step still free for new branches. With equal rows the new branches are
        planned only after they all are open, so the open branches' unplanned tokens count as taken:
        a branch is opened (and holds a sequence) only when the step can carry some of it."""
        if not step.equal_rows:
            return step.tokens_left
        return step.tokens_left - sum(len(fill.tokens) - fill.planned for fill in state.filling)

    @staticmethod
    def _fits(step: Step, state: StateRun) -> bool:
        """Room for the next branch, and take it.

        Sequences: an item with multi-token labels leaves one free for its label positions, which
        are copies of its branch. Cells: always inside a state's reservation; a streaming state's
        reservation holds its largest item, and only the items open beyond it take free cells. In
        memory epochs a streaming state opens its items one at a time (label positions included):
        a branch freed below a live sibling would leave a hole that the sibling's next cells fill
        out of position order."""
        item = state.pending[0]
        if step.seqs.available < (2 if item.trie.children(()) else 1):
            return False
        cells = state.item_cells[id(item)]
        if state.streaming:
            if step.seqs.epochs and state.open_items > len(state.pending):
                return False
            extra = max(0, state.opened + cells - max(state.largest_item, state.opened))
            if extra > step.cells_left:
                return False
            step.cells_left -= extra
        state.opened += cells
        return True

    def _open_branch(self, step: Step, state: StateRun, fill: Fill) -> None:
        state.filling.append(fill)
        if not step.equal_rows:  # with equal rows the new branches are planned together, longest first
            self._plan_piece(step, state, fill)

    def _plan_fills(self, state: StateRun, step: Step) -> None:
        """Branches whose prompt is longer than one step's budget continue where they stopped (with
        equal rows, all the open ones at once, on the row length they settle on)."""
        fills = list(state.filling)
        step.settle_row_tokens([len(fill.tokens) - fill.planned for fill in fills])
        for fill in fills:
            if not step.tokens_left:
                return
            if fill.planned < len(fill.tokens):
                self._plan_piece(step, state, fill)

    def _plan_piece(self, step: Step, state: StateRun, fill: Fill) -> None:
        take = step.take(len(fill.tokens) - fill.planned)
        if take <= 0:
            return
        start = fill.planned
        fill.planned += take
        last = fill.planned == len(fill.tokens)
        spec = self._spec(fill.item, ()) if last else None
        row = Row(fill.seq, fill.tokens[start : start + take], fill.start + start, spec)

        def done(finished: Row) -> None:
            state.decoded += take
            if last:
                state.filling.remove(fill)
                end = fill.start + len(fill.tokens)
                self._read(step, state, Branch(fill.item, (), fill.seq, end, deque()), finished)

        step.add(self, row, done, keep=not state.streaming)

    def _plan_children(self, state: StateRun, step: Step) -> None:
        """Positions for multi-token labels: copy a read branch, append one label token, read there."""
        for branch in list(state.branches):
            while branch.children and step.seqs.available and step.tokens_left:
                child = branch.children.popleft()
                seq = self._fork(step, branch.seq)
                row = Row(seq, [child[-1]], branch.end, self._spec(branch.item, child))
                grown = Branch(branch.item, child, seq, branch.end + 1, deque())
                step.add(
                    self,
                    row,
                    lambda done, grown=grown: self._child_read(step, state, grown, done),
                    keep=not state.streaming,
                )
            if not branch.children:
                state.branches.remove(branch)
                self._drop(step, state, branch)

    def _read(self, step: Step, state: StateRun, branch: Branch, done: Row) -> None:
        assert done.result is not None
        branch.item.outputs[branch.prefix] = done.result
        branch.children.extend(branch.item.trie.children(branch.prefix))
        if branch.children:
            state.branches.append(branch)
        else:
            self._drop(step, state, branch)

    def _child_read(self, step: Step, state: StateRun, branch: Branch, done: Row) -> None:
        state.decoded += 1
        self._read(step, state, branch, done)

    def _drop(self, step: Step, state: StateRun, branch: Branch) -> None:
        """Remove a branch whose children have all started; close its item once fully read."""
        self._free(step, branch.seq)
        item = branch.item
        if len(item.outputs) == len(item.trie.nodes) and not any(b.item is item for b in state.branches):
            self._release(step.seqs, state, state.item_cells[id(item)], kept=not state.streaming)
            state.opened -= state.item_cells[id(item)]
            state.open_items -= 1
            state.remember(item)
            if state.open_items == 0:
                self._release(step.seqs, state, state.prefix_cells)
                self._unpin(state)
                state.give_up()  # nothing it claimed is left: a follower never waits on it

    @staticmethod
    def _release(seqs: SeqPool, state: StateRun, cells: int, *, kept: bool = True) -> None:
        state.released += cells
        if kept and seqs.epochs:
            state.dead += cells

    def _spec(self, item: Item, prefix: Prefix) -> OutputSpec:
        extensions = self.plan.options.extensions
        return OutputSpec(
            token_ids=item.trie.nodes[prefix],
            logsumexp=item.readout == READOUT_CHAIN or extensions,
            argmax=extensions and not prefix,
        )

    def abandon(self, seqs: SeqPool) -> None:
        """Release every sequence (the request was cancelled or failed), planned rows' included."""
        for seq in sorted(self._held):
            seqs.release(seq)
        self._held.clear()
        for state in self.states:
            self._unpin(state)
            state.give_up()
            state.branches.clear()
            state.filling.clear()
            state.seq = None
            state.pending.clear()
            state.open_items = 0
            state.opened = 0
            self._release(seqs, state, state.decoded - state.released)
