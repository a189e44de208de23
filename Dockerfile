# syntax=docker/dockerfile:1
# kvservice: vLLM's KV-cache block manager as a gRPC service.
#
#   docker build -t kvservice:0.1.0 .                      # CPU image (python:3.11-slim)
#   docker build -t kvservice:0.1.0-cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg EXTRAS=runtime .                          # CUDA base, with torch (gpu_runtime)
#
# Any Debian/Ubuntu base works: one without python3 gets it (>= 3.11 needed) from apt.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -c 'import sys; assert sys.version_info >= (3, 11), sys.version'

# Build: a virtual environment with the project and its pinned dependencies.
FROM base AS build
# Installing compiles kvservice/core with mypyc (setup.py): a C compiler, and Python's
# headers where the base lacks them (python:*-slim has them, an apt python3 needs -dev).
# Its C block hasher (kvservice/core/_native_hashing.c) links OpenSSL's libcrypto: the
# headers here; the library itself comes with the base's Python (its ssl module needs it).
RUN if python3 -c 'import os, sys, sysconfig as s; sys.exit(not os.path.exists(s.get_paths()["include"] + "/Python.h"))'; \
    then headers=""; else headers=python3-dev; fi; \
    apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libssl-dev $headers \
    && rm -rf /var/lib/apt/lists/*
# Optional extras from pyproject.toml, e.g. EXTRAS=runtime for torch.
ARG EXTRAS=""
RUN python3 -m venv /opt/kvservice
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvservice/ kvservice/
COPY gpu_runtime/ gpu_runtime/
RUN /opt/kvservice/bin/pip install --no-compile ".${EXTRAS:+[${EXTRAS}]}"

# Runtime: the environment only, run as an unprivileged user.
FROM base AS runtime
RUN groupadd --system --gid 10001 kvservice \
    && useradd --system --uid 10001 --gid kvservice --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin kvservice
COPY --from=build /opt/kvservice /opt/kvservice
ENV PATH=/opt/kvservice/bin:$PATH
USER 10001:10001
# gRPC (with grpc.health.v1 for probes) and Prometheus /metrics.
EXPOSE 50051 9400
ENTRYPOINT ["kvservice", "serve"]
# Bind all interfaces in a container (the service defaults to loopback); plaintext and
# without tokens, which off loopback needs --allow-insecure-bind (see the README's
# Security section to add TLS and tokens). The Helm chart replaces these with the same
# flags plus its ConfigMap's settings.
CMD ["--host=0.0.0.0", "--port=50051", "--metrics-host=0.0.0.0", "--metrics-port=9400", \
     "--allow-insecure-bind"]
