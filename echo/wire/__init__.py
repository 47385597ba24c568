"""The wire: the contract between the trainer and the samplers, the only thing either side knows
of the other. Importers name the module they use:

- names.py: subjects, streams, buckets and their keys, headers, ids, object names, and the bounds
  a message's values keep to;
- messages.py: the messages, pydantic models checked field by field;
- codec.py: messages as JSON, a rollout group as JSON fields and fixed-width arrays, strict
  decoding (ProtocolError with a reason) and the earlier schemas still read (_UPGRADES).

Each word keeps one meaning on the wire: a `version` is a number within a term, `Version` the
pair (term, version) that orders them; a `term` is the trainer's count of takeovers (Raft's word,
not a pass over the data), not an identity; a `process` is one process's name (a sampler's, or
the lease holder's); a slot is one group of granted work; the trainer's status is a TrainerStatus. Header and key values that stored
streams and buckets already carry keep their old spelling (`Echo-Policy-Version`, `policy-version`,
the status key `learner`).

Schema history (names.SCHEMA_VERSION; a change to a message bumps it, and a rename also reads the
earlier schema, renamed, so a recorded run replays and a restarted trainer trains the groups it had
not read; this is the one list of it):
2: a weights announcement lists shards; 3: and names the trainer's epoch (a term since 28).
4: the trainer grants work (GrantRequest/Grant), samplers no longer take it from KV.
5: grants are numbered slots: a grant names them, a group carries the one it fills and its epoch.
6: a group names the engine and precision that sampled it.
7: a sampler's heartbeat is its registry entry (hardware, state, measured rates, sync times, cost, relay).
8: a rollout group's token ids and log-probs travel as fixed-width binary arrays after its fields.
9: a pull request names the trainer's epoch (a resumed trainer asks for an older version).
10: a completion sampled across weight updates names where each newer version took over.
11: a group's body parts share their sampler's one bodies subject, its message names their sequences.
12: a completion may be a multi-turn episode: it names where the environment's tokens lie.
13: the trainer's status says when the run has finished, a sampler's heartbeat that it saw it.
    The oldest schema still read.
14: slots are "slot"/"slots" on the wire (13 said "lease"/"leases", the word the TrainerLease also uses).
15: a sampler names its process (then `incarnation`) in its heartbeat and its requests for work, so a
    process restarted under its id is told from its predecessor; read as "" from 13 and 14.
16: the trainer's status names its last step's mean staleness and the strikes it counted; read as
    0 and none before.
17: a full-weight version may go as a delta against the one before (`delta_of`, with the chain back
    to its anchor) and names the digest of the whole weights it makes.
18: the trainer's lease names its holder's process (a restarted trainer on the same machine takes
    over at once from one that exited); read as "" before.
19: a grant names each slot's prompt (the trainer's draw), and a heartbeat's numbers, strings and
    dicts are bounded; a grant of 18 or before with slots is refused: it names no prompt.
20: one meaning per word: a group's `policy_version` is its `version`, a sampler's `incarnation` its
    `process` (in SamplerStatus and GrantRequest); LearnerStatus is TrainerStatus (same fields, its
    key's value unchanged).
21: the trainer's status counts each sampler's slots ended and those it never delivered (`slots`);
    read as none before.
22: the trainer's status names the run's steps, the trainer's seconds since it started and its
    estimate of the seconds left (`steps`, `elapsed_s`, `eta_s`), the last step's headline values
    and sample completions, and the model and task (`scalars`, `samples`, `model`, `task`); read
    as 0, none and "" (unknown) before.
23: a rollout group may carry its mixture of experts' routing (`routing`: its shape in the fields,
    the expert ids bit-packed and compressed after the log-probs); read as none before.
24: a prompt granted again keeps the keyed noise of the slot it was first granted on: a grant names
    each slot's (`noise_slots`), a group the one that drew it where not its own (`noise_slot`);
    read as their own before; a group may name the engine "mlx".
25: a sampler's heartbeat names the processes its model is split over (`ranks`), how many times
    their group was lost and started again and why the last time (`ranks_restarted`,
    `rank_lost`); read as 1, 0 and "" before. A grant with work left and no slot says when to ask
    again (`again_s`: the trainer spreads a crowd's asks); read as 0 (the sampler's own pace).
26: async mode's grant budget says how many slots were open and how many samplers idle when it
    was published, and its draw (`open`, `idle`, `draw`): among many, only a share of the idle
    wake to ask; read as 0 (every idle sampler asks) before.
27: a grant refusing a sampler whose long groups would arrive stale names the version it waits for
    (`wait_version`): budgets of older ones do not wake it; read as 0 (none) before.
28: the trainer's count of takeovers is its `term` (in verl, TRL and PPO an epoch is a pass over
    the data); `epoch` before, in every message that names it (announcements, the lease, pull
    requests, requests for work, groups). Stored names keep theirs: the weights objects'
    `trainer-epoch` header and their names' `e` prefix. A completion's reward from its sampler
    is its `claimed_reward` (`reward` before): a claim the trainer checks, never trained on.
    A weights digest is `sha256:<hex>`, the one digest of weights (the base model's already was);
    bare hex before.
29: a request for work may carry the sampler's own seconds a token, from a warm-up generation
    (`claimed_s_per_token`): the trainer paces a sampler it has not measured yet by it; read as
    none (not paced until measured) before.
30: the run's end is a state key of its own (`finished`: the last step), which samplers read in
    place of the trainer's status: that status's tables by sampler made each heartbeat's read
    grow with the fleet. The status still says `finished`; a sampler of this schema sees no end
    of a run whose trainer is older.
"""
