"""Constrained string and time types shared by the site and recipe models.

Values that end up on an `#SBATCH` line are restricted to characters sbatch reads as one
token, because a space or quote there would silently become another directive. Values that
reach a shell command are quoted by the template filter instead, so they may hold anything
but newlines and NULs.
"""

from __future__ import annotations

import os
import re
import typing as tp

import pydantic

TOKEN_RE = _TOKEN = re.compile(r"^[A-Za-z0-9_.:@%+/=,&|!\[\]*-]+$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HOSTPART = re.compile(r"^[A-Za-z0-9.-]*$")
_ENVNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME = re.compile(r"^(?:(?P<d>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?$")


def _token(value: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(
            "must be one sbatch token: letters, digits and _.:@%+/=,&|![]*- only, "
            f"no spaces, quotes or newlines (got {value!r})"
        )
    return value


def _name(value: str) -> str:
    if not _NAME.match(value) or len(value) > 64:
        raise ValueError(
            f"must start with a letter or digit and hold only letters, digits, '_', '.', '-' (got {value!r})"
        )
    return value


def _hostpart(value: str) -> str:
    if not _HOSTPART.match(value):
        raise ValueError(f"may hold only letters, digits, '.' and '-' (got {value!r})")
    return value


def _envname(value: str) -> str:
    if not _ENVNAME.match(value):
        raise ValueError(f"is not a valid environment variable name (got {value!r})")
    return value


def _line(value: str) -> str:
    if "\n" in value or "\r" in value or "\0" in value:
        raise ValueError(f"must be a single line (got {value!r})")
    return value


def _path(value: str) -> str:
    _line(value)
    if not value.strip():
        raise ValueError("must not be empty")
    return value


def _cpus(value: tp.Any) -> tp.Any:
    """`auto` means this machine's cores: right for the local site, whose node is where hpcrun runs."""
    return (os.cpu_count() or 1) if value == "auto" else value


def parse_minutes(value: tp.Any) -> int:
    """SLURM time formats (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`) or an int of minutes."""
    if isinstance(value, bool):
        raise ValueError(f"must be a time such as '02:00:00' or minutes (got {value!r})")
    if isinstance(value, int):
        minutes = value
    else:
        match = _TIME.match(str(value).strip())
        if not match:
            raise ValueError(f"must be a SLURM time such as '02:00:00', '1-12:00:00' or minutes (got {value!r})")
        days = int(match["d"] or 0)
        nums = [int(x) for x in (match["a"], match["b"], match["c"]) if x is not None]
        if match["d"] is not None:  # D-HH[:MM[:SS]]
            nums += [0] * (3 - len(nums))
            hours, mins, secs = nums
        elif len(nums) == 3:
            hours, mins, secs = nums
        else:  # MM or MM:SS
            hours, mins, secs = 0, nums[0], (nums[1] if len(nums) > 1 else 0)
        minutes = days * 1440 + hours * 60 + mins + (1 if secs else 0)
    if minutes < 1:
        raise ValueError(f"must be at least one minute (got {value!r})")
    return minutes


def format_minutes(minutes: int) -> str:
    """Minutes as SLURM's `D-HH:MM:SS` (or `HH:MM:SS` under a day)."""
    days, rest = divmod(minutes, 1440)
    text = f"{rest // 60:02d}:{rest % 60:02d}:00"
    return f"{days}-{text}" if days else text


Token = tp.Annotated[str, pydantic.AfterValidator(_token)]
Name = tp.Annotated[str, pydantic.AfterValidator(_name)]
HostPart = tp.Annotated[str, pydantic.AfterValidator(_hostpart)]
EnvName = tp.Annotated[str, pydantic.AfterValidator(_envname)]
Line = tp.Annotated[str, pydantic.AfterValidator(_line)]
PathStr = tp.Annotated[str, pydantic.AfterValidator(_path)]
Cpus = tp.Annotated[int, pydantic.BeforeValidator(_cpus)]
Minutes = tp.Annotated[int, pydantic.BeforeValidator(parse_minutes)]
