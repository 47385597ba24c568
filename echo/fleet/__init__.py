"""The swarm as the trainer plans it: who generates what, how fast, and what arrives in time.

grants.py       the grant budget, grants and slots (what each sampler may generate)
staleness.py    which groups the trainer may learn from, by policy version
consumed.py     which rollout messages the trainer has counted
throughput.py   a sampler's measured rates
capacity.py     ECHO-2's capacity model: which samplers keep the learner busy, cheapest
"""
