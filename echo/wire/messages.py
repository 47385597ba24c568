"""The wire's messages: pydantic models, strict and frozen, each checked field by field when it is
decoded (echo/wire/codec.py). What a sampler says about itself is bounded (echo/wire/names.py's
bounds): it reaches trackers, the live page and terminals."""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, ValidationInfo, model_validator

from echo.wire.names import (
    COUNT_MAX,
    DIGEST,
    ID_PATTERN,
    LABEL_PATTERN,
    MAX_CHAIN,
    PROCESS_PATTERN,
    RATE_MAX,
    ROUTING_EXPERTS_MAX,
    ROUTING_LAYERS_MAX,
    ROUTING_TOP_K_MAX,
    SAMPLE_CHARS,
    SCALAR_NAME,
    SCHEMA_VERSION,
    SECONDS_MAX,
    STATUS_SAMPLES,
    TIMESTAMP_MAX,
    Version,
)

Count = Annotated[int, Field(ge=0, le=COUNT_MAX)]
Seconds = Annotated[float, Field(ge=0, le=SECONDS_MAX)]
Rate = Annotated[float, Field(ge=0, le=RATE_MAX)]
Timestamp = Annotated[float, Field(ge=0, le=TIMESTAMP_MAX)]
Label = Annotated[str, Field(max_length=256, pattern=LABEL_PATTERN)]
VersionKey = Annotated[str, Field(pattern=r"^[0-9]{1,15}$")]
ReasonKey = Annotated[str, Field(pattern=r"^[a-z0-9_]{1,64}$")]


class Message(BaseModel):
    """A message of the wire, naming the schema it was written in."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    schema_version: Literal[30] = SCHEMA_VERSION


# The validation context of a decoded message, whose arrays the codec (echo/wire/codec.py) checked
# whole (per completion, those checks cost more than the rest of a short group's decoding).
ARRAYS_CHECKED = {"arrays_checked": True}


def _checked(info: ValidationInfo) -> bool:
    return info.context is ARRAYS_CHECKED


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
    return read_only(ids.astype(np.uint32))


def _logprobs(value, info: ValidationInfo) -> np.ndarray:
    """Log-probs as a read-only float32 array (what the trainer computes with)."""
    if _checked(info):
        return value
    return read_only(_flat(value, "iuf", "logprobs: a flat sequence of numbers").astype(np.float32))


def read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False  # the models are frozen: so are their arrays
    return values


# In memory a group's tokens and log-probs are numpy arrays, end to end (decoding a long group
# into Python lists took most of its ingest time); model_dump gives plain lists.
TokenIds = Annotated[np.ndarray, BeforeValidator(_token_ids), PlainSerializer(lambda a: a.tolist())]


def _expert_ids(value, info: ValidationInfo) -> np.ndarray:
    """Expert ids as a read-only uint16 array of (tokens, layers, top_k)."""
    if _checked(info):
        return value
    ids = np.asarray(value)
    if ids.ndim != 3 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError("routing ids: integers, (tokens, layers, top_k)")
    if ids.size and (ids.min() < 0 or ids.max() >= ROUTING_EXPERTS_MAX):
        raise ValueError(f"routing ids: between 0 and {ROUTING_EXPERTS_MAX - 1}")
    return read_only(ids.astype(np.uint16))


ExpertIds = Annotated[np.ndarray, BeforeValidator(_expert_ids), PlainSerializer(lambda a: a.tolist())]
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
    `at` on are its observation (rendered by echo/tasks/episodes.py), not sampled by the model."""

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
    # The sampler's own score of it: a claim, which the trainer's verifier checks (a strike where
    # it differs), never what the trainer trains on.
    claimed_reward: float
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
        if not math.isfinite(self.claimed_reward):
            raise ValueError("claimed_reward must be finite")
        # Model turns and observations alternate, the model's first and last: each observation
        # begins after a model token and is followed by one.
        ends = [0, *(o.at + o.tokens for o in self.observations)]
        if any(o.at <= end for o, end in zip(self.observations, ends)) or ends[-1] >= len(self.token_ids):
            raise ValueError("observations: each after a model turn and before the next, in order")
        return self

    @property
    def truncated(self) -> bool:
        """Cut at the token budget rather than ended by the model."""
        return self.finish_reason == "length"

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


class Routing(_HoldsArrays, BaseModel):
    """A mixture of experts' routing of a group's tokens (echo/trust/routing.py), recorded by the sampler
    for the trainer to replay: for every token id the group carries, the prompt's then each
    completion's, the `top_k` experts (of `experts`) each of the model's `layers` MoE layers sent
    it to. A completion's last token was never an input: its row is zeros and means nothing."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, arbitrary_types_allowed=True)
    layers: int = Field(ge=1, le=ROUTING_LAYERS_MAX)
    top_k: int = Field(ge=1, le=ROUTING_TOP_K_MAX)
    experts: int = Field(ge=2, le=ROUTING_EXPERTS_MAX)
    ids: ExpertIds


def check_routing(routing: Routing, last_tokens: np.ndarray) -> None:
    """Each token's choice at each layer: `top_k` distinct experts of `experts` (a router's top-k
    never repeats one), but at `last_tokens`, rows that mean nothing."""
    ids = routing.ids
    if ids.shape[1:] != (routing.layers, routing.top_k) or routing.top_k > routing.experts:
        raise ValueError(f"routing: {tuple(ids.shape[1:])} choices a token, the group says ({routing.layers}, "
                         f"{routing.top_k}) of {routing.experts} experts")
    if ids.size and ids.max() >= routing.experts:
        raise ValueError(f"routing: an expert id past the {routing.experts} the model has")
    ranked = np.sort(ids, axis=-1)
    repeated = (ranked[..., 1:] == ranked[..., :-1]).any(axis=(1, 2))
    repeated[last_tokens] = False
    if repeated.any():
        raise ValueError(f"routing: an expert chosen twice for token {int(repeated.argmax())} at one layer")


class RolloutGroup(_HoldsArrays, Message):
    """One GRPO group: every completion the sampler drew for one prompt."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    group_id: str = Field(pattern=ID_PATTERN)
    sampler_id: str = Field(pattern=ID_PATTERN)
    version: Count
    term: Count  # the term of the trainer whose weights generated it (versions restart with one)
    task: Label
    prompt_index: Count  # the task's prompt at this index (echo.tasks.Task.prompt), as its slot's grant named
    slot: int = Field(ge=1, le=COUNT_MAX)  # the granted slot this group fills (Grant.slots)
    prompt_token_ids: TokenIds
    completions: list[Completion] = Field(min_length=1)
    temperature: float = Field(gt=0, le=1000)
    # What sampled it: 16-bit log-probs differ from the trainer's by rounding, which the proof
    # of sampling allows for (trainer.verify_tolerance_16bit) where the run allows 16 bits (sampling.dtypes).
    engine: Literal["hf", "vllm", "mlx"]
    dtype: Literal["float32", "bfloat16", "float16"]
    gen_seconds: Seconds
    created_at: Timestamp
    # Partial rollouts: its completions were sampled together, and newer weights took over
    # between chunks. None: `version` sampled it all; else it sampled the tokens before the
    # first change, and each change's version those from its `at` (in every completion that long).
    version_changes: list[VersionChange] = []
    routing: Routing | None = None  # a mixture of experts', where the run replays it (algorithm.router_replay)
    # The slot whose keyed noise drew it, where not its own: a prompt granted again (its first
    # slot lost) is drawn with its first slot's noise (Grant.noise_slots). None: its own.
    noise_slot: int | None = Field(None, ge=1, le=COUNT_MAX)

    @property
    def keyed_slot(self) -> int:
        """The slot whose keyed noise drew it (echo/trust/noise.py's group_key)."""
        return self.slot if self.noise_slot is None else self.noise_slot

    @model_validator(mode="after")
    def _has_a_prompt(self, info: ValidationInfo):
        if not self.prompt_token_ids.size:
            raise ValueError("prompt_token_ids: an empty prompt")
        tokens = len(self.prompt_token_ids) + sum(len(c.token_ids) for c in self.completions)
        if self.routing is not None:
            if len(self.routing.ids) != tokens:
                raise ValueError(f"routing: for {len(self.routing.ids)} tokens, the group has {tokens}")
            if not _checked(info):
                check_routing(self.routing, self.last_tokens())
        changes, versions = self.version_changes, [self.version, *(c.version for c in self.version_changes)]
        if any(a.at >= b.at for a, b in zip(changes, changes[1:])) or any(a >= b for a, b in zip(versions, versions[1:])):
            raise ValueError("version_changes: each later in the completions than the one before, and newer")
        if changes and changes[-1].at >= max(len(c.token_ids) for c in self.completions):
            raise ValueError("version_changes: past every completion's last token")
        return self

    def last_tokens(self) -> np.ndarray:
        """Where each completion's last token lies among the group's token ids (the prompt's first)."""
        return len(self.prompt_token_ids) + np.cumsum([len(c.token_ids) for c in self.completions]) - 1

    @property
    def newest_version(self) -> int:
        """The version that sampled its last tokens (`version` sampled its first)."""
        return self.version_changes[-1].version if self.version_changes else self.version

    def sampled_from(self, oldest: int) -> int:
        """The token index from which its completions were sampled with version `oldest` or newer."""
        if self.version >= oldest:
            return 0
        return next((c.at for c in self.version_changes if c.version >= oldest),
                    max(len(c.token_ids) for c in self.completions))


class WeightsShard(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    object_name: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")




class WeightsLink(BaseModel):
    """One version of a delta chain: its objects, whole weights (the anchor) or a delta
    (echo/weights/delta.py) against the version `delta_of`, and the digest of the whole weights it makes."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    version: int = Field(ge=0)
    shards: list[WeightsShard] = Field(min_length=1)
    delta_of: int | None = None
    digest: str = Field("", pattern=DIGEST)


class WeightsAnnouncement(Message):
    """A new version of the weights: safetensors files, one object each. `lora`: the adapter's tensors
    (usually one shard); `full`: every parameter of the model, sharded by size, or (`delta_of`
    set) a delta per shard against version `delta_of`, with `chain` the versions from the last
    whole one (the anchor) up to `delta_of`: a sampler holding none of them rebuilds this one
    from the anchor. `digest` is that of the whole weights this version makes."""

    version: int = Field(ge=0)
    term: int = Field(ge=1)  # the announcing trainer's TrainerLease.term: versions are ordered within one
    kind: Literal["lora", "full"]
    shards: list[WeightsShard] = Field(min_length=1)
    base_model: str  # its content digest (echo/model/loading.py::base_model_digest): any copy matches
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
    def term_version(self) -> Version:
        """Its version as the wire orders them: by term, then number."""
        return Version(self.term, self.version)


class TrainerLease(Message):
    """The run's owner. Each trainer start takes the next term (compare-and-set) and renews the
    lease while it runs: a second trainer finds it renewed and refuses to start; a restarted one
    finds it lapsed (or released) and takes over. Samplers accept announcements of this term only.
    `term` is the trainer's count of takeovers, which orders them, not an identity: `process`
    names the process that holds the lease."""

    term: int = Field(ge=1)
    holder: str  # host and process, for the operator
    released: bool = False  # a trainer that stopped cleanly: the next may start at once
    # The holder's process as its machine names it (echo/process/lifeline.py; "" where it cannot): a trainer
    # started where it can see that process has exited takes over at once.
    process: str = Field("", max_length=128)


class GrantBudget(Message):
    """Async mode: samplers running `version` may take slots numbered up to `allowance`.

    It wakes the idle samplers to ask for the work; among many, only a share of them, drawn
    afresh each `draw` (echo/fleet/grants.py::drawn_to_ask): `open` slots were left when it was
    published, for `idle` samplers (known to the trainer, not gone, holding none; 0: every one
    asks)."""

    version: int = Field(ge=0)
    allowance: int = Field(ge=0)
    groups_per_step: int = Field(ge=1)
    open: Count = 0
    idle: Count = 0
    draw: Count = 0


class Sample(BaseModel):
    """A completion the trainer shows (workers/trainer/accounting.py's step_samples): decoded by
    the trainer from the tokens it trained on, its texts bounded and free of control characters."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    step: Count
    group: Annotated[str, Field(pattern=ID_PATTERN)]
    sampler: Annotated[str, Field(pattern=ID_PATTERN)]
    version: Count
    reward: float = Field(ge=0, le=1)
    finish_reason: Literal["stop", "length"]
    prompt: str = Field(max_length=SAMPLE_CHARS)
    completion: str = Field(max_length=SAMPLE_CHARS)


class SlotsEnded(BaseModel):
    """A sampler's granted slots that have ended, and how many of them it never delivered
    (passed over, or held when it stopped, restarted, died or stalled: echo/fleet/grants.py)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    ended: Count
    undelivered: Count


class TrainerStatus(Message):
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
    strikes: dict[str, int] = {}  # by sampler, counted by this trainer process (workers/trainer/strikes.py)
    slots: dict[str, SlotsEnded] = {}  # by sampler, counted by this trainer process: selective delivery shows here
    steps: int = Field(0, ge=0)  # the run's (run.steps); 0: unknown (a status of schema 21 or before)
    elapsed_s: float = Field(0.0, ge=0)  # since this trainer process started
    eta_s: float = Field(0.0, ge=0)  # the steps left at the pace of the last ones (waits included)
    # For the page: the last step's headline values (loss, kl, entropy, grad_norm, lr, lengths,
    # the signal: echo/train/metrics.py's PAGE_SCALARS, finite ones only), its sample completions, and
    # what the run trains (model.name, the task and its dataset).
    scalars: dict[Annotated[str, Field(pattern=SCALAR_NAME)], float] = Field({}, max_length=32)
    samples: list[Sample] = Field([], max_length=STATUS_SAMPLES)
    model: Label = ""
    task: Label = ""


class Schedule(Message):
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
# bad_heartbeat: not a sampler's word but its readers', for a heartbeat that did not decode.
SamplerState = Literal["active", "standby", "draining", "quarantined", "finished", "bad_heartbeat"]


class SamplerStatus(Message):
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
    process: str = Field("", pattern=PROCESS_PATTERN)  # this process's random name, new at each start
    # One model over several processes (sampler.ranks): how many, how many times their group was
    # lost (a rank exited or hung) and the sampler started again, and why the last time.
    ranks: int = Field(1, ge=1, le=64)
    ranks_restarted: Count = 0
    rank_lost: Label = ""


class Quarantine(Message):
    """Samplers the trainer ignores (their groups are acked unread, they are granted no work),
    with why: caught forging log-probs or claiming rewards more than `trainer.quarantine_after`
    times. Lifted by an operator (`echo-rl quarantine lift`)."""

    samplers: dict[str, str] = {}


class Strikes(Message):
    """The trainer's strikes against samplers, and the suspects whose every group it checks
    (caught forging once): kept in the run's state so that a restarted or taken-over trainer
    gives no credential its budget back. Written by the trainer alone."""

    counts: dict[str, int] = {}
    suspects: list[str] = []


class PullRequest(Message):
    """Sequential mode: the trainer wants `groups` groups generated with `version` of its
    `term`: a trainer resumed from an older checkpoint asks for a version lower than the one
    samplers run, and means its own."""

    request_id: str = Field(pattern=ID_PATTERN)
    term: int = Field(ge=1)
    version: int = Field(ge=0)
    groups: int = Field(ge=1)


class GrantRequest(Message):
    """A sampler asks the trainer for up to `want` groups to generate with the weights it runs
    (`term`, `version`); in sequential mode, for the pull request `pull_request_id`."""

    want: int = Field(ge=1, le=1024)
    term: Count
    version: int = Field(ge=-1, le=COUNT_MAX)
    pull_request_id: str | None = Field(None, pattern=ID_PATTERN)
    process: str = Field("", pattern=PROCESS_PATTERN)  # the process asking (SamplerStatus.process)
    # Its seconds a token, from a warm-up generation: a claim, which paces it only until the
    # trainer measured it. It can only cost the sampler work: a slow claim is refused, a fast
    # one tried as any sampler not yet measured is.
    claimed_s_per_token: Seconds | None = None


class Grant(Message):
    """The trainer's answer: generate one group for each of `slots` (numbered across the run),
    on the prompt at the same place in `prompts` (the trainer's choice, echo/fleet/grants.py), each
    group naming its slot, so the trainer knows which grants were fulfilled and which are
    still out. `more`: work is left that this sampler may get soon (once the trainer has
    received the groups it holds, or once enough samplers have joined): ask again shortly;
    otherwise nothing is left until the trainer asks for more (a new budget or pull request)."""

    slots: list[int] = Field(default_factory=list, max_length=1024)
    prompts: list[Count] = Field(default_factory=list, max_length=1024)
    more: bool = False
    # The slot whose keyed noise each slot's group draws with (a prompt granted again keeps its
    # first slot's); empty: each its own.
    noise_slots: list[int] = Field(default_factory=list, max_length=1024)
    # No slot: with more, ask again this long after at the soonest; without, ask again after this
    # long at the latest, a new budget waking the sampler sooner (the trainer spreads a crowd's
    # asks, echo/fleet/grants.py::ask_again_s); 0: the sampler's own pace. Bounded by the sampler
    # (workers/sampler/sampler.py::again_s) whatever it says.
    again_s: Seconds = 0.0
    # Async mode, no slot: none for this sampler before it runs this version (its long groups
    # would arrive stale at the trainer's pace), so a budget of an older one does not wake it;
    # 0: no such wait.
    wait_version: Count = 0

    @model_validator(mode="after")
    def _a_prompt_a_slot(self):
        if len(self.prompts) != len(self.slots):
            raise ValueError("prompts: one for each slot")
        if self.noise_slots and len(self.noise_slots) != len(self.slots):
            raise ValueError("noise_slots: one for each slot, or none")
        return self

    @property
    def groups(self) -> int:
        return len(self.slots)

    def keyed_slots(self) -> list[int]:
        """The slot whose keyed noise each slot's group draws with."""
        return self.noise_slots or self.slots
