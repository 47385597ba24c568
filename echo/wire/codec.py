"""The wire's encodings: a message as JSON (orjson), decoded strictly into its model, earlier
schemas still read renamed (_UPGRADES); a rollout group as its fields in JSON followed by its
token ids and log-probs as fixed-width arrays, and a mixture of experts' routing bit-packed and
compressed (encode_rollout), decoded within the run's limits and checked against its subject and
headers. A message that does not match raises ProtocolError with a reason."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import orjson
from pydantic import ValidationError

from echo.wire.messages import ARRAYS_CHECKED, Message, RolloutGroup, check_routing, read_only
from echo.wire.names import (
    HDR_MSG_ID,
    HDR_SAMPLER_ID,
    HDR_SCHEMA,
    HDR_TASK,
    HDR_VERSION,
    ROUTING_EXPERTS_MAX,
    ROUTING_LAYERS_MAX,
    ROUTING_TOP_K_MAX,
    SCHEMA_VERSION,
)


class ProtocolError(ValueError):
    """A message that does not follow the wire's contract. `reason` is short and countable."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
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


# Earlier schemas still read (recorded messages outlive a release): each with the wire names the
# next schema renamed, old to new ("list.name": a field of each object in a list). A message is
# renamed one schema at a time up to this one.
_UPGRADES: dict[int, dict[str, str]] = {
    13: {"lease": "slot", "leases": "slots"}, 14: {}, 15: {}, 16: {}, 17: {}, 18: {},
    19: {"policy_version": "version", "incarnation": "process"}, 20: {}, 21: {}, 22: {}, 23: {}, 24: {}, 25: {},
    26: {}, 27: {"epoch": "term", "completions.reward": "completions.claimed_reward"}, 28: {}, 29: {},
}


def _upgraded(raw: dict) -> dict:
    """`raw` in this schema's names, if it is in one this module still reads."""
    sent_in = raw.get("schema_version")
    if type(sent_in) is not int or sent_in not in _UPGRADES:
        return raw
    fields = {k: v for k, v in raw.items() if k != "schema_version"}
    for schema in range(sent_in, SCHEMA_VERSION):
        fields = _renamed(fields, _UPGRADES[schema], sent_in)
    return {"schema_version": SCHEMA_VERSION} | fields


def _renamed(fields: dict, renames: dict[str, str], sent_in: int) -> dict:
    """`fields` with one schema's renames, those of each object in a list field ("list.name") too."""
    inner: dict[str, dict[str, str]] = {}
    for old, new in renames.items():
        if "." in old:
            within, name = old.split(".", 1)
            inner.setdefault(within, {})[name] = new.split(".", 1)[1]
    if twice := [old for old, new in renames.items() if "." not in old and old in fields and new in fields]:
        raise ProtocolError("bad_schema", f"{twice[0]}: schema {sent_in} has no {renames[twice[0]]!r} beside it")
    fields = {renames.get(k, k): v for k, v in fields.items()}
    for within, names in inner.items():
        if isinstance(items := fields.get(within), list):
            fields[within] = [_renamed(item, names, sent_in) if isinstance(item, dict) else item for item in items]
    return fields


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
# Where the group carries a mixture of experts' routing, its JSON names the routing's shape and
# byte count, and the routing follows: every token's expert ids, token by token, layer by layer,
# each in the fewest bits that hold `experts - 1`, zlib-compressed.
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
    # (layers, top_k, experts) of the run's model where the run replays a mixture of experts'
    # routing: each group carries it. None: no group may.
    routing: tuple[int, int, int] | None = None
    # The run's sampling.chunk_tokens: a partial rollout's versions change between chunks, each
    # after a whole number of them. 0: the run makes no partial rollouts.
    chunk_tokens: int = 0

    @property
    def max_bytes(self) -> int:
        per_completion = FIELDS_BYTES + self.max_new_tokens * (8 + TEXT_BYTES_PER_TOKEN)  # id, log-prob, text
        most = _ROLLOUT_HEAD.size + FIELDS_BYTES + 4 * PROMPT_TOKENS_ALLOWED + self.group_size * per_completion
        if self.routing is not None:
            most += routing_bytes_max(self.routing, PROMPT_TOKENS_ALLOWED + self.group_size * self.max_new_tokens)
        return most

    def check_version_changes(self, group: RolloutGroup) -> None:
        """A partial rollout only where the run makes them, its versions changing where an engine
        changes them: between chunks (a claim of another version from token 1 on is not one)."""
        if not group.version_changes:
            return
        if not self.chunk_tokens:
            raise ProtocolError("partial_not_enabled", "a partial rollout in a run without sampling.chunk_tokens")
        if any(c.at % self.chunk_tokens for c in group.version_changes) or group.version_changes[0].at <= 0:
            raise ProtocolError("bad_version_change", f"versions change at "
                                f"{[c.at for c in group.version_changes]}, not after whole chunks of {self.chunk_tokens}")

    def check_routing_shape(self, routing: dict | None) -> None:
        """A group's routing shape is the run's, and it has one where the run replays routing."""
        if routing is None:
            if self.routing is not None:
                raise ProtocolError("no_routing", "the run replays its mixture of experts' routing: each group carries it")
            return
        if self.routing is None:
            raise ProtocolError("unexpected_routing", "this run replays no routing")
        if (routing["layers"], routing["top_k"], routing["experts"]) != self.routing:
            raise ProtocolError("bad_routing", f"({routing['layers']}, {routing['top_k']}, {routing['experts']}) "
                                                f"(layers, top_k, experts), the run's model routes {self.routing}")

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
_PACK_BLOCK = 1 << 20  # expert ids bit-packed this many at a time (a multiple of 8: each block ends on a byte)
ROUTING_IDS_MAX = 1 << 29  # expert ids one group may carry (1 GiB in memory): inflated only within this


def _bits(experts: int) -> int:
    return max(1, (experts - 1).bit_length())


def routing_bytes_max(shape: tuple[int, int, int], tokens: int) -> int:
    """The most a routing of `tokens` tokens takes compressed: zlib's worst case over its packed bits."""
    layers, top_k, experts = shape
    packed = -(-tokens * layers * top_k * _bits(experts) // 8)
    return packed + packed // 1000 + 64


def pack_expert_ids(ids: np.ndarray, experts: int) -> bytes:
    """Expert ids (any shape), each in _bits(experts) bits, big-endian bit order, zlib-compressed."""
    bits, flat = _bits(experts), ids.reshape(-1).astype(">u2")
    blocks = []
    for at in range(0, len(flat), _PACK_BLOCK):
        block = np.unpackbits(flat[at : at + _PACK_BLOCK].view(np.uint8)).reshape(-1, 16)[:, 16 - bits :]
        blocks.append(np.packbits(block.reshape(-1)).tobytes())
    return zlib.compress(b"".join(blocks), 6)


def unpack_expert_ids(data: bytes, count: int, experts: int) -> np.ndarray:
    """`count` expert ids from pack_expert_ids' bytes, or ProtocolError: what does not inflate to
    exactly their packed length is refused before more than that length is inflated."""
    bits = _bits(experts)
    packed = -(-count * bits // 8)
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(data, packed + 1)
    except zlib.error as e:
        raise ProtocolError("bad_routing", f"not zlib: {e}") from None
    if len(raw) != packed or not inflate.eof or inflate.unused_data:
        raise ProtocolError("bad_routing", f"its bytes do not inflate to the {packed} that {count} ids take")
    ids = np.empty(count, np.uint16)
    block_bytes = _PACK_BLOCK * bits // 8
    for n, at in enumerate(range(0, count, _PACK_BLOCK)):
        size = min(_PACK_BLOCK, count - at)
        chunk = np.unpackbits(np.frombuffer(raw, np.uint8, -(-size * bits // 8), n * block_bytes))[: size * bits]
        wide = np.zeros((size, 16), np.uint8)
        wide[:, 16 - bits :] = chunk.reshape(size, bits)
        ids[at : at + size] = np.packbits(wide.reshape(-1)).view(">u2")
    return ids


def encode_rollout(group: RolloutGroup) -> bytes:
    fields = group.model_dump(exclude={"prompt_token_ids", "completions", "routing"})
    fields["completions"] = [c.model_dump(exclude={"token_ids", "logprobs"}) for c in group.completions]
    return _pack(fields, group.prompt_token_ids, [c.token_ids for c in group.completions],
                 [c.logprobs for c in group.completions], group.routing)


def _pack(fields: dict, prompt_ids, completion_ids: list, logprobs: list, routing=None) -> bytes:
    """Arrays or sequences: the prompt's ids, each completion's ids and each one's log-probs; and
    a Routing, if any."""
    for token_ids, values in zip(completion_ids, logprobs, strict=True):
        if len(token_ids) != len(values):
            raise ValueError("each completion token needs its log-prob")
    ids = np.concatenate([np.asarray(ids, _WIRE_IDS) for ids in (prompt_ids, *completion_ids)])
    claimed = np.concatenate([np.empty(0, _WIRE_LOGPROBS), *(np.asarray(v, _WIRE_LOGPROBS) for v in logprobs)])
    routed = pack_expert_ids(routing.ids, routing.experts) if routing is not None else b""
    shape = {"routing": routing.model_dump(exclude={"ids"}) | {"bytes": len(routed)}} if routing is not None else {}
    meta = orjson.dumps({**fields, **shape, "prompt_tokens": len(prompt_ids),
                         "completion_tokens": list(map(len, completion_ids))})
    return b"".join((_ROLLOUT_HEAD.pack(ROLLOUT_MAGIC, len(meta)), meta, ids.tobytes(), claimed.tobytes(), routed))


def _routing_shape(raw: dict) -> dict | None:
    """A rollout message's routing shape, checked enough to size its bytes (the model checks the rest)."""
    shape = raw.get("routing")
    if shape is None:
        return None
    if not (isinstance(shape, dict) and set(shape) == {"layers", "top_k", "experts", "bytes"}
            and all(type(v) is int and v >= 1 for v in shape.values())):
        raise ProtocolError("bad_schema", "routing: its layers, top_k, experts and bytes, positive integers")
    if shape["layers"] > ROUTING_LAYERS_MAX or shape["top_k"] > ROUTING_TOP_K_MAX or shape["experts"] > ROUTING_EXPERTS_MAX:
        raise ProtocolError("bad_routing", "more layers, experts or choices a token than the wire carries")
    return shape


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
    routing = _routing_shape(raw)
    if limits is not None:
        limits.check_routing_shape(routing)
    tokens = prompt_tokens + sum(completion_tokens)
    arrays_end = meta_end + 4 * tokens + 4 * sum(completion_tokens)
    expected = arrays_end + (routing["bytes"] if routing else 0)
    if len(data) != expected:
        raise ProtocolError("bad_encoding", f"{len(data)} bytes, its token counts make {expected}")
    data = bytes(data)  # a read-only buffer: the arrays below are views of it
    # Native byte order (a copy on a big-endian machine only): torch takes no other.
    ids = np.frombuffer(data, _WIRE_IDS, tokens, meta_end).astype(np.uint32, copy=False)
    logprobs = np.frombuffer(data, _WIRE_LOGPROBS, tokens - prompt_tokens, meta_end + 4 * tokens)
    if routing:
        count = tokens * routing["layers"] * routing["top_k"]
        if count > ROUTING_IDS_MAX:
            raise ProtocolError("bad_routing", f"{count} expert ids, more than the {ROUTING_IDS_MAX} a group may carry")
        expert_ids = unpack_expert_ids(data[arrays_end:], count, routing["experts"])
        raw["routing"] = {"layers": routing["layers"], "top_k": routing["top_k"], "experts": routing["experts"],
                          "ids": read_only(expert_ids.reshape(tokens, routing["layers"], routing["top_k"]))}
    return raw, prompt_tokens, completion_tokens, read_only(ids), read_only(logprobs.astype(np.float32, copy=False))


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
    group = _validate(RolloutGroup, raw, ARRAYS_CHECKED)
    if limits is not None:
        limits.check_version_changes(group)
    if group.routing is not None:
        try:
            check_routing(group.routing, group.last_tokens())
        except ValueError as e:
            raise ProtocolError("bad_routing", str(e)) from None
    return group, sent_in


def rollout_headers(group: RolloutGroup) -> dict[str, str]:
    return {
        HDR_SCHEMA: str(SCHEMA_VERSION),
        HDR_VERSION: str(group.version),
        HDR_SAMPLER_ID: group.sampler_id,
        HDR_TASK: group.task,
        HDR_MSG_ID: group.group_id,
    }


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
