"""KV connectors: moving KV blocks between the engine's pool and places beyond it (RAM, disk, other engines).

`base.py` is the interface (a scheduler side and a worker side, vLLM v1's split), `factory.py` picks a connector by
name, `offload/` is the RAM + disk tier connector. Pure Python except the worker sides, which core/ never imports.
"""
