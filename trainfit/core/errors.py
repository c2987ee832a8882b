"""Errors shared across layers whose class callers catch by name."""


class EnvError(RuntimeError):
    """An environment cannot go on (service unreachable, invalid reply, broken task row, a bad image part)."""
