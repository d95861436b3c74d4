"""Small helpers the tests share: run the CLI in-process and write YAML files."""

from __future__ import annotations

import typing as tp
from pathlib import Path

import yaml
from click.testing import CliRunner, Result

from hpcrun.cli import main

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=True)


def write_yaml(path: Path, data: tp.Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def load_yaml(path: Path) -> dict[str, tp.Any]:
    return yaml.safe_load(path.read_text())
