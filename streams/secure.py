"""A secured broker: TLS, one nkey per client, and per-role permissions on one run's subjects.

`echo-rl secure init DIR --run-id ID` writes DIR/ca.pem and the server's certificate, an nkey
seed per client (trainer.nk, observer.nk, sampler-<id>.nk) and DIR/server.conf, which the hub
includes. Permissions are written from the run's names (echo/protocol.py), so they follow the
wire contract. Why nkeys and not JWTs: one config file and no operator/account signing chain to
run; a client proves it holds its seed by signing the server's nonce, the seed never leaves its
box. Adding a sampler rewrites the user list and reloads the server (SIGHUP): no restart.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import signal
import ssl
from dataclasses import dataclass
from pathlib import Path

import nkeys

from echo.protocol import HUB_DOMAIN, SAMPLER_STATUS_PREFIX, TRAINER_CONSUMER, RunNames, check_id

ROLES_FILE = "roles.json"  # public keys and roles: the source of server.conf's user list
SERVER_CONF = "server.conf"
PID_FILE = "nats-server.pid"


def inbox_prefix(public_key: str) -> str:
    """Each client reads replies only under its own prefix: `_INBOX.>` would let it read everyone's."""
    return f"_INBOX_{public_key}"


@dataclass(frozen=True)
class Credentials:
    """What a client needs to join a secured broker: its nkey seed and the CA to check the server."""

    seed_file: Path
    ca_file: Path

    def connect_options(self) -> dict:
        seed = self.seed_file.read_bytes().strip()
        public = nkeys.from_seed(bytearray(seed)).public_key.decode()
        return {
            "nkeys_seed_str": seed.decode(),
            "tls": ssl.create_default_context(cafile=str(self.ca_file)),
            "inbox_prefix": inbox_prefix(public),
        }


def credentials_of(creds: str, tls_ca: str) -> Credentials | None:
    """The `nats.creds` and `nats.tls_ca` fields of a config, or None for an open broker."""
    return Credentials(Path(creds), Path(tls_ca)) if creds else None


def _api_prefixes(hub_domain: str) -> list[str]:
    # Clients of the hub reach JetStream as $JS.API and, through the domain, $JS.<domain>.API.
    return ["$JS.API", f"$JS.{hub_domain}.API"]


def _kv_write(bucket: str, key: str, hub_domain: str) -> list[str]:
    # streams/client.py writes KV keys through the domain's API prefix (so they cross a relay).
    subject = f"$KV.{bucket}.{key}"
    return [subject, f"$JS.{hub_domain}.API.{subject}"]


def permissions(role: str, names: RunNames, public_key: str, sampler_id: str | None = None,
                hub_domain: str = HUB_DOMAIN) -> dict:
    """The NATS permissions of one client of the run. The trainer owns everything; a sampler reads
    weights, announcements, config and budget, publishes on its own rollout and grants subjects
    only and writes only its own heartbeat; an observer reads. No one but the trainer may create, change, purge or
    delete a stream or consumer, and no one may read another client's replies."""
    inbox = inbox_prefix(public_key) + ".>"
    if role == "trainer":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    readable = [names.control_stream, names.weights_stream, f"KV_{names.state_bucket}"]
    if role == "observer":
        readable.append(names.rollouts_stream)  # replay
    allow = []
    for api in _api_prefixes(hub_domain):
        allow.append(f"{api}.INFO")
        for stream in readable:
            allow += [f"{api}.STREAM.INFO.{stream}", f"{api}.STREAM.MSG.GET.{stream}",
                      f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>",
                      f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>",
                      f"{api}.CONSUMER.INFO.{stream}.>", f"{api}.CONSUMER.MSG.NEXT.{stream}.>"]
    allow += [f"$JS.FC.{stream}.>" for stream in readable]  # flow control of ordered consumers
    deny = [f"{api}.CONSUMER.CREATE.{names.rollouts_stream}.{TRAINER_CONSUMER}{tail}"
            for api in _api_prefixes(hub_domain) for tail in ("", ".>")]  # the trainer's own consumer
    if role == "sampler":
        check_id("sampler id", sampler_id)
        allow += [names.rollouts_subject(sampler_id), names.grants_subject(sampler_id)]
        allow += _kv_write(names.state_bucket, f"{SAMPLER_STATUS_PREFIX}{sampler_id}", hub_domain)
    elif role != "observer":
        raise ValueError(f"unknown role {role!r}")
    return {"publish": {"allow": allow, "deny": deny}, "subscribe": {"allow": [inbox]}}


def _new_seed() -> bytes:
    return nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)


def _write_secret(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    os.chmod(path, 0o600)


def _write_tls(directory: Path, hosts: list[str]) -> None:
    """A local CA and the server's certificate for `hosts` (names or IP addresses)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    later = now + datetime.timedelta(days=825)

    def cert(subject, issuer, public, signer, extensions):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public)
                   .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(later))
        for ext, critical in extensions:
            builder = builder.add_extension(ext, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    def pem_key(key):
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "echo-rl local CA")])
    ca = cert(ca_name, ca_name, ca_key.public_key(), ca_key, [(x509.BasicConstraints(ca=True, path_length=0), True)])
    sans = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server = cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]), ca_name, server_key.public_key(),
                  ca_key, [(x509.SubjectAlternativeName(sans), False), (x509.BasicConstraints(ca=False, path_length=None), True)])
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "server-cert.pem").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_secret(directory / "server-key.pem", pem_key(server_key))
    _write_secret(directory / "ca-key.pem", pem_key(ca_key))  # keep offline: it can mint server certificates


class SecureDir:
    """The files `secure init` writes, and the user list they derive from (roles.json)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory).resolve()

    @property
    def ca_file(self) -> Path:
        return self.dir / "ca.pem"

    def seed_file(self, user: str) -> Path:
        return self.dir / f"{user}.nk"

    def credentials(self, user: str) -> Credentials:
        return Credentials(self.seed_file(user), self.ca_file)

    def _roles(self) -> dict:
        return json.loads((self.dir / ROLES_FILE).read_text())

    def init(self, run_id: str, hosts: list[str], samplers: list[str], hub_domain: str = HUB_DOMAIN) -> None:
        RunNames(run_id)  # a valid run id
        self.dir.mkdir(parents=True, exist_ok=True)
        if (self.dir / ROLES_FILE).exists():
            raise FileExistsError(f"{self.dir} holds a secured swarm already: use add-sampler")
        _write_tls(self.dir, hosts)
        (self.dir / ROLES_FILE).write_text(json.dumps({"run_id": run_id, "hub_domain": hub_domain, "users": {}}))
        for user in ("trainer", "observer"):
            self._add_user(user, user)
        for sampler_id in samplers:
            self._add_user(f"sampler-{sampler_id}", "sampler", sampler_id)
        self.write_server_conf()

    def add_sampler(self, sampler_id: str) -> Credentials:
        """A new sampler's seed, then the server's user list rewritten and reloaded if it runs."""
        check_id("sampler id", sampler_id)
        self._add_user(f"sampler-{sampler_id}", "sampler", sampler_id)
        self.write_server_conf()
        self.reload()
        return self.credentials(f"sampler-{sampler_id}")

    def _add_user(self, user: str, role: str, sampler_id: str | None = None) -> None:
        roles = self._roles()
        if user in roles["users"]:
            raise FileExistsError(f"{user} has credentials already ({self.seed_file(user)})")
        seed = _new_seed()
        _write_secret(self.seed_file(user), seed + b"\n")
        public = nkeys.from_seed(bytearray(seed)).public_key.decode()
        roles["users"][user] = {"role": role, "nkey": public, "sampler_id": sampler_id}
        (self.dir / ROLES_FILE).write_text(json.dumps(roles, indent=1))

    def write_server_conf(self) -> None:
        """TLS and the user list, for the hub's config to include. JSON is valid NATS config."""
        roles = self._roles()
        names = RunNames(roles["run_id"])
        users = [
            {"nkey": u["nkey"], "permissions": permissions(u["role"], names, u["nkey"], u["sampler_id"], roles["hub_domain"])}
            for u in roles["users"].values()
        ]
        q = json.dumps
        text = "\n".join([
            f"tls {{ cert_file: {q(str(self.dir / 'server-cert.pem'))}, key_file: {q(str(self.dir / 'server-key.pem'))}, timeout: 5 }}",
            f"authorization {{ users: {q(users)} }}",
            f"pid_file: {q(str(self.dir / PID_FILE))}",
        ])
        tmp = self.dir / (SERVER_CONF + ".tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, self.dir / SERVER_CONF)

    def reload(self) -> bool:
        """Tell a running hub to re-read its config (the new user list). False if none runs."""
        try:
            pid = int((self.dir / PID_FILE).read_text())
            os.kill(pid, signal.SIGHUP)
            return True
        except (FileNotFoundError, ProcessLookupError, ValueError):
            return False
