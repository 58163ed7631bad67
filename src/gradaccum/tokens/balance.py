"""Rows into micro-batches within a token budget, and micro-batches onto ranks: plain arithmetic.

No tensors here: the cut and the assignment work on row lengths, so that they are tested on their
own and the trainer, the loaders and the benchmarks plan the same way.

The cut sorts the rows by length, longest first (ties by position, so the plan is deterministic),
and fills each micro-batch while ``rows x longest <= max_tokens``. Since the rows of a micro-batch
are neighbours in length, trimming it to its own longest row leaves little padding; since each
micro-batch is filled until the next row would overflow it, few micro-batches are needed.

The assignment is the largest differencing method of Karmarkar and Karp for ``world`` sets: each
micro-batch starts as a partition of its own, the two partitions whose sets differ most are merged
(the heaviest set of one with the lightest of the other), until one is left. It balances better
than greedy longest-first placement when the items are few per rank, as here (a handful of
micro-batches each). With ``equal_count`` the partitions start as groups of ``world`` consecutive
micro-batches (by weight), one in each set, so every merge keeps the sets' sizes equal.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gradaccum.errors import PlanError
from gradaccum.tokens.cost import CostFn, balance_by_cost, longest_two
from gradaccum.tokens.cost import cost_imbalance as ratio_to_mean
from gradaccum.values import require_int

__all__ = ["TokenPlan", "assign", "cut", "plan_tokens"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenPlan:
    """Which rows form each micro-batch of each rank, and what that computes."""

    ranks: tuple[tuple[tuple[int, ...], ...], ...]
    """``ranks[r][m]``: the row indices of rank r's micro-batch m, longest row first."""
    lengths: tuple[int, ...]
    """Each row's length: the position after its last valid token (what trimming keeps)."""
    valid: tuple[int, ...]
    """Each row's valid tokens (``attention_mask`` ones)."""
    max_tokens: int
    """The budget: rows x longest of every micro-batch is at most this."""
    cost: CostFn | None = field(default=None, compare=False)
    """What the ranks were balanced by: a micro-batch's compute cost from its rows' valid tokens
    (:mod:`gradaccum.tokens.cost`); ``None``: the ranks' valid tokens."""

    def computed_tokens(self, rows: Sequence[int]) -> int:
        """Token positions a micro-batch of these rows computes once trimmed: rows x longest."""
        return len(rows) * max(self.lengths[i] for i in rows)

    @property
    def micro_batches(self) -> int:
        """Micro-batches over every rank."""
        return sum(len(rank) for rank in self.ranks)

    @property
    def rank_valid_tokens(self) -> tuple[int, ...]:
        """Each rank's valid tokens."""
        return tuple(sum(self.valid[i] for mb in rank for i in mb) for rank in self.ranks)

    @property
    def rank_computed_tokens(self) -> tuple[int, ...]:
        """Each rank's computed token positions (padding included)."""
        return tuple(sum(self.computed_tokens(mb) for mb in rank) for rank in self.ranks)

    @property
    def padding_fraction(self) -> float:
        """Padding over computed positions, every rank's micro-batches together."""
        computed = sum(self.rank_computed_tokens)
        return 1 - sum(self.valid) / computed if computed else 0.0

    @property
    def fewest_micro_batches(self) -> int:
        """The fewest micro-batches the budget allows: every valid token must fit somewhere."""
        return max(1, -(-sum(self.valid) // self.max_tokens))

    def rank_cost(self, cost: CostFn | None = None) -> tuple[float, ...]:
        """Each rank's compute cost: the sum over its micro-batches of ``cost`` (default the plan's
        own) called on each micro-batch's rows' valid tokens; a plan balanced by tokens and no
        ``cost`` given: each rank's valid tokens."""
        cost = self.cost if cost is None else cost
        if cost is None:
            return tuple(float(t) for t in self.rank_valid_tokens)
        return tuple(sum(float(cost([self.valid[i] for i in mb])) for mb in rank) for rank in self.ranks)

    def cost_imbalance(self, cost: CostFn | None = None) -> float:
        """The slowest rank's cost over the ranks' mean cost (:meth:`rank_cost`): 1.0 is balanced."""
        return ratio_to_mean(self.rank_cost(cost))

    @property
    def imbalance(self) -> float:
        """The largest distance of a rank's valid tokens from the ranks' mean, over that mean."""
        tokens = self.rank_valid_tokens
        mean = sum(tokens) / len(tokens)
        return max(abs(t - mean) for t in tokens) / mean if mean else 0.0


def cut(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices in micro-batches of at most ``max_tokens`` computed tokens, longest rows first.

    A row longer than the budget is refused (:class:`PlanError` naming its length and the budget):
    no micro-batch could hold it, and cutting it would change what the model sees.
    """
    max_tokens = require_int("max_tokens", max_tokens, error=PlanError)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if order and lengths[order[0]] > max_tokens:
        i = order[0]
        raise PlanError(
            f"row {i} holds a sequence of {lengths[i]} tokens, longer than max_tokens={max_tokens}: no "
            f"micro-batch within the budget can hold it. Raise max_tokens to at least {lengths[i]}, or "
            "cut or drop the sequences longer than the budget before batching."
        )
    out: list[list[int]] = []
    for i in order:
        # the first row of a micro-batch is its longest, so rows x that length is its cost
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _halve(
    micro_batches: list[list[int]], world: int, weigh: Callable[[list[int]], float] | None = None
) -> None:
    """Split the micro-batch of most rows in two (each half stays within the budget, trimmed); with
    ``weigh`` (a micro-batch's cost), the costliest one of two rows or more: what keeps a cost
    balance from evening out is a micro-batch too costly to move, not one too coarse."""
    if weigh is None:
        j = max(range(len(micro_batches)), key=lambda m: (len(micro_batches[m]), -m))
    else:
        j = max(
            (m for m in range(len(micro_batches)) if len(micro_batches[m]) > 1),
            key=lambda m: (weigh(micro_batches[m]), -m),
            default=0,
        )
    rows = micro_batches[j]
    if len(rows) < 2:  # plan_tokens halves only while a micro-batch holds two rows
        raise PlanError(f"internal: {len(micro_batches)} micro-batches of one row each cannot be halved")
    half = (len(rows) + 1) // 2
    micro_batches[j : j + 1] = [rows[:half], rows[half:]]


def assign(weights: Sequence[float], world: int, *, equal_count: bool = False) -> list[list[int]]:
    """Item indices in ``world`` sets of balanced summed weight (largest differencing, see the
    module); with ``equal_count`` every set holds ``len(weights) / world`` items (which must divide).
    Sets come back heaviest first, each holding its items in their given order."""
    world = require_int("world", world, error=PlanError)
    if equal_count and len(weights) % world:
        raise PlanError(f"internal: {len(weights)} items do not divide into {world} equal sets")
    counter = itertools.count()
    # a partition: (-(max - min), tiebreak, sets) where sets are (sum, items) heaviest first
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []

    def push(sets: list[tuple[float, list[int]]]) -> None:
        sets.sort(key=lambda s: (-s[0], s[1][:1]))
        heapq.heappush(heap, (sets[-1][0] - sets[0][0], next(counter), sets))

    ascending = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    if equal_count:
        for start in range(0, len(ascending), world):
            push([(weights[i], [i]) for i in ascending[start : start + world]])
    else:
        for i in ascending:
            push([(weights[i], [i])] + [(0, []) for _ in range(world - 1)])
    if not heap:
        return [[] for _ in range(world)]
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # heaviest of one with lightest of the other: the differences cancel
        push([(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second), strict=True)])
    return [sorted(items) for _, items in heap[0][2]]


BALANCE_TOLERANCE = 0.02
"""How far a rank's valid tokens may lie from the ranks' mean before the plan spends another
micro-batch on balance: the slowest rank then waits about 2 % longer than the mean one."""


def _rebalance(
    ranks: list[list[list[int]]], lengths: Sequence[int], valid: Sequence[int], max_tokens: int
) -> None:
    """Move or swap single rows from the heaviest rank to the lightest, in place, while that
    narrows their gap and the ranks lie further than :data:`BALANCE_TOLERANCE` from the mean.

    Of the moves that fit the budget and narrow the gap, the one that adds the fewest computed
    tokens (padding) is taken, then the one that narrows it most: rows go where a micro-batch has
    room for them, which is why a plan with a micro-batch more than the fewest balances better.
    A swap of row a for row b is sought among the few rows of the light micro-batch whose valid
    tokens lie nearest ``valid[a] - gap / 2`` (the swap that would close the gap), so a pass costs
    rows x log(rows) per pair of micro-batches, not rows squared.
    """
    for _ in range(4 * len(lengths)):  # each move narrows the gap; this only bounds the work
        totals = [sum(valid[i] for mb in rank for i in mb) for rank in ranks]
        mean = sum(totals) / len(totals)
        if max(abs(t - mean) for t in totals) <= BALANCE_TOLERANCE * mean:
            return
        heavy = max(range(len(ranks)), key=lambda r: (totals[r], -r))
        light = min(range(len(ranks)), key=lambda r: (totals[r], r))
        gap = totals[heavy] - totals[light]
        lights = []
        for rows_y in ranks[light]:
            by_valid = sorted(rows_y, key=lambda i: (valid[i], i))
            lights.append((rows_y, longest_two(rows_y, lengths), by_valid, [valid[i] for i in by_valid]))
        best: tuple[int, float, int, int, int, int] | None = None
        for x, rows_x in enumerate(ranks[heavy]):
            top_x, n_x = longest_two(rows_x, lengths), len(rows_x)
            for y, (rows_y, top_y, by_valid, keys) in enumerate(lights):
                n_y = len(rows_y)
                before = n_x * top_x[0] + n_y * top_y[0]
                for a in rows_x:
                    rest_x = top_x[2] if a == top_x[1] else top_x[0]
                    candidates = []
                    if n_x > 1:  # a moves alone
                        candidates.append((-1, (n_x - 1) * rest_x, (n_y + 1) * max(top_y[0], lengths[a])))
                    near = bisect.bisect_left(keys, valid[a] - gap / 2)
                    for b in by_valid[max(0, near - 2) : near + 2]:  # a swaps with b
                        rest_y = top_y[2] if b == top_y[1] else top_y[0]
                        after_x = n_x * max(rest_x, lengths[b])
                        candidates.append((b, after_x, n_y * max(rest_y, lengths[a])))
                    for b, after_x, after_y in candidates:
                        narrowed = abs(gap - 2 * (valid[a] - (valid[b] if b >= 0 else 0)))
                        if narrowed >= gap or after_x > max_tokens or after_y > max_tokens:
                            continue
                        key = (after_x + after_y - before, narrowed, x, y, a, b)
                        if best is None or key < best:
                            best = key
        if best is None:
            return
        _, _, x, y, a, b = best
        ranks[heavy][x].remove(a)
        ranks[light][y].append(a)
        if b >= 0:
            ranks[light][y].remove(b)
            ranks[heavy][x].append(b)
        for mb in (ranks[heavy][x], ranks[light][y]):
            mb.sort(key=lambda i: (-lengths[i], i))


def _fill_empty(
    ranks: list[list[list[int]]], valid: Sequence[int], weigh: Callable[[list[int]], float] | None = None
) -> None:
    """Give every rank without a micro-batch one, in place, from a rank that holds two or more.

    The largest differencing balances weights, and a micro-batch of rows without a valid token
    weighs nothing: it can land beside another on one rank and leave a rank with none, which cannot
    step (the window's engine refuses an empty window). Of the micro-batches a rank of two or more
    can give, the move that leaves the ranks' valid tokens closest to their mean is taken (the row
    moves after it balance further). There are at least ``world`` micro-batches, so a giver exists.
    With ``weigh`` (a micro-batch's cost) the ranks' costs are brought closest to their mean instead.
    """

    def weight_of(rows: list[int]) -> float:
        return sum(valid[i] for i in rows) if weigh is None else weigh(rows)

    while True:
        empty = next((r for r, rank in enumerate(ranks) if not rank), None)
        if empty is None:
            return
        totals = [sum(weight_of(mb) for mb in rank) for rank in ranks]
        mean = sum(totals) / len(totals)
        best: tuple[float, int, int] | None = None
        for giver, rank in enumerate(ranks):
            if len(rank) < 2:
                continue
            for m, rows in enumerate(rank):
                weight = weight_of(rows)
                after = [
                    t - weight if r == giver else t + weight if r == empty else t
                    for r, t in enumerate(totals)
                ]
                key = (max(abs(t - mean) for t in after), giver, m)
                if best is None or key < best:
                    best = key
        if best is None:
            raise PlanError(f"internal: no rank can give rank {empty} a micro-batch")
        _, giver, m = best
        ranks[empty].append(ranks[giver].pop(m))


def _imbalance(ranks: list[list[list[int]]], valid: Sequence[int]) -> float:
    totals = [sum(valid[i] for mb in rank for i in mb) for rank in ranks]
    mean = sum(totals) / len(totals)
    return max(abs(t - mean) for t in totals) / mean if mean else 0.0


def _refuse_unequal(fewest: int, rows: int, world: int, max_tokens: int) -> None:
    """Refuse ``equal_count`` where no plan deals the ranks equal counts.

    The sorted cut needs the fewest micro-batches any plan within the budget can have (a micro-batch
    holding the longest row holds at most ``max_tokens // longest`` rows, and the cut gives it the
    longest ones, so the rest is no harder to cut), and any count from there up to one row per
    micro-batch is reached by halving. An equal plan exists iff a multiple of ``world`` lies
    between the two.
    """
    target = -(-fewest // world) * world
    if target > rows:
        raise PlanError(
            f"equal_count=True: the window's {rows} rows need at least {fewest} micro-batches within "
            f"max_tokens={max_tokens} and can fill at most {rows} (a row each), and no multiple of "
            f"{world} ranks lies between {fewest} and {rows}, so the ranks cannot run equal counts. "
            f"Give the window at least {target} rows, raise max_tokens so that fewer micro-batches "
            f"hold it, or leave equal_count off (DDP steps unequal counts exactly)."
        )


def plan_tokens(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    world: int = 1,
    equal_count: bool = False,
    valid: Sequence[int] | None = None,
    cost: CostFn | None = None,
) -> TokenPlan:
    """Cut rows into micro-batches within ``max_tokens`` and assign them to ``world`` ranks,
    balancing the ranks' valid tokens (``valid``, default the lengths), or with ``cost`` the ranks'
    totals of ``cost`` called on each micro-batch's rows' valid tokens (:mod:`gradaccum.tokens.cost`).

    The fewest micro-batches the sorted cut allows come first; while the ranks' valid tokens lie
    further than :data:`BALANCE_TOLERANCE` from their mean after the assignment and the row moves
    (:func:`_rebalance`), one more micro-batch (``world`` more with ``equal_count``) is made by
    splitting the one of most rows, up to ``world`` more in all; the best balanced plan is kept.
    Every rank gets at least one micro-batch (a rank with an empty window cannot step), and with
    ``equal_count`` the same number: a rank the assignment left empty (micro-batches of rows
    without a valid token weigh nothing) is given one by :func:`_fill_empty`. Fewer rows than ranks
    is refused, and ``equal_count`` only where no equal plan exists (:func:`_refuse_unequal`).

    With ``cost`` the same search runs on costs: the largest differencing over the micro-batches'
    costs, then :func:`gradaccum.tokens.cost.balance_by_cost`'s moves instead of the row moves, and
    the slowest rank's cost within :data:`BALANCE_TOLERANCE` of the mean ends the search. The cut,
    the budget, the halving and the rules above are the same; ``cost=None`` plans as before.
    """
    if cost is not None and not callable(cost):
        raise PlanError(
            f"cost must be a callable on a micro-batch's row lengths returning its compute cost "
            f"(e.g. gradaccum.tokens.transformer_cost(d_model, layers)), got {type(cost).__name__}"
        )
    world = require_int("world", world, error=PlanError)
    valid = list(lengths if valid is None else valid)
    if len(valid) != len(lengths):
        raise PlanError(f"internal: {len(valid)} valid counts for {len(lengths)} rows")
    if len(lengths) < world:
        raise PlanError(
            f"the window holds {len(lengths)} rows for {world} ranks: every rank needs at least one row "
            "to step. Give the window at least one row per rank (a larger global batch)."
        )
    micro_batches = cut(lengths, max_tokens)
    if equal_count:
        _refuse_unequal(len(micro_batches), len(lengths), world, max_tokens)
    # halving splits a micro-batch of two rows or more: possible while there are fewer than rows
    while len(micro_batches) < world or (equal_count and len(micro_batches) % world):
        _halve(micro_batches, world)
    fewest = len(micro_batches)
    best: list[list[list[int]]] | None = None
    if cost is None:

        def off(ranks: list[list[list[int]]]) -> float:
            return _imbalance(ranks, valid)

    else:
        price = cost

        def weigh(rows: list[int]) -> float:
            return float(price([valid[i] for i in rows]))

        def off(ranks: list[list[list[int]]]) -> float:
            return ratio_to_mean([sum(weigh(mb) for mb in rank) for rank in ranks]) - 1

    while True:
        if cost is None:
            weights: list[float] = [sum(valid[i] for i in mb) for mb in micro_batches]
        else:
            weights = [weigh(mb) for mb in micro_batches]
        sets = assign(weights, world, equal_count=equal_count)
        ranks = [[list(micro_batches[m]) for m in items] for items in sets]
        if world > 1 and cost is None:
            _fill_empty(ranks, valid)
            _rebalance(ranks, lengths, valid, max_tokens)
        elif world > 1:
            _fill_empty(ranks, valid, weigh)
            balance_by_cost(
                ranks,
                lengths,
                valid,
                max_tokens,
                price,
                equal_count=equal_count,
                tolerance=BALANCE_TOLERANCE,
            )
        if best is None or off(ranks) < off(best):
            best = ranks
        if off(best) <= BALANCE_TOLERANCE or len(micro_batches) >= fewest + world:
            break
        step = world if equal_count else 1
        if len(micro_batches) + step > len(lengths):  # each micro-batch holds a row at least
            break
        for _ in range(step):
            _halve(micro_batches, world, None if cost is None else weigh)
    return TokenPlan(
        ranks=tuple(tuple(tuple(mb) for mb in rank) for rank in best),
        lengths=tuple(lengths),
        valid=tuple(valid),
        max_tokens=max_tokens,
        cost=cost,
    )
