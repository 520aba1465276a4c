"""Per-cell constraints for the planner: fix or forbid options at chosen cells.

A rule names cells and options. As text (the ``loopkv plan --fix/--forbid`` syntax)::

    LOOPS:LAYERS=OPTIONS       e.g.  2:*=share      1:7,8=int4|bf16      *:0-3=int2

* ``LOOPS`` and ``LAYERS``: ``*`` (all), a number, an inclusive range ``a-b``, or a comma list of those.
  Loops and layers are 0-based, as everywhere in loopkv: the paper's "loop 3" of Ouro's four is loop 2
  here, and loop ``T-1`` is the final loop.
* ``OPTIONS``: one option or several joined by ``|`` (from ``bf16``, ``int4``, ``int2``, ``share``).

``fix`` restricts the named cells to the options given (one option: the cell takes exactly that); a fixed
option need not be in the solver's menu, but the profile must price it. ``forbid`` removes the options
from the named cells. In Python a rule is that string, a ``(cells, options)`` pair (``cells``: a
:class:`~loopkv.cells.Cell` or an iterable of them; ``options``: a str or a sequence), or a mapping
``{Cell: option(s)}`` for many at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loopkv.cells import Cell, CellLayout
from loopkv.format import OPTIONS

SYNTAX = "LOOPS:LAYERS=OPTIONS, e.g. '2:*=share' or '*:7=int2|share' (0-based loops and layers; * = all)"


@dataclass(frozen=True)
class Rule:
    """Cells (``loops`` x ``layers``; None = all) and the options a rule fixes or forbids there."""

    loops: tuple[int, ...] | None
    layers: tuple[int, ...] | None
    options: tuple[str, ...]
    text: str = ""

    def cells(self, layout: CellLayout) -> list[Cell]:
        """The cells this rule names; ValueError when a loop or layer is out of the layout's range."""
        for name, values, n in (("loop", self.loops, layout.loops), ("layer", self.layers, layout.layers)):
            bad = [v for v in values or () if not 0 <= v < n]
            if bad:
                raise ValueError(
                    f"rule {self.text or self!r} names {name}(s) {bad}, but the model has {n} {name}s (0-based: "
                    f"0..{n - 1})"
                )
        loops = range(layout.loops) if self.loops is None else self.loops
        layers = range(layout.layers) if self.layers is None else self.layers
        return [Cell(t, layer) for t in loops for layer in layers]


def parse_rule(text: str) -> Rule:
    """A :class:`Rule` from ``LOOPS:LAYERS=OPTIONS`` (module docstring); ValueError naming the problem."""
    if not isinstance(text, str):
        raise ValueError(f"a rule must be a string {SYNTAX}, got {type(text).__name__}")
    where, eq, opts = text.replace(" ", "").partition("=")
    loops, colon, layers = where.partition(":")
    if not eq or not colon or not opts:
        raise ValueError(f"rule {text!r} is not {SYNTAX}")
    return Rule(_parse_index(loops, text, "loops"), _parse_index(layers, text, "layers"),
                _parse_options(opts.split("|"), text), text)


def _parse_index(part: str, text: str, name: str) -> tuple[int, ...] | None:
    if part == "*":
        return None
    values: list[int] = []
    for piece in part.split(","):
        lo, dash, hi = piece.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"rule {text!r}: {name} {part!r} must be *, N, A-B or a comma list of those") from None
        if b < a:
            raise ValueError(f"rule {text!r}: the range {piece!r} is empty (write it low-high)")
        values.extend(range(a, b + 1))
    return tuple(sorted(set(values)))


def _parse_options(options: Iterable[str], text: str) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(options))
    bad = [o for o in out if o not in OPTIONS]
    if bad or not out:
        raise ValueError(f"rule {text!r} names unknown option(s) {bad or out}; options are {OPTIONS}")
    return out


def as_rules(spec: Any, what: str) -> list[Rule]:
    """``fix=`` / ``forbid=`` as a list of rules (see the module docstring for what they take)."""
    if spec is None:
        return []
    if isinstance(spec, (str, Rule)) or (isinstance(spec, tuple) and len(spec) == 2 and _is_cells(spec[0])):
        spec = [spec]
    if isinstance(spec, Mapping):
        spec = list(spec.items())
    rules = []
    for item in spec:
        if isinstance(item, Rule):
            rules.append(item)
        elif isinstance(item, str):
            rules.append(parse_rule(item))
        elif isinstance(item, Sequence) and len(item) == 2 and _is_cells(item[0]):
            cells = [item[0]] if isinstance(item[0], Cell) else list(item[0])
            opts = _parse_options([item[1]] if isinstance(item[1], str) else item[1], f"{what} {item!r}")
            rules.extend(Rule((c.loop,), (c.layer,), opts, f"{c.loop}:{c.layer}={'|'.join(opts)}") for c in cells)
        else:
            raise ValueError(
                f"{what} entries must be rule strings ({SYNTAX}), (cells, options) pairs or a {{Cell: options}} "
                f"mapping; got {item!r}"
            )
    return rules


def _is_cells(value: Any) -> bool:
    return isinstance(value, Cell) or (
        isinstance(value, Iterable) and not isinstance(value, str) and all(isinstance(c, Cell) for c in value)
    )


def allowed_options(
    layout: CellLayout, menu: Sequence[str], final_menu: Sequence[str], *, fix: Any = None, forbid: Any = None
) -> dict[int, tuple[str, ...]]:
    """Per flat cell index, the options the solver may give the cell: the menu (``final_menu`` in the final
    loop), then ``fix`` rules (the cell takes one of the fixed options), then ``forbid`` rules. ValueError
    for a rule that leaves a cell nothing, fixes ``share`` in the final loop, or fixes one cell twice
    differently."""
    final = layout.loops - 1
    allowed = {layout.flat_index(c): tuple(final_menu if c.loop == final else menu) for c in layout}
    fixed_by: dict[int, Rule] = {}
    for rule in as_rules(fix, "fix"):
        for cell in rule.cells(layout):
            i = layout.flat_index(cell)
            if cell.loop == final and "share" in rule.options:
                raise ValueError(
                    f"fix {rule.text!r} puts 'share' in the final loop (loop {final}); the final loop is the source "
                    "shared cells read. Fix its cells to bf16, int4 or int2"
                )
            if i in fixed_by and set(fixed_by[i].options) != set(rule.options):
                raise ValueError(f"cell {tuple(cell)} is fixed twice: {fixed_by[i].text!r} and {rule.text!r}")
            fixed_by[i] = rule
            allowed[i] = rule.options
    for rule in as_rules(forbid, "forbid"):
        for cell in rule.cells(layout):
            i = layout.flat_index(cell)
            allowed[i] = tuple(o for o in allowed[i] if o not in rule.options)
            if not allowed[i]:
                source = f"fix {fixed_by[i].text!r}" if i in fixed_by else "the menu"
                raise ValueError(
                    f"forbid {rule.text!r} leaves cell {tuple(cell)} no option ({source} allowed only "
                    f"{fixed_by[i].options if i in fixed_by else tuple(final_menu if cell.loop == final else menu)})"
                )
    return allowed


def fixed_cells(layout: CellLayout, fix: Any) -> set[int]:
    """Flat indices of the cells a ``fix`` rule names."""
    return {layout.flat_index(c) for rule in as_rules(fix, "fix") for c in rule.cells(layout)}


def describe(rules: Iterable[Rule]) -> list[str]:
    """The rules as text, for a plan's provenance."""
    return [r.text or f"{_index_text(r.loops)}:{_index_text(r.layers)}={'|'.join(r.options)}" for r in rules]


def _index_text(values: tuple[int, ...] | None) -> str:
    return "*" if values is None else ",".join(map(str, values))
