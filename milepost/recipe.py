"""TOML recipes and `--key value` overrides for a flat pydantic config, and back to TOML.

A recipe's tables only organize: every key is unique across tables, so `[rollout] n_samples_per_prompt`
and the override `--n-samples-per-prompt` address the same field. This module turns text into
Python values of each field's type (so `--rollout-batch-size 8` is the int 8), and the model then
validates in strict mode: a recipe's `rollout_batch_size = "8"` or `colocate = "yes"` is refused,
never coerced (`validate_strict`).
"""

from __future__ import annotations

import difflib
import json
import math
import sys
import textwrap
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from milepost.flags import flag_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

M = TypeVar("M", bound=BaseModel)
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


class ConfigError(ValueError):
    """A recipe or an override is malformed, unknown, or refused; the message names it and the fix."""


def _args(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without None, whether None is allowed)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), optional
    return annotation, False


def _is_bool(model: type[BaseModel], name: str) -> bool:
    return _args(model.model_fields[name].annotation)[0] is bool


def _is_list(model: type[BaseModel], name: str) -> bool:
    return typing.get_origin(_args(model.model_fields[name].annotation)[0]) is list


def _norm(key: str) -> str:
    return key.strip().lstrip("-").replace("_", "-").lower()


def spellings(model: type[BaseModel]) -> dict[str, str]:
    """Every accepted spelling of a setting (dashes, no leading `--`) -> field name."""
    out: dict[str, str] = {}
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        for flag in [flag_name(name), *extra.get("flags", [])]:  # type: ignore[list-item]
            out[_norm(flag)] = name
    return out


def _unknown_flag(key: str, candidates: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    hint = f"; did you mean --{close[0]}?" if close else "; `milepost train --help` lists every setting"
    return ConfigError(f"unknown setting --{key}{hint}")


def read_recipe(path: Path, table_of: Mapping[str, str]) -> dict[str, Any]:
    """Flatten a TOML recipe into {field: value}. Keys may sit at top level or in their own table.

    `table_of` maps each field to its table. A key in an unknown table, in another key's table, or
    given twice is refused with a message naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist; pass the path of a TOML recipe")
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"recipe {path} is not valid TOML: {err}") from err
    tables = sorted(set(table_of.values()))
    flat: dict[str, Any] = {}

    def put(key: str, value: Any, table: str | None) -> None:
        if key not in table_of:
            close = difflib.get_close_matches(key.lower(), list(table_of), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "; `milepost train --help` lists every setting"
            where = f"[{table}] " if table else ""
            raise ConfigError(f"recipe {path}: unknown key {where}{key}{hint}")
        if table is not None and table_of[key] != table:
            raise ConfigError(
                f"recipe {path}: {key} belongs in table [{table_of[key]}], not [{table}]; move it there"
            )
        if key in flat:
            raise ConfigError(f"recipe {path}: {key} is given twice; keep one")
        flat[key] = value

    for key, value in doc.items():
        if key == "evidence" and isinstance(value, dict):
            continue  # the recipe's evidence level (milepost/recipes_cli.py), not a setting
        if isinstance(value, dict):
            if key not in tables:
                close = difflib.get_close_matches(key, tables, n=1, cutoff=0.6)
                hint = f"; did you mean [{close[0]}]?" if close else f"; tables are {', '.join(tables)}"
                raise ConfigError(f"recipe {path}: unknown table [{key}]{hint}")
            for sub, sub_value in value.items():
                put(sub, sub_value, key)
        else:
            put(key, value, None)
    return flat


def _bool_word(text: str) -> bool | None:
    low = text.strip().lower()
    return True if low in _TRUE else False if low in _FALSE else None


def _value(model: type[BaseModel], name: str, raw: str) -> Any:
    if raw.strip().lower() in ("none", "null") and _args(model.model_fields[name].annotation)[1]:
        return None
    if _is_list(model, name):
        if raw.lstrip().startswith("["):
            try:
                items = json.loads(raw)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{flag_name(name)}: {raw!r} is not a JSON list: {err}") from err
            if not isinstance(items, list):
                raise ConfigError(f"{flag_name(name)}: {raw!r} is not a JSON list")
            return items
        items = [item.strip() for item in raw.split(",") if item.strip()]
        if typing.get_args(_args(model.model_fields[name].annotation)[0]) == (int,):
            return [_number(name, item, int) for item in items]
        return items
    kind = _args(model.model_fields[name].annotation)[0]
    if kind in (int, float):
        return _number(name, raw, kind)
    return raw  # str, Path, Literal: the field validates it


def _number(name: str, raw: str, kind: type) -> int | float:
    """Command-line text as the field's number type; a clear error naming the flag otherwise."""
    try:
        return kind(raw.strip())
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{flag_name(name)} takes {what}; got {raw!r}") from None


def validate_strict(model: type[M], values: Mapping[str, Any]) -> M:
    """`model` from recipe/override values, with no type coercion: "8" is not 8, "yes" not True.

    Paths are the one conversion (TOML has no path type): strings become Path first. Raises
    pydantic's ValidationError, which the caller words per setting.
    """
    typed = dict(values)
    for name, value in typed.items():
        info = model.model_fields.get(name)
        if info is not None and isinstance(value, str) and _args(info.annotation)[0] is Path:
            if not value.strip():  # Path("") is ".", which would be reported as a missing "."
                raise ConfigError(f"{flag_name(name)} is empty; pass a path, or leave the "
                                  "setting out" + (" (or pass none)" if _args(info.annotation)[1]
                                                   else ""))
            typed[name] = Path(value)
    return model.model_validate(typed, strict=True)


def parse_overrides(model: type[BaseModel], argv: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value`, `--flag`, `--no-flag` (and `--flag true|false`) -> {field: value}.

    Lists are comma-separated (`--rollout-stop a,b`), repeated (`--rollout-stop a --rollout-stop b`)
    or JSON (`--rollout-stop '["a,b"]'`); `none` clears an optional setting. Later flags win.
    """
    known = spellings(model)
    out: dict[str, Any] = {}
    repeated: set[str] = set()
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"expected a setting as --key value, got {token!r}")
        key, has_eq, raw = token[2:].partition("=")
        name = known.get(_norm(key))
        negated = False
        if name is None and _norm(key).startswith("no-"):
            base = known.get(_norm(key)[3:])
            if base is not None and _is_bool(model, base):
                name, negated = base, True
        if name is None:
            raise _unknown_flag(_norm(key), sorted(known))
        if _is_bool(model, name):
            if negated:
                if has_eq:
                    raise ConfigError(f"{token}: --no-{_norm(key)[3:]} takes no value")
                out[name] = False
            elif has_eq:
                word = _bool_word(raw)
                if word is None:
                    raise ConfigError(f"{flag_name(name)} takes true or false; got {raw!r}")
                out[name] = word
            elif i < len(argv) and _bool_word(argv[i]) is not None:
                out[name] = _bool_word(argv[i])
                i += 1
            else:
                out[name] = True
            continue
        if not has_eq:
            if i >= len(argv) or (argv[i].startswith("--") and len(argv[i]) > 2):
                raise ConfigError(f"{flag_name(name)} needs a value: {flag_name(name)} VALUE")
            raw = argv[i]
            i += 1
        value = _value(model, name, raw)
        if isinstance(value, list) and name in repeated and isinstance(out.get(name), list):
            out[name] = out[name] + value  # a repeated list flag adds items
        else:
            out[name] = value
        repeated.add(name)
    return out


def _toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (str, Path)):
        # JSON strings are TOML basic strings, except that TOML also wants DEL escaped.
        return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_scalar(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table, e.g. one [[opd.teachers]] entry
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_scalar(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as TOML")


def dump_toml(config: BaseModel, table_of: Mapping[str, str], header: str = "") -> str:
    """Every field of `config` as TOML, grouped in its table, each preceded by its description.

    None values are written as a comment (TOML has no null), so they load back as the default None.
    """
    model = type(config)
    lines = [f"# {line}" for line in header.splitlines()]
    for table in dict.fromkeys(table_of.values()):
        lines += ["", f"[{table}]"]
        for name, t in table_of.items():
            if t != table:
                continue
            doc = model.model_fields[name].description or ""
            lines += [f"# {line}" for line in textwrap.wrap(doc, 96)]
            value = getattr(config, name)
            lines.append(f"# {name} = (not set)" if value is None else f"{name} = {_toml_scalar(value)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def describe_settings(model: type[BaseModel], table_of: Mapping[str, str]) -> str:
    """A help listing: every setting under its table, with its flag, default and description."""
    lines = []
    for table in dict.fromkeys(table_of.values()):
        lines.append(f"[{table}]")
        for name, t in table_of.items():
            if t != table:
                continue
            info = model.model_fields[name]
            default = (
                "required"
                if info.is_required()
                else "optional"
                if info.get_default() is None
                else f"default {info.get_default()!r}"
            )
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            flag = " / ".join([flag_name(name), *extra.get("flags", [])])  # type: ignore[list-item]
            inner = _args(info.annotation)[0]
            if _is_bool(model, name):
                flag += " / --no-" + flag_name(name)[2:]
            elif typing.get_origin(inner) is typing.Literal:
                flag += " {" + ",".join(map(str, typing.get_args(inner))) + "}"
            lines.append(f"  {flag}  ({default})")
            lines += ["      " + line for line in textwrap.wrap(info.description or "", 90)]
        lines.append("")
    return "\n".join(lines)
