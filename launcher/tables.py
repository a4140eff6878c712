"""The launcher's tables: rich tables, rendered for where the text goes.

On a terminal a table gets the terminal's width and colour; anywhere else (a pipe, a log
file, a test capturing output) it is plain text, as wide as its widest row, so no escape
code reaches a log and no row is folded for a width nobody will see.
"""

from __future__ import annotations

import io
import shutil
import sys
from typing import TYPE_CHECKING, TextIO, cast

if TYPE_CHECKING:
    from rich.box import Box
    from rich.console import JustifyMethod
    from rich.table import Table

UNBOUNDED_WIDTH = 10_000
"""Width given to rich off a terminal: a table then takes its natural width."""


def _ascii_head() -> Box:
    """rich's SIMPLE_HEAD drawn in ASCII: a row of dashes under the header, nothing else."""
    from rich.box import Box

    blank = "    \n"
    return Box(blank * 2 + " -- \n" + blank * 5)


def new_table(*columns: str | tuple[str, JustifyMethod], header: bool = True) -> Table:
    """A borderless table, with a bold header row unless `header` is false: each column a
    name (left-justified) or a (name, justify) pair."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, show_header=header)
    for column in columns:
        name, justify = (column, "left") if isinstance(column, str) else column
        table.add_column(name, justify=cast("JustifyMethod", justify), header_style="bold")
    return table


def render(table: Table, stream: TextIO | None = None, heading: str = "") -> str:
    """`table`, below a `heading` line if one is given, as text for `stream` (sys.stdout
    when None): coloured and as wide as the terminal on a terminal, plain text otherwise;
    trailing blanks are stripped."""
    from rich.console import Console
    from rich.text import Text

    target = stream if stream is not None else sys.stdout
    terminal = _is_terminal(target)
    width = shutil.get_terminal_size().columns if terminal else UNBOUNDED_WIDTH
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=width,
        force_terminal=terminal,
        color_system="auto" if terminal else None,
        highlight=False,
    )
    if not terminal:
        table.box = _ascii_head()  # a log or a pipe may not be UTF-8
    if heading:  # a table's own title would be wrapped to the table's width
        console.print(Text(heading, style="bold"), soft_wrap=True)
    console.print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip("\n").splitlines())


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False
