"""Proof of sampling: the trainer recomputes the behaviour log-probs a sampler claims for a
group under the version the group names (each token under the version that sampled it,
for a partial rollout), and compares. Compute only; no I/O.

A sampler's log-probs drive the importance weights pi_old / mu: a sampler that invents them
(to inflate its groups' weight, or to pass off completions it did not sample from the policy)
is caught by a forward pass of the claimed version. prime-rl checks inference with TOPLOC
proofs from the inference engine; here the log-probs the protocol already carries are the proof.
Log-probs alone cannot catch a sampler that runs the model forward over completions it chose
and reports their true log-probs. With keyed noise (sampling.noise = "keyed", echo/trust/noise.py) a
token is a function of the logits and of noise the trainer draws again, so the same forward
checks the tokens too: each must be the noisy argmax, within `margin` (the engines' numeric
differences): every token the model drew, an episode's turns included (the environment's
observations are its own), a partial rollout's each under the version that drew it.

The trainer keeps the last `max_staleness + 1` versions' trainable tensors (an adapter is a
few MB) and swaps the claimed one in for the forward, then swaps its current one back. On
several ranks each keeps and swaps its own shards, and all run the forward together.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import torch
from peft import PeftModel
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from echo.config import EchoConfig
from echo.model.devices import DTYPES, autocast, model_device
from echo.model.policy import packed_states, spanning_logprobs, states_logprobs
from echo.trust.noise import TokenMargins, group_key
from echo.trust.routing import RoutingReplay
from echo.weights.shards import check_tensors, policy_shapes
from echo.wire.messages import Completion, RolloutGroup

# The reasons a group is refused as forged (SamplingProof.forged): its sender becomes a suspect.
FORGERIES = frozenset({"token_forgery", "forged_routing", "logprob_forgery"})


def logprob_gap(claimed: list[Completion], recomputed: torch.Tensor) -> float:
    """The largest absolute difference between a claimed and a recomputed log-prob of a token the
    model sampled (`recomputed` is [G, C], right-padded; each row is read up to its completion's
    length; an episode's observations are the environment's, with no log-prob to check)."""
    gap = 0.0
    for row, completion in enumerate(claimed):
        sampled = torch.from_numpy(completion.model_mask())
        diff = (recomputed[row, : len(completion.logprobs)] - torch.tensor(completion.logprobs, dtype=recomputed.dtype))
        gap = max(gap, float(diff.abs()[sampled].max()))
    return gap


def _trainable(model) -> dict[str, torch.Tensor]:
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def _published_name(model, name: str) -> str:
    """A trainable parameter's name in the published tensors (echo/model/policy.py's policy_tensors):
    peft names an adapter's without the adapter's name, as get_peft_model_state_dict does."""
    return name.replace(f".{model.active_adapter}", "") if isinstance(model, PeftModel) else name


def _copy_into(model, tensors: dict[str, torch.Tensor]) -> None:
    for module in model.modules():  # FSDP2 leaves the root's parameters whole after a forward
        if isinstance(module, FSDPModule):  # with no backward: shard them again, as the copies are
            module.reshard()
    with torch.no_grad():
        for k, p in _trainable(model).items():
            p.copy_(tensors[k])  # casts a rounded version back to the parameter's dtype


@dataclass(frozen=True)
class ProofSettings:
    """What the check compares against, from the run's config (ProofSettings.of)."""

    temperature: float  # the run's sampling temperature: the log-probs are of the tempered distribution
    fraction: float  # of the groups checked at random
    tolerance: float  # the largest gap in nats between fp32 samplers and an fp32 trainer
    keep: int  # versions kept to check against: a partial rollout's first tokens may be this old
    tolerance_16bit: float | None = None  # where either side computes in 16 bits; None: `tolerance`
    publish_dtype: torch.dtype = torch.float32  # what the samplers run: the versions as published
    compute_dtype: torch.dtype = torch.float32  # the trainer's forward
    noise_seed: int | None = None  # the run's seed where samplers draw keyed noise: tokens checked too
    margin: float = 0.01  # how far (logits / T) a token may fall short of the noisy argmax, fp32
    margin_16bit: float = 0.5  # the same where either side computes in 16 bits
    # The step proves the groups sampled by the version it trains from, from its own forward
    # (held_checks): the trainer's weights are those the samplers run (published unrounded).
    in_step: bool = False
    trusted: frozenset[str] = frozenset()  # samplers whose text the run trusts: log-probs checked, not tokens
    # Where the run replays a mixture of experts' routing (the forwards route as the group says):
    # how far a recorded expert may lie below the trainer's own top-k (routing_gap). None: no replay.
    routing_margin: float | None = None

    @classmethod
    def of(cls, cfg: EchoConfig, compute_dtype: torch.dtype) -> ProofSettings:
        tcfg = cfg.trainer
        return cls(cfg.sampling.temperature, tcfg.verify_fraction, tcfg.verify_tolerance, cfg.begun_within + 1,
                   tcfg.verify_tolerance_16bit, DTYPES[tcfg.publish_dtype], compute_dtype,
                   cfg.run.seed if cfg.sampling.noise == "keyed" else None, tcfg.verify_margin,
                   tcfg.verify_margin_16bit, in_step=tcfg.publish_dtype == "float32",
                   trusted=frozenset(cfg.sampling.trusted_samplers),
                   routing_margin=tcfg.verify_routing_margin if cfg.algorithm.router_replay == "replay" else None)


@dataclass(frozen=True)
class Checked:
    """What the check found in one group."""

    gap: float  # the largest log-prob gap (logprob_gap)
    margin: float | None = None  # the largest token margin (noise.TokenMargins); None: tokens not checked
    routing: float | None = None  # the largest routing gap (routing.RoutingReplay); None: no routing replayed

    def worst(self, other: Checked) -> Checked:
        """Both parts of one group's check (its completions split between passes) as one."""
        def larger(a, b):
            return a if b is None else b if a is None else max(a, b)

        return Checked(max(self.gap, other.gap), larger(self.margin, other.margin), larger(self.routing, other.routing))


def worst_checks(parts) -> dict[str, Checked]:
    """Checks of parts of groups (passes, ranks: group id -> Checked each) as one per group."""
    out: dict[str, Checked] = {}
    for part in parts:
        for gid, c in part.items():
            out[gid] = out[gid].worst(c) if gid in out else c
    return out


def held_noise(pass_groups: list[tuple[RolloutGroup, list[int]]], version: int,
               noise_key) -> list[tuple[int, int] | None]:
    """For each row of a training pass (`pass_groups`' completions in order), the noise it was
    drawn with (its group's key, its index) if its group is one `version` sampled and its tokens
    are checked (`noise_key`: SamplingProof.noise_key), else None."""
    return [(key, i) if held(group, version) and key is not None else None
            for group, rows in pass_groups for key in [noise_key(group)] for i in rows]


def held(group: RolloutGroup, version: int) -> bool:
    """Every token of `group` sampled by `version`."""
    return group.version == version and not group.version_changes


def held_checks(pass_groups: list[tuple[RolloutGroup, list[int]]], recomputed: torch.Tensor,
                margins: TokenMargins | None, version: int, replay: RoutingReplay | None = None) -> dict[str, Checked]:
    """The proof of sampling from a training pass's own forward, for its groups sampled by
    `version`, the one the step trains from: their recomputed log-probs are the step's pi_old
    (`recomputed`, [R, C]), their token margins (`margins`; None: no token checked) read from the
    logits it made for them, their routing gaps from the routing it replayed (`replay`). The pass's rows are
    `pass_groups`' completions in order; the check of a group split between passes is its parts'
    worst (Checked.worst)."""
    if not any(held(group, version) for group, _ in pass_groups):
        return {}
    out, start = {}, 0
    recomputed = recomputed.detach().float().cpu()  # once for the pass, not a wait on the device a group
    gaps = None if replay is None else replay.gaps.cpu()
    for group, rows in pass_groups:
        span, start = slice(start, start + len(rows)), start + len(rows)
        if held(group, version):
            claimed = [group.completions[i] for i in rows]
            margin = None if margins is None else margins.of(span)
            routing = None if gaps is None else float(gaps[span].max())
            out[group.group_id] = Checked(logprob_gap(claimed, recomputed[span]), margin, routing)
    return out


class SamplingProof:
    """Which groups to check (a random `fraction`, and every group of a suspect sampler), the
    versions to check them against, and the check itself."""

    def __init__(self, model, pad_id: int, settings: ProofSettings):
        self.model, self.pad_id, self.temperature = model, pad_id, settings.temperature
        self.fraction, self.keep = settings.fraction, settings.keep
        self.tolerance, self.tolerance_16bit = settings.tolerance, settings.tolerance_16bit or settings.tolerance
        self.publish_dtype, self.compute_dtype = settings.publish_dtype, settings.compute_dtype
        self.noise_seed, self.margin, self.margin_16bit = settings.noise_seed, settings.margin, settings.margin_16bit
        self.in_step, self.trusted = settings.in_step, settings.trusted
        self.routing_margin = settings.routing_margin
        # From the OS, not the run's seed: every sampler reads the config, and one that could tell
        # which groups will be checked would forge only the others.
        self.rng = random.SystemRandom()
        self.versions: dict[int, dict[str, torch.Tensor]] = {}  # as published: what the samplers run
        self.live: dict[str, torch.Tensor] = {}  # the trainer's own (unrounded) current tensors
        self.suspects: set[str] = set()
        self.counts: Counter[str] = Counter()  # groups by outcome: passed, forged, unverifiable

    def remember(self, version: int) -> None:
        """Keep the model's tensors as `version` (call right after publishing it)."""
        self.live = {k: v.detach().clone() for k, v in _trainable(self.model).items()}
        rounded = self.publish_dtype != torch.float32
        self.versions[version] = {k: v.to(self.publish_dtype) for k, v in self.live.items()} if rounded else self.live
        for old in [v for v in self.versions if v <= version - self.keep]:
            del self.versions[old]

    def recall(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `tensors` (a version's tensors as published, read back whole from the run's
        weights files) as `version`: a restarted trainer proves its predecessor's last versions'
        groups as that trainer would have. On several ranks every rank calls it alike: each keeps
        its own shards (distribute_tensor, a collective)."""
        check_tensors(policy_shapes(self.model), tensors)
        live = {k: v.detach().clone() for k, v in _trainable(self.model).items()}
        with torch.no_grad():
            for name, p in _trainable(self.model).items():
                whole = tensors[_published_name(self.model, name)].to(p.dtype)
                p.copy_(distribute_tensor(whole, p.device_mesh, p.placements) if isinstance(p, DTensor) else whole)
        self.versions[version] = {k: v.detach().clone().to(self.publish_dtype) for k, v in _trainable(self.model).items()}
        _copy_into(self.model, live)

    def wants(self, group: RolloutGroup, version: int) -> bool:
        """Whether to check `group` now, the trainer holding `version`: not where the step proves
        it from its own forward (in_step), else a suspect's always, another's at `fraction`."""
        if self.in_step and held(group, version):
            return False
        return group.sampler_id in self.suspects or self.rng.random() < self.fraction

    def judged_in_step(self, groups: dict[str, RolloutGroup], checked: dict[str, Checked]) -> dict[str, str]:
        """The groups a step's own forward found forged (group id -> why), counted; every group
        passed is counted only by the step that trains it (one with none forged)."""
        forged = {gid: why for gid, c in checked.items() for why in [self.forged(groups[gid], c)] if why}
        if forged:
            self.counts["forged"] += len(forged)
            self.suspects.update(groups[gid].sampler_id for gid in forged)
        else:
            self.counts["passed"] += len(checked)
        return forged

    def check(self, group: RolloutGroup) -> Checked | None:
        """The group's log-prob gap and token margin, or None if a version that sampled it is no
        longer kept (not checked): check_many of one group."""
        return self.check_many([group])[group.group_id]

    def check_many(self, groups: list[RolloutGroup], rows_per_forward: int = 64) -> dict[str, Checked | None]:
        """Each group's check (group id -> Checked), or None where a version that sampled it is no
        longer kept. Groups sampled by one version are proved together: that version swapped in
        once, forwards of up to `rows_per_forward` completions; a partial rollout's tokens each
        under the version that sampled them. A forgery makes its sampler a suspect: all its
        groups are checked."""
        out: dict[str, Checked | None] = {}
        by_version: dict[int, list[RolloutGroup]] = {}
        for group in groups:
            versions = [group.version, *(change.version for change in group.version_changes)]
            if any(version not in self.versions for version in versions):
                self.counts["unverifiable"] += 1
                out[group.group_id] = None
            elif not group.version_changes:
                by_version.setdefault(group.version, []).append(group)
        swapped = False

        def use(version: int) -> None:
            nonlocal swapped
            tensors = self.versions[version]
            if tensors is not self.live or swapped:
                _copy_into(self.model, tensors)
                swapped = True

        try:
            with torch.no_grad(), autocast(model_device(self.model), self.compute_dtype):
                for version, alike in sorted(by_version.items()):
                    use(version)
                    per_forward = max(1, rows_per_forward // len(alike[0].completions))
                    for start in range(0, len(alike), per_forward):
                        out |= self._one_version(alike[start : start + per_forward], version)
                for group in groups:
                    if group.version_changes and group.group_id not in out:
                        out[group.group_id] = self._spanning(group, use)
        finally:
            if swapped:
                _copy_into(self.model, self.live)
        for group in groups:
            checked = out[group.group_id]
            if checked is None:
                continue
            if self.forged(group, checked):
                self.counts["forged"] += 1
                self.suspects.add(group.sampler_id)
            else:
                self.counts["passed"] += 1
        return out

    def _one_version(self, groups: list[RolloutGroup], version: int) -> dict[str, Checked]:
        """One packed forward of groups that `version` (in the model now) sampled whole."""
        pass_groups = [(group, list(range(len(group.completions)))) for group in groups]
        device = model_device(self.model)
        margins = None  # the token check, from the logits the log-probs are made of
        if any(self.noise_key(group) is not None for group in groups):
            margins = TokenMargins(held_noise(pass_groups, version, self.noise_key),
                                   [torch.from_numpy(c.model_mask()) for group in groups for c in group.completions],
                                   self.temperature, device)
        replay = RoutingReplay.of(pass_groups) if self.routing_margin else None
        owners = [k for k, group in enumerate(groups) for _ in group.completions]
        states, ids, _ = packed_states(self.model, [group.prompt_token_ids for group in groups],
                                       [c.token_ids for group in groups for c in group.completions], owners,
                                       self.pad_id, replay=replay)
        recomputed = states_logprobs(self.model, states, ids, self.temperature, observe=margins)
        return held_checks(pass_groups, recomputed, margins, version, replay)

    def _spanning(self, group: RolloutGroup, use) -> Checked:
        """A partial rollout's check: each token under the version that sampled it (`use(version)`
        puts a version's weights in the model)."""
        versions = [group.version, *(change.version for change in group.version_changes)]
        completions = [c.token_ids for c in group.completions]
        margins = None
        key = self.noise_key(group)
        if key is not None:
            margins = TokenMargins([(key, j) for j in range(len(completions))],
                                   [torch.from_numpy(c.model_mask()) for c in group.completions],
                                   self.temperature, model_device(self.model))
        replay = RoutingReplay.of([(group, list(range(len(completions))))]) if self.routing_margin else None
        starts = [0, *(change.at for change in group.version_changes)]
        recomputed = spanning_logprobs(self.model, group.prompt_token_ids, completions, starts,
                                       lambda k: use(versions[k]), self.temperature, self.pad_id, margins, replay)
        return Checked(logprob_gap(group.completions, recomputed.float().cpu()),
                       None if margins is None else margins.of(slice(None)),
                       None if replay is None else float(replay.gaps.max()))

    def noise_key(self, group: RolloutGroup) -> int | None:
        """The key of the noise that drew `group`'s tokens, where they are checked: the run draws
        keyed noise and does not trust the group's sampler's text."""
        if self.noise_seed is None or group.sampler_id in self.trusted:
            return None
        return group_key(self.noise_seed, group.term, group.keyed_slot)

    def exact(self, group: RolloutGroup) -> bool:
        """fp32 on both sides agrees to float error; a 16-bit side (the group's sampler, or this
        recomputation) rounds every logit, and the gap and margins are that rounding."""
        return group.dtype == "float32" and self.compute_dtype == torch.float32

    def tolerance_for(self, group: RolloutGroup) -> float:
        return self.tolerance if self.exact(group) else self.tolerance_16bit

    def margin_for(self, group: RolloutGroup) -> float:
        return self.margin if self.exact(group) else self.margin_16bit

    def forged(self, group: RolloutGroup, checked: Checked | None) -> str | None:
        """Why the group is a forgery (token_forgery: a token the noise did not pick;
        forged_routing: experts the router would not have chosen, which replay would have trusted;
        logprob_forgery: log-probs not the policy's), or None."""
        if checked is None:
            return None
        # "not <=": a NaN (a token or log-prob no forward gives) is a forgery, never a pass.
        if checked.margin is not None and not checked.margin <= self.margin_for(group):
            return "token_forgery"
        if checked.routing is not None and not checked.routing <= self.routing_margin:
            return "forged_routing"
        return None if checked.gap <= self.tolerance_for(group) else "logprob_forgery"
