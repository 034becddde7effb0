"""Network address helpers shared by the orchestration and the stages (kept apart from the settings, so that a
change to the orchestration's settings does not change the stages' code versions)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`: addresses no other machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
