"""A rich table that fits the terminal by leaving whole columns out, never by cutting
cells: the providers of `iop-edge catalog`, and the other tables the CLI prints
(`iop-edge usage`).

rich fits a table that is too wide by squeezing every column and cutting (or folding)
each cell, so at 80 columns a usage row reads `alice-te…`, `1234…`: every column there,
none of them readable. Rules:

1. The essential columns are always shown, their cells folded if they must be, never
   cut; the others are shown in priority order while each fits whole (its widest cell or
   footer, plus the frame; a header of several words may wrap, so its longest word; a
   column of prose, `folds_at`, at most that wide).
2. Shown columns keep their display order, whatever their priority.
3. What was left out is named under the table, with the two ways to see it: a wider
   terminal, or `--json`.
4. A table of more than `ALIGNED_ROWS` rows (a fleet's providers, its models by
   provider) is printed as aligned columns without a frame (`aligned`): rich lays out
   every cell of a framed table, about half a millisecond a row, 16-20 s for the 30,000
   providers of 10,000 Nodes; aligned rows take about a second. The columns are chosen
   as for a frame (Rules 1-3); no cell is cut or folded, so a line wider than the
   terminal is the terminal's to wrap (the caller prints it with `crop=False`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from rich.console import Group, JustifyMethod, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["ALIGNED_ROWS", "Column", "aligned", "fitted_table", "left_out_note"]

#: What a column costs beyond its widest value: padding and the border.
COLUMN_FRAME = 3
#: Rows from which a table is printed aligned, without a frame (Rule 4).
ALIGNED_ROWS: Final = 500
#: Between two aligned columns.
_GAP: Final = "  "


@dataclass(frozen=True)
class Column:
    """One column: its header, its cells (one per row) and how it is shown."""

    name: str
    cells: Sequence[Text]
    essential: bool = False
    justify: JustifyMethod = "left"
    footer: str = ""
    folds_at: int | None = None
    """For a column whose cells are prose (a reason): planned at this width at most, its
    cells folded past it, and given what the other columns leave of the line."""

    def needed(self) -> int:
        """Its width at the least: the widest cell or footer, whole (at most `folds_at`),
        and the header's longest word (a header of several words wraps)."""
        header = max(len(word) for word in self.name.split() or [""])
        widest = max([header, len(self.footer), *(cell.cell_len for cell in self.cells)])
        if self.folds_at is not None:
            widest = min(widest, self.folds_at)
        return widest + COLUMN_FRAME


def fitted_table(
    columns: Sequence[Column],
    width: int,
    *,
    priority: Sequence[str] | None = None,
    title: str | None = None,
    show_footer: bool = False,
) -> tuple[RenderableType, list[str]]:
    """The table of the columns that fit `width` (Rules 1 and 2), aligned if it is long
    (Rule 4), and the names of those left out, in display order. `priority` orders the
    optional columns (default: their display order)."""
    by_name = {column.name: column for column in columns}
    shown = {column.name for column in columns if column.essential}
    used = sum(by_name[name].needed() for name in shown) + 1
    for name in priority or [column.name for column in columns]:
        column = by_name[name]
        if name not in shown and used + column.needed() <= width:
            shown.add(name)
            used += column.needed()
    kept = [column for column in columns if column.name in shown]
    left_out = [column.name for column in columns if column.name not in shown]
    rows = len(columns[0].cells) if columns else 0
    if rows > ALIGNED_ROWS:
        return aligned(kept, title=title, show_footer=show_footer), left_out
    table = Table(title=title, title_justify="left", show_footer=show_footer)
    for column in kept:
        table.add_column(
            column.name,
            footer=column.footer,
            justify=column.justify,
            overflow="fold",
            ratio=None if column.folds_at is None else 1,
        )
    for index in range(rows):
        table.add_row(*(column.cells[index] for column in kept))
    return table, left_out


def aligned(
    columns: Sequence[Column], *, title: str | None = None, show_footer: bool = False
) -> Group:
    """The columns as lines of cells padded to each column's widest, header bold, footers
    last (Rule 4); not wrapped when printed (a group, so the console prints the text as it
    is), and not cut when printed with `crop=False`."""
    widths = [
        max([len(column.name), len(column.footer), *(cell.cell_len for cell in column.cells)])
        for column in columns
    ]
    last = len(columns) - 1

    def line(cells: Sequence[Text]) -> Text:
        text = Text()
        for index, (column, cell, width) in enumerate(zip(columns, cells, widths, strict=True)):
            pad = " " * (width - cell.cell_len)
            if index:
                text.append(_GAP)
            if column.justify == "right":
                text.append(pad)
                text.append_text(cell)
            else:
                text.append_text(cell)
                if index < last:
                    text.append(pad)
        return text

    lines = [] if title is None else [Text(title, style="italic")]
    lines.append(line([Text(column.name, style="bold") for column in columns]))
    rows = len(columns[0].cells) if columns else 0
    lines.extend(line([column.cells[index] for column in columns]) for index in range(rows))
    if show_footer:
        lines.append(line([Text(column.footer, style="bold") for column in columns]))
    return Group(Text("\n", no_wrap=True, overflow="ignore").join(lines))


def left_out_note(left_out: Sequence[str], width: int) -> Text:
    """Rule 3's line."""
    return Text(
        f"not shown at {width} columns: {', '.join(left_out)} (widen the terminal, or use --json)",
        style="dim",
    )
