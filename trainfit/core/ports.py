"""TCP port checks for the rendezvous, shared by the launcher (dist.py) and `trainfit doctor`.
No torch import: doctor must stay fast."""

from __future__ import annotations

import socket

DEFAULT_PORT = 29500  # torchrun's default MASTER_PORT


def port_free(port: int, host: str = "") -> bool:
    """Whether a TCP listener could bind `port` (SO_REUSEADDR, as torch's TCPStore sets, so sockets in
    TIME_WAIT do not count as busy). `host` "" = every interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
