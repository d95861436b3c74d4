"""The callable submitit pickles. It lives outside `runtime/` so pickling it by reference on
the login node does not import torch; the import happens inside the allocation."""

from __future__ import annotations

import typing as tp


def run(spec_path: str) -> dict[str, tp.Any]:
    from hpcrun.runtime.trainer import main

    return main(spec_path)
