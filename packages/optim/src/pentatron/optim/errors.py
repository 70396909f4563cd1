"""The one error type for a configuration that cannot work."""

from __future__ import annotations


class OptimConfigError(ValueError):
    """A bad DDP/optimizer/scheduler setting; the message names the field, the rule and a fix."""


def config_error(field: str, value: object, rule: str, fix: str) -> OptimConfigError:
    return OptimConfigError(f"{field}={value!r}: {rule}; fix: {fix}")
