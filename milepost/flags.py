"""Command-line flags generated from a pydantic config model, and back.

Each field becomes `--field-name` (underscores to dashes), its help is the field description,
extra spellings come from `json_schema_extra={"flags": [...]}`. The model stays the one source
of defaults and validation: flags not given on the command line are simply not passed to it.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)


def flag_name(field: str) -> str:
    """The canonical flag of a config field: `mem_fraction_static` -> `--mem-fraction-static`."""
    return "--" + field.replace("_", "-")


def _flags(name: str, info: FieldInfo) -> list[str]:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return [flag_name(name), *extra.get("flags", [])]  # type: ignore[list-item]


def _unwrap_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """Add one flag per field of `model` to `parser`; defaults stay with the model."""
    for name, info in model.model_fields.items():
        annotation = _unwrap_optional(info.annotation)
        help_text = info.description or ""
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        # None and False defaults say nothing useful; the description explains derived values.
        if default is not None and default is not False:
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {
            "dest": name,
            "help": help_text,
            # SUPPRESS keeps absent flags out of the namespace so the model's defaults apply.
            "default": argparse.SUPPRESS,
        }
        if annotation is bool:
            if info.get_default() is True:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["action"] = "store_true"
        elif typing.get_origin(annotation) is Literal:
            choices = typing.get_args(annotation)
            metavar = "{" + ",".join(map(str, choices)) + "}"
            kwargs.update(type=type(choices[0]), choices=choices, metavar=metavar)
        elif annotation in (int, float, str, Path):
            kwargs.update(type=annotation, metavar=name.upper())
        else:
            raise TypeError(f"{model.__name__}.{name}: no flag mapping for type {annotation!r}")
        if info.is_required():
            kwargs["required"] = True
        parser.add_argument(*_flags(name, info), **kwargs)


def format_validation_error(model: type[BaseModel], err: ValidationError) -> str:
    """One line per error, each naming the flag at fault (validators already name it themselves)."""
    lines = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        loc = e["loc"]
        if loc and isinstance(loc[0], str) and loc[0] in model.model_fields and not msg.startswith("--"):
            msg = f"{flag_name(loc[0])}: {msg}; got {e['input']!r}"
        lines.append(msg)
    return "\n".join(lines)


def model_from_namespace(model: type[M], ns: argparse.Namespace, parser: argparse.ArgumentParser) -> M:
    """Build `model` from the flags present in `ns`; invalid values exit through `parser.error`."""
    given = {k: v for k, v in vars(ns).items() if k in model.model_fields}
    try:
        return model(**given)
    except ValidationError as err:
        parser.error(format_validation_error(model, err))  # raises SystemExit(2)
        raise  # unreachable: parser.error exits; keeps type checkers informed


def model_to_argv(config: BaseModel) -> list[str]:
    """Flags that rebuild `config` (e.g. to launch an engine subprocess); only non-default fields."""
    argv: list[str] = []
    for name, info in type(config).model_fields.items():
        value = getattr(config, name)
        if name in config.model_fields_set or info.is_required():
            if value is None:
                continue
            if isinstance(value, bool):
                if value:
                    argv.append(flag_name(name))
                elif info.get_default() is True:
                    argv.append("--no-" + flag_name(name)[2:])
                continue
            argv += [flag_name(name), str(value)]
    return argv
