"""The project's exception types.

Every refusal sq makes is an ``SqError``.  They are raised from facts every rank shares
(config, safetensors headers, model structure, arguments), so all ranks raise the same
error at the same point and none is left waiting in a collective the others skipped.
The CLI turns any ``SqError`` into ``sq: error: ...`` lines and a non-zero exit.
"""

from __future__ import annotations


class SqError(Exception):
    """Base class: a problem with the user's input or environment, reported as-is."""

    def __init__(self, problems: str | list[str]):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class LoadRefused(SqError):
    """The checkpoint cannot be loaded safely; nothing was materialized.

    ``problems`` lists every problem found, each naming keys, shapes and files.
    """


class DistError(SqError):
    """A peer rank failed or a collective timed out."""
