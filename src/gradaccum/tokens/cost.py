"""Balancing the ranks by compute cost instead of valid tokens: the cost model and the row moves.

A token budget's plan balances the ranks' valid tokens (:mod:`gradaccum.tokens.balance`). That is
the right measure while a transformer's time is its projections and MLPs, which grow with tokens;
attention grows with the square of a row's length, so on long-tailed lengths (a few rows of
thousands of tokens beside many short ones) the rank holding the long rows computes more for the
same tokens and every other rank waits for it at the gradient all-reduce.

``cost`` is a callable on one micro-batch's row lengths (its rows' valid tokens) returning that
micro-batch's compute cost; it need not be a sum over rows (a fixed cost per micro-batch, a cost
of the padded shape). The plan balances the ranks' totals of whatever it returns.

:func:`transformer_cost` is the built-in. Per layer and per token, a transformer's linear layers
(the query, key, value and output projections, 4·d² multiply-adds; an MLP of width 4d, 8·d²) take
about 24·d² FLOPs forward, and attention (the scores q·kᵀ over the row's L keys, then the weighted
sum of L values, L·d multiply-adds each) about 4·L·d. A row of length L so costs
``L · 24·d² · (1 + L / (6·d))``; in units of one token's linear layers that is
``L · (1 + L / (6·d))``, per layer (the backward pass is about twice the forward for both terms, so
the ratio holds). A row of ``6·d`` tokens costs twice its tokens; at d = 4096 that is 24k tokens.
The embedding and the output head are per token and left out (they add to the linear term, so the
formula weighs attention slightly high on models with a large vocabulary against a small d); a
causal kernel that skips the masked half of the scores halves the attention term.

The balancer here works after the plan's cut and largest differencing (both run on the
micro-batches' costs): it moves whole micro-batches, swaps them, and moves or swaps single rows
between the heaviest rank and the lightest one that a move helps, each move the one that lowers
the heavier of the two ranks most (ties: the least padding added), until every rank lies within
``tolerance`` of the ranks' mean or no move lowers it. Every candidate is priced by calling
``cost`` on the micro-batches it would make, so a cost that is not a sum over rows is balanced by
what it returns. Deterministic: ties go to the lowest indices.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gradaccum.errors import PlanError
from gradaccum.values import require_int

__all__ = [
    "CostFn",
    "TransformerCost",
    "balance_by_cost",
    "cost_imbalance",
    "model_dimensions",
    "transformer_cost",
]

CostFn = Callable[[Sequence[int]], float]
"""A micro-batch's compute cost from its rows' valid tokens."""


@dataclass(frozen=True, slots=True)
class TransformerCost:
    """``sum(L * (1 + L / (6 * d_model))) * layers`` over a micro-batch's rows (see the module)."""

    d_model: int
    """The model's hidden width."""
    layers: int = 1
    """Transformer blocks (the cost scales with them; the balance does not)."""

    def __post_init__(self) -> None:
        require_int("d_model", self.d_model, error=PlanError)
        require_int("layers", self.layers, error=PlanError)

    def __call__(self, lengths: Sequence[int]) -> float:
        width = 6.0 * self.d_model
        return self.layers * sum(n * (1.0 + n / width) for n in lengths)

    def to_dict(self) -> dict[str, int | str]:
        """What a run card records."""
        return {"model": "transformer", "d_model": self.d_model, "layers": self.layers}


def transformer_cost(d_model: int, layers: int = 1) -> TransformerCost:
    """The built-in cost: a row of ``L`` valid tokens costs ``L * (1 + L / (6 * d_model))`` token
    units per layer, times ``layers``; a micro-batch, the sum over its rows (see the module for the
    derivation). Pass it as ``cost=`` to :func:`gradaccum.split_by_tokens`, ``plan_batch`` or
    ``gradaccum.windows``."""
    return TransformerCost(d_model, layers)


WIDTH_NAMES = ("d_model", "hidden_size", "n_embd", "dim", "embed_dim")
"""Where a model's config (transformers' ``config``, a module's ``cfg``) or the module itself names
its hidden width, first match wins."""
DEPTH_NAMES = ("n_layer", "num_hidden_layers", "num_layers", "n_layers")
"""Where it names its number of transformer blocks."""


def _whole(holder: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(holder, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def model_dimensions(model: object) -> tuple[int, int] | None:
    """(d_model, layers) a model declares, or None: read from its ``config`` (transformers), its
    ``cfg``, or the module itself (:data:`WIDTH_NAMES`, :data:`DEPTH_NAMES`), through the wrappers
    that hold it (DDP's ``module``, torch.compile's ``_orig_mod``)."""
    for _ in range(4):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            break
        model = inner
    for holder in (getattr(model, "config", None), getattr(model, "cfg", None), model):
        if holder is None:
            continue
        width, depth = _whole(holder, WIDTH_NAMES), _whole(holder, DEPTH_NAMES)
        if width is not None and depth is not None:
            return width, depth
    return None


def cost_imbalance(totals: Sequence[float]) -> float:
    """The slowest rank's cost over the ranks' mean (1.0: balanced, or nothing to compute)."""
    mean = sum(totals) / len(totals) if totals else 0.0
    return max(totals) / mean if mean > 0 else 1.0


def _price(cost: CostFn, valid: Sequence[int], rows: Sequence[int]) -> float:
    value = float(cost([valid[i] for i in rows]))
    if value != value or value in (float("inf"), float("-inf")) or value < 0:
        raise PlanError(
            f"cost returned {value!r} for a micro-batch of row lengths {[valid[i] for i in rows]}: a "
            "compute cost must be a finite number >= 0"
        )
    return value


@dataclass(slots=True)
class _State:
    ranks: list[list[list[int]]]
    costs: list[list[float]]
    lengths: Sequence[int]
    valid: Sequence[int]
    max_tokens: int
    cost: CostFn
    equal_count: bool
    alone: list[float]
    """Each row's cost in a micro-batch of its own: the key swap partners are sought by."""
    additive: bool = False
    """``cost`` is a sum over rows by construction (:class:`TransformerCost`): a move's cost is
    the difference of its rows' costs alone, without calling it."""

    def totals(self) -> list[float]:
        return [sum(rank) for rank in self.costs]

    def price(self, rows: Sequence[int]) -> float:
        return _price(self.cost, self.valid, rows)


def longest_two(rows: Sequence[int], lengths: Sequence[int]) -> tuple[int, int, int]:
    """(longest length, its row, the next longest length) of a micro-batch."""
    first, second, row = 0, 0, -1
    for i in rows:
        if lengths[i] > first:
            first, second, row = lengths[i], first, i
        elif lengths[i] > second:
            second = lengths[i]
    return first, row, second


Move = tuple[float, int, int, int, int, int, tuple[float, float], str]
"""(the heavier rank after it, padding added, x, y, a, b, the two micro-batches' costs after it,
the kind): what :func:`_best_move` finds, and :func:`_apply` makes."""


def _best_move(s: _State, heavy: int, light: int, gap: float) -> Move | None:
    """The move between rank ``heavy`` and rank ``light`` that lowers the heavier of the two, adding
    the least padding (then lowering it most); a split only where nothing else does.

    Budgets are checked from each micro-batch's longest rows before ``cost`` is called; a swap
    partner for row a is sought among the few rows of the light micro-batch whose cost alone lies
    nearest ``alone[a] - gap / 2`` (the swap that would close the gap for an additive cost). A cost
    that is a sum over rows by construction (:class:`TransformerCost`) is priced by differences of
    its rows' costs instead of calls."""
    total_h, total_l = sum(s.costs[heavy]), sum(s.costs[light])
    bar = total_h - 1e-12 * max(total_h, 1.0)  # a move must lower the heavy rank's cost
    best: Move | None = None
    best_key: tuple[bool, int, float, int, int, int, int] | None = None
    budget, lengths, alone, additive = s.max_tokens, s.lengths, s.alone, s.additive

    def offer(after: tuple[float, float], padding: int, at: tuple[int, int, int, int], kind: str,
              costs: tuple[float, float]) -> None:  # fmt: skip
        nonlocal best, best_key
        top = max(after)
        if top >= bar:
            return
        # a row split off into a micro-batch of its own adds a micro-batch (and its fixed cost, which
        # ``cost`` may not know of): the last resort, taken only where no other move lowers the rank
        key = (kind == "split", padding, top, *at)
        if best_key is None or key < best_key:
            best, best_key = (top, padding, *at, costs, kind), key

    heavy_mbs, light_mbs = s.ranks[heavy], s.ranks[light]
    for x in range(len(heavy_mbs)):
        c_x = s.costs[heavy][x]
        if not s.equal_count and len(heavy_mbs) > 1:  # the whole micro-batch moves
            offer((total_h - c_x, total_l + c_x), 0, (x, -1, -1, -1), "move", (0.0, c_x))
        for y in range(len(light_mbs)):  # the two micro-batches trade places
            c_y = s.costs[light][y]
            offer((total_h - c_x + c_y, total_l - c_y + c_x), 0, (x, y, -1, -1), "trade", (c_y, c_x))
    lights = []
    for rows_y in light_mbs:
        by_alone = sorted(rows_y, key=lambda i: (alone[i], i))
        lights.append((rows_y, longest_two(rows_y, lengths), by_alone, [alone[i] for i in by_alone]))
    for x, rows_x in enumerate(heavy_mbs):
        c_x, n_x = s.costs[heavy][x], len(rows_x)
        movable = n_x > 1  # a row moves only out of a micro-batch of two or more; swaps from any
        top_x = longest_two(rows_x, lengths)
        before_x = n_x * top_x[0]
        for a in rows_x:
            rest = None if additive else [i for i in rows_x if i != a]
            rest_top = top_x[2] if a == top_x[1] else top_x[0]
            c_rest = 0.0
            if movable:
                c_rest = c_x - alone[a] if rest is None else s.price(rest)
            if movable and not s.equal_count:  # a leaves for a micro-batch of its own
                padding = (n_x - 1) * rest_top + lengths[a] - before_x
                after = (total_h - c_x + c_rest, total_l + alone[a])
                offer(after, padding, (x, -1, a, -1), "split", (c_rest, alone[a]))
            for y, (rows_y, top_y, by_alone, keys) in enumerate(lights):
                c_y, n_y = s.costs[light][y], len(rows_y)
                before_y = n_y * top_y[0]
                grown = (n_y + 1) * max(top_y[0], lengths[a])
                if movable and grown <= budget:  # a moves alone
                    cy = c_y + alone[a] if rest is None else s.price([*rows_y, a])
                    padding = (n_x - 1) * rest_top + grown - before_x - before_y
                    offer(
                        (total_h - c_x + c_rest, total_l - c_y + cy),
                        padding,
                        (x, y, a, -1),
                        "row",
                        (c_rest, cy),
                    )
                near = bisect.bisect_left(keys, alone[a] - gap / 2)
                for b in by_alone[max(0, near - 2) : near + 2]:  # a and b swap
                    rest_y = top_y[2] if b == top_y[1] else top_y[0]
                    size_x, size_y = n_x * max(rest_top, lengths[b]), n_y * max(rest_y, lengths[a])
                    if size_x > budget or size_y > budget:
                        continue
                    if rest is None:
                        cx, cy = c_x - alone[a] + alone[b], c_y - alone[b] + alone[a]
                    else:
                        cx, cy = s.price([*rest, b]), s.price([*(i for i in rows_y if i != b), a])
                    padding = size_x + size_y - before_x - before_y
                    offer((total_h - c_x + cx, total_l - c_y + cy), padding, (x, y, a, b), "row", (cx, cy))
    return best


def _apply(s: _State, heavy: int, light: int, move: Move) -> None:
    _, _, x, y, a, b, costs, kind = move
    if kind == "move":
        s.ranks[light].append(s.ranks[heavy].pop(x))
        s.costs[light].append(s.costs[heavy].pop(x))
        return
    if kind == "trade":
        s.ranks[heavy][x], s.ranks[light][y] = s.ranks[light][y], s.ranks[heavy][x]
        s.costs[heavy][x], s.costs[light][y] = costs
        return
    s.ranks[heavy][x].remove(a)
    s.costs[heavy][x] = costs[0]
    if kind == "split":
        s.ranks[light].append([a])
        s.costs[light].append(costs[1])
        return
    s.ranks[light][y].append(a)
    if b >= 0:
        s.ranks[light][y].remove(b)
        s.ranks[heavy][x].append(b)
    s.costs[light][y] = costs[1]


def balance_by_cost(
    ranks: list[list[list[int]]],
    lengths: Sequence[int],
    valid: Sequence[int],
    max_tokens: int,
    cost: CostFn,
    *,
    equal_count: bool,
    tolerance: float,
) -> None:
    """Lower the heaviest rank's cost by moves within the budget, in place (see the module).

    Whole micro-batches move only without ``equal_count`` and only from a rank of two or more (every
    rank keeps one); rows move only out of a micro-batch of two or more (none is emptied), and a
    move or swap is taken only where both micro-batches stay within ``max_tokens``."""
    s = _State(
        ranks=ranks,
        costs=[[_price(cost, valid, mb) for mb in rank] for rank in ranks],
        lengths=lengths,
        valid=valid,
        max_tokens=max_tokens,
        cost=cost,
        equal_count=equal_count,
        alone=[0.0] * len(lengths),
        additive=isinstance(cost, TransformerCost),
    )
    s.alone = [s.price([i]) for i in range(len(lengths))]
    for _ in range(4 * len(lengths) + 4 * len(ranks)):  # each move lowers a rank; this bounds the work
        totals = s.totals()
        if cost_imbalance(totals) <= 1 + tolerance:
            break
        heavy = max(range(len(ranks)), key=lambda r: (totals[r], -r))
        lights = sorted((r for r in range(len(ranks)) if r != heavy), key=lambda r: (totals[r], r))
        for light in lights:
            move = _best_move(s, heavy, light, totals[heavy] - totals[light])
            if move is not None:
                _apply(s, heavy, light, move)
                break
        else:
            break
    for rank in ranks:
        for mb in rank:
            mb.sort(key=lambda i: (-lengths[i], i))
