"""specpilot: a compiler for speculative-decoding deployments."""

__version__ = "0.1.0"
