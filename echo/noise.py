"""Sampling noise the trainer can draw again: Gumbel-max with keyed noise.

A token drawn as argmax(logits / T + g), with g a standard Gumbel variable for each vocabulary
id, is a draw from softmax(logits / T): the same distribution as plain temperature sampling.
Here g is not the engine's random state but a function of the group's key (the run's seed, the
trainer's epoch and the slot it granted), the completion's index in the group, the token's
position in the completion and the vocabulary id. So a completion is a function of the policy's
logits: a sampler holding the grant has no choice of text, and the trainer, recomputing the
logits, checks that each token is the one the noise picks (echo/proof.py). The exceptions are
near-ties within the engines' numeric error: the trainer's margin bounds them.

The noise is a counter-based hash (murmur3's 32-bit finaliser, twice), vectorised in int64 so
that any torch device computes the same bits; no generator state is involved.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def group_key(run_seed: int, epoch: int, slot: int) -> int:
    """The noise key of the group that fills `slot` in the trainer's `epoch`: slots are numbered
    once per epoch, so no two groups of a run share noise, a restarted sampler's included."""
    digest = hashlib.sha256(f"echo-noise/{run_seed}/{epoch}/{slot}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


@dataclass(frozen=True)
class Draw:
    """Whose noise a prompt's completions draw in one generate call: the group's `key`; its n
    completions are the group's completions `first`, first + 1, ...; their first new token is at
    `position` in its completion (an episode's later turn begins past its earlier turns and the
    environment's observations)."""

    key: int
    first: int = 0
    position: int = 0


def _mix(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix32 on int64 lanes holding 32-bit values (products wrap mod 2**64; the low
    32 bits, all that is kept, are exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def gumbel(key: int, completion: int, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [len(positions), vocab] in float32, on `positions`' device: the same
    bits on every device for the same (key, completion, position, vocabulary id)."""
    device = positions.device
    low, high = key & _M32, (key >> 32) & _M32
    counter = (positions.to(torch.int64) + completion * 0x9E3779B9) & _M32  # (completion, position)
    row = _mix(_mix(_mix(counter) ^ low) ^ high)
    bits = _mix(_mix(row[:, None] ^ _vocabulary_bits(vocab, device)[None, :]) ^ low)
    return -torch.log(-torch.log(uniform(bits)))


@functools.lru_cache(maxsize=4)
def _vocabulary_bits(vocab: int, device: torch.device) -> torch.Tensor:
    """Each vocabulary id hashed: the same for every row, made once per vocabulary and device."""
    return _mix((torch.arange(vocab, device=device, dtype=torch.int64) * 0x27D4EB2F) & _M32)


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes as float32 uniforms strictly inside (0, 1). 23 bits, so that k + 0.5 is exact
    in float32: with 24 the largest rounded to 1.0, whose noise is infinite (a bench found one)."""
    return ((bits >> 9).to(torch.float32) + 0.5) / float(1 << 23)


def noisy_margin(scores: torch.Tensor, tokens: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """How far each token falls short of the noisy argmax: max(scores + noise) minus the token's
    own scores + noise, per row (0 where the token is the argmax). scores are logits / T."""
    noisy = scores.float() + noise
    return noisy.max(dim=-1).values - noisy.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
