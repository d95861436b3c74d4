"""Read YAML and validate it once into frozen pydantic models, with errors naming file and field."""

from __future__ import annotations

import typing as tp
from pathlib import Path

import pydantic
import yaml

from hpcrun.errors import HpcrunError

M = tp.TypeVar("M", bound=pydantic.BaseModel)


class Frozen(pydantic.BaseModel):
    """Base of every config model: immutable, and unknown keys are an error, not ignored."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", strict=False)


def read_yaml(path: Path) -> dict[str, tp.Any]:
    """The mapping at the top of a YAML file, or one clear error line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise HpcrunError(f"cannot read ({exc.strerror})", path) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise HpcrunError(f"{where}invalid YAML ({problem})", path) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise HpcrunError(f"must be a mapping at the top level (got {type(data).__name__})", path)
    return data


def validate(model: type[M], data: tp.Any, path: Path | str, prefix: str = "") -> M:
    """`model` built from `data`; the first validation error becomes an HpcrunError.
    `prefix` is where `data` sits in the file (`stages.1`), so the field named is the user's."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise error_from(exc, data, model, path, prefix) from exc


def error_from(
    exc: pydantic.ValidationError, data: tp.Any, model: type[pydantic.BaseModel], path: Path | str, prefix: str = ""
) -> HpcrunError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    inner = field_path(first["loc"], data)
    message = describe(first, model, inner)
    field = ".".join(p for p in (prefix, inner) if p)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return HpcrunError(message, path, field or None)


def field_path(loc: tuple[tp.Any, ...], data: tp.Any) -> str:
    """Dotted path of `loc` as the user wrote it. Union tags (a `name` or `kind` value) and
    validator names are pydantic's bookkeeping, not keys in the user's file, so they are dropped."""
    parts: list[str] = []
    node = data
    tag_seen: set[int] = set()
    for item in loc:
        if isinstance(node, dict):
            # the tag comes first, right after the union's own key (job -> "entrypoint" -> entrypoint)
            if id(node) not in tag_seen and item in (node.get("name"), node.get("kind")):
                tag_seen.add(id(node))
                continue
            if item in node:
                parts.append(str(item))
                node = node[item]
            elif isinstance(item, str) and "[" in item:
                continue
            else:  # a missing key: reported under its own name
                parts.append(str(item))
                node = None
        elif isinstance(node, list) and isinstance(item, int) and item < len(node):
            parts.append(str(item))
            node = node[item]
        elif not (isinstance(item, str) and "[" in item):
            parts.append(str(item))
            node = None
    return ".".join(parts)


def describe(error: tp.Mapping[str, tp.Any], model: type[pydantic.BaseModel], field: str) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        valid = _valid_keys(model, field.split(".")[:-1])
        return "unknown key" + (f" (valid keys: {', '.join(valid)})" if valid else "")
    if kind == "missing":
        return "required"
    if kind == "union_tag_invalid":
        ctx = error.get("ctx", {})
        return f"must be one of {ctx.get('expected_tags')} (got {ctx.get('tag')!r})"
    message = str(error["msg"])
    message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    message = message[0].lower() + message[1:] if message else message
    value = error.get("input")
    if kind not in ("value_error", "assertion_error") and isinstance(value, (str, int, float, bool, type(None))):
        message += f" (got {value!r})"
    return message  # HpcrunError keeps it to one line, whatever the input held


def _valid_keys(model: type[pydantic.BaseModel], parents: list[str]) -> list[str]:
    """The keys allowed at `parents` inside `model`, for the unknown-key message."""
    annotation: tp.Any = model
    for name in parents:
        origin = tp.get_origin(annotation)
        if origin in (dict, list, tuple):  # `name` is a key or index into a container of models
            annotation = tp.get_args(annotation)[-1]
            continue
        model_cls = _model_in(annotation)
        field = model_cls.model_fields.get(name) if model_cls else None
        if field is None:
            return []
        annotation = field.annotation
    model_cls = _model_in(annotation) if tp.get_origin(annotation) not in (dict, list, tuple) else None
    return sorted(model_cls.model_fields) if model_cls else []


def _model_in(annotation: tp.Any) -> type[pydantic.BaseModel] | None:
    """The model class inside an annotation such as `Model | None`."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    if tp.get_origin(annotation) in (dict, list, tuple):
        return None
    for arg in tp.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
