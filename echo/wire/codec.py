"""The wire's encodings: a message as JSON (orjson), decoded strictly into its model, earlier
schemas still read renamed (_UPGRADES); a rollout group as its fields in JSON followed by its
token ids and log-probs as fixed-width arrays (encode_rollout), decoded within the run's limits and
checked against its subject and headers. A message that does not match raises ProtocolError with a
reason."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import orjson
from pydantic import ValidationError

from echo.wire.messages import ARRAYS_CHECKED, Message, RolloutGroup, read_only
from echo.wire.names import HDR_MSG_ID, HDR_SAMPLER_ID, HDR_SCHEMA, HDR_TASK, HDR_VERSION, SCHEMA_VERSION


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
# next schema renamed, old to new. A message is renamed one schema at a time up to this one.
_UPGRADES: dict[int, dict[str, str]] = {
    13: {"lease": "slot", "leases": "slots"}, 14: {}, 15: {}, 16: {}, 17: {}, 18: {},
    19: {"policy_version": "version", "incarnation": "process"}, 20: {}, 21: {},
}


def _upgraded(raw: dict) -> dict:
    """`raw` in this schema's names, if it is in one this module still reads."""
    sent_in = raw.get("schema_version")
    if type(sent_in) is not int or sent_in not in _UPGRADES:
        return raw
    fields = {k: v for k, v in raw.items() if k != "schema_version"}
    for schema in range(sent_in, SCHEMA_VERSION):
        renames = _UPGRADES[schema]
        if twice := [old for old, new in renames.items() if old in fields and new in fields]:
            raise ProtocolError("bad_schema", f"{twice[0]}: schema {sent_in} has no {renames[twice[0]]!r} beside it")
        fields = {renames.get(k, k): v for k, v in fields.items()}
    return {"schema_version": SCHEMA_VERSION} | fields


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
    return _validate(RolloutGroup, raw, ARRAYS_CHECKED), sent_in


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
