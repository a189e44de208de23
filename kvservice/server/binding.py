"""Where the server listens: ``host:port`` as gRPC and URLs spell it (an IPv6 address in
brackets), and each listening address tried before gRPC or the HTTP server binds it,
so that a port in use or an address not of this machine fails startup with one line
naming the setting, instead of gRPC's "Failed to bind" or a traceback."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import stat

from kvservice.core.errors import KVCacheError


class BindError(KVCacheError):
    """A listening address that cannot be bound; raised at startup only (``kvservice
    serve`` exits with code 2)."""

    status = "FAILED_PRECONDITION"


def address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (``[::1]:50051``)."""
    bare = host.strip("[]")
    try:
        is_v6 = ipaddress.ip_address(bare).version == 6
    except ValueError:
        is_v6 = False
    return f"[{bare}]:{port}" if is_v6 else f"{host}:{port}"


def socket_family(host: str, port: int) -> socket.AddressFamily:
    """The address family ``host`` resolves to first (for a server socket)."""
    infos = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    return infos[0][0]


def check_bindable(host: str, port: int, flags: str) -> None:
    """Raise ``BindError`` unless a listening socket can be bound to ``host:port``
    now (as servers bind: with ``SO_REUSEADDR``); ``flags`` names the settings to
    change (e.g. ``--host/--port``)."""
    where = address(host, port)
    try:
        infos = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as err:
        raise BindError(
            f"cannot listen on {where}: the host does not resolve ({err.strerror}); check {flags}"
        ) from None
    family, kind, proto, _, sockaddr = infos[0]
    with contextlib.closing(socket.socket(family, kind, proto)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
            sock.listen()
        except OSError as err:
            raise BindError(f"cannot listen on {where}: {_reason(err)}; check {flags}") from None


def remove_stale_socket(path: str, flag: str) -> None:
    """Remove a socket file at ``path`` (a previous server's: binding it again would
    fail); ``BindError`` naming ``flag`` for anything else there."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise BindError(f"{flag} {path}: the path exists and is not a socket; choose another path")
    os.unlink(path)


def _reason(err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return "the port is in use (another server, or this one still running)"
    if err.errno == errno.EADDRNOTAVAIL:
        return "the address is not one of this machine's"
    if err.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    return err.strerror or str(err)
