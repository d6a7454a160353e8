"""Progress displays of the long commands: `progress` yields a `Progress` task to update.

The display is a `rich` progress line on stderr — spinner, description, a bar with counts when
the total is known, elapsed time — so stdout keeps only the command's result. It is quiet
(every update a no-op) under ``--json`` and whenever stderr is not a terminal, so pipes, logs
and tests see no control characters. Library code never imports rich: it takes a callback, and
the command passes one that updates its `Progress`. Updates may come from any thread.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID


class Progress:
    """One task of a live display, or nothing (no display: quiet)."""

    def __init__(self, display: RichProgress | None = None, task: TaskID | None = None) -> None:
        self._display, self._task = display, task

    def update(
        self,
        *,
        completed: float | None = None,
        advance: float | None = None,
        total: float | None = None,
        description: str | None = None,
    ) -> None:
        """Set the task's completed amount, total or description, or advance it (None: keep)."""
        if self._display is not None and self._task is not None:
            self._display.update(
                self._task,
                completed=completed,
                advance=advance,
                total=total,
                description=description,
            )


@contextlib.contextmanager
def progress(
    description: str, *, total: float | None = None, unit: str = "", quiet: bool = False
) -> Iterator[Progress]:
    """A live progress line on stderr for the ``with`` block (quiet: see the module docstring).

    With a ``total`` (given here or by a later update) it shows a bar and ``done/total unit``;
    without, only the spinner, the description and the time so far. The line is removed when
    the block ends.
    """
    if quiet or not sys.stderr.isatty():
        yield Progress()
        return
    from rich import progress as rich_progress
    from rich.console import Console
    from rich.text import Text

    class WhenTotalKnown(rich_progress.ProgressColumn):
        """A column drawn only once the task has a total (a command may learn it late)."""

        def __init__(self, column: rich_progress.ProgressColumn) -> None:
            super().__init__()
            self.column = column

        def render(self, task: rich_progress.Task) -> Any:
            return Text() if task.total is None else self.column.render(task)

    display = rich_progress.Progress(
        rich_progress.SpinnerColumn(),
        rich_progress.TextColumn("{task.description}"),
        WhenTotalKnown(rich_progress.BarColumn()),
        WhenTotalKnown(rich_progress.MofNCompleteColumn()),
        WhenTotalKnown(rich_progress.TextColumn(unit)),
        rich_progress.TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        # stdout stays the command's own: only stderr writes (warnings, log lines) are drawn
        # above the live line.
        redirect_stdout=False,
    )
    with display:
        yield Progress(display, display.add_task(description, total=total))
