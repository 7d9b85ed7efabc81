"""The certificates and keys of a local control plane, as kubeadm lays them out.

One CA signs the API server's serving certificate and every client certificate: the admin
(`kubernetes-admin`, group `system:masters`), the controller manager and the scheduler (the users
the RBAC bootstrap roles name), the node (`system:node:<name>` in `system:nodes`, which the Node
authorizer and the NodeRestriction admission plugin check) and the API server's own client for
kubelets. A separate key signs service-account tokens. Keys are ECDSA P-256: a cluster takes
them everywhere and they are made in microseconds, where RSA takes most of a second on 2 cores.
"""

from __future__ import annotations

import datetime
import ipaddress
import pathlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

ONE_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Credential:
    """A certificate and its key, as PEM files."""

    cert: pathlib.Path
    key: pathlib.Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: pathlib.Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(parts)


class Pki:
    """A CA in `folder` and the credentials it issues (`issue`), each written as PEM files."""

    def __init__(self, folder: pathlib.Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._ca_key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        self._ca_cert = (
            x509.CertificateBuilder()
            .subject_name(_name("corefleet-test-ca"))
            .issuer_name(_name("corefleet-test-ca"))
            .public_key(self._ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - ONE_DAY)
            .not_valid_after(now + 30 * ONE_DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._ca_key, hashes.SHA256())
        )
        self.ca = folder / "ca.crt"
        self.ca.write_bytes(self._ca_cert.public_bytes(serialization.Encoding.PEM))
        self.service_account_key = folder / "sa.key"
        self.service_account_pub = folder / "sa.pub"
        sa_key = _key()
        _write_key(sa_key, self.service_account_key)
        self.service_account_pub.write_bytes(
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    def issue(
        self,
        file_stem: str,
        common_name: str,
        organization: str | None = None,
        *,
        server_names: tuple[str, ...] = (),
    ) -> Credential:
        """A certificate signed by the CA: a client one, or a serving one with `server_names`
        (host names and IP addresses, as subject alternative names)."""
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        usage = x509.oid.ExtendedKeyUsageOID
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, organization))
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - ONE_DAY)
            .not_valid_after(now + 30 * ONE_DAY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [usage.SERVER_AUTH, usage.CLIENT_AUTH] if server_names else [usage.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server_names:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_alt_name(n) for n in server_names]), critical=False
            )
        cert = builder.sign(self._ca_key, hashes.SHA256())
        credential = Credential(self.folder / f"{file_stem}.crt", self.folder / f"{file_stem}.key")
        credential.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, credential.key)
        return credential


def _alt_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)
