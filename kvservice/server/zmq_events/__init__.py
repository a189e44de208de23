"""vLLM 0.33.0's KV event stream on ZMQ (``--kv-events-config``), for KV-aware routers.

``config``: vLLM's ``KVEventsConfig`` keys and endpoint grammar; ``wire``: vLLM's
msgpack structs and the core's events turned into them; ``publisher``: the PUB and
replay sockets, fed by the server's event log (``kvservice.server.events``).
"""
