"""What every client of a secured broker needs to connect: its nkey seed, its client certificate
and key, and the CA that signed the server's (streams/secure.py issues them; `echo-rl secure`).
Only the standard library and nkeys: a sampler's box connects without the operator's tools
(cryptography)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import nkeys


def inbox_prefix(public_key: str) -> str:
    """Each client reads replies only under its own prefix: `_INBOX.>` would let it read everyone's."""
    return f"_INBOX_{public_key}"


def sibling_file(seed_file: Path, suffix: str) -> Path:
    """NAME<suffix> beside NAME.nk: the files issued with a seed."""
    return seed_file.with_name(seed_file.stem + suffix)


@dataclass(frozen=True)
class Credentials:
    """What a client needs to join a secured broker: its nkey seed, its client certificate and key
    (NAME-cert.pem and NAME-key.pem beside NAME.nk) and the CA to check the server."""

    seed_file: Path
    ca_file: Path

    @property
    def cert_file(self) -> Path:
        return sibling_file(self.seed_file, "-cert.pem")

    @property
    def key_file(self) -> Path:
        return sibling_file(self.seed_file, "-key.pem")

    def connect_options(self) -> dict:
        seed = self.seed_file.read_bytes().strip()
        public = nkeys.from_seed(bytearray(seed)).public_key.decode()
        if not self.cert_file.exists():
            raise FileNotFoundError(f"{self.cert_file}: a secured broker wants the client certificate issued with "
                                    f"{self.seed_file.name}; copy it and {self.key_file.name} beside the seed")
        tls = ssl.create_default_context(cafile=str(self.ca_file))
        tls.load_cert_chain(self.cert_file, self.key_file)
        return {"nkeys_seed_str": seed.decode(), "tls": tls, "inbox_prefix": inbox_prefix(public)}


def credentials_of(creds: str, tls_ca: str) -> Credentials | None:
    """The `nats.creds` and `nats.tls_ca` fields of a config, or None for an open broker."""
    return Credentials(Path(creds), Path(tls_ca)) if creds else None
