"""Rows -> an Arrow table of a declared schema: the one way results and steps rows are typed."""

from __future__ import annotations

import typing as tp

import pyarrow as pa


def arrow_table(rows: list[dict[str, tp.Any]], schema: pa.Schema, what: str) -> pa.Table:
    """`rows` as a table of exactly `schema`; an unknown column is an error, not a new column.
    A map column (`extra`) takes a dict per row."""
    unknown = {k for r in rows for k in r} - set(schema.names)
    if unknown:
        raise ValueError(f"columns not in the {what} schema: {sorted(unknown)}")
    cols = {}
    for field in schema:
        values = [r.get(field.name) for r in rows]
        if pa.types.is_map(field.type):
            values = [list((v or {}).items()) for v in values]
        cols[field.name] = pa.array(values, type=field.type)
    return pa.table(cols, schema=schema)
