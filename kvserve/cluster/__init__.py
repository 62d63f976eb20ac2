"""A local cluster for a new user (`kvserve cluster`) and the real services it and the tests start: the global
index's Valkey server, Mooncake's master and storage node (`services.py`), and the launcher (`launch.py`)."""
