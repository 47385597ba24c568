"""The wire's names: subjects, streams, buckets and their keys, headers, ids and the bounds a
message's values keep to. Both sides name everything on the broker through this module."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

SCHEMA_VERSION = 30  # what each schema changed, and which earlier ones are still read: echo/wire/__init__.py

# Run and sampler ids become subject tokens and stream names: keep them to safe characters.
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
PROCESS_PATTERN = r"^[0-9a-f]{0,32}$"  # a sampler process's random name; "" from a sampler before schema 15
_ID_RE = re.compile(ID_PATTERN)

# Headers on every rollout message, so routing, filtering and replay need not decode bodies.
HDR_SCHEMA = "Echo-Schema"
HDR_VERSION = "Echo-Policy-Version"  # the group's version (its value predates the name)
HDR_SAMPLER_ID = "Echo-Sampler-Id"
HDR_TASK = "Echo-Task"
HDR_MSG_ID = "Nats-Msg-Id"  # JetStream de-duplicates on it: a retried publish is stored once
# A group larger than ROLLOUT_MESSAGE_MAX: its encoded body is published in parts of at most
# BODY_PART_MAX on the sampler's own bodies subject (RunNames.bodies_subject), each with the
# Nats-Msg-Id `<group id>-<index>`; then the rollout message carries no body, only these headers
# beside the usual ones: the parts' stream sequences (comma-separated, in order), the body's size
# and digest. The trainer reads the parts by sequence and checks subject, id, size and digest.
HDR_BODY_PARTS = "Echo-Body-Parts"
HDR_BODY_SIZE = "Echo-Body-Size"
HDR_BODY_SHA256 = "Echo-Body-Sha256"
# The largest message each stream stores (headers included), so a sampler's quota in messages
# (NatsConfig.sampler_quota_gb) is one in bytes too.
ROLLOUT_MESSAGE_MAX = 256 << 10  # a group of 16 completions of ~1k tokens
# A sampler's heartbeat (SamplerStatus) as its registry bucket stores it: an honest one is a few
# KB; an 8 MB one cost the scheduler 1.5 s to decode every 5 s and `echo-rl status` 9 s.
STATUS_MAX_BYTES = 64 << 10
BODY_PART_MAX = 8 << 20  # the max_payload of the servers we configure
MAX_BODY_PARTS = 64  # 64 x (8 MB - headers): past the largest group worth training on

# The JetStream domain of the run's broker. A relay (a leaf node with a domain of its own)
# reaches the broker's JetStream API as $JS.hub.API through its leaf connection.
HUB_DOMAIN = "hub"

# Headers on each adapter object in the weights bucket; values must be lists of strings.
OBJ_HDR_VERSION = "policy-version"
OBJ_HDR_TERM = "trainer-epoch"  # the term; its value predates the name (schema 28)

TRAINER_CONSUMER = "trainer"
# Keys of the run's state bucket.
CONFIG_KEY = "config"  # the run's config, JSON: an edge sampler needs only the URL and the run id
BUDGET_KEY = "budget"  # async mode's GrantBudget, written by the trainer
TRAINER_KEY = "trainer"  # the TrainerLease: which trainer process, in which term, owns the run
SLOTS_KEY = "slots"  # the number of slots granted so far (the trainer's, kept across restarts)
SLOTS_KEY_BEFORE_14 = "leases"  # its name before schema 14, read when a run that began earlier resumes
QUARANTINE_KEY = "quarantine"  # samplers whose groups are ignored (Quarantine), by the trainer or an operator
STRIKES_KEY = "strikes"  # the trainer's strikes and suspects (Strikes), kept across its restarts
SCHEDULE_KEY = "schedule"  # the scheduler's choice of samplers (Schedule), written by the trainer
# The trainer's pace (TrainerStatus), for the scheduler and `echo-rl plan`. The key keeps its schema-19
# value: a run begun before schema 20 resumes, and its samplers and credentials read it there.
TRAINER_STATUS_KEY = "learner"
# The step the run finished at, while no trainer takes it further: what a sampler's heartbeat
# reads, in place of the trainer's status, whose tables by sampler grow with the fleet.
FINISHED_KEY = "finished"
ROLLOUT_DEDUP_WINDOW_S = 300.0
GRANT_TIMEOUT_S = 5.0  # a sampler waits this long for the trainer's answer, then asks again later


def check_id(kind: str, value: str) -> str:
    if not _ID_RE.match(value):
        raise ValueError(f"{kind} {value!r} must match {ID_PATTERN}")
    return value


@dataclass(frozen=True)
class Storage:
    """How the trainer creates the run's streams and buckets: copies of each in a NATS cluster,
    and how much rollout history the stream keeps."""

    replicas: int = 1
    rollouts_max_bytes: int = -1  # -1: no limit
    rollouts_max_age_s: float = 0.0  # 0: no limit
    sampler_max_bytes: int = -1  # each sampler's share of each of the two streams (-1: no limit)


@dataclass(frozen=True)
class RunNames:
    """Names of everything one run owns on the broker. The run id prefixes all of them,
    so several runs can share one NATS server without colliding."""

    run_id: str

    def __post_init__(self):
        check_id("run id", self.run_id)

    @property
    def prefix(self) -> str:
        return f"echo.{self.run_id}"

    def rollouts_subject(self, sampler_id: str) -> str:
        # One subject per sampler, so credentials can later pin a sampler to its own.
        return f"{self.prefix}.rollouts.{check_id('sampler id', sampler_id)}"

    @property
    def all_rollouts(self) -> str:
        return f"{self.prefix}.rollouts.>"

    def bodies_subject(self, sampler_id: str) -> str:
        # One per sampler, as for its rollouts: its credentials pin it there, and the stream's
        # per-subject limit is its quota.
        return f"{self.prefix}.bodies.{check_id('sampler id', sampler_id)}"

    @property
    def all_bodies(self) -> str:
        return f"{self.prefix}.bodies.*"

    @property
    def bodies_stream(self) -> str:
        return f"ECHO_{self.run_id}_BODIES"

    def grants_subject(self, sampler_id: str) -> str:
        # Request/reply: a sampler asks the trainer for work on its own subject (its credentials
        # allow it no other), so the trainer knows who holds what.
        return f"{self.prefix}.grants.{check_id('sampler id', sampler_id)}"

    @property
    def all_grants(self) -> str:
        return f"{self.prefix}.grants.*"

    @property
    def weights_subject(self) -> str:
        return f"{self.prefix}.weights"

    @property
    def pull_subject(self) -> str:
        return f"{self.prefix}.pull"

    @property
    def rollouts_stream(self) -> str:
        return f"ECHO_{self.run_id}_ROLLOUTS"

    @property
    def control_stream(self) -> str:
        return f"ECHO_{self.run_id}_CONTROL"

    @property
    def weights_bucket(self) -> str:
        return f"echo_{self.run_id}_weights"

    @property
    def weights_stream(self) -> str:  # the object store's stream
        return f"OBJ_{self.weights_bucket}"

    @property
    def state_bucket(self) -> str:
        return f"echo_{self.run_id}_state"

    @property
    def registry_bucket(self) -> str:
        # The samplers' heartbeats (SamplerStatus), keyed by sampler id: apart from the trainer's
        # state, so that nothing a sampler writes can reach it (streams/layout.py).
        return f"echo_{self.run_id}_registry"


def prompts_object_name(sha256_hex: str) -> str:
    # A dataset's prompt shard or its manifest (echo/tasks/dataset.py), in the weights bucket so
    # that relays mirror it; by content, so a restarted trainer's identical one is already there.
    return f"prompts-{sha256_hex}"


def weights_object_name(term: int, version: int, shard: int) -> str:
    # Keyed by term too: a trainer resumed from an older checkpoint republishes versions an
    # earlier term published, and must not overwrite what a sampler may be reading.
    return f"weights-e{term:06d}-v{version:08d}-{shard:04d}.safetensors"


class Version(NamedTuple):
    """A version of the weights as the wire orders them: the term of the trainer that published
    it (its count of takeovers) and its number. Ordered as a tuple: a restarted trainer's versions
    come after its predecessor's, whatever their numbers."""

    term: int
    version: int


# What a sampler says about itself reaches the trainer's trackers, the live page and operators'
# terminals: every number finite and in range (JSON gives no inf or NaN; 1e308 overflowed a mean),
# every string short and free of control characters (a terminal obeys escape sequences), every
# dict small with keys of the declared kind (a key "x" for a version stopped the trainer).
COUNT_MAX = 2**53 - 1  # versions, terms, slots, prompt indices, counts: exact as a double, safe in int64 sums
SECONDS_MAX = 1e9  # about 31 years
RATE_MAX = 1e12
TIMESTAMP_MAX = 1e11  # Unix seconds, the year 5138
SAMPLE_CHARS = 2000  # of a sample completion's prompt, and of its text, as the trainer shows them
STATUS_SAMPLES = 4  # sample completions the trainer's status carries (run.samples_per_step may ask more)
SCALAR_NAME = r"^[a-z_]{1,64}$"  # a step's headline value in the trainer's status
CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f"  # C0 and C1, as a regex character range: ESC and CSI among them
LABEL_PATTERN = rf"^[^{CONTROL_CHARACTERS}]*$"
DIGEST = r"^((sha256:)?[0-9a-f]{64})?$"  # echo/weights/digest.py (bare hex before schema 28), or "" for none
MAX_CHAIN = 64  # links of a delta chain an announcement may name (the trainer sends whole long before)
# A mixture of experts' routing on the wire: MoE layers, experts chosen a token, experts a layer
# (Qwen3-235B: 94 layers, 8 of 128; DeepSeek-V3: 58, 8 of 256).
ROUTING_LAYERS_MAX, ROUTING_TOP_K_MAX, ROUTING_EXPERTS_MAX = 256, 64, 4096


def subject_sampler(subject: str) -> str:
    """The sampler id a rollouts or grants subject names (the last token)."""
    return subject.rsplit(".", 1)[-1]
