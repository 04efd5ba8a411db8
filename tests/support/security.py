"""What the security tests (tests/test_security.py, test_security_engine.py) probe with: the
addresses a port is listened on (``listen_addresses``, read from /proc/net), and a pickle that
runs a call when loaded (``PickledCall``)."""

from __future__ import annotations

import os
from pathlib import Path


def listen_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of the sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A = LISTEN
                found.add(addr)
    return found


LOOPBACK_V4 = "0100007F"  # 127.0.0.1 in /proc/net/tcp's little-endian hex


class PickledCall:
    """Pickles as a call of ``fn(*args)``, by reference as torch's own reductions do (unpickling
    ``PickledCall(open, path, "w")`` creates a file: a file appearing means code ran).
    tests/test_security.py feeds such payloads to the loaders; test_security_engine.py builds
    sender-shaped ones."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args
