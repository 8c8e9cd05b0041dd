"""User-facing errors: the CLI prints them as one line and exits with status 2, no traceback."""

from __future__ import annotations


class SpecpilotError(Exception):
    """A mistake the user can act on. The message names the file, the field and what was expected."""


class SpecError(SpecpilotError):
    """pipeline.yaml (or a file it names) is missing, malformed or invalid."""


class PipelineError(SpecpilotError):
    """A pass pipeline string names an unknown pass or gives it a bad parameter."""


class DSLSyntaxError(SpecpilotError):
    """DSL text does not parse; the message carries file, line and column."""


class CheckpointError(SpecpilotError):
    """A model directory is missing, incomplete or does not fit the target."""


class EngineError(SpecpilotError):
    """An engine directory is missing, incomplete or fails its checks."""
