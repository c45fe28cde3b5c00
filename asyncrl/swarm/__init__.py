"""Inference workers the run does not own: they join over HTTP with a token each, pull groups under
leases, and every sample they return is checked (cheaply always, by recompute on a sampled share)
before a batch may hold it. docs/untrusted.md.

    roster.py     the workers' tokens, trust and work, in the run's ledger
    gateway.py    the HTTP endpoints a worker may call (join, weights, work, results)
    remote.py     a joined worker as the router sees it: a replica fed through a queue, under leases
    checks.py     the cheap checks every returned sample passes
    trust.py      a worker's trust score, its share of samples recomputed, its quarantine
    recompute.py  the trusted recompute of a sample's logprobs under the version it claims
    members.py    the joined workers of a run: admission, verification, quarantine
    download.py   a worker's hash-checked, resumable, throttleable fetch of the run's files
    join.py       `asyncrl worker --join URL --token T`: the worker's side
"""
