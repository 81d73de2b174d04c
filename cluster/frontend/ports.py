"""Listening ports: a port in use is an error, never shared (ARCHITECTURE invariant 11).

gRPC servers set SO_REUSEPORT by default, so two servers on one port would split its
connections; kvloom's turn it off (`ServerOptions.grpc_options`), and the metrics server
never sets it. `check_port_free` looks before binding so the error says, in one line, which
port is taken, instead of gRPC's own log line.
"""

from __future__ import annotations

import errno
import socket


class PortInUse(OSError):
    """Another process listens on the port."""


def check_port_free(host: str, port: int, what: str = "port") -> None:
    """Raises PortInUse (or OSError naming the cause) if `host:port` cannot be listened on.
    Port 0 (any free port) is always fine."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host}:{port}: {host!r} does not resolve") from exc
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            # As a server binds: SO_REUSEADDR (a port left in TIME_WAIT is free), and an
            # IPv6 socket for IPv6 only (its IPv4 twin is probed on its own).
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise _bind_error(exc, host, port, what) from None


def _bind_error(exc: OSError, host: str, port: int, what: str) -> OSError:
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return PortInUse(
            f"{what} {port} is in use on {host or 'every interface'} (another process "
            f"listens on {where}; kvloom never shares a port): stop it or choose another port"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return OSError(f"cannot listen on {where}: {host} is not an address of this machine")
    if exc.errno == errno.EACCES:
        return OSError(f"cannot listen on {where}: permission denied (ports below 1024 need it)")
    return OSError(f"cannot listen on {where}: {exc.strerror or exc}")
