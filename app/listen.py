"""Where and how the web UI listens, checked before the model loads (each mistake one line):
the port, HTTPS (a browser gives a page the camera only over HTTPS, or from localhost) and the
passwords a UI on the network should ask."""

from __future__ import annotations

import ipaddress
import socket
import ssl
from pathlib import Path

from app.errors import UsageError


def tls_arguments(certfile: str | None, keyfile: str | None) -> dict:
    """Gradio's launch arguments for HTTPS, checked now: a missing or unusable certificate is one
    line before the model loads, not a traceback from the server's start."""
    if certfile is None and keyfile is None:
        return {}
    if certfile is None or keyfile is None:
        raise UsageError("--ssl-certfile and --ssl-keyfile go together")
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not Path(path).is_file():
            raise UsageError(f"{flag}: no such file: {path}")
    try:  # an empty password: an encrypted key fails here instead of asking on the terminal
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password=b"")
    except (ssl.SSLError, OSError) as e:
        raise UsageError(f"cannot serve HTTPS with {certfile} and {keyfile} (an unencrypted PEM key and "
                         f"its certificate): {e.strerror or e}") from None
    return {"ssl_certfile": certfile, "ssl_keyfile": keyfile}


def read_auth(path: str) -> list[tuple[str, str]]:
    """The (user, password) pairs of an --auth-file: one 'user:password' a line (spaces around
    the colon ignored); blank lines and lines starting with # are skipped, a user named twice is
    a mistake. A byte-order mark (Windows Notepad's UTF-8) is no part of the first name: it had
    made that user unable to log in, as had "dave : x" (the page strips what is typed)."""
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--auth-file: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    pairs = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, password = line.partition(":")
        user, password = user.strip(), password.strip()
        if not sep or not user or not password:
            raise UsageError(f"--auth-file {path}, line {n}: expected user:password")
        if any(user == u for u, _ in pairs):  # the last had silently won
            raise UsageError(f"--auth-file {path}, line {n}: {user} is named twice")
        pairs.append((user, password))
    if not pairs:
        raise UsageError(f"--auth-file {path} has no user:password line")
    return pairs


def loopback(host: str) -> bool:
    """Whether every address the host name stands for is this machine's own."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (socket.gaierror, ValueError):
        return False


def check_port(host: str, port: int) -> None:
    """The host resolves and the port is free (bound and let go again, as the server will bind it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            s.bind(addr)
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e} (choose another --port)") from None


def settings_users(names: str | None, auth: list[tuple[str, str]] | None) -> frozenset[str] | None:
    """The users of `ui --settings-by` (comma-separated), each one of the --auth-file's: without
    a password a page has no user name to check. None: every user may apply Settings."""
    if names is None:
        return None
    if auth is None:
        raise UsageError("--settings-by needs --auth-file: a page without a login has no user name")
    users = {n.strip() for n in names.split(",") if n.strip()}
    unknown = sorted(users - {u for u, _ in auth})
    if not users or unknown:
        raise UsageError(f"--settings-by: {', '.join(unknown) or repr(names)} is no user of the --auth-file")
    return frozenset(users)
