"""Config dataclasses that round-trip through plain dicts (resume signature, report)."""

from __future__ import annotations

import dataclasses
from typing import Any


class DictConfig:
    """Mixin for a ``@dataclass``: ``to_dict()`` and a strict ``from_dict()`` (unknown fields refused)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}")
        return cls(**d)
