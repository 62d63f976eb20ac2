"""The shared KV pool connector (Mooncake style): blocks stored in a distributed store under their chained hash and
the model's layout fingerprint, written through as they fill, read into free blocks on a local miss.

`options.py` (the kv_transfer_config keys), `store.py` (the store interface: Mooncake Store, or Valkey holding the
bytes), `scheduler.py` (lookups in the background, answered "ask again" until they return; loads and saves to
plan; events), `worker.py` (the staging buffer and the I/O thread that moves blocks).
"""
