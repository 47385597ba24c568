"""A secured broker: TLS, one nkey per client, an account per role, and per-role permissions on
one run's subjects.

`echo-rl secure init DIR --run-id ID` writes DIR/ca.pem and the server's certificate, an nkey
seed and a client certificate per client (trainer.nk, trainer-cert.pem, trainer-key.pem; the
same for observer and sampler-<id>) and DIR/server.conf, which the hub includes. Mutual TLS: the
hub and relays accept only clients whose certificate the run's CA signed, then check the nkey;
an attacker needs both a stolen seed and its key, and one without gets no further than the TLS
handshake. Permissions are written from the run's names (echo/wire/names.py), so they follow the
wire contract. Why nkeys and not JWTs: one config file and no operator/account signing chain to
run; a client proves it holds its seed by signing the server's nonce, the seed never leaves its
box. Adding a sampler rewrites the user list and reloads the server (SIGHUP): no restart.

The run's streams and buckets live in account RUN with the trainer; samplers, observers and
relays are in accounts of their own that import from RUN only what their users may publish
(hub_accounts): a server's answer to a sampler's request cannot land in the run's state.

`secure add-relay DIR NAME` issues a relay's leaf nkey (accepted on the hub's leaf port only,
allowed to mirror the weights and announcements and nothing else) and a certificate and user
list (the samplers, reading its mirrors only) for the relay's own client port.

This module is the operator's (the CA, certificates, permissions, server config); what a client
needs to connect with the files it writes is in streams/credentials.py.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path

import nkeys

from echo.wire.names import HUB_DOMAIN, RunNames, check_id
from streams.credentials import Credentials, inbox_prefix, sibling_file
from streams.server import write_secret

ROLES_FILE = "roles.json"  # public keys and roles: the source of server.conf's user list
SERVER_CONF = "server.conf"
LEAF_CONF = "leafnodes.conf"
PID_FILE = "nats-server.pid"


@dataclass(frozen=True)
class RelayFiles(Credentials):
    """What `secure add-relay DIR NAME` writes for one relay, kept side by side on the site box:
    relay-NAME.nk (its leaf nkey, also its own admin identity on its server), the hub's CA, a
    certificate (relay-NAME-cert.pem, -key.pem) that is both its client certificate on the hub's
    leaf port and its server certificate on its own client port, and the samplers allowed to
    read its mirrors (relay-NAME-users.conf)."""

    @property
    def users_file(self) -> Path:
        return sibling_file(self.seed_file, "-users.conf")

    def leaf_remote(self) -> dict:
        """The nats-server `leafnodes.remotes` entry's options: sign with the nkey, present the
        certificate, check the hub's."""
        return {"nkey": self.seed_file.read_text().strip(),
                "tls": {"ca_file": str(self.ca_file.resolve()), "cert_file": str(self.cert_file.resolve()),
                        "key_file": str(self.key_file.resolve())}}

    def server_conf(self) -> str:
        """Mutual TLS on the relay's client port and its users, for the relay's nats-server to include."""
        return (_tls_block(self.cert_file.resolve(), self.key_file.resolve(), self.ca_file.resolve()) + "\n"
                + self.users_file.read_text())


def _tls_block(cert_file: Path, key_file: Path, ca_file: Path) -> str:
    """Server TLS that also asks each client for a certificate the CA signed (`verify`)."""
    q = json.dumps
    return (f"tls {{ cert_file: {q(str(cert_file))}, key_file: {q(str(key_file))}, ca_file: {q(str(ca_file))}, "
            f"verify: true, timeout: 5 }}")


def _direct_gets(api: str, stream: str) -> list[str]:
    """The JetStream API subjects that read one stream's messages by direct gets, all a sampler
    may ask JetStream: a stream answers them itself (any replica or mirror), outside the server's
    JetStream API queues, which every other request waits in, the trainer's too. No consumer: a
    sampler made 1000 durable consumers on the weights stream, the server's limit, and every fetch
    failed until someone deleted them. No INFO (account or stream): a flood of STREAM.INFO (~150 KB
    answers) stalled the run 44-80 s, and one of account INFO or message gets (4 connections, 20 s)
    had the server drop the trainer's consumer and stream INFO requests (streams/client.py joins
    a run and binds buckets by direct gets)."""
    return [f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>"]


def _stream_reads(api: str, stream: str) -> list[str]:
    """An observer's reads of one stream: direct gets and (non-direct) message gets."""
    return [f"{api}.STREAM.MSG.GET.{stream}", *_direct_gets(api, stream)]


def _stream_consumers(api: str, stream: str) -> list[str]:
    """What reading one stream through ephemeral consumers takes (an observer's replay, status):
    `CONSUMER.CREATE.<stream>` without a name, and their fetches; the list of consumers (status
    sums the trainer's readers)."""
    return [f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.INFO.{stream}.>", f"{api}.CONSUMER.LIST.{stream}",
            f"{api}.CONSUMER.MSG.NEXT.{stream}.>"]


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
    weights, announcements, config and budget by direct gets alone, publishes on its own rollout,
    bodies and grants subjects only and writes only its own heartbeat; an observer reads, through
    ephemeral consumers and INFO too. No one but the trainer may create, change, purge or delete a stream
    or make a named consumer, and no one may read another client's replies."""
    inbox = inbox_prefix(public_key) + ".>"
    if role == "trainer":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    readable = [names.control_stream, names.weights_stream, f"KV_{names.state_bucket}"]
    if role == "observer":
        readable += [names.rollouts_stream, names.bodies_stream, f"KV_{names.registry_bucket}"]  # replay, status
    allow = []
    for api in _api_prefixes(hub_domain):
        if role == "observer":  # replay and status read through consumers and stream info
            allow.append(f"{api}.INFO")
        for stream in readable:
            if role == "observer":
                allow += _stream_reads(api, stream) + _stream_consumers(api, stream) + [f"{api}.STREAM.INFO.{stream}"]
            else:
                allow += _direct_gets(api, stream)
    if role == "observer":
        allow += [f"$JS.FC.{stream}.>" for stream in readable]  # flow control of ordered consumers
    # Named consumers on the rollouts stream: the trainer's readers.
    deny = [f"{api}.CONSUMER.CREATE.{names.rollouts_stream}.>" for api in _api_prefixes(hub_domain)]
    if role == "sampler":
        check_id("sampler id", sampler_id)
        allow += [names.rollouts_subject(sampler_id), names.bodies_subject(sampler_id), names.grants_subject(sampler_id)]
        allow += _kv_write(names.registry_bucket, sampler_id, hub_domain)
    elif role != "observer":
        raise ValueError(f"unknown role {role!r}")
    return {"publish": {"allow": allow, "deny": deny}, "subscribe": {"allow": [inbox]}}


def _mirrored(names: RunNames) -> list[str]:
    return [names.control_stream, names.weights_stream]


def relay_leaf_permissions(names: RunNames, public_key: str, hub_domain: str = HUB_DOMAIN) -> dict:
    """The hub's permissions for a relay's leaf connection: what mirroring the announcements and
    the weights bucket needs, found on a real server. Seen from the hub: `publish` is what the
    relay may send into it, `subscribe` what the hub may deliver to it. The relay's JetStream
    asks the hub's domain to create each mirror's consumer (replies on `$JSC.R.`), receives
    the messages on `$JS.M.<id>` and answers flow control; `INFO` lets the relay wait for the hub."""
    publish = [f"$JS.{hub_domain}.API.INFO"]
    for stream in _mirrored(names):
        publish += [f"$JS.{hub_domain}.API.CONSUMER.CREATE.{stream}", f"$JS.FC.{stream}.>"]
    return {"publish": {"allow": publish},
            "subscribe": {"allow": ["$JS.M.>", "$JSC.R.>", inbox_prefix(public_key) + ".>"]}}


def mirror_reader_permissions(names: RunNames, public_key: str) -> dict:
    """A sampler on a relay's client port: it reads the relay's mirrors (its own JetStream, no
    domain) by direct gets and nothing else; everything else it does on the hub."""
    allow = [s for stream in _mirrored(names) for s in _direct_gets("$JS.API", stream)]
    return {"publish": {"allow": allow}, "subscribe": {"allow": [inbox_prefix(public_key) + ".>"]}}


# NATS accounts: the run's streams and buckets live in RUN, with the trainer alone. Each sampler,
# the observers and relays' leaf connections sit in accounts of their own (no JetStream there)
# that import from RUN exactly the subjects their users may publish, as services, and their
# users' inboxes as streams. NATS does not check a request's reply subject: whoever answers (the
# JetStream API, a stream's publish ack, the trainer) writes there with its own rights. Across
# an import the answer goes back into the requester's account, where no stream of the run
# listens: one sampler's credentials can no longer have the server write into the run's state.
# A sampler's account is its own, so the server bounds its connections and subscriptions.
# nats-server starts a configured account's service imports when it starts, not when a reload
# adds the account (server.go, configureAccounts: `!reloading`): a sampler whose account a reload
# introduced could connect and reach nothing. So every account a reload may fill exists from the
# start: RELAYS always, and one empty spare sampler account, SAMPLER_<n+1> after n samplers,
# which the next add-sampler fills while writing the next spare.
RUN, OBSERVERS, RELAYS = "RUN", "OBSERVERS", "RELAYS"
SAMPLER_LIMITS = {"max_connections": 8, "max_subscriptions": 512}  # a sampler needs 1-3 and a few dozen


def sampler_account(slot: int) -> str:
    return f"SAMPLER_{slot}"


def account_of(user: dict) -> str:
    """The account of a user of roles.json."""
    if user["role"] == "sampler":
        return sampler_account(user["slot"])
    return {"trainer": RUN, "observer": OBSERVERS, "relay": RELAYS}[user["role"]]


def hub_accounts(users: list[tuple[str, dict]], hub_domain: str, spare: str, run_storage: int = -1) -> dict:
    """The hub's `accounts` block for (account, user entry) pairs: each user in its account, and
    RUN's exports and the other accounts' imports derived from the users' permissions; RELAYS and
    the `spare` sampler account empty until a user is issued into them. `run_storage`: the bytes
    RUN's streams may keep on disk (-1: no limit)."""
    jetstream = {"max_file": run_storage} if run_storage > 0 else "enabled"
    accounts = {RUN: {"jetstream": jetstream, "users": [], "exports": []},
                RELAYS: {"users": [], "imports": []}, spare: {"users": [], "imports": [], "limits": SAMPLER_LIMITS}}
    exported: dict[tuple[str, str], dict] = {}

    def share(kind: str, subject: str, account: str) -> None:
        entry = exported.get((kind, subject))
        if entry is None:
            entry = exported[(kind, subject)] = {kind: subject, "accounts": []}
            if ".MSG.NEXT." in subject or ".DIRECT.GET." in subject:
                entry["response_type"] = "stream"  # a fetch, a batched get answer with many messages
            accounts[RUN]["exports"].append(entry)
        if account not in entry["accounts"]:
            entry["accounts"].append(account)
            accounts[account]["imports"].append({kind: {"account": RUN, "subject": subject}})

    for account, user in users:
        if account not in accounts:
            accounts[account] = {"users": [], "imports": []}
            if account.startswith("SAMPLER_"):
                accounts[account]["limits"] = SAMPLER_LIMITS
        accounts[account]["users"].append(user)
        if account == RUN:
            continue
        for subject in user["permissions"]["publish"]["allow"]:
            if account == RELAYS:  # the hub maps a leaf's $JS.<domain>.API requests to $JS.API in its account
                subject = subject.replace(f"$JS.{hub_domain}.API.", "$JS.API.")
            share("service", subject, account)
        if account == RELAYS:
            share("stream", "$JS.M.>", account)  # its mirrors' deliveries
        else:
            share("stream", inbox_prefix(user["nkey"]) + ".>", account)  # its consumers' deliveries, its answers
    return accounts


def _sampler_slots(roles: dict) -> int:
    """How many sampler accounts are filled: the spare is the next."""
    return sum(u["role"] == "sampler" for u in roles["users"].values())


def _new_seed() -> bytes:
    return nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)


def _replace_text(path: Path, text: str) -> None:
    """Whole or not at all: a reloading server never reads half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def _certificate(subject_cn: str, issuer, public_key, signer, extensions):
    """Signed by `signer` as `issuer` (a name; None: self-signed)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject).public_key(public_key)
               .serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=825)))
    for ext, critical in extensions:
        builder = builder.add_extension(ext, critical=critical)
    return builder.sign(signer, hashes.SHA256())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_ca(directory: Path) -> None:
    """A local CA: ca.pem for every client and server, ca-key.pem to issue certificates."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("echo-rl local CA", None, key.public_key(), key,
                      [(x509.BasicConstraints(ca=True, path_length=0), True)])
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    write_secret(directory / "ca-key.pem", _pem_key(key))  # keep offline: it can mint certificates


def _issue_certificate(directory: Path, name: str, hosts: list[str], cert_file: Path, key_file: Path) -> None:
    """A certificate signed by the directory's CA: a client's (named `name`), and with `hosts`
    (names or IP addresses) a server's too."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), None)
    sans = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if hosts else [])
    extensions = [(x509.BasicConstraints(ca=False, path_length=None), True), (x509.ExtendedKeyUsage(usages), False)]
    if sans:
        extensions.append((x509.SubjectAlternativeName(sans), False))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(name, ca.subject, key.public_key(), ca_key, extensions)
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_secret(key_file, _pem_key(key))


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

    def holds_run(self, run_id: str) -> bool:
        """Whether `init` ran here for this run; another run's credentials are an error."""
        if not (self.dir / ROLES_FILE).exists():
            return False
        held = self._roles()["run_id"]
        if held != run_id:
            raise FileExistsError(f"{self.dir} holds run {held}'s credentials, not {run_id}'s")
        return True

    def init(self, run_id: str, hosts: list[str], samplers: list[str], hub_domain: str = HUB_DOMAIN,
             run_storage: int = -1) -> None:
        """`run_storage`: the bytes the run's streams may keep on the hub's disk, all together (-1:
        no limit). The trainer reserves its rollout streams' share within it (streams/client.py)."""
        RunNames(run_id)  # a valid run id
        self.dir.mkdir(parents=True, exist_ok=True)
        if (self.dir / ROLES_FILE).exists():
            raise FileExistsError(f"{self.dir} holds a secured swarm already: use add-sampler or add-relay")
        _write_ca(self.dir)
        _issue_certificate(self.dir, hosts[0], hosts, self.dir / "server-cert.pem", self.dir / "server-key.pem")
        roles = {"run_id": run_id, "hub_domain": hub_domain, "run_storage": run_storage, "users": {}}
        (self.dir / ROLES_FILE).write_text(json.dumps(roles))
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

    def relay_files(self, name: str) -> RelayFiles:
        return RelayFiles(self.seed_file(f"relay-{name}"), self.ca_file)

    def add_relay(self, name: str, hosts: list[str]) -> RelayFiles:
        """A relay's leaf nkey and a certificate for its client port (`hosts`: the names its
        samplers reach it by), then the hub's user list rewritten and reloaded if it runs."""
        check_id("relay name", name)
        self._add_user(f"relay-{name}", "relay", hosts=["localhost", "127.0.0.1", *hosts])
        self.write_server_conf()
        self.reload()
        return self.relay_files(name)

    def _user_entry(self, user: dict, names: RunNames, hub_domain: str) -> tuple[str, dict]:
        """One user of the hub's config. A relay's nkey opens only a leaf connection, and a
        client's only a client connection: each role's permissions are written for one kind."""
        if user["role"] == "relay":
            return RELAYS, {"nkey": user["nkey"], "allowed_connection_types": ["LEAFNODE"],
                            "permissions": relay_leaf_permissions(names, user["nkey"], hub_domain)}
        return account_of(user), {"nkey": user["nkey"], "allowed_connection_types": ["STANDARD"],
                                  "permissions": permissions(user["role"], names, user["nkey"], user["sampler_id"],
                                                             hub_domain)}

    def _relay_users(self, relay_key: str, names: RunNames) -> list[dict]:
        """A relay's client port: the relay itself owns its server; samplers read the mirrors."""
        samplers = [u["nkey"] for u in self._roles()["users"].values() if u["role"] == "sampler"]
        return [{"nkey": relay_key, "permissions": {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}}] + [
            {"nkey": key, "permissions": mirror_reader_permissions(names, key)} for key in samplers]

    def _add_user(self, user: str, role: str, sampler_id: str | None = None, hosts: list[str] = ()) -> None:
        """A user's nkey seed and client certificate (`hosts`: a server's too, for a relay's port)."""
        roles = self._roles()
        if user in roles["users"]:
            raise FileExistsError(f"{user} has credentials already ({self.seed_file(user)})")
        seed = _new_seed()
        write_secret(self.seed_file(user), seed + b"\n")
        credentials = self.credentials(user)
        _issue_certificate(self.dir, user, list(hosts), credentials.cert_file, credentials.key_file)
        public = nkeys.from_seed(bytearray(seed)).public_key.decode()
        entry = {"role": role, "nkey": public, "sampler_id": sampler_id}
        if role == "sampler":  # into the spare account, which the hub has had since its last (re)load
            entry["slot"] = _sampler_slots(roles) + 1
        roles["users"][user] = entry
        (self.dir / ROLES_FILE).write_text(json.dumps(roles, indent=1))

    def write_server_conf(self) -> None:
        """TLS and the accounts with their users, for the hub's config to include. JSON is valid
        NATS config."""
        roles = self._roles()
        names = RunNames(roles["run_id"])
        users = [self._user_entry(u, names, roles["hub_domain"]) for u in roles["users"].values()]
        q = json.dumps
        tls = _tls_block(self.dir / "server-cert.pem", self.dir / "server-key.pem", self.ca_file)
        accounts = hub_accounts(users, roles["hub_domain"], sampler_account(_sampler_slots(roles) + 1),
                                roles.get("run_storage", -1))
        _replace_text(self.dir / SERVER_CONF, "\n".join(
            [tls, f"accounts: {q(accounts)}",
             f"pid_file: {q(str(self.dir / PID_FILE))}"]))
        _replace_text(self.leaf_conf, tls)  # the leaf port speaks TLS too; leaf users are in the list above
        for name, u in roles["users"].items():
            if u["role"] == "relay":  # a new sampler may read every relay's mirrors
                _replace_text(self.relay_files(name.removeprefix("relay-")).users_file,
                              f"authorization {{ users: {q(self._relay_users(u['nkey'], names))} }}")

    @property
    def leaf_conf(self) -> Path:
        """For the hub's config to include inside its `leafnodes { }` block."""
        return self.dir / LEAF_CONF

    def reload(self) -> bool:
        """Tell a running hub on this machine to re-read its config (the new user list). False if
        none runs here that this user may signal: the pid file may be a stopped hub's, or one in a
        container, whose pid here is another process's (on Linux the name is checked first)."""
        try:
            pid = int((self.dir / PID_FILE).read_text())
            if Path("/proc").is_dir() and Path(f"/proc/{pid}/comm").read_text().strip() != "nats-server":
                return False
            os.kill(pid, signal.SIGHUP)
            return True
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
            return False
