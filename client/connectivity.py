"""Can this site reach its coordinator? One line naming the address and the cause
(docs/protocol.md §3), for `afl-client doctor` and for the daemons before they enrol.

:func:`probe` walks the layers gRPC hides behind one DEADLINE_EXCEEDED:

1. the address has a port and the host name resolves (``cannot resolve``);
2. a TCP connection opens (``connection refused``: nothing listens, wrong port or server down;
   ``no answer``: a firewall drops packets or the host is down);
3. a TLS handshake with the kit's CA, certificate and key, ALPN ``h2`` as gRPC offers it: the
   kit's key must match its certificate, the server's certificate must chain to the kit's CA
   (else: another federation's server, or a foreign kit), be within its validity period and name
   the host dialled; a peer that does not speak TLS is named (e.g. the metrics port);
4. the server must accept this site's certificate: with TLS 1.3 a refusal arrives after the
   handshake, so the probe sends the HTTP/2 preface and reads the server's first frame; a TLS
   alert there names the refusal (unknown CA, expired certificate).

:func:`wait_until_reachable` runs it before enrolment: a permanent cause (TLS, certificate, key)
fails at once with that line; a transient one (refused, no answer, name not resolved) is logged
with the address and retried with back-off, then fails with the same line.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from afl.client.config import ClientConfig
from afl.client.daemon.transport import DaemonError, RetryPolicy, open_channel
from afl.crypto.identity.kit_check import PROBLEM, check_tls_kit

__all__ = ["Reachability", "connect", "probe", "split_address", "wait_until_reachable"]

log = logging.getLogger("afl.client")

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_NOT_TLS = (
    "WRONG_VERSION_NUMBER",
    "RECORD_LAYER_FAILURE",
    "PACKET_LENGTH_TOO_LONG",
    "HTTP_REQUEST",
)
_REFUSED_CERT = {
    "UNKNOWN_CA": "the server does not trust this site's certificate (issued by another "
    "federation's CA: a foreign kit?)",
    "CERTIFICATE_EXPIRED": "the server refused this site's certificate: it has EXPIRED",
    "BAD_CERTIFICATE": "the server refused this site's certificate",
    "CERTIFICATE_UNKNOWN": "the server refused this site's certificate",
    "CERTIFICATE_REQUIRED": "the server requires a client certificate and got none it accepts",
    "HANDSHAKE_FAILURE": "the server refused the TLS handshake (certificate or protocol)",
}


@dataclass(frozen=True)
class Reachability:
    """The probe's outcome: ``ok``; ``transient`` causes may go away by waiting (server not up
    yet); ``message`` is one line naming the address and the cause."""

    ok: bool
    message: str
    transient: bool = False


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError naming the address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"server address {address!r} must be host:port")
    return host.strip("[]"), int(port)


def _tls_context(config: ClientConfig) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    ctx.load_verify_locations(cafile=str(config.tls.ca_cert))
    try:
        ctx.load_cert_chain(certfile=str(config.tls.cert), keyfile=str(config.tls.key))
    except ssl.SSLError as exc:
        raise ValueError(
            f"the kit's TLS key {config.tls.key} does not match its certificate "
            f"{config.tls.cert} ({exc.reason or exc})"
        ) from exc
    return ctx


def _verify_failure(exc: ssl.SSLCertVerificationError, where: str, host: str) -> str:
    code = exc.verify_code
    if code == 10:  # X509_V_ERR_CERT_HAS_EXPIRED
        return f"{where}: the server's certificate has EXPIRED ({exc.verify_message})"
    if code == 9:  # X509_V_ERR_CERT_NOT_YET_VALID
        return f"{where}: the server's certificate is not valid yet (check the clocks)"
    if code == 62:  # X509_V_ERR_HOSTNAME_MISMATCH
        return (
            f"{where}: the server's certificate does not name {host!r}; dial a host name it "
            "lists (afl provision --server-host) or re-provision"
        )
    return (
        f"{where}: the server's certificate is not issued by this kit's CA ({exc.verify_message}):"
        " the address reaches another federation's server, or this kit is not this federation's"
    )


def _alert(exc: ssl.SSLError) -> str | None:
    text = f"{exc.reason or ''} {exc}".upper()
    for key, message in _REFUSED_CERT.items():
        if key in text:
            return message
    return None


def _why(config: ClientConfig) -> str:
    """The kit's own problem that makes a server refuse it, if any (gRPC sends no alert)."""
    findings = check_tls_kit(ca_cert=config.tls.ca_cert, cert=config.tls.cert, key=config.tls.key)
    problems = [f.message for f in findings if f.level == PROBLEM]
    return "; ".join(problems) or (
        "the kit looks valid, so the server's CA differs from this kit's (re-provisioned "
        "federation? a kit of another federation?)"
    )


def probe(config: ClientConfig, *, insecure: bool = False, timeout_s: float = 10.0) -> Reachability:
    """Check every layer between this site and ``config.server_address`` (module docstring)."""
    address = config.server_address
    try:
        host, port = split_address(address)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except ValueError as exc:
        return Reachability(False, str(exc))
    except socket.gaierror as exc:
        return Reachability(
            False, f"cannot resolve host {host!r} of {address}: {exc.strerror}", True
        )
    family, kind, proto, _, sockaddr = infos[0]
    where = f"{address} ({sockaddr[0]} port {port})"
    try:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(timeout_s)
        sock.connect(sockaddr)
    except ConnectionRefusedError:
        return Reachability(
            False,
            f"connection refused by {where}: nothing listens there (afl-server not running, or "
            "the wrong port in [client] server)",
            True,
        )
    except TimeoutError:
        return Reachability(
            False, f"no answer from {where} within {timeout_s:g} s (firewall or host down)", True
        )
    except OSError as exc:
        return Reachability(False, f"cannot connect to {where}: {exc.strerror or exc}", True)
    with sock:
        if insecure:
            return Reachability(True, f"{where}: TCP connection open (--insecure: no TLS)")
        try:
            ctx = _tls_context(config)
        except (ValueError, OSError) as exc:
            return Reachability(False, str(exc))
        try:
            with ctx.wrap_socket(sock, server_hostname=host) as tls:
                version = tls.version()
                tls.sendall(_H2_PREFACE)
                first = tls.recv(9)
        except ssl.SSLCertVerificationError as exc:
            return Reachability(False, _verify_failure(exc, where, host))
        except ssl.SSLError as exc:
            alert = _alert(exc)
            if alert is not None:
                return Reachability(False, f"{where}: {alert}")
            if any(k in str(exc).upper() for k in _NOT_TLS):
                return Reachability(
                    False, f"{where} does not speak TLS: a wrong port (the metrics port?)"
                )
            return Reachability(False, f"{where}: TLS failed: {exc.reason or exc}")
        except TimeoutError:
            return Reachability(
                False, f"{where}: no TLS answer within {timeout_s:g} s (not an afl-server?)"
            )
        except OSError as exc:
            return Reachability(False, f"{where}: connection lost during TLS: {exc}", True)
    if not first:
        return Reachability(
            False, f"{where}: the server refused this site's certificate: {_why(config)}"
        )
    return Reachability(True, f"{where}: mutual TLS ({version}) accepted, gRPC over HTTP/2")


def wait_until_reachable(
    config: ClientConfig,
    *,
    insecure: bool,
    retry: RetryPolicy,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """:func:`probe` until it passes; :class:`DaemonError` with its line on a permanent cause at
    once, on a transient one after ``retry.attempts`` attempts (each logged with the cause)."""
    for attempt in range(retry.attempts):
        result = probe(config, insecure=insecure, timeout_s=min(10.0, config.timing.rpc_timeout_s))
        if result.ok:
            log.info("site=%s %s", config.site_id, result.message)
            return
        if not result.transient or attempt == retry.attempts - 1:
            raise DaemonError(f"cannot reach afl-server: {result.message}")
        pause = retry.delay(attempt)
        log.warning("site=%s %s; retrying in %.1f s", config.site_id, result.message, pause)
        sleep(pause)


def connect(config: ClientConfig, *, insecure: bool = False) -> grpc.Channel:
    """:func:`wait_until_reachable` (waits of up to ~30 s between attempts), then the daemon's
    channel (:func:`afl.client.daemon.transport.open_channel`)."""
    t = config.timing
    policy = RetryPolicy(
        attempts=t.retry_attempts, initial_s=max(1.0, t.poll_interval_s), max_s=30.0
    )
    wait_until_reachable(config, insecure=insecure, retry=policy)
    return open_channel(config, insecure=insecure)
