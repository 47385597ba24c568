"""The wire contract between the trainer and the samplers.

Every subject, stream, bucket, header and message schema lives here; both sides import
this module and nothing else about each other. Messages are JSON (orjson) validated by
pydantic models, except a rollout: its fields in JSON, then its token ids and log-probs as
fixed-width arrays (encode_rollout). A message that does not match raises ProtocolError with a
reason.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from typing import Annotated, Literal, NamedTuple, TypeVar

import numpy as np
import orjson
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, ValidationError, ValidationInfo,
                      model_validator)

SCHEMA_VERSION = 19  # 2: a weights announcement lists shards; 3: and names the trainer's epoch;
# 4: the trainer grants work (GrantRequest/Grant), samplers no longer take it from KV;
# 5: grants are numbered slots: a grant names them, a group carries the one it fills and its epoch;
# 6: a group names the engine and precision that sampled it; 7: a sampler's heartbeat is its
# registry entry (hardware, state, measured rates, sync times, cost, relay); 8: a rollout group's
# token ids and log-probs travel as fixed-width binary arrays after its fields (encode_rollout);
# 9: a pull request names the trainer's epoch (a resumed trainer asks for an older version);
# 10: a completion sampled across weight updates names where each newer version took over;
# 11: a group's body parts share their sampler's one bodies subject, its message names their sequences;
# 12: a completion may be a multi-turn episode: it names where the environment's tokens lie;
# 13: the trainer's LearnerStatus says when the run has finished, a sampler's heartbeat that it saw it;
# 14: slots are "slot"/"slots" on the wire, as in the code (schema 5 to 13 said "lease"/"leases",
# the word the trainer's TrainerLease also used). Schema 13 is still read (_UPGRADES): replay of a
# recorded run, and a restarted trainer's unread groups, keep working.
# 15: a sampler names its process (`incarnation`) in its heartbeat and its requests for work, so
# that a process restarted under its id is told from its predecessor (whose slots it never saw).
# 16: the trainer's LearnerStatus names its last step's mean staleness and the strikes it counted
# (the live page shows them); schema 15 is read, with neither.
# 17: a full-weight version may go as a delta against the one before (`delta_of`, with the chain
# back to its anchor) and names the digest of the whole weights it makes; schema 16 is read.
# 18: the trainer's lease names its holder's process (a restarted trainer on the same machine takes
# over at once from one that exited); schema 17 is read.
# 19: a grant names each slot's prompt (the trainer's draw: a sampler no longer picks its own), and a
# heartbeat's numbers, strings and dicts are bounded; schema 18 is read.

# Run and sampler ids become subject tokens and stream names: keep them to safe characters.
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
INCARNATION_PATTERN = r"^[0-9a-f]{0,32}$"  # a process's random name; "" from a sampler before schema 15
_ID_RE = re.compile(ID_PATTERN)

# Headers on every rollout message, so routing, filtering and replay need not decode bodies.
HDR_SCHEMA = "Echo-Schema"
HDR_POLICY_VERSION = "Echo-Policy-Version"
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
OBJ_HDR_EPOCH = "trainer-epoch"

TRAINER_CONSUMER = "trainer"
# Keys of the run's state bucket.
CONFIG_KEY = "config"  # the run's config, JSON: an edge sampler needs only the URL and the run id
BUDGET_KEY = "budget"  # async mode's GrantBudget, written by the trainer
TRAINER_KEY = "trainer"  # the TrainerLease: which trainer incarnation (epoch) owns the run
SLOTS_KEY = "slots"  # the number of slots granted so far (the trainer's, kept across restarts)
SLOTS_KEY_BEFORE_14 = "leases"  # its name before schema 14, read when a run that began earlier resumes
QUARANTINE_KEY = "quarantine"  # samplers whose groups are ignored (Quarantine), by the trainer or an operator
SCHEDULE_KEY = "schedule"  # the scheduler's choice of samplers (Schedule), written by the trainer
LEARNER_KEY = "learner"  # the trainer's pace (LearnerStatus), for the scheduler and `echo-rl plan`
ROLLOUT_DEDUP_WINDOW_S = 300.0
GRANT_TIMEOUT_S = 5.0  # a sampler waits this long for the trainer's answer, then asks again later


class ProtocolError(ValueError):
    """A message that does not follow this contract. `reason` is short and countable."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


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


def weights_object_name(epoch: int, version: int, shard: int) -> str:
    # Keyed by epoch too: a trainer resumed from an older checkpoint republishes versions an
    # earlier incarnation published, and must not overwrite what a sampler may be reading.
    return f"weights-e{epoch:06d}-v{version:08d}-{shard:04d}.safetensors"


class PolicyVersion(NamedTuple):
    """A version of the policy: the trainer incarnation (epoch) that published it and its number.
    Ordered as a tuple: a restarted trainer's versions come after its predecessor's, whatever
    their numbers."""

    epoch: int
    version: int


# What a sampler says about itself reaches the trainer's trackers, the live page and operators'
# terminals: every number finite and in range (JSON gives no inf or NaN; 1e308 overflowed a mean),
# every string short and free of control characters (a terminal obeys escape sequences), every
# dict small with keys of the declared kind (a key "x" for a version stopped the trainer).
COUNT_MAX = 2**53 - 1  # versions, epochs, slots, prompt indices, counts: exact as a double, safe in int64 sums
SECONDS_MAX = 1e9  # about 31 years
RATE_MAX = 1e12
TIMESTAMP_MAX = 1e11  # Unix seconds, the year 5138
CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f"  # C0 and C1, as a regex character range: ESC and CSI among them
LABEL_PATTERN = rf"^[^{CONTROL_CHARACTERS}]*$"
Count = Annotated[int, Field(ge=0, le=COUNT_MAX)]
Seconds = Annotated[float, Field(ge=0, le=SECONDS_MAX)]
Rate = Annotated[float, Field(ge=0, le=RATE_MAX)]
Timestamp = Annotated[float, Field(ge=0, le=TIMESTAMP_MAX)]
Label = Annotated[str, Field(max_length=256, pattern=LABEL_PATTERN)]
VersionKey = Annotated[str, Field(pattern=r"^[0-9]{1,15}$")]
ReasonKey = Annotated[str, Field(pattern=r"^[a-z0-9_]{1,64}$")]


# ---- messages ----------------------------------------------------------------------------


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    schema_version: Literal[19] = SCHEMA_VERSION


# The validation context of a decoded message, whose arrays _decode_group checked whole (per
# completion, those checks cost more than the rest of a short group's decoding).
_CHECKED = {"arrays_checked": True}


def _checked(info: ValidationInfo) -> bool:
    return info.context is _CHECKED


def _flat(value, kinds: str, what: str) -> np.ndarray:
    """`value` as a 1-d array whose dtype kind is one of `kinds` (numpy's: i, u, f)."""
    values = np.asarray(value)
    if values.ndim != 1 or (values.size and values.dtype.kind not in kinds):
        raise ValueError(what)
    return values


def _token_ids(value, info: ValidationInfo) -> np.ndarray:
    """Token ids as a read-only uint32 array (the wire's width), from a sequence of integers."""
    if _checked(info):
        return value
    ids = _flat(value, "iu", "token ids: a flat sequence of integers")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.uint32).max):
        raise ValueError("token ids: between 0 and 2**32 - 1")
    return _read_only(ids.astype(np.uint32))


def _logprobs(value, info: ValidationInfo) -> np.ndarray:
    """Log-probs as a read-only float32 array (what the trainer computes with)."""
    if _checked(info):
        return value
    return _read_only(_flat(value, "iuf", "logprobs: a flat sequence of numbers").astype(np.float32))


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False  # the models are frozen: so are their arrays
    return values


# In memory a group's tokens and log-probs are numpy arrays, end to end (decoding a long group
# into Python lists took most of its ingest time); model_dump gives plain lists.
TokenIds = Annotated[np.ndarray, BeforeValidator(_token_ids), PlainSerializer(lambda a: a.tolist())]
LogProbs = Annotated[np.ndarray, BeforeValidator(_logprobs), PlainSerializer(lambda a: a.tolist())]


class _HoldsArrays:
    def __eq__(self, other) -> bool:  # pydantic's compares field by field, which arrays refuse
        return type(self) is type(other) and self.model_dump() == other.model_dump()

    __hash__ = None

    def replaced(self, **changes):
        """A copy with `changes`, validated (model_copy is not: a list would stay a list)."""
        return type(self).model_validate({**self.model_dump(), **changes})


class VersionChange(BaseModel):
    """Where, in a completion sampled across weight updates (partial rollouts), a newer version
    took over: it sampled the tokens from `at` on (until the next change)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    at: int = Field(ge=1)
    version: Count


class Observation(BaseModel):
    """Where, in a multi-turn episode's tokens, the environment answered: `tokens` tokens from
    `at` on are its observation (rendered by echo/environments.py), not sampled by the model."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    at: int = Field(ge=1)
    tokens: int = Field(ge=1)


class Completion(_HoldsArrays, BaseModel):
    """One completion, or one multi-turn episode: the model's turns and, between them, the
    environment's observations (`observations`; their log-probs are 0 and mean nothing)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, arbitrary_types_allowed=True)
    token_ids: TokenIds
    logprobs: LogProbs  # behaviour log-prob of each token, under the version that sampled it
    text: str
    reward: float
    finish_reason: Literal["stop", "length"]
    observations: list[Observation] = []

    @model_validator(mode="after")
    def _aligned(self, info: ValidationInfo):
        if not _checked(info):
            if not self.token_ids.size:
                raise ValueError("token_ids: an empty completion")
            if len(self.logprobs) != len(self.token_ids):
                raise ValueError("logprobs and token_ids differ in length")
            if not (np.isfinite(self.logprobs).all() and (self.logprobs <= 0.0).all()):
                raise ValueError("logprobs must be finite and <= 0")
        if not math.isfinite(self.reward):
            raise ValueError("reward must be finite")
        # Model turns and observations alternate, the model's first and last: each observation
        # begins after a model token and is followed by one.
        ends = [0, *(o.at + o.tokens for o in self.observations)]
        if any(o.at <= end for o, end in zip(self.observations, ends)) or ends[-1] >= len(self.token_ids):
            raise ValueError("observations: each after a model turn and before the next, in order")
        return self

    def model_turns(self) -> list[tuple[int, int]]:
        """The (start, end) of each of the model's turns in token_ids."""
        starts = [0, *(o.at + o.tokens for o in self.observations)]
        ends = [*(o.at for o in self.observations), len(self.token_ids)]
        return list(zip(starts, ends))

    def model_mask(self) -> np.ndarray:
        """True at the tokens the model sampled: the only ones trained, weighted and checked."""
        mask = np.ones(len(self.token_ids), dtype=bool)
        for o in self.observations:
            mask[o.at : o.at + o.tokens] = False
        return mask


class RolloutGroup(_HoldsArrays, _Message):
    """One GRPO group: every completion the sampler drew for one prompt."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    group_id: str = Field(pattern=ID_PATTERN)
    sampler_id: str = Field(pattern=ID_PATTERN)
    policy_version: Count
    epoch: Count  # the trainer incarnation whose weights generated it (versions restart with one)
    task: Label
    prompt_index: Count  # the task's prompt at this index (echo.tasks.Task.prompt), as its slot's grant named
    slot: int = Field(ge=1, le=COUNT_MAX)  # the granted slot this group fills (Grant.slots)
    prompt_token_ids: TokenIds
    completions: list[Completion] = Field(min_length=1)
    temperature: float = Field(gt=0, le=1000)
    # What sampled it: 16-bit log-probs differ from the trainer's by rounding, which the proof
    # of sampling allows for (trainer.verify_tolerance_16bit) where the run allows 16 bits (sampling.dtypes).
    engine: Literal["hf", "vllm"]
    dtype: Literal["float32", "bfloat16", "float16"]
    gen_seconds: Seconds
    created_at: Timestamp
    # Partial rollouts: its completions were sampled together, and newer weights took over
    # between chunks. None: policy_version sampled it all; else it sampled the tokens before the
    # first change, and each change's version those from its `at` (in every completion that long).
    version_changes: list[VersionChange] = []

    @model_validator(mode="after")
    def _has_a_prompt(self):
        if not self.prompt_token_ids.size:
            raise ValueError("prompt_token_ids: an empty prompt")
        changes, versions = self.version_changes, [self.policy_version, *(c.version for c in self.version_changes)]
        if any(a.at >= b.at for a, b in zip(changes, changes[1:])) or any(a >= b for a, b in zip(versions, versions[1:])):
            raise ValueError("version_changes: each later in the completions than the one before, and newer")
        if changes and changes[-1].at >= max(len(c.token_ids) for c in self.completions):
            raise ValueError("version_changes: past every completion's last token")
        return self

    @property
    def newest_version(self) -> int:
        """The version that sampled its last tokens (policy_version sampled its first)."""
        return self.version_changes[-1].version if self.version_changes else self.policy_version

    def sampled_from(self, oldest: int) -> int:
        """The token index from which its completions were sampled with version `oldest` or newer."""
        if self.policy_version >= oldest:
            return 0
        return next((c.at for c in self.version_changes if c.version >= oldest),
                    max(len(c.token_ids) for c in self.completions))


class WeightsShard(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    object_name: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


DIGEST = r"^([0-9a-f]{64})?$"  # echo/delta.py::digest, or "" where none is given
MAX_CHAIN = 64  # links of a delta chain an announcement may name (the trainer sends whole long before)


class WeightsLink(BaseModel):
    """One version of a delta chain: its objects, whole weights (the anchor) or a delta
    (echo/delta.py) against the version `delta_of`, and the digest of the whole weights it makes."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    version: int = Field(ge=0)
    shards: list[WeightsShard] = Field(min_length=1)
    delta_of: int | None = None
    digest: str = Field("", pattern=DIGEST)


class WeightsAnnouncement(_Message):
    """A new policy version: safetensors files, one object each. `lora`: the adapter's tensors
    (usually one shard); `full`: every parameter of the model, sharded by size, or (`delta_of`
    set) a delta per shard against version `delta_of`, with `chain` the versions from the last
    whole one (the anchor) up to `delta_of`: a sampler holding none of them rebuilds this one
    from the anchor. `digest` is that of the whole weights this version makes."""

    version: int = Field(ge=0)
    epoch: int = Field(ge=1)  # the announcing trainer's TrainerLease.epoch: versions are ordered within one
    kind: Literal["lora", "full"]
    shards: list[WeightsShard] = Field(min_length=1)
    base_model: str  # its content digest (echo/models.py::base_model_digest): any copy matches
    created_at: float
    digest: str = Field("", pattern=DIGEST)
    delta_of: int | None = None
    chain: list[WeightsLink] = Field(default_factory=list, max_length=MAX_CHAIN)

    @model_validator(mode="after")
    def _a_chain_from_an_anchor(self):
        if self.delta_of is None:
            if self.chain:
                raise ValueError("chain: only a delta names one")
            return self
        links = self.links
        if not self.digest or links[0].delta_of is not None:
            raise ValueError("delta_of: a delta names its digest, and a chain that begins whole")
        if any(b.delta_of != a.version or not b.digest for a, b in zip(links, links[1:])):
            raise ValueError("chain: each link a delta against the one before it, with its digest")
        return self

    @property
    def links(self) -> list[WeightsLink]:
        """The chain and this version, the anchor first."""
        return [*self.chain, WeightsLink(version=self.version, shards=self.shards, delta_of=self.delta_of,
                                         digest=self.digest)]

    @property
    def size(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def policy(self) -> PolicyVersion:
        return PolicyVersion(self.epoch, self.version)


class TrainerLease(_Message):
    """The run's owner. Each trainer start takes the next epoch (compare-and-set) and renews the
    lease while it runs: a second trainer finds it renewed and refuses to start; a restarted one
    finds it lapsed (or released) and takes over. Samplers accept announcements of this epoch only."""

    epoch: int = Field(ge=1)
    holder: str  # host and process, for the operator
    released: bool = False  # a trainer that stopped cleanly: the next may start at once
    # The holder's process as its machine names it (echo/lifeline.py; "" where it cannot): a trainer
    # started where it can see that process has exited takes over at once.
    process: str = Field("", max_length=128)


class GrantBudget(_Message):
    """Async mode: samplers running `version` may take slots numbered up to `allowance`."""

    version: int = Field(ge=0)
    allowance: int = Field(ge=0)
    groups_per_step: int = Field(ge=1)


class LearnerStatus(_Message):
    """The trainer's pace over its last steps: T, a step's seconds when its groups are there
    (training, checkpoint, publishing), B and S; and the utilisation it measured, T over T plus
    the time it waited for groups."""

    step_s: float = Field(ge=0)
    groups_per_step: int = Field(ge=1)
    max_staleness: int = Field(ge=0)
    version: int = Field(ge=0)
    utilisation: float = Field(ge=0, le=1)
    updated_at: float
    # For `echo-rl status`: the step, its recent rewards, the last publish's seconds, what became
    # of the run's groups (trained, dropped_stale, rejected, pending, ...) and rejections by reason.
    step: int = Field(0, ge=0)
    rewards: list[float] = []
    publish_s: float = Field(0.0, ge=0)
    accounting: dict[str, int] = {}
    rejected: dict[str, int] = {}
    finished: bool = False  # its last step is trained: status and samplers' heartbeats say so
    staleness: float = Field(0.0, ge=0)  # the last step's groups: their mean age in versions
    strikes: dict[str, int] = {}  # by sampler, counted by this trainer process (quarantine.py)


class Schedule(_Message):
    """The scheduler's choice (scheduler.enabled): the samplers to keep on standby, their weights
    current and no slots taken, because cheaper ones reach the target utilisation without them.
    Every sampler not named here takes slots (one that joined since is measured first)."""

    active: list[str]
    standby: list[str]
    predicted_utilisation: float = Field(ge=0, le=1)
    cost_per_step: float = Field(ge=0)
    why: str  # what made the scheduler choose again
    updated_at: float


# finished: the trainer said the run has finished; the sampler waits, in case the run goes on.
SamplerState = Literal["active", "standby", "draining", "quarantined", "finished"]


class SamplerStatus(_Message):
    """A sampler's heartbeat, and its entry in the run's registry: what it runs and on what, how
    fast it generates, what it costs, and what went wrong. The entry expires by itself `ttl_s`
    after the last beat (a dead sampler's goes)."""

    sampler_id: str = Field(pattern=ID_PATTERN)
    version: int = Field(ge=-1, le=COUNT_MAX)  # the adapter version its engine runs; -1 before the first
    groups_published: Count
    # refused adapters by reason (digest, truncated, shape, base model)
    weight_failures: dict[ReasonKey, Count] = Field(max_length=32)
    updated_at: Timestamp
    # active: takes slots; standby: keeps its weights current, takes none (the scheduler's
    # choice); draining: stopping, finishing what it holds; quarantined: the trainer ignores it.
    state: SamplerState = "active"
    ttl_s: int = Field(30, ge=1, le=86_400)
    engine: Label = ""
    device: Label = ""
    model: Label = ""
    relay: Label = ""  # the JetStream domain of the relay it reads weights from; "" on the hub itself
    cost_per_hour: Rate = 0.0
    # Measured over its last calls (sampler.rate_window_s): rates while generating, not per wall second.
    groups_per_s: Rate = 0.0
    tokens_per_s: Rate = 0.0
    call_s: Seconds = 0.0  # one generation call, from its start to its groups published
    # its last versions: from hearing of one to running it (fetch and load)
    sync_s: dict[VersionKey, Seconds] = Field(default_factory=dict, max_length=16)
    incarnation: str = Field("", pattern=INCARNATION_PATTERN)  # this process, new at each start


class Quarantine(_Message):
    """Samplers the trainer ignores (their groups are acked unread, they are granted no work),
    with why: caught forging log-probs or claiming rewards more than `trainer.quarantine_after`
    times. Lifted by an operator (`echo-rl quarantine lift`)."""

    samplers: dict[str, str] = {}


class PullRequest(_Message):
    """Sequential mode: the trainer wants `groups` groups generated with `version` of its
    `epoch`: a trainer resumed from an older checkpoint asks for a version lower than the one
    samplers run, and means its own."""

    request_id: str = Field(pattern=ID_PATTERN)
    epoch: int = Field(ge=1)
    version: int = Field(ge=0)
    groups: int = Field(ge=1)


class GrantRequest(_Message):
    """A sampler asks the trainer for up to `want` groups to generate with the weights it runs
    (`epoch`, `version`); in sequential mode, for the pull request `pull_request_id`."""

    want: int = Field(ge=1, le=1024)
    epoch: Count
    version: int = Field(ge=-1, le=COUNT_MAX)
    pull_request_id: str | None = Field(None, pattern=ID_PATTERN)
    incarnation: str = Field("", pattern=INCARNATION_PATTERN)  # the process asking (SamplerStatus.incarnation)


class Grant(_Message):
    """The trainer's answer: generate one group for each of `slots` (numbered across the run),
    on the prompt at the same place in `prompts` (the trainer's choice, echo/grants.py), each
    group naming its slot, so the trainer knows which grants were fulfilled and which are
    still out. `more`: work is left that this sampler may get soon (once the trainer has
    received the groups it holds, or once enough samplers have joined): ask again shortly;
    otherwise nothing is left until the trainer asks for more (a new budget or pull request)."""

    slots: list[int] = Field(default_factory=list, max_length=1024)
    prompts: list[Count] = Field(default_factory=list, max_length=1024)
    more: bool = False

    @model_validator(mode="after")
    def _a_prompt_a_slot(self):
        if len(self.prompts) != len(self.slots):
            raise ValueError("prompts: one for each slot")
        return self

    @property
    def groups(self) -> int:
        return len(self.slots)


M = TypeVar("M", bound=_Message)


def encode(message: _Message) -> bytes:
    return orjson.dumps(message.model_dump())


def decode(cls: type[M], data: bytes) -> M:
    return _validate(cls, _json_object(data))


def _json_object(data: bytes) -> dict:
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ProtocolError("bad_json", str(e)) from None
    if not isinstance(raw, dict):
        raise ProtocolError("bad_json", "message is not an object")
    return raw


# Earlier schemas still read, each as the wire names it renamed: recorded messages outlive a release.
_UPGRADES: dict[int, dict[str, str]] = {13: {"lease": "slot", "leases": "slots"}, 14: {}, 15: {}, 16: {}, 17: {}, 18: {}}


def _upgraded(raw: dict) -> dict:
    """`raw` in this schema's names, if it is in one this module still reads."""
    renames = _UPGRADES.get(raw.get("schema_version"))  # type: ignore[arg-type]
    if renames is None:
        return raw
    return {"schema_version": SCHEMA_VERSION} | {renames.get(k, k): v for k, v in raw.items() if k != "schema_version"}


def _validate(cls: type[M], raw: dict, context: dict | None = None) -> M:
    raw = _upgraded(raw)
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise ProtocolError("bad_schema_version", f"got {raw.get('schema_version')!r}, speak {SCHEMA_VERSION}")
    try:
        return cls.model_validate(raw, context=context)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or cls.__name__
        raise ProtocolError("bad_schema", f"{where}: {err['msg']}") from None


# A rollout message: magic, the length of the JSON that follows, that JSON (every field of the
# group but its token ids and log-probs, plus how many tokens the prompt and each completion
# have), then every token id (prompt first, then each completion's) as little-endian uint32,
# then every completion token's log-prob as little-endian float32. About 8 bytes a completion
# token plus its text, against about 31 as JSON; float32 is what the trainer computes with.
ROLLOUT_MAGIC = b"ECRG"
PROMPT_TOKENS_ALLOWED = 32_768  # a prompt's length on the wire (the trainer then checks it is the task's own)
TEXT_BYTES_PER_TOKEN = 48  # a completion's text as JSON: a token's bytes, escaped, with room to spare
FIELDS_BYTES = 4096  # a group's other fields as JSON, and each completion's, beside its text


@dataclass(frozen=True)
class RolloutLimits:
    """What a rollout message may hold in a run, from its config: checked before anything of it
    is validated (its counts) or read (a body in parts, by the size it claims), so the trainer's
    time and memory per message stay bounded whatever a sampler sends."""

    group_size: int
    max_new_tokens: int

    @property
    def max_bytes(self) -> int:
        per_completion = FIELDS_BYTES + self.max_new_tokens * (8 + TEXT_BYTES_PER_TOKEN)  # id, log-prob, text
        return _ROLLOUT_HEAD.size + FIELDS_BYTES + 4 * PROMPT_TOKENS_ALLOWED + self.group_size * per_completion

    def check_size(self, size: int) -> None:
        if size > self.max_bytes:
            raise ProtocolError("too_large", f"{size} bytes, more than the {self.max_bytes} a group of this run takes")

    def check_counts(self, prompt_tokens: int, completion_tokens: list[int]) -> None:
        if prompt_tokens > PROMPT_TOKENS_ALLOWED:
            raise ProtocolError("prompt_too_long", f"{prompt_tokens} tokens")
        if len(completion_tokens) > self.group_size:
            raise ProtocolError("wrong_group_size", f"{len(completion_tokens)} completions, the run's groups have "
                                                    f"{self.group_size}")
        if any(n > self.max_new_tokens for n in completion_tokens):
            raise ProtocolError("completion_too_long", f"{max(completion_tokens)} tokens")
_ROLLOUT_HEAD = struct.Struct("<4sI")
_WIRE_IDS, _WIRE_LOGPROBS = np.dtype("<u4"), np.dtype("<f4")  # little-endian on any machine


def encode_rollout(group: RolloutGroup) -> bytes:
    fields = group.model_dump(exclude={"prompt_token_ids", "completions"})
    fields["completions"] = [c.model_dump(exclude={"token_ids", "logprobs"}) for c in group.completions]
    return _pack(fields, group.prompt_token_ids, [c.token_ids for c in group.completions],
                 [c.logprobs for c in group.completions])


def _pack(fields: dict, prompt_ids, completion_ids: list, logprobs: list) -> bytes:
    """Arrays or sequences: the prompt's ids, each completion's ids and each one's log-probs."""
    for token_ids, values in zip(completion_ids, logprobs, strict=True):
        if len(token_ids) != len(values):
            raise ValueError("each completion token needs its log-prob")
    ids = np.concatenate([np.asarray(ids, _WIRE_IDS) for ids in (prompt_ids, *completion_ids)])
    claimed = np.concatenate([np.empty(0, _WIRE_LOGPROBS), *(np.asarray(v, _WIRE_LOGPROBS) for v in logprobs)])
    meta = orjson.dumps({**fields, "prompt_tokens": len(prompt_ids), "completion_tokens": list(map(len, completion_ids))})
    return b"".join((_ROLLOUT_HEAD.pack(ROLLOUT_MAGIC, len(meta)), meta, ids.tobytes(), claimed.tobytes()))


def _read_rollout(data: bytes,
                  limits: RolloutLimits | None = None) -> tuple[dict, int, list[int], np.ndarray, np.ndarray]:
    """A rollout message's parts, every byte accounted for: its fields (without the arrays), the
    prompt's token count, each completion's, every token id, and every log-prob (not yet checked):
    read-only views of `data`. Within `limits`, checked before any completion is looked at."""
    if limits is not None:
        limits.check_size(len(data))
    if len(data) < _ROLLOUT_HEAD.size or data[:4] != ROLLOUT_MAGIC:
        raise ProtocolError("bad_encoding", f"not a rollout message (it starts {bytes(data[:8])!r})")
    _, meta_len = _ROLLOUT_HEAD.unpack_from(data)
    meta_end = _ROLLOUT_HEAD.size + meta_len
    if meta_end > len(data):
        raise ProtocolError("bad_encoding", f"its fields run {meta_len} bytes into a {len(data)}-byte message")
    raw = _json_object(data[_ROLLOUT_HEAD.size : meta_end])
    prompt_tokens, completion_tokens = raw.pop("prompt_tokens", None), raw.pop("completion_tokens", None)
    completions = raw.get("completions")
    if (type(prompt_tokens) is not int or prompt_tokens < 0 or not isinstance(completion_tokens, list)
            or not all(type(n) is int and n >= 0 for n in completion_tokens) or not isinstance(completions, list)
            or len(completions) != len(completion_tokens) or not all(isinstance(c, dict) for c in completions)):
        raise ProtocolError("bad_schema", "token counts: one for the prompt and one for each completion")
    if limits is not None:
        limits.check_counts(prompt_tokens, completion_tokens)
    tokens = prompt_tokens + sum(completion_tokens)
    expected = meta_end + 4 * tokens + 4 * sum(completion_tokens)
    if len(data) != expected:
        raise ProtocolError("bad_encoding", f"{len(data)} bytes, its token counts make {expected}")
    data = bytes(data)  # a read-only buffer: the arrays below are views of it
    # Native byte order (a copy on a big-endian machine only): torch takes no other.
    ids = np.frombuffer(data, _WIRE_IDS, tokens, meta_end).astype(np.uint32, copy=False)
    logprobs = np.frombuffer(data, _WIRE_LOGPROBS, tokens - prompt_tokens, meta_end + 4 * tokens)
    return raw, prompt_tokens, completion_tokens, _read_only(ids), _read_only(logprobs.astype(np.float32, copy=False))


def _spans(counts: list[int]):
    start = 0
    for n in counts:
        yield start, start + n
        start += n


def _decode_group(data: bytes, limits: RolloutLimits | None) -> tuple[RolloutGroup, object]:
    """Every check the schema makes, and the schema version it was sent in. The arrays go in as
    read-only views of the message, checked whole here: the encoding makes them integers and
    floats, one log-prob per token; each completion has a token, and every log-prob is finite
    and <= 0."""
    raw, prompt_tokens, counts, ids, logprobs = _read_rollout(data, limits)
    sent_in = raw.get("schema_version")
    if 0 in counts:
        raise ProtocolError("bad_schema", f"completions.{counts.index(0)}.token_ids: an empty completion")
    if not (np.isfinite(logprobs).all() and (logprobs <= 0.0).all()):
        raise ProtocolError("bad_schema", "completions: logprobs must be finite and <= 0")
    raw["prompt_token_ids"] = ids[:prompt_tokens]
    for c, (a, b) in zip(raw["completions"], _spans(counts)):
        c["token_ids"], c["logprobs"] = ids[prompt_tokens + a : prompt_tokens + b], logprobs[a:b]
    return _validate(RolloutGroup, raw, _CHECKED), sent_in


def rollout_headers(group: RolloutGroup) -> dict[str, str]:
    return {
        HDR_SCHEMA: str(SCHEMA_VERSION),
        HDR_POLICY_VERSION: str(group.policy_version),
        HDR_SAMPLER_ID: group.sampler_id,
        HDR_TASK: group.task,
        HDR_MSG_ID: group.group_id,
    }


def subject_sampler(subject: str) -> str:
    """The sampler id a rollouts or grants subject names (the last token)."""
    return subject.rsplit(".", 1)[-1]


def decode_rollout(data: bytes, headers: dict[str, str] | None, subject: str,
                   limits: RolloutLimits | None = None) -> RolloutGroup:
    """Decode a rollout message (within the run's `limits`, when given) and check its subject
    and headers agree with its body. A sampler's credentials allow it only its own subject: a
    body naming another sampler is a sampler impersonating another. Every header is what its
    body makes: readers that go by headers alone (replay's filters, JetStream's de-duplication)
    see what is trained."""
    group, sent_in = _decode_group(data, limits)
    if subject.split(".")[-2:] != ["rollouts", group.sampler_id]:
        raise ProtocolError("subject_mismatch", f"{group.sampler_id!r} published on {subject}")
    headers = headers or {}
    for name, value in (rollout_headers(group) | {HDR_SCHEMA: str(sent_in)}).items():
        if headers.get(name) != value:
            raise ProtocolError("header_mismatch", f"{name}={headers.get(name)!r}, its body makes {value!r}")
    return group
