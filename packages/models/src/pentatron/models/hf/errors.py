"""The one error type of the Hugging Face converter (shared by the config and state maps)."""

from __future__ import annotations

from typing import Any


class HFConfigError(ValueError):
    """A Hugging Face config this converter cannot represent; names the field and a fix."""


def fail(field: str, value: Any, rule: str, fix: str) -> None:
    raise HFConfigError(f"Hugging Face config {field}={value!r}: {rule}; fix: {fix}")
