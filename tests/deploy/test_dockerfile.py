"""The Dockerfile, read (no Docker engine here to build it): multi-stage, a CPU base by
default that a CUDA base can replace, non-root, and an entrypoint that is `kvservice serve`
with flags the CLI has and the chart uses."""

from __future__ import annotations

import json
import re

from kvservice.cli import build_parser
from tests.deploy.support import ROOT
from tests.deploy.test_helm_chart import container, render, serve_flags

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    result = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def test_multi_stage_with_a_cpu_default_base() -> None:
    steps = instructions()
    assert steps[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    stages = [rest for keyword, rest in steps if keyword == "FROM"]
    assert stages == ["${BASE_IMAGE} AS base", "base AS build", "base AS runtime"]
    assert ("COPY", "--from=build /opt/kvservice /opt/kvservice") in steps


def test_runs_as_the_charts_non_root_user() -> None:
    steps = instructions()
    runtime = steps[[rest for _, rest in steps].index("base AS runtime") :]
    (user,) = [rest for keyword, rest in runtime if keyword == "USER"]
    uid, gid = (int(x) for x in user.split(":"))
    deployment = next(d for d in render({}) if d["kind"] == "Deployment")
    context = deployment["spec"]["template"]["spec"]["securityContext"]
    assert uid != 0 and (uid, gid) == (context["runAsUser"], context["runAsGroup"])


def test_installs_the_project_from_the_repo() -> None:
    """Only the repository's own files go in: pyproject.toml, setup.py (which compiles
    the core) and the packages they name; never a local build of the core."""
    copies = [
        rest for keyword, rest in instructions() if keyword == "COPY" and "--from" not in rest
    ]
    assert copies == [
        "pyproject.toml setup.py README.md ./",
        "kvservice/ kvservice/",
        "gpu_runtime/ gpu_runtime/",
    ]
    assert any(
        "pip install" in rest and '"."' not in rest and "." in rest
        for k, rest in instructions()
        if k == "RUN"
    )
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".tools", ".git", "tests"} <= ignored
    assert not {"pyproject.toml", "setup.py", "README.md", "kvservice", "gpu_runtime"} & ignored
    assert "kvservice/_compiled" in ignored


def test_entrypoint_is_kvservice_serve_with_the_charts_flags() -> None:
    steps = dict((k, v) for k, v in instructions() if k in {"ENTRYPOINT", "CMD", "EXPOSE"})
    assert json.loads(steps["ENTRYPOINT"]) == ["kvservice", "serve"]
    cmd: list[str] = json.loads(steps["CMD"])
    flags = serve_flags()
    assert all(arg.split("=", 1)[0] in flags for arg in cmd)
    build_parser().parse_args(["serve", *cmd])
    # The chart's args replace CMD; they must start with the same bind flags and ports.
    assert container(render({}))["args"][: len(cmd)] == cmd
    assert steps["EXPOSE"].split() == ["50051", "9400"]
