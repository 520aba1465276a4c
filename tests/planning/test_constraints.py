"""Per-cell rules: the LOOPS:LAYERS=OPTIONS syntax and what fix / forbid leave each cell."""

import pytest

from loopkv.cells import Cell, CellLayout
from loopkv.planning.constraints import allowed_options, as_rules, parse_rule

LAYOUT = CellLayout(4, 6)
MENU, FINAL = ("int4", "int2", "share"), ("int4",)


def _cells(rule):
    return [tuple(c) for c in parse_rule(rule).cells(LAYOUT)]


def test_rule_syntax():
    assert _cells("2:*=share") == [(2, layer) for layer in range(6)]
    assert _cells("*:3=int2") == [(t, 3) for t in range(4)]
    assert _cells("0-1:4,0=int4") == [(0, 0), (0, 4), (1, 0), (1, 4)]
    assert parse_rule(" 1 : 2 = int4|bf16 ").options == ("int4", "bf16")
    for bad, match in [("2:*", "LOOPS:LAYERS=OPTIONS"), ("x:1=int4", "must be \\*, N, A-B"),
                       ("3-1:0=int4", "range '3-1' is empty"), ("0:0=int9", "unknown option")]:
        with pytest.raises(ValueError, match=match):
            parse_rule(bad)
    with pytest.raises(ValueError, match=r"layer\(s\) \[6\].*0\.\.5"):
        parse_rule("0:6=int4").cells(LAYOUT)


def test_fix_and_forbid():
    allowed = allowed_options(LAYOUT, MENU, FINAL, fix=["2:*=share", "0:0=int4|bf16"], forbid=["*:5=int2"])
    assert allowed[LAYOUT.flat_index(Cell(2, 3))] == ("share",)
    assert allowed[LAYOUT.flat_index(Cell(0, 0))] == ("int4", "bf16")  # a fixed option may be off the menu
    assert allowed[LAYOUT.flat_index(Cell(1, 5))] == ("int4", "share")
    assert allowed[LAYOUT.flat_index(Cell(3, 5))] == ("int4",)  # the final loop: its own menu
    assert allowed[LAYOUT.flat_index(Cell(1, 1))] == MENU


def test_rule_forms():
    text = as_rules(["1:2=int4"], "fix")
    pair = as_rules((Cell(1, 2), "int4"), "fix")
    mapping = as_rules({Cell(1, 2): ["int4"]}, "fix")
    assert [r.cells(LAYOUT) for r in text] == [r.cells(LAYOUT) for r in pair] == [r.cells(LAYOUT) for r in mapping]
    assert text[0].options == pair[0].options == mapping[0].options == ("int4",)
    with pytest.raises(ValueError, match="rule strings"):
        as_rules([3.5], "forbid")
