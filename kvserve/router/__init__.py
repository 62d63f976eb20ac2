"""The router: one OpenAI-compatible front over several kvserve instances (`kvserve router`).

`app.py` (the FastAPI front and the Router), `instances.py` (health and the router's load account),
`policies.py` (round_robin, least_loaded, cache_aware), `prefix.py` (prompt -> token ids -> block hashes),
`proxy.py` (forwarding with the failure rules). It reaches the instances only over HTTP and shared plain types
(tests/test_layering.py).
"""
