"""Plain-text tables for the commands' human output: `table` and `key_value`.

`table(rows, headers=None, align=None)` pads every column to its widest cell and joins the
columns with two spaces; `align` holds one letter per column, ``l`` (left) or ``r`` (right),
and defaults to a left-aligned first column (the labels) with the rest right-aligned (the
numbers). Given ``headers``, the header line comes first with a rule of dashes under it. Trailing
spaces are stripped from every line. `key_value(rows)` is the two-column form without headers:
``label  value`` with the labels padded to one width.

Cells are rendered with ``str``, so callers format numbers themselves. Pure Python: every layer
may use it.
"""

from __future__ import annotations

from collections.abc import Sequence

GAP = "  "  # between columns


def table(
    rows: Sequence[Sequence[object]],
    headers: Sequence[str] | None = None,
    align: str | None = None,
) -> str:
    """Rows (and an optional header line with a rule under it) as aligned columns."""
    lines = [[str(cell) for cell in row] for row in ([headers] if headers is not None else [])]
    lines += [[str(cell) for cell in row] for row in rows]
    if not lines:
        return ""
    num_columns = len(lines[0])
    if any(len(cells) != num_columns for cells in lines):
        raise ValueError(f"every row needs {num_columns} cells: {lines}")
    align = align or "l" + "r" * (num_columns - 1)
    if len(align) != num_columns or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one 'l' or 'r' per column ({num_columns}), got {align!r}")
    widths = [max(len(cells[i]) for cells in lines) for i in range(num_columns)]
    text = [
        GAP.join(
            cell.ljust(width) if side == "l" else cell.rjust(width)
            for cell, width, side in zip(cells, widths, align, strict=True)
        ).rstrip()
        for cells in lines
    ]
    if headers is not None:
        text.insert(1, "-" * (sum(widths) + len(GAP) * (num_columns - 1)))
    return "\n".join(text)


def key_value(rows: Sequence[tuple[str, object]]) -> str:
    """``label  value`` lines, the labels padded to the longest one."""
    return table(rows, align="ll")
