"""What an agent gets back from ``get_prompt``: the text, where it came from,
and ``compile`` to fill in its ``{placeholders}``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

from .errors import MissingVariable

# The server's own rule (src/domain/prompt.rs `placeholder_spans`): `{` + one or more
# ASCII letters, digits or `_` + `}`, not part of a `{{…}}` pair. Anything else
# in braces (JSON examples, `{{escaped}}`) is left alone.
_PLACEHOLDER = re.compile(r"(?<!\{)\{([A-Za-z0-9_]+)\}")


def placeholders(text: str) -> "list[str]":
    """The placeholder names in ``text``, in order of first appearance."""
    seen: dict[str, None] = {}
    for m in _PLACEHOLDER.finditer(text):
        seen.setdefault(m.group(1), None)
    return list(seen)


@dataclass(frozen=True)
class Arm:
    """The arm of an experiment (traffic split) this answer was drawn from,
    when the server runs one for the prompt."""

    version: int
    role: str
    experiment: str


@dataclass(frozen=True)
class Prompt:
    """A prompt as served to an agent.

    ``version`` is ``None`` only for a ``fallback`` (``source == "fallback"``);
    ``source`` is ``"server"`` while the server's answer is fresh or was
    confirmed by the last revalidation, ``"stale"`` when the last attempt to
    reach the server failed and the last known text is served, and
    ``"fallback"`` when the caller's fallback text was used.
    """

    name: str
    text: str
    version: Optional[int]
    label: Optional[str] = None
    labels: Tuple[str, ...] = ()
    arm: Optional[Arm] = None
    source: str = "server"
    content_hash: Optional[str] = None
    subject: Optional[str] = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def variables(self) -> "list[str]":
        """The ``{placeholders}`` that ``compile`` fills in."""
        return placeholders(self.text)

    def compile(self, **variables: Any) -> str:
        """The text with every ``{name}`` replaced by ``str(variables[name])``.

        Raises :class:`MissingVariable` naming every placeholder without a value.
        Braces that are not placeholders (``{"json": 1}``, ``{{literal}}``,
        ``{ spaced }``) are kept verbatim; extra variables are ignored.
        """
        missing = [v for v in self.variables if v not in variables]
        if missing:
            raise MissingVariable(self.name, missing)
        return _PLACEHOLDER.sub(lambda m: str(variables[m.group(1)]), self.text)

    def __str__(self) -> str:
        return self.text
