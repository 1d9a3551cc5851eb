"""The base of every algorithm's settings (a leaf module: the maths modules define their configs on it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from sq.dictconfig import DictConfig

__all__ = ["AlgoConfig", "option"]


def option(default, help: str, *, choices: dict[str, Any] | None = None):
    """A config field that is also a command-line flag (``--name-with-dashes``) and an API keyword.

    ``choices`` maps the words the flag accepts to field values (``--actorder static|off``).
    """
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class AlgoConfig(DictConfig):
    """Base of every algorithm's settings.  ``name`` is the ``--algo`` word; ``version`` goes into
    the resume signature (bump it when the same settings would now give other bits)."""

    name: ClassVar[str] = ""
    version: ClassVar[int] = 1
    # the integer grid of symmetric int schemes under --int-grid auto (sq.formats.schemes.INT_GRIDS)
    default_int_grid: ClassVar[str] = "standard"

    def problems(self) -> list[str]:
        """Refusals of the settings themselves (identical on every rank)."""
        return []

    def signature(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, **self.to_dict()}
