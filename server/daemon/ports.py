"""Is a listen address free? One line naming the cause when it is not (afl-server start and
`afl-server check`)."""

from __future__ import annotations

import errno
import socket

__all__ = ["port_in_use", "split_listen"]


def split_listen(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError naming the address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address {address!r} must be host:port")
    return host.strip("[]"), int(port)


def port_in_use(address: str) -> str:
    """ "" when ``address`` (host:port) can be bound now, else why not (port 0 is always free)."""
    try:
        host, port = split_listen(address)
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    except ValueError as exc:
        return str(exc)
    except socket.gaierror as exc:
        return f"cannot resolve {address}: {exc.strerror}"
    if port == 0:
        return ""
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "the address is already in use (another afl-server running?)"
            return exc.strerror or str(exc)
    return ""
