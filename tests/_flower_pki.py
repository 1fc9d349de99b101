"""Test harness: certificates and SuperNode keys for a local Flower federation over TLS with node authentication
(tests, benchmarks, trying the secure setup on one machine; a real deployment uses its own CA).

What Flower 1.42 asks for, and what is written here (all with ``cryptography``, which Flower
itself depends on; nothing is hand-rolled):

- the SuperLink serves its Fleet, Control and Runtime APIs over TLS with ``--ssl-ca-certfile``,
  ``--ssl-certfile`` and ``--ssl-keyfile``: a self-signed CA (``ca.crt``) and a server certificate
  it signed, whose subject alternative names are ``IP:127.0.0.1`` and ``DNS:localhost`` (gRPC checks
  the address the SuperNodes and ``flwr`` dial against them);
- SuperNodes and ``flwr`` trust that CA (``--root-certificates`` / ``root-certificates`` in
  ``config.toml``);
- with ``--enable-supernode-auth`` only SuperNodes whose public key was registered
  (``flwr supernode register KEY.pub``) may connect; each signs its requests with its private key
  (``--auth-supernode-private-key``): an elliptic-curve key on a NIST curve (P-384 here), the
  private key in OpenSSH PEM format and the public key in OpenSSH format, as ``ssh-keygen -t ecdsa
  -b 384`` writes them.

Keys are written with mode 0600 and are valid for one day: they are for a federation that lives
as long as a test or a trial.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LocalPKI", "write_local_pki"]

_VALID = datetime.timedelta(days=1)


@dataclass(frozen=True)
class LocalPKI:
    """Paths of what :func:`write_local_pki` wrote."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...]  # private keys; the public key of ``k`` is ``k.with_suffix(".pub")``

    def node_public_key(self, i: int) -> Path:
        return self.node_keys[i].with_suffix(".pub")


def _write_secret(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_local_pki(folder: str | Path, num_nodes: int) -> LocalPKI:
    """Write a CA, a server certificate for 127.0.0.1/localhost and ``num_nodes`` SuperNode key
    pairs into ``folder`` (created; files of an earlier call are replaced)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + _VALID  # 5 min: clocks a little apart

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "paratrain local federation CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    server_key = ec.generate_private_key(ec.SECP384R1())
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
              .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(start).not_valid_after(end)
              .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                          x509.DNSName("localhost")]), critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .sign(ca_key, hashes.SHA256()))

    pem = serialization.Encoding.PEM
    (out / "ca.crt").write_bytes(ca.public_bytes(pem))
    (out / "server.pem").write_bytes(server.public_bytes(pem))
    _write_secret(out / "server.key", server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
    node_keys = []
    for i in range(int(num_nodes)):
        key = ec.generate_private_key(ec.SECP384R1())
        path = out / f"node{i}.key"
        _write_secret(path, key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
        path.with_suffix(".pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                           serialization.PublicFormat.OpenSSH))
        node_keys.append(path)
    return LocalPKI(out / "ca.crt", out / "server.pem", out / "server.key", tuple(node_keys))
