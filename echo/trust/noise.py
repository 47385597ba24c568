"""Sampling noise the trainer can draw again: Gumbel-max with keyed noise.

A token drawn as argmax(logits / T + g), with g a standard Gumbel variable for each vocabulary
id, is a draw from softmax(logits / T): the same distribution as plain temperature sampling.
Here g is not the engine's random state but a function of the group's key (the run's seed, the
trainer's term and the slot it granted), the completion's index in the group, the token's
position in the completion and the vocabulary id. So a completion is a function of the policy's
logits: a sampler holding the grant has no choice of text, and the trainer, recomputing the
logits, checks that each token is the one the noise picks (echo/trust/proof.py). The exceptions are
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


def group_key(run_seed: int, term: int, slot: int) -> int:
    """The noise key of the group that fills `slot` in the trainer's `term`: slots are numbered
    once per term, so no two groups of a run share noise, a restarted sampler's included."""
    digest = hashlib.sha256(f"echo-noise/{run_seed}/{term}/{slot}".encode()).digest()
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
    return _noise(key & _M32, key >> 32, completion, positions[:, None],
                  _vocabulary_bits(vocab, positions.device)[None, :])


def gumbel_at(key: int, completion: int, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """gumbel's noise at the pairs (positions[i], ids[i]) only."""
    return _noise(key & _M32, key >> 32, completion, positions, _id_bits(ids))


def _noise(low, high, completion, positions: torch.Tensor, id_bits: torch.Tensor) -> torch.Tensor:
    """The noise of each (key, completion, position, id), from the key's 32-bit halves; the
    arguments broadcast (ints or int64 tensors)."""
    return _cell_noise(_row_bits(low, high, completion, positions), low, id_bits)


def _row_bits(low, high, completion, positions: torch.Tensor) -> torch.Tensor:
    """The hash of each (key, completion, position): a row's part of its cells' noise."""
    counter = (positions.to(torch.int64) + completion * 0x9E3779B9) & _M32
    return _mix(_mix(_mix(counter) ^ low) ^ high)


def _cell_noise(row_bits: torch.Tensor, low, id_bits: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform(_mix(_mix(row_bits ^ id_bits) ^ low))))


def _id_bits(ids: torch.Tensor) -> torch.Tensor:
    return _mix((ids.to(torch.int64) * 0x27D4EB2F) & _M32)


@functools.lru_cache(maxsize=4)
def _vocabulary_bits(vocab: int, device: torch.device) -> torch.Tensor:
    """Each vocabulary id hashed: the same for every row, made once per vocabulary and device."""
    return _id_bits(torch.arange(vocab, device=device))


# The largest and smallest noise `uniform` allows: u = 1 - 2**-24 gives -log(-log(u)) = 16.64,
# u = 2**-24 gives -2.81.
GUMBEL_MAX, GUMBEL_MIN = 17.0, -3.0


def noisy_scores(scores: torch.Tensor, low: torch.Tensor, high: torch.Tensor, completion: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """scores [N, V] (logits / T) plus each row's noise (row n: completion `completion[n]` of the
    group keyed (`high[n]`, `low[n]`) at `positions[n]`), -inf for the ids that cannot be the
    argmax: an id more than GUMBEL_MAX - GUMBEL_MIN below the row's best score never beats it."""
    scores = scores.float()
    return _noisy_above(scores, scores.max(dim=-1).values - (GUMBEL_MAX - GUMBEL_MIN), low, high, completion, positions)


def keyed_draw(scores: torch.Tensor, low: torch.Tensor, high: torch.Tensor, completion: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of Gumbel-max with keyed noise on scores [N, V] (logits / T), rows drawn as in
    noisy_scores: the noisy scores, each row's drawn token (their argmax) and its behaviour
    log-prob, log-softmax(scores) at that token. For an engine whose own sampler then takes the
    argmax of what a processor returns (hf-paged, vLLM)."""
    scores = scores.float()
    noisy = noisy_scores(scores, low, high, completion, positions)
    token = noisy.argmax(-1)
    return noisy, token, torch.log_softmax(scores, -1).gather(-1, token[:, None]).squeeze(-1)


def _noisy_above(scores: torch.Tensor, floor: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                 completion: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """scores plus noise where above the row's `floor`, -inf elsewhere: the noise is drawn for
    those ids alone where they are few (a language model's peaked logits: hashing the whole
    vocabulary cost more than a step's forward on a CPU), for the whole grid where they are most."""
    cells = _cells_above(scores, floor)
    if cells is None:
        return _grid_noisy(scores, floor, low, high, completion, positions)
    noisy = torch.full_like(scores, float("-inf"))
    noisy.view(-1)[cells] = scores.reshape(-1)[cells] + _sparse_noise(cells, scores.shape[-1], low, high, completion,
                                                                      positions)
    return noisy


BLOCK = 64  # vocabulary ids a block: _cells_above reads a block's max before its ids


def _cells_above(values: torch.Tensor, floor: torch.Tensor) -> torch.Tensor | None:
    """The flat indices (row * vocab + id) of values [N, V] above their row's `floor`, or None
    where they are in most blocks. A block's max is compared first and only the blocks that reach
    the floor id by id: a language model's few such ids lie in few blocks (13% of SmolLM2's at
    T = 0.7), and one pass over a [N, V] mask to find them cost more than the rest of the check."""
    n, vocab = values.shape
    whole = vocab - vocab % BLOCK
    blocks = values[:, :whole].view(n, whole // BLOCK, BLOCK)
    hit = (blocks.amax(-1) > floor[:, None]).view(-1).nonzero().squeeze(1)  # row * blocks + block
    if len(hit) * 4 > n * (whole // BLOCK):
        return None
    rows, block = hit // (whole // BLOCK), hit % (whole // BLOCK)
    # A whole vocabulary's blocks are rows of one [N * blocks, BLOCK] view: index_select is the fast read.
    picked = (values.view(-1, BLOCK).index_select(0, hit) if whole == vocab and values.is_contiguous()
              else blocks[rows, block])
    inside, at = (picked > floor[rows, None]).nonzero(as_tuple=True)
    tail_rows, tail_ids = (values[:, whole:] > floor[:, None]).nonzero(as_tuple=True)
    return torch.cat([rows[inside] * vocab + block[inside] * BLOCK + at, tail_rows * vocab + whole + tail_ids])


def _grid_noisy(scores: torch.Tensor, floor: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                completion: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    noise = _noise(low[:, None], high[:, None], completion[:, None], positions[:, None],
                   _vocabulary_bits(scores.shape[-1], scores.device)[None, :])
    return torch.where(scores > floor[:, None], scores + noise, float("-inf"))


def _sparse_noise(cells: torch.Tensor, vocab: int, low: torch.Tensor, high: torch.Tensor, completion: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """The noise of the flat cells (row * vocab + id) of rows drawn as in noisy_scores: each row's
    hash made once, each id's read from the vocabulary's (few hash operations per cell)."""
    rows = cells // vocab
    return _cell_noise(_row_bits(low, high, completion, positions)[rows], low[rows],
                       _vocabulary_bits(vocab, cells.device)[cells % vocab])


def key_halves(keys: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Group keys as the (low, high) 32-bit halves the noise is drawn from, one per row."""
    return (torch.tensor([key & _M32 for key in keys], dtype=torch.int64, device=device),
            torch.tensor([key >> 32 for key in keys], dtype=torch.int64, device=device))


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes as float32 uniforms strictly inside (0, 1). 23 bits, so that k + 0.5 is exact
    in float32: with 24 the largest rounded to 1.0, whose noise is infinite (a bench found one)."""
    return ((bits >> 9).to(torch.float32) + 0.5) / float(1 << 23)


def noisy_margin(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, low: torch.Tensor,
                 high: torch.Tensor, completion: torch.Tensor, positions: torch.Tensor,
                 checked: torch.Tensor | None = None) -> torch.Tensor:
    """How far each token falls short of the noisy argmax: max(logits / T + noise) minus the
    token's own, per row of logits [N, V], row n drawing the noise of completion `completion[n]`
    of the group keyed (`high[n]`, `low[n]`) at `positions[n]`; 0 where the token is the argmax.
    Only ids whose score is within GUMBEL_MAX below the token's noisy score can beat it: those
    are found on the logits as they are (no scaled fp32 copy of the chunk) and the noise drawn
    for them alone where they are few; where most are, for the whole grid (it hashes faster).
    `checked` (a mask of rows): the others' margins are 0, their noise not drawn."""
    own = logits.gather(-1, tokens[:, None]).squeeze(-1).float() / temperature
    own = own + _noise(low, high, completion, positions, _id_bits(tokens))
    floor = (own - GUMBEL_MAX) * temperature  # in the logits' units; the token itself above it
    if checked is not None:
        floor = floor.masked_fill(~checked, float("inf"))
    cells, vocab = _cells_above(logits, floor), logits.shape[-1]
    if cells is None:
        noisy = _grid_noisy(logits.float() / temperature, floor / temperature, low, high, completion, positions)
        return (noisy.max(-1).values - own).clamp(min=0)  # a row not checked: -inf - own
    noisy = logits.reshape(-1)[cells].float() / temperature + _sparse_noise(cells, vocab, low, high, completion,
                                                                             positions)
    return own.scatter_reduce(0, cells // vocab, noisy, "amax") - own


class TokenMargins:
    """The token margins of completions drawn with keyed noise, read from logits made anyway (the
    log-probs' chunks: echo/model/policy.py's states_logprobs shows it each). Row r of the tokens is
    completion `noise[r][1]` of the group keyed `noise[r][0]`, or not checked (None); `sampled[r]`
    marks the tokens the model drew (an episode's observations are the environment's).
    `worst[r]`: the worst margin of its tokens seen (0 for a row not checked)."""

    def __init__(self, noise: list[tuple[int, int] | None], sampled: list[torch.Tensor], temperature: float,
                 device: torch.device):
        self.temperature = temperature
        self.sampled = torch.zeros((len(sampled), max(len(m) for m in sampled)), dtype=torch.bool)
        for r, (mask, n) in enumerate(zip(sampled, noise)):
            self.sampled[r, : len(mask)] = mask.to(torch.bool) & (n is not None)
        self.sampled = self.sampled.to(device)
        self.checked = [n is not None for n in noise]
        keys = [n or (0, 0) for n in noise]
        self.low, self.high = key_halves([key for key, _ in keys], device)
        self.completion = torch.tensor([j for _, j in keys], dtype=torch.int64, device=device)
        self.worst = torch.zeros(len(noise), device=device)
        self.read: torch.Tensor | None = None  # `worst` copied off the device once for every group's read

    def __call__(self, rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        inside = positions < self.sampled.shape[1]  # past every completion's end: padding
        checked = inside & self.sampled[rows, positions.clamp(max=self.sampled.shape[1] - 1)]
        # Every row of the chunk's logits as they are (a subset would be a copy of them): the rows
        # not checked (a prompt's, an observation's, padding) draw no noise and have margin 0.
        margins = noisy_margin(logits, tokens, self.temperature, self.low[rows], self.high[rows],
                               self.completion[rows], positions, checked)
        self.worst.scatter_reduce_(0, rows, margins, "amax")
        self.read = None

    def of(self, rows: slice) -> float | None:
        """The worst margin of these rows' tokens, or None where none was checked."""
        if not any(self.checked[rows]):
            return None
        if self.read is None:  # a copy a group would wait on the device each time (a GPU's step, 32 groups)
            self.read = self.worst.cpu()
        return float(self.read[rows].max())
