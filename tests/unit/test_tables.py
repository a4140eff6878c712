"""The launcher's tables: styled on a terminal, plain text in a pipe or a log."""

from __future__ import annotations

import io

from pretrain.launcher.tables import new_table, render


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def table_of(rows: int, cell: str):
    table = new_table("name", ("value", "right"))
    for i in range(rows):
        table.add_row(f"row{i}", cell)
    return table


def test_a_table_off_a_terminal_is_plain_text_never_folded() -> None:
    long = "x" * 300  # wider than any terminal: a log keeps the row whole
    text = render(table_of(2, long), io.StringIO(), heading="two rows")
    lines = text.splitlines()
    assert "\x1b[" not in text
    assert lines[0] == "two rows"
    assert lines[1].split() == ["name", "value"] and set(lines[2]) == {"-"}
    assert lines[3].split() == ["row0", long] and len(lines) == 5


def test_a_table_on_a_terminal_is_styled() -> None:
    text = render(table_of(1, "1"), Terminal())
    assert "\x1b[1m" in text  # the bold header
    assert "row0" in text
