"""Errors the client raises: few, and each says what to do about it."""

from __future__ import annotations

from typing import Optional


class CombeeError(Exception):
    """Base class of every error raised by this package."""


class CombeeUnavailable(CombeeError):
    """The server could not be reached (or answered 5xx/429), and there is no
    cached text for this prompt and no ``fallback`` was given."""


class CombeeAPIError(CombeeError):
    """The server refused the request (a 4xx such as 401, 403 or 404): a bug
    in the caller or its configuration, which retrying will not fix."""

    def __init__(self, status: int, title: str, detail: Optional[str] = None) -> None:
        self.status = status
        self.title = title
        self.detail = detail
        super().__init__(f"HTTP {status} {title}" + (f": {detail}" if detail else ""))


class MissingVariable(CombeeError, KeyError):
    """``Prompt.compile`` met a ``{placeholder}`` with no value."""

    def __init__(self, prompt: str, missing: "list[str]") -> None:
        self.prompt = prompt
        self.missing = missing
        super().__init__(prompt, missing)

    def __str__(self) -> str:
        names = ", ".join("{" + m + "}" for m in self.missing)
        return f"prompt {self.prompt!r} needs a value for {names}"
