"""Errors shared across layers whose class callers catch by name."""


class EnvError(RuntimeError):
    """An environment cannot go on (service unreachable, invalid reply, broken task row, a bad image part)."""


class EnvLost(EnvError):
    """The environment service lost the episode (it restarted) or could not be reached within its retries:
    the episode's whole group is sampled again (trainfit/envs/groups.py), never trained on in part."""
