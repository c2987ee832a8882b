"""This machine's CPU RAM, read without importing anything heavy (doctor and the offload launch check)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_ram() -> dict:
    """Total and available CPU RAM in bytes (Linux /proc/meminfo, else sysconf)."""
    try:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
        return {"total": info["MemTotal"], "available": info.get("MemAvailable", info["MemTotal"])}
    except (OSError, KeyError, ValueError, IndexError):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return {"total": total, "available": total}
        except (ValueError, OSError, AttributeError):
            return {"total": None, "available": None}
