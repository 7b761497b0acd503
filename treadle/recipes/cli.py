"""Command lines generated from a recipe's pydantic config: every field is a flag, documented by --help."""

from __future__ import annotations

from typing import Sequence, TypeVar

from pydantic import BaseModel
from pydantic_settings import CliApp, CliSettingsSource

ConfigT = TypeVar("ConfigT", bound=BaseModel)


def parse_config(config_cls: type[ConfigT], argv: Sequence[str] | None = None, prog: str | None = None) -> ConfigT:
    """Parse `argv` (default: sys.argv[1:]) into `config_cls`; booleans are `--flag` / `--no-flag`."""
    import sys

    source = CliSettingsSource(config_cls, cli_implicit_flags=True, cli_prog_name=prog)
    return CliApp.run(config_cls, cli_args=list(sys.argv[1:] if argv is None else argv), cli_settings_source=source)
