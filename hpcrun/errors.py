"""The one error type users see: a file, a field and what is wrong, exit code 2."""

from __future__ import annotations

from pathlib import Path

import click


class HpcrunError(click.ClickException):
    """Bad input or a refused operation, reported as one line naming the file and field.

    Subclassing ClickException means click prints `Error: <message>` and exits with
    `exit_code` without a traceback; `--debug` re-raises instead (see cli.py).
    """

    exit_code = 2

    def __init__(self, message: str, file: str | Path | None = None, field: str | None = None) -> None:
        self.file = str(file) if file is not None else None
        self.field = field
        prefix = ": ".join(p for p in (self.file, field) if p)
        text = f"{prefix}: {message}" if prefix else message
        # always one line: a newline from a hostile value could otherwise fake a second message
        super().__init__(text.replace("\r", "\\r").replace("\n", "\\n"))


class SubmissionError(HpcrunError):
    """The scheduler refused or failed a request (its own message is kept)."""

    exit_code = 1


class ToolError(SubmissionError):
    """A SLURM tool that could not be started (missing, not executable): nothing was sent, so a
    submission's fresh run directory goes (a SubmissionError), but it is the site's setup that
    is wrong, exit code 2 like every failed SLURM tool."""

    exit_code = 2
