"""A rich table that fits the terminal by leaving whole columns out, never by cutting
cells: what `iop-edge catalog` does with its providers, for the other tables the CLI
prints (`iop-edge usage`).

rich fits a table that is too wide by squeezing every column and cutting (or folding)
each cell, so at 80 columns a usage row reads `alice-te…`, `1234…`: every column there,
none of them readable. Rules:

1. The essential columns are always shown, their cells folded if they must be, never
   cut; the others are shown in priority order while each fits whole (its widest cell or
   footer, plus the frame; a header of several words may wrap, so its longest word).
2. Shown columns keep their display order, whatever their priority.
3. What was left out is named under the table, with the two ways to see it: a wider
   terminal, or `--json`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import JustifyMethod
from rich.table import Table
from rich.text import Text

__all__ = ["Column", "fitted_table", "left_out_note"]

#: What a column costs beyond its widest value: padding and the border.
COLUMN_FRAME = 3


@dataclass(frozen=True)
class Column:
    """One column: its header, its cells (one per row) and how it is shown."""

    name: str
    cells: Sequence[Text]
    essential: bool = False
    justify: JustifyMethod = "left"
    footer: str = ""

    def needed(self) -> int:
        """Its width at the least: the widest cell or footer, whole, and the header's
        longest word (a header of several words wraps)."""
        header = max(len(word) for word in self.name.split() or [""])
        widest = max([header, len(self.footer), *(cell.cell_len for cell in self.cells)])
        return widest + COLUMN_FRAME


def fitted_table(
    columns: Sequence[Column],
    width: int,
    *,
    priority: Sequence[str] | None = None,
    title: str | None = None,
    show_footer: bool = False,
) -> tuple[Table, list[str]]:
    """The table of the columns that fit `width` (Rules 1 and 2), and the names of those
    left out, in display order. `priority` orders the optional columns (default: their
    display order)."""
    by_name = {column.name: column for column in columns}
    shown = {column.name for column in columns if column.essential}
    used = sum(by_name[name].needed() for name in shown) + 1
    for name in priority or [column.name for column in columns]:
        column = by_name[name]
        if name not in shown and used + column.needed() <= width:
            shown.add(name)
            used += column.needed()
    table = Table(title=title, title_justify="left", show_footer=show_footer)
    kept = [column for column in columns if column.name in shown]
    for column in kept:
        table.add_column(
            column.name,
            footer=column.footer,
            justify=column.justify,
            overflow="fold",
        )
    rows = len(columns[0].cells) if columns else 0
    for index in range(rows):
        table.add_row(*(column.cells[index] for column in kept))
    return table, [column.name for column in columns if column.name not in shown]


def left_out_note(left_out: Sequence[str], width: int) -> Text:
    """Rule 3's line."""
    return Text(
        f"not shown at {width} columns: {', '.join(left_out)} (widen the terminal, or use --json)",
        style="dim",
    )
