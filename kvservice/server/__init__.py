"""The gRPC service (``kvservice serve``): ``app`` assembles and runs it, ``config``
and ``settings`` say what it serves.

Imports nothing itself, so importing a module of the package loads only what that
module needs.
"""
