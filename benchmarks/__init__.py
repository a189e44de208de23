"""Benchmarks: run with `make bench`; they print ratios measured side by side.

Imported before any benchmark module, and so before grpc: gRPC without fork handlers,
as ``kvservice serve`` runs it, so ``bench_audit`` may fork its snapshots
(``kvservice.server.forking``)."""

from kvservice.server.forking import disable_grpc_fork_handlers

disable_grpc_fork_handlers()
