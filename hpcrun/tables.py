"""Rows -> an Arrow table of a declared schema, and a file's table -> that schema: the one way
results and steps rows are typed."""

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


def conform(data: pa.Table, schema: pa.Schema) -> tuple[pa.Table, bool]:
    """A table read from a file of another hpcrun version as `schema`, and whether it had columns
    `schema` lacks: columns an older version did not write are null, columns a newer one added
    are left out. Raises ValueError (or an ArrowException) for a column of another type."""
    present = set(data.column_names)
    columns = [
        data.column(f.name).cast(f.type) if f.name in present else pa.nulls(data.num_rows, f.type) for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema), bool(present - set(schema.names))
