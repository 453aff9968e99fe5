"""Optional mutual TLS for both planes of a swarm: a private cluster CA and node certificates.

    cellswarm certs init --dir CA                     CA/ca.pem, CA/ca.key (0600)
    cellswarm certs node NAME --dir CA --host IP ...  CA/NAME/{ca.pem, node.pem, node.key}

A node's TLS folder (`--tls DIR`) holds ca.pem, node.pem and node.key. Every connection —
HTTP to a coordinator, frames between stages, a stage's calls to part servers — presents the
node's certificate and requires the peer's to chain to ca.pem; one from another CA fails the
handshake. The cluster token's HMAC proofs (auth.py) still run inside: TLS is in addition.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cellswarm.errors import RequestError

if TYPE_CHECKING:  # `cryptography` is imported only to make certificates: it costs a
    # worker ~15 MB of RSS, and the ssl module alone serves the connections
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

CA_CERT, CA_KEY = "ca.pem", "ca.key"
NODE_CERT, NODE_KEY = "node.pem", "node.key"
CA_DAYS, NODE_DAYS = 3650, 825
# for TLS 1.2 peers (1.3 has its own, all good): forward-secret AEAD only; uvicorn's default
# ("TLSv1") would allow CBC with SHA-1
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


def init_ca(directory: str | Path) -> Path:
    """A new cluster CA in `directory` (ca.pem, ca.key 0600); refuses to replace one, since
    every node certificate it signed would stop working."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = Path(directory)
    if (d / CA_KEY).exists() or (d / CA_CERT).exists():
        raise RequestError(f"{d} already holds a CA ({CA_CERT}); use it, or another --dir")
    d.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cellswarm cluster CA")])
    cert = (
        _builder(name, name, key.public_key(), CA_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    _write_key(d / CA_KEY, key)
    (d / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return d


def issue(ca_dir: str | Path, name: str, out_dir: str | Path, hosts: Sequence[str] = ()) -> Path:
    """A node certificate for `name` signed by the CA in `ca_dir`, valid for `hosts` (IPs or
    DNS names) and `name`: out_dir gets ca.pem, node.pem and node.key (0600)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key, ca_cert = _load_ca(Path(ca_dir))
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, ca_cert.subject, key.public_key(), NODE_DAYS)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False)
        .add_extension(x509.SubjectAlternativeName(_names([*hosts, name])), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CA_CERT).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(out / NODE_KEY, key)
    (out / NODE_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return out


# asyncio's SSLProtocol gives every connection a 256 KiB read buffer the moment it is
# accepted, before any handshake: 1,000 strangers who connect and say nothing cost a TLS
# listener ~290 MB (measured), and glibc keeps most of it after they go (a data port's cap
# on unproven connections counts only those past TLS). Every TLS connection of a
# coordinator or a worker reads in one TLS record's size instead; a data-plane link that
# proved its key reads in asyncio's 256 KiB again (widen_tls_reads): a prefill's
# activations arrive in megabytes, 16 times the receive calls would cost.
TLS_READ_BYTES = 16 * 1024
LINK_READ_BYTES = 256 * 1024


def lean_tls_buffers() -> None:
    """Every asyncio TLS connection of this process reads into TLS_READ_BYTES, not 256 KiB."""
    import asyncio.sslproto

    asyncio.sslproto.SSLProtocol.max_size = TLS_READ_BYTES


def widen_tls_reads(writer: asyncio.StreamWriter) -> None:
    """A proven data-plane link (TLS or not: nothing for plain TCP) reads LINK_READ_BYTES at
    a time: asyncio's SSLProtocol grows its buffer up to the instance's max_size when it
    next reads (asyncio/sslproto.py get_buffer)."""
    protocol = getattr(writer.transport, "_ssl_protocol", None)
    if protocol is not None:
        protocol.max_size = LINK_READ_BYTES


def server_context(tls_dir: str | Path) -> ssl.SSLContext:
    """For a listener: present node.pem, require a client certificate chained to ca.pem."""
    return _context(ssl.PROTOCOL_TLS_SERVER, Path(tls_dir))


def client_context(tls_dir: str | Path) -> ssl.SSLContext:
    """For a caller: present node.pem, require the server's certificate chained to ca.pem.

    No hostname check: data-plane peers dial the IPs the coordinator wires them with, and a
    node's address can change (DHCP, NAT, --advertise) without its certificate changing. The
    CA is private to the cluster and signs only its nodes, so a certificate chained to it is
    the identity check; which node may send what is then the token's job (auth.py)."""
    ctx = _context(ssl.PROTOCOL_TLS_CLIENT, Path(tls_dir))
    ctx.check_hostname = False  # verify_mode stays CERT_REQUIRED
    return ctx


def files(tls_dir: str | Path) -> tuple[str, str, str]:
    """(ca.pem, node.pem, node.key) of a node's TLS folder, checked to be readable."""
    d = Path(tls_dir)
    if not d.is_dir():
        raise RequestError(f"TLS folder {d} does not exist; {_fix(d)}")
    paths = (d / CA_CERT, d / NODE_CERT, d / NODE_KEY)
    for p in paths:
        if not os.access(p, os.R_OK):
            raise RequestError(f"TLS folder {d}: {p.name} is missing or unreadable; {_fix(d)}")
    return str(paths[0]), str(paths[1]), str(paths[2])


def check_url(url: str, tls_dir: str | Path | None) -> None:
    """A coordinator's URL is http(s)://HOST[:PORT]; an https URL needs a TLS folder and a
    TLS folder needs https: say so, not a handshake (or a silence: urllib's 'unknown url
    type' was caught as a network error and retried for ever)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url.strip())
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:  # a port that is no number
        parts, port_ok = urlsplit(""), False
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or not port_ok:
        raise RequestError(f"{url!r} is not a coordinator's URL: give http://HOST:PORT "
                           "(e.g. http://10.0.0.5:8000), https:// with --tls")  # fmt: skip
    https = url.strip().lower().startswith("https://")
    if https and tls_dir is None:
        raise RequestError(f"{url} is https: pass --tls DIR (a node's certificate folder)")
    if tls_dir is not None and not https:
        raise RequestError(f"--tls is given but {url} is not https://; use https://")


def _context(protocol: int, d: Path) -> ssl.SSLContext:
    ca, cert, key = files(d)
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(TLS12_CIPHERS)
    ctx.verify_mode = ssl.CERT_REQUIRED  # both sides: mutual TLS
    try:
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(ca)
    except (ssl.SSLError, ValueError) as exc:
        raise RequestError(f"TLS folder {d}: its files do not load ({exc}); {_fix(d)}") from None
    return ctx


def _fix(d: Path) -> str:
    return (f"make one with `cellswarm certs init --dir CA` (once per cluster), then "
            f"`cellswarm certs node NAME --dir CA --out {d}`")  # fmt: skip


def _load_ca(d: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        key = serialization.load_pem_private_key((d / CA_KEY).read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate((d / CA_CERT).read_bytes())
    except OSError as exc:
        raise RequestError(f"no readable CA in {d} ({exc.strerror}); make one with "
                           f"`cellswarm certs init --dir {d}`") from None  # fmt: skip
    except ValueError as exc:
        raise RequestError(f"the CA in {d} does not load ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise RequestError(f"{d / CA_KEY} is not a key `cellswarm certs init` made")
    return key, cert


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    from cryptography import x509

    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
        .public_key(public_key).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))  # nodes' clocks differ a little
        .not_valid_after(now + datetime.timedelta(days=days))
    )  # fmt: skip


def _key_usage(ca: bool) -> x509.KeyUsage:
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=not ca, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip


def _names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    from cryptography import x509

    out: list[x509.GeneralName] = []
    for h in dict.fromkeys(h.strip() for h in hosts if h.strip()):  # in order, once each
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """The private key, readable by its owner only from the first byte on."""
    from cryptography.hazmat.primitives import serialization

    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())  # fmt: skip
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    path.chmod(0o600)  # O_CREAT's mode does not apply to a file that already existed


def tls_failure(exc: BaseException) -> str:
    """What went wrong on a TLS connection, if `exc` (or the error urllib wrapped) looks like
    a refused handshake: an SSL error, or — TLS 1.3 checks the client's certificate after the
    client is done — the server closing the connection before it answers."""
    reason = getattr(exc, "reason", exc)  # urllib.error.URLError wraps the socket's error
    if isinstance(reason, ssl.SSLError):
        return str(reason)
    if isinstance(reason, ConnectionResetError):  # http.client.RemoteDisconnected is one
        return f"the peer closed the connection unanswered ({reason})"
    return ""
