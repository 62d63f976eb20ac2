"""Prefill/decode disaggregation: the "pd" connector (vLLM's roles and kv_transfer_params; Mooncake's transfer).

    prefill instance:  --kv-transfer-config '{"kv_connector": "pd", "kv_role": "kv_producer"}'
    decode instance:   --kv-transfer-config '{"kv_connector": "pd", "kv_role": "kv_consumer"}'

The flow of one request (a router, `kvserve router --prefill ... --decode ...`, drives the two calls):

1. The client's request goes to the prefill instance with max_tokens=1 and kv_transfer_params
   {"do_remote_decode": true}. Its prompt is computed as usual (prefix-cache hits included). When it finishes,
   the scheduler side keeps its full prompt blocks (`request_finished` -> keep) and answers with where to fetch
   them: {"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port", "remote_block_ids",
   "remote_request_id", "remote_ranks": [[host, port] per TP rank], "remote_tp_size"}. The worker side of every
   rank learns of the kept blocks at the next step and holds them under a *lease* (`lease_s`).
2. The same request goes to the decode instance with those params. Its scheduler side asks for the prompt's full
   blocks past its own prefix-cache hits (leaving the last partial block, at least one token, to compute), the
   scheduler allocates them and parks the request in WAITING_FOR_REMOTE_KVS. Each rank's worker side then opens
   the producer rank's side channel (a TCP socket; rank r talks to rank r) and sends one `Pull`: its handshake
   (layout id, block size, TP size, dtype, per-tensor block bytes), the producer's request id, which of its blocks
   it wants (from the first one it lacks) and the block ids to write them into.
3. The producer checks the handshake (a mismatch is refused at once, with a message naming the difference) and the
   lease, then pushes the blocks: over the same socket (transport "tcp": the bytes of each contiguous run of
   blocks, straight from the producer's KV pool into the consumer's with `recv_into`), or with Mooncake's
   TransferEngine (transport "mooncake": one batched write per request, one descriptor per contiguous run of every
   K/V tensor, into the addresses the consumer sent; then a `Done` on the side channel). Contiguous runs are
   merged on both sides. The lease ends when the push is done (or failed: the reader is gone), when the consumer
   releases it (its request ended without reading), or when it expires; the producer's scheduler side then frees
   the blocks (`finished_saving`).
4. The consumer reports the load; the request is scheduled with the loaded tokens computed, computes the rest of
   its last block and decodes. A failed transfer (producer gone, lease expired, timeout) is recomputed
   (`recompute_on_failure`, default true); an incompatible producer, or any failure with the fallback off, ends
   the request with finish reason "abort" and kv_transfer_params {"error": ...}.

The push happens from the producer's side-channel threads, as soon as the consumer asks (which is after the
prefill has finished: the router calls the two instances in turn), so it overlaps both engines' other work but not
the request's own prefill. With n > 1 the decode instance's samples share one transfer: the first loads, the others
wait ("ask again") and then hit the loaded blocks in the prefix cache.

Modules: `options.py` (the config keys), `params.py` (kv_transfer_params both ways), `wire.py` (side-channel
messages, handshake check), `runs.py` (contiguous runs), `leases.py` (the producer's held requests), `regions.py`
(the pool's tensors as addresses, vectored socket I/O), `transport.py` (Mooncake), `producer.py` (the side-channel
server), `consumer.py` (the pulls), `scheduler.py` and `worker.py` (the connector's two halves).
"""
