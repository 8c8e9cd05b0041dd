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


class WeightsWrittenError(EngineError):
    """An engine wrote into weights that token forcing's reference shares (runtime/shared_weights.py)."""


class PluginError(SpecpilotError):
    """A plugin (an installed package's entry point, or a local module pipeline.yaml names) cannot be
    loaded, or one of its passes raised, returned an invalid IR or took a name already taken. The
    message names the plugin and the pass."""


class UnpricedError(SpecpilotError):
    """The cost model cannot price something a program holds (a plugin's weight format registered
    without its bits per weight): the program can be measured, not predicted."""
