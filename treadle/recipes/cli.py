"""Command lines generated from a recipe's pydantic config (treadle's one generator, `treadle.config`).

Every field is a flag documented by --help; booleans are `--flag` / `--no-flag`, lists repeat the
flag. A flag beats the environment and a `--config` file; a flag not given overrides neither.
"""

from treadle.config import parse_config

__all__ = ["parse_config"]
