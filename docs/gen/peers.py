"""The key tables of the "Coming from ..." pages, from trainfit/config/peer_keys.py: the same rows that answer
an unknown key with the trainfit key it means."""

from __future__ import annotations

from docs.gen.tables import table
from trainfit.config.peer_keys import PEER_KEYS, WHAT

PEERS = {"trl": "TRL", "verl": "verl", "openrlhf": "OpenRLHF", "llamafactory": "LLaMA-Factory"}


def peer_table(peer: str) -> str:
    """Every key the tool writes that trainfit reads under another name, then the words several tools use."""
    name = PEERS[peer]
    rows = [r for r in PEER_KEYS if r.peer == name] + [r for r in PEER_KEYS if not r.peer]
    return table([f"{name} key", "trainfit key", "what it is", "carrying the value over"],
                 ([f"`{r.key}`" + ("" if r.peer else " (several tools)"), f"`{r.trainfit}`", WHAT.get(r.trainfit, ""),
                   r.convert or ("as is" + (f"; {r.note}" if r.note else ""))] for r in rows))
