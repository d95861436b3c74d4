"""Rows -> an Arrow table of a declared schema, and a file's table -> that schema: the one way
results and steps rows are typed."""

from __future__ import annotations

import typing as tp

import pyarrow as pa

from hpcrun.rundir import RENAMED


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
    are left out, and one an older version wrote under an old name (hpcrun.rundir.RENAMED) is read
    under today's. Raises ValueError (or an ArrowException) for a column of another type."""
    data = current_columns(data)
    present = set(data.column_names)
    columns = [
        data.column(f.name).cast(f.type) if f.name in present else pa.nulls(data.num_rows, f.type) for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema), bool(present - set(schema.names))


def current_columns(data: pa.Table) -> pa.Table:
    """`data` with the columns an older hpcrun wrote under an old name (hpcrun.rundir.RENAMED) under
    today's; where both are there, today's wins."""
    for old, new in RENAMED.items():
        if old in data.column_names:
            data = data.drop_columns([old]) if new in data.column_names else data.rename_columns(
                [new if name == old else name for name in data.column_names]
            )
    return data


def reading_schema(schema: pa.Schema) -> pa.Schema:
    """`schema` and the old names of its renamed columns: a dataset read with it (which fills a column
    a file lacks with nulls) finds a column under either name, old files and new mixed; then `fold`."""
    old = [schema.field(new).with_name(o) for o, new in RENAMED.items() if new in schema.names]
    return pa.schema([*schema, *old])


def fold(data: pa.Table, schema: pa.Schema) -> pa.Table:
    """A table read with `reading_schema(schema)` as `schema`: each renamed column's values from
    today's name, or from the old one in the rows of files that had only it."""
    import pyarrow.compute as pc

    for old, new in RENAMED.items():
        if old in data.column_names:
            index = data.schema.get_field_index(new)
            data = data.set_column(index, new, pc.coalesce(data.column(new), data.column(old))).drop_columns([old])
    return data.select(schema.names).cast(schema)
