"""The gRPC service around the core allocator (``kvservice serve``).

``kvservice.core`` never imports grpc; everything network-facing lives here.
"""

from kvservice.server.app import KVCacheServer, ServerHandle, serve, serve_in_background
from kvservice.server.config import ServerConfig

__all__ = ["KVCacheServer", "ServerConfig", "ServerHandle", "serve", "serve_in_background"]
