"""The trainer's checks on what an untrusted sampler sends.

scorer.py       the trainer's checks on a sampler's group
proof.py        proof of sampling: the claimed log-probs recomputed, and the tokens
noise.py        keyed Gumbel noise: sampling the trainer can draw again
routing.py      mixture-of-experts routing: recorded, replayed, and how far a claimed choice lies off
"""
