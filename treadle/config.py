"""Configuration of every treadle command and recipe: one flat pydantic model, four layers.

Precedence, highest first: a command-line flag, the environment, a config file, the field's default.
A flag that is not given never overrides anything below it (its argparse default is "absent", not the
field's default). The environment variable of a field is `<PREFIX><FIELD>` in upper case
(`TREADLE_GATEWAY_PORT`); the connection fields `broker_url`, `result_url` and `storage_url` also
fall back to the variables every treadle process shares (`TREADLE_BROKER_URL`, ...). A list or dict
field reads JSON from the environment (`["a", "b"]`); a list also takes a comma-separated string.

The config file is TOML or JSON, named by `--config FILE` or by `TREADLE_CONFIG`. Its keys are field
names; a table named after the command (`[gateway]`, `[worker]`, ...) holds that command's keys, so one
file can configure a whole deployment; a dotted section (`runs.submit`) is a nested table
(`[runs.submit]`). An unknown key is an error naming it.

A field with an alias (`as_json: bool = Field(alias="json")`) is known by its alias everywhere: its flag,
its variable and its file key. That is how an option takes a name pydantic keeps for itself (`json`).
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

from pydantic import BaseModel, ValidationError

ConfigT = TypeVar("ConfigT", bound=BaseModel)

SHARED_ENV = {
    "broker_url": "TREADLE_BROKER_URL",
    "result_url": "TREADLE_RESULT_URL",
    "storage_url": "TREADLE_STORAGE_URL",
}
CONFIG_ENV = "TREADLE_CONFIG"


def env_prefix_of(model: type[BaseModel], default: str | None) -> str | None:
    """A pydantic-settings model names its own prefix; a plain model gets the caller's."""
    return model.model_config.get("env_prefix") or default


def env_names(name: str, prefix: str | None) -> list[str]:
    """The environment variables of one field, the most specific first."""
    names = [f"{prefix}{name}".upper()] if prefix else []
    if name in SHARED_ENV:
        names.append(SHARED_ENV[name])
    return names


def keys_of(model: type[BaseModel]) -> dict[str, Any]:
    """option name (the alias, else the field's name) -> its FieldInfo."""
    return {info.alias or name: info for name, info in model.model_fields.items()}


def _kind(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without None, whether None is allowed)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


def _container(annotation: Any) -> type | None:
    origin = typing.get_origin(_kind(annotation)[0])
    return origin if origin in (list, dict) else None


def _scalar_parser(annotation: Any):
    kind, nullable = _kind(annotation)
    convert = kind if kind in (int, float) else str

    def parse(text: str):
        if nullable and text.lower() in ("none", "null"):
            return None
        return convert(text)

    parse.__name__ = getattr(convert, "__name__", "str")  # argparse names the type in its error messages
    return parse


def add_config_args(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    env_prefix: str | None = None,
    with_config_file: bool = True,
    section: str | None = None,
) -> None:
    """One `--field` per config field (type, default, description, environment variable) and `--config`.

    The parsed namespace also carries `config_spec` (model, prefix, section): `config_of(ns)` reads the
    command's config from it, and a test can map any command to its model without restating it."""
    prefix = env_prefix_of(model, env_prefix)
    parser.set_defaults(config_spec=(model, prefix, section))
    for name, info in keys_of(model).items():
        default = info.default_factory() if info.default_factory is not None else info.default
        where = ", ".join(f"${n}" for n in env_names(name, prefix))
        shown = "required" if info.is_required() else f"default: {default!r}"
        help_text = f"{info.description or ''} ({shown}" + (f"; env {where})" if where else ")")
        flag = f"--{name}"
        if _kind(info.annotation)[0] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif _container(info.annotation) is dict:
            parser.add_argument(flag, type=json.loads, default=argparse.SUPPRESS, help=help_text + " [JSON]")
        elif _container(info.annotation) is list:
            parser.add_argument(flag, action="append", default=argparse.SUPPRESS, help=help_text + " [repeatable]")
        else:
            parser.add_argument(flag, type=_scalar_parser(info.annotation), default=argparse.SUPPRESS, help=help_text)
    if with_config_file:
        parser.add_argument(
            "--config",
            dest="config_file",
            default=argparse.SUPPRESS,
            help=f"TOML or JSON file of these options (env ${CONFIG_ENV}); flags and the environment win over it.",
        )


def _env_value(annotation: Any, text: str) -> Any:
    container = _container(annotation)
    if container is dict or (container is list and text.lstrip().startswith("[")):
        return json.loads(text)
    if container is list:
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


def from_environment(
    model: type[BaseModel], prefix: str | None, environ: Mapping[str, str]
) -> dict[str, tuple[str, Any]]:
    """field -> (the variable it came from, its value)."""
    values = {}
    for name, info in keys_of(model).items():
        var = next((v for v in env_names(name, prefix) if v in environ), None)
        if var is not None:
            try:
                values[name] = (var, _env_value(info.annotation, environ[var]))
            except json.JSONDecodeError as exc:
                raise ValueError(f"${var}: {name} needs JSON here, got {environ[var]!r} ({exc})") from None
    return values


def from_file(model: type[BaseModel], path: str | os.PathLike, section: str | None) -> dict[str, Any]:
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
    for part in section.split(".") if section else ():
        if not isinstance(data.get(part), dict):
            break
        data = data[part]
    known = keys_of(model)
    unknown = sorted(k for k, v in data.items() if k not in known and not isinstance(v, dict))
    if unknown:
        raise ValueError(
            f"config file {path}: unknown option(s) {', '.join(unknown)}"
            f" for {section or model.__name__} (known: {', '.join(known)})"
        )
    return {k: v for k, v in data.items() if k in known}


def load_config(
    model: type[ConfigT],
    flags: Mapping[str, Any] | None = None,
    *,
    env_prefix: str | None = None,
    config_file: str | os.PathLike | None = None,
    section: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> ConfigT:
    """Merge default < config file < environment < flags and validate the result as `model`."""
    environ = os.environ if environ is None else environ
    flags = dict(flags or {})
    config_file = flags.pop("config_file", None) or config_file or environ.get(CONFIG_ENV)
    prefix = env_prefix_of(model, env_prefix)
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, value in (from_file(model, config_file, section) if config_file else {}).items():
        merged[name], source[name] = value, f"config file {config_file}"
    for name, (var, value) in from_environment(model, prefix, environ).items():
        merged[name], source[name] = value, f"${var}"
    known = keys_of(model)
    for name, value in flags.items():
        if name in known:
            merged[name], source[name] = value, f"--{name}"
    try:
        return model.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, source, prefix)) from None


class ConfigError(ValueError):
    """A config that does not validate; the message names each field, its value and where it came from."""


def _explain(exc: ValidationError, source: Mapping[str, str], prefix: str | None) -> str:
    lines = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else ""
        if name in source:
            got = f" (got {err.get('input')!r} from {source[name]})"
        else:
            got = " (set --{} or {})".format(
                name, " or ".join(f"${v}" for v in env_names(name, prefix)) or "the config file"
            )
        lines.append(f"{'.'.join(map(str, err['loc'])) or exc.title}: {err['msg']}{got}")
    return "; ".join(lines)


def config_from_args(
    model: type[ConfigT], ns: argparse.Namespace, env_prefix: str | None = None, section: str | None = None
) -> ConfigT:
    """The config of a parsed sub-command: only the flags actually given appear in `ns`."""
    return load_config(model, vars(ns), env_prefix=env_prefix, section=section)


def config_of(ns: argparse.Namespace) -> BaseModel:
    """The config of a sub-command parsed with `add_config_args`, from the spec its namespace carries."""
    model, prefix, section = ns.config_spec
    return load_config(model, vars(ns), env_prefix=prefix, section=section)


def parse_config(
    config_cls: type[ConfigT], argv: Sequence[str] | None = None, prog: str | None = None, env_prefix: str | None = None
) -> ConfigT:
    """Parse `argv` (default: sys.argv[1:]) into `config_cls`; booleans are `--flag` / `--no-flag`."""
    parser = argparse.ArgumentParser(prog=prog, description=config_cls.__doc__)
    add_config_args(parser, config_cls, env_prefix)
    ns = parser.parse_args(argv)
    try:
        return config_from_args(config_cls, ns, env_prefix)
    except ConfigError as exc:
        parser.error(str(exc))
