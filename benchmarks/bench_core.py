"""Core allocator throughput, side by side in one run: vLLM 0.33.0's own
``KVCacheManager``, kvservice's core from its sources (``KVSERVICE_PURE_PYTHON=1``) and
the same core compiled by mypyc.

Each engine lives in a worker process of its own (``--worker ENGINE``: the two kvservice
modes cannot share one process, and vLLM's imports stay out of kvservice's). The workers
take turns, never run at once, and every round runs each workload in every engine, the
engines' order rotating from round to round, so all three see the same machine.

A workload is a seeded scheduler-like loop, the same code for every engine: new requests
(building one hashes its prompt), their prefix lookup and admission (``allocate_slots``
with the hit, or ``None``), a decode step of one token per running request
(``allocate_slots(req, 1)``, preempting the newest request when the pool is full),
and ``free`` when a request finishes or is preempted. Each of those manager calls is one
op. Every engine must make the same decisions (the same op mix and prefix-hit tokens):
a difference is printed. Last, the admission-heavy run's requests are built alone
(each hashes its prompt, vLLM's way or kvservice's): what no manager call can save,
and so the ratio to vLLM a manager costing nothing would reach on that workload; and
the blocks they hash, with what ``pickle.dumps`` (vLLM's bytes) and ``sha256`` cost
alone on them: the floor of hashing the Python way, the rest being Python around those
two calls (the compiled build hashes plain blocks in C, below that floor).
Run: ``make bench`` or ``python -m benchmarks.bench_core``.

``--baseline REV`` adds a fourth engine: the core compiled from another revision (its
tree exported with ``git archive`` and built in place, once per commit, under
``build/bench-baseline/``), so that a change to the core is measured against its
parent side by side, round by round (``compiled/baseline``).
``--baseline-tree DIR`` takes a tree already built instead.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import io
import json
import os
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import tracemalloc
import warnings
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvservice.core.block_hashing import NativeChain
    from kvservice.core.kv_cache_interface import KVCacheSpec

BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
ENGINES = ("vllm", "pure", "compiled")
# The compiled core of another revision (--baseline); never a default engine.
BASELINE = "baseline"
# The workload whose requests' cost alone (prompt hashing) is printed apart.
HASH_FLOOR_WORKLOAD = "admission-heavy"
ENGINE_TITLES = {"vllm": "vLLM", "pure": "pure", "compiled": "compiled", BASELINE: BASELINE}
REPO_ROOT = Path(__file__).resolve().parents[1]
# Baseline trees, one per commit, kept for the next comparison (build/ is ignored).
BASELINE_TREES = REPO_ROOT / "build" / "bench-baseline"
BUILT_MARK = ".bench-baseline-built"
BIG_POOL = 1_000_000


@dataclass(frozen=True)
class WorkloadSpec:
    """The shape of a seeded workload (lengths in tokens unless named blocks)."""

    name: str
    num_blocks: int
    max_running: int
    num_prefixes: int  # shared system prompts
    prefix_blocks: tuple[int, int]
    suffix_tokens: tuple[int, int]
    decode_tokens: tuple[int, int]
    # None: every request's suffix is new; N: requests cycle through N prompts, so
    # whole prompts come back (retries, repeated questions: full prefix hits).
    distinct_prompts: int | None = None
    sliding_window: int | None = None  # a second KV cache group with this window


def workloads(big_pool: int = BIG_POOL) -> list[WorkloadSpec]:
    return [
        # Long decodes: most ops are allocate_slots(req, 1) that take no block; the
        # pool is small enough for refused admissions and preemptions.
        WorkloadSpec("decode-heavy", 640, 48, 4, (1, 3), (1, 40), (128, 512)),
        # Long prompts behind shared system prompts, a few tokens each: hashing,
        # lookups and admissions.
        WorkloadSpec("admission-heavy", 10_000, 16, 8, (4, 16), (16, 256), (1, 4)),
        # Full attention and a 128-token sliding window drawing from one pool.
        WorkloadSpec("hybrid", 10_000, 24, 4, (2, 8), (1, 128), (16, 256), sliding_window=128),
        # Short requests, a quarter of the prompts seen before, on a small and a big pool.
        WorkloadSpec("mixed", 10_000, 16, 4, (1, 3), (1, 40), (1, 48), distinct_prompts=4096),
        WorkloadSpec(
            f"mixed {_blocks(big_pool)}",
            big_pool,
            16,
            4,
            (1, 3),
            (1, 40),
            (1, 48),
            distinct_prompts=4096,
        ),
    ]


def _blocks(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k"


# -- the workload, one code path for every engine ---------------------------------------


class SchedRequest(Protocol):
    num_computed_tokens: int
    status: Any

    @property
    def num_tokens(self) -> int: ...

    def append_output_token_ids(self, token_ids: int) -> None: ...


class Engine(Protocol):
    """What the workload needs besides the manager's three calls."""

    running: Any
    finished: Any

    def make_manager(self, spec: WorkloadSpec) -> Any: ...

    def request_factory(self, manager: Any) -> Callable[[str, list[int]], SchedRequest]: ...

    def preempt(self, request: SchedRequest) -> None: ...


class RecordingEngine(Engine, Protocol):
    """An engine whose hashing can be watched (``measure_hashing``)."""

    def recording_factory(
        self, manager: Any, hashed: list[Any]
    ) -> Callable[[str, list[int]], SchedRequest]:
        """``request_factory`` whose hash function also appends what it hashes to
        ``hashed`` (a block: parent hash, token ids, extra keys)."""
        ...


@dataclass
class OpMix:
    """What a run did: manager calls by kind (each is one op), and the prefix-hit tokens
    (which must agree between engines)."""

    adds: int = 0
    lookups: int = 0
    admissions: int = 0
    refused: int = 0
    decodes: int = 0
    frees: int = 0
    preemptions: int = 0
    hit_tokens: int = 0

    @property
    def ops(self) -> int:
        return self.adds + self.lookups + self.admissions + self.refused + self.decodes + self.frees


@dataclass
class Prompts:
    """Seeded prompts and decode lengths, generated before the clock starts: enough for
    ``num_requests`` requests."""

    spec: WorkloadSpec
    seed: int
    num_requests: int
    prompts: list[list[int]] = field(init=False)
    decode_lengths: list[int] = field(init=False)
    tokens: list[int] = field(init=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        spec = self.spec
        # Suffixes are slices of one random stream: distinct, and cheap to make.
        stream = [rng.getrandbits(15) for _ in range(1 << 18)]
        prefixes = [
            stream[i : i + BLOCK_SIZE * rng.randint(*spec.prefix_blocks)]
            for i in range(0, spec.num_prefixes * 4096, 4096)
        ]
        n = min(self.num_requests, spec.distinct_prompts or self.num_requests)
        self.prompts = []
        for _ in range(n):
            start = rng.randrange(len(stream) - spec.suffix_tokens[1])
            suffix = stream[start : start + rng.randint(*spec.suffix_tokens)]
            self.prompts.append(rng.choice(prefixes) + suffix)
        self.decode_lengths = [rng.randint(*spec.decode_tokens) for _ in range(n)]
        self.tokens = stream[-8191:]


def run_workload(
    engine: Engine, spec: WorkloadSpec, num_ops: int, seed: int
) -> tuple[OpMix, float]:
    """About ``num_ops`` manager calls on a fresh manager: what was done, and the CPU
    seconds they took (process time, so that other load on the machine does not count)."""
    manager = engine.make_manager(spec)
    # A request takes four ops at least (add, lookup, admission, free).
    data = Prompts(spec, seed, num_ops // 4 + 1)
    prompts, decode_lengths, tokens = data.prompts, data.decode_lengths, data.tokens
    num_prompts, num_tokens = len(prompts), len(tokens)
    request_ids = [f"r{i}" for i in range(num_ops + spec.max_running)]
    new_request = engine.request_factory(manager)
    lookup, allocate, free = manager.get_computed_blocks, manager.allocate_slots, manager.free
    preempt, running_status, finished_status = engine.preempt, engine.running, engine.finished
    # Requests, and beside each the tokens it still has to decode.
    running: list[SchedRequest] = []
    running_left: list[int] = []
    waiting: list[SchedRequest] = []
    waiting_left: list[int] = []
    # The loop is the part of the measure that is not the manager: plain locals only.
    adds = lookups = admissions = refused = decodes = frees = preemptions = hit_tokens = 0
    next_token = 0
    # As vLLM's engine does after startup, the heap built so far (the pool, and here the
    # workload's prompts) is frozen out of the collector's scans: a collection during
    # the run then costs what the run's own objects cost, in every engine alike.
    gc.collect()
    gc.freeze()
    start = time.process_time()
    while adds + lookups + admissions + refused + decodes + frees < num_ops:
        while len(running) + len(waiting) < spec.max_running:
            i = adds % num_prompts
            waiting.append(new_request(request_ids[adds], prompts[i]))
            waiting_left.append(decode_lengths[i])
            adds += 1
        # Admissions in order, until one does not fit (vLLM's scheduler stops there).
        while waiting:
            request = waiting[0]
            hit, num_hit, _ = lookup(request)
            lookups += 1
            hit_tokens += num_hit
            if allocate(request, request.num_tokens - num_hit, num_hit, hit) is None:
                refused += 1
                break
            admissions += 1
            request.num_computed_tokens = request.num_tokens
            request.status = running_status
            running.append(waiting.pop(0))
            running_left.append(waiting_left.pop(0))
        # One decode token per running request; the newest is preempted for room.
        i = 0
        while i < len(running):
            request = running[i]
            if running_left[i] == 0:
                request.status = finished_status
                free(request)
                frees += 1
                running.pop(i)
                running_left.pop(i)
                continue
            next_token += 1
            request.append_output_token_ids(tokens[next_token % num_tokens])
            decodes += 1
            while allocate(request, 1) is None:
                victim = running.pop()
                waiting.insert(0, victim)
                waiting_left.insert(0, running_left.pop())
                free(victim)
                preempt(victim)
                frees += 1
                preemptions += 1
                if victim is request:
                    break
                decodes += 1
            else:
                request.num_computed_tokens += 1
                running_left[i] -= 1
                i += 1
    seconds = time.process_time() - start
    gc.unfreeze()
    mix = OpMix(adds, lookups, admissions, refused, decodes, frees, preemptions, hit_tokens)
    return mix, seconds


# -- engines ---------------------------------------------------------------------------


class KVServiceEngine:
    """kvservice's core, compiled or from its sources as the worker's environment says.

    Imported here, not at the top: the environment chooses the build at import, and
    the vLLM worker never imports kvservice.core.
    """

    def __init__(self) -> None:
        from kvservice.core import (  # noqa: PLC0415
            COMPILED,
            block_pool,
            kv_cache_interface,
            kv_cache_manager,
            request,
        )

        self.compiled = COMPILED
        self.block_pool_file = block_pool.__file__
        self.interface = kv_cache_interface
        self.manager_cls = kv_cache_manager.KVCacheManager
        self.running = request.RequestStatus.RUNNING
        self.finished = request.RequestStatus.FINISHED

    def make_manager(self, spec: WorkloadSpec) -> Any:
        kvi = self.interface
        shape: dict[str, Any] = {"num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16"}
        specs: list[KVCacheSpec] = [kvi.FullAttentionSpec(block_size=BLOCK_SIZE, **shape)]
        if spec.sliding_window is not None:
            window = spec.sliding_window
            specs.append(
                kvi.SlidingWindowSpec(block_size=BLOCK_SIZE, sliding_window=window, **shape)
            )
        groups = [kvi.KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
        config = kvi.KVCacheConfig(spec.num_blocks, [], groups)
        return self.manager_cls(config, max_model_len=MAX_MODEL_LEN, hash_algo="sha256")

    def request_factory(self, manager: Any) -> Callable[[str, list[int]], SchedRequest]:
        new_request: Callable[[str, list[int]], SchedRequest] = manager.new_request
        return new_request

    def recording_factory(
        self, manager: Any, hashed: list[Any]
    ) -> Callable[[str, list[int]], SchedRequest]:
        hasher = manager.block_hasher
        hasher.hash_fn = _recording(hasher.hash_fn, hashed)
        # A baseline from before the C chain has no attribute for it.
        if getattr(hasher, "native_chain", None) is not None:
            hasher.native_chain = _recording_chain(hasher.native_chain, hashed)
        return self.request_factory(manager)

    def preempt(self, request: Any) -> None:
        request.preempt()


class VLLMEngine:
    """vLLM 0.33.0's ``KVCacheManager`` and ``Request``, hashing with sha256 as it does by
    default."""

    def __init__(self) -> None:
        # Its modules are loaded by name: vLLM is a test dependency, in this worker only.
        vllm = {
            name: importlib.import_module(name)
            for name in (
                "torch",
                "vllm",
                "vllm.sampling_params",
                "vllm.utils.hashing",
                "vllm.v1.core.kv_cache_manager",
                "vllm.v1.core.kv_cache_utils",
                "vllm.v1.kv_cache_interface",
                "vllm.v1.request",
            )
        }
        self.version: str = vllm["vllm"].__version__
        self.bfloat16 = vllm["torch"].bfloat16
        self.interface = vllm["vllm.v1.kv_cache_interface"]
        self.manager_cls = vllm["vllm.v1.core.kv_cache_manager"].KVCacheManager
        utils, sha256 = vllm["vllm.v1.core.kv_cache_utils"], vllm["vllm.utils.hashing"].sha256
        utils.init_none_hash(sha256)
        self.hasher = utils.get_request_block_hasher(BLOCK_SIZE, sha256)
        self.new_hasher = utils.get_request_block_hasher
        self.sha256 = sha256
        self.request_cls = vllm["vllm.v1.request"].Request
        self.sampling_params = vllm["vllm.sampling_params"].SamplingParams(max_tokens=MAX_MODEL_LEN)
        status = vllm["vllm.v1.request"].RequestStatus
        self.running, self.finished, self.preempted = (
            status.RUNNING,
            status.FINISHED_STOPPED,
            status.PREEMPTED,
        )

    def make_manager(self, spec: WorkloadSpec) -> Any:
        vki = self.interface
        shape: dict[str, Any] = {"num_kv_heads": 8, "head_size": 128, "dtype": self.bfloat16}
        specs = [vki.FullAttentionSpec(block_size=BLOCK_SIZE, **shape)]
        if spec.sliding_window is not None:
            window = spec.sliding_window
            specs.append(
                vki.SlidingWindowSpec(block_size=BLOCK_SIZE, sliding_window=window, **shape)
            )
        groups = [vki.KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
        config = vki.KVCacheConfig(spec.num_blocks, [], groups)
        return self.manager_cls(
            config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
        )

    def request_factory(
        self, manager: Any, hasher: Any = None
    ) -> Callable[[str, list[int]], SchedRequest]:
        request_cls, params = self.request_cls, self.sampling_params
        hasher = self.hasher if hasher is None else hasher

        def new_request(request_id: str, prompt: list[int]) -> SchedRequest:
            request: SchedRequest = request_cls(
                request_id, prompt, params, None, block_hasher=hasher
            )
            return request

        return new_request

    def recording_factory(
        self, manager: Any, hashed: list[Any]
    ) -> Callable[[str, list[int]], SchedRequest]:
        hasher = self.new_hasher(BLOCK_SIZE, _recording(self.sha256, hashed))
        return self.request_factory(manager, hasher)

    def preempt(self, request: Any) -> None:
        # What vLLM's scheduler does to a request it preempts, after freeing it.
        request.status = self.preempted
        request.num_computed_tokens = 0
        request.num_preemptions += 1


# -- the worker process ----------------------------------------------------------------


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure_build(engine: Engine, spec: WorkloadSpec) -> dict[str, float]:
    """CPU seconds to build a manager of ``spec``'s pool, the resident memory it adds,
    and the memory Python traces for it (a second build, traced)."""
    gc.collect()
    rss_before = _rss_mib()
    start = time.process_time()
    manager = engine.make_manager(spec)
    seconds = time.process_time() - start
    rss_added = _rss_mib() - rss_before
    del manager
    gc.collect()
    tracemalloc.start()
    manager = engine.make_manager(spec)
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del manager
    gc.collect()
    return {"seconds": seconds, "rss_mib": rss_added, "traced_mib": traced / 2**20}


def measure_requests(engine: Engine, spec: WorkloadSpec, count: int, seed: int) -> float:
    """CPU seconds to build the first ``count`` requests of ``spec``'s run alone (their
    prompts hashed, as building one does), best of three: the part of a run no manager
    call can save."""
    best = float("inf")
    for _ in range(3):
        manager = engine.make_manager(spec)
        prompts = Prompts(spec, seed, count).prompts
        new_request = engine.request_factory(manager)
        gc.collect()
        gc.freeze()
        start = time.process_time()
        _build_requests(new_request, prompts, count)
        best = min(best, time.process_time() - start)
        gc.unfreeze()
    return best


def _build_requests(
    new_request: Callable[[str, list[int]], SchedRequest], prompts: list[list[int]], count: int
) -> None:
    """The first ``count`` requests of a run, as ``run_workload`` names and builds them."""
    for i in range(count):
        new_request(f"r{i}", prompts[i % len(prompts)])


def _recording(hash_fn: Callable[[Any], bytes], hashed: list[Any]) -> Callable[[Any], bytes]:
    def recording(block: Any) -> bytes:
        hashed.append(block)
        return hash_fn(block)

    return recording


def _recording_chain(chain: NativeChain, hashed: list[Any]) -> NativeChain:
    """``chain`` (the C chain of the compiled build) appending the blocks it hashed, as
    ``_recording`` does for one block."""

    def recording(
        parent: bytes, tokens: MutableSequence[int], start: int, num_blocks: int, block_size: int
    ) -> list[bytes] | None:
        hashes = chain(parent, tokens, start, num_blocks, block_size)
        if hashes is not None:
            for i, block_parent in enumerate([parent, *hashes[:-1]]):
                first = start + i * block_size
                hashed.append((block_parent, tuple(tokens[first : first + block_size]), None))
        return hashes

    return recording


def measure_hashing(
    engine: RecordingEngine, spec: WorkloadSpec, count: int, seed: int
) -> dict[str, Any]:
    """The blocks building the first ``count`` requests of ``spec``'s run hashes (as
    ``measure_requests`` builds them), and the CPU seconds of their two C calls alone,
    best of three: ``pickle.dumps`` of each (the bytes vLLM hashes) and ``sha256`` of
    those bytes. Everything else building a request does is Python around them."""
    manager = engine.make_manager(spec)
    hashed: list[Any] = []
    _build_requests(
        engine.recording_factory(manager, hashed), Prompts(spec, seed, count).prompts, count
    )
    best_pickle = best_sha256 = float("inf")
    for _ in range(3):
        start = time.process_time()
        data = [pickle.dumps(block, protocol=pickle.HIGHEST_PROTOCOL) for block in hashed]
        best_pickle = min(best_pickle, time.process_time() - start)
        start = time.process_time()
        for item in data:
            hashlib.sha256(item).digest()
        best_sha256 = min(best_sha256, time.process_time() - start)
    return {"blocks": len(hashed), "pickle": best_pickle, "sha256": best_sha256}


def spec_from_json(fields: dict[str, Any]) -> WorkloadSpec:
    pairs = ("prefix_blocks", "suffix_tokens", "decode_tokens")
    return WorkloadSpec(**{**fields, **{k: tuple(fields[k]) for k in pairs}})


def worker(engine_name: str) -> int:
    """Answer the parent's commands, one JSON line in, one out, until stdin closes."""
    # Replies own the real stdout; anything a library prints goes to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    engine: RecordingEngine
    info: dict[str, Any] = {"engine": engine_name}
    if engine_name == "vllm":
        warnings.simplefilter("ignore")  # its optional-dependency warnings
        vllm_engine = VLLMEngine()
        info["version"] = vllm_engine.version
        engine = vllm_engine
    else:
        kvservice_engine = KVServiceEngine()
        if kvservice_engine.compiled is (engine_name == "pure"):
            raise SystemExit(f"worker {engine_name}: kvservice.core.COMPILED is wrong")
        info["block_pool"] = kvservice_engine.block_pool_file
        engine = kvservice_engine
    replies.write(json.dumps(info) + "\n")
    replies.flush()
    for line in sys.stdin:
        command = json.loads(line)
        spec = spec_from_json(command["workload"])
        if command["cmd"] == "build":
            reply: dict[str, Any] = measure_build(engine, spec)
        elif command["cmd"] == "requests":
            reply = {"seconds": measure_requests(engine, spec, command["count"], command["seed"])}
        elif command["cmd"] == "hashing":
            reply = measure_hashing(engine, spec, command["count"], command["seed"])
        else:
            mix, seconds = run_workload(engine, spec, command["ops"], command["seed"])
            reply = {"mix": asdict(mix), "ops": mix.ops, "seconds": seconds}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


def baseline_tree(rev: str) -> Path:
    """A kvservice tree of ``rev`` with its core compiled in place: exported with
    ``git archive`` and built with ``setup.py build_ext --inplace`` the first time,
    kept under ``build/bench-baseline/<commit>`` for the next comparison."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    tree = BASELINE_TREES / commit
    if (tree / BUILT_MARK).exists():
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(_git("archive", "--format=tar", commit))) as tar:
        tar.extractall(tree, filter="data")
    print(f"bench_core: compiling the core of {rev} ({commit[:12]}) in {tree}", flush=True)
    build = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    if build.returncode != 0:
        raise SystemExit(f"compiling the core of {rev} failed:\n{build.stderr[-3000:]}")
    (tree / BUILT_MARK).write_text(f"{rev}\n")
    return tree


def _git(*args: str) -> bytes:
    done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.decode().strip()}")
    return done.stdout


class Worker:
    """One engine's worker process. The baseline's worker imports kvservice from its own
    tree (first on ``PYTHONPATH``; ``-P`` keeps this repo off ``sys.path``) and runs
    this file's workload code, so both kvservice engines run the same loop."""

    def __init__(self, engine: str, baseline: Path | None = None) -> None:
        env = dict(os.environ)
        command = [sys.executable, "-m", "benchmarks.bench_core", "--worker", engine]
        cwd = REPO_ROOT
        if engine != "vllm":
            env["KVSERVICE_PURE_PYTHON"] = "1" if engine == "pure" else "0"
        if engine == BASELINE:
            assert baseline is not None
            env["PYTHONPATH"] = str(baseline)
            command = [sys.executable, "-P", __file__, "--worker", engine]
            cwd = baseline
        self.engine = engine
        self.process = subprocess.Popen(
            command,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.info = self._read()
        if engine == BASELINE and not Path(self.info["block_pool"]).is_relative_to(cwd):
            raise SystemExit(
                f"the baseline worker imported {self.info['block_pool']}, not the core of {cwd}"
            )

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.engine} worker exited ({self.process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


# -- the parent: rounds, table ---------------------------------------------------------


@dataclass
class Cell:
    """One (workload, engine): its best ops/s over the rounds, each round's ops/s."""

    per_round: list[float] = field(default_factory=list)
    mix: dict[str, int] = field(default_factory=dict)

    @property
    def best(self) -> float:
        return max(self.per_round)


def _ratio_range(a: Cell, b: Cell) -> str:
    ratios = [x / y for x, y in zip(a.per_round, b.per_round, strict=True)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=60_000, help="manager calls per run")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each engine's best")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--big-pool", type=int, default=BIG_POOL, help="the big pool's blocks")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also run the core compiled from this git revision (built once per commit)",
    )
    parser.add_argument(
        "--baseline-tree",
        metavar="DIR",
        type=Path,
        help="also run the compiled core of this kvservice tree (built in place already)",
    )
    parser.add_argument("--worker", choices=(*ENGINES, BASELINE), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    engines = args.engines.split(",")
    baseline: Path | None = args.baseline_tree.resolve() if args.baseline_tree else None
    if args.baseline is not None:
        baseline = baseline_tree(args.baseline)
    if baseline is not None:
        engines.append(BASELINE)
    specs = workloads(args.big_pool)
    print(
        f"bench_core: {args.ops} manager calls per run, seed {args.seed}, block size "
        f"{BLOCK_SIZE}, sha256 prefix hashing; {args.rounds} rounds, engines in turn (order "
        "rotating), one worker process each; ops/s: per CPU second of the worker, best round; "
        "ratios per round: lowest-highest"
    )
    workers = {name: Worker(name, baseline) for name in engines}
    try:
        for w in workers.values():
            print(
                f"  {w.engine:>8}: "
                + ", ".join(f"{k} {v}" for k, v in w.info.items() if k != "engine")
            )
        builds = {
            name: w.ask({"cmd": "build", "workload": asdict(specs[-1])})
            for name, w in workers.items()
        }
        cells = {(s.name, e): Cell() for s in specs for e in engines}
        seconds: dict[tuple[str, str], float] = {}
        for r in range(args.rounds):
            order = engines[r % len(engines) :] + engines[: r % len(engines)]
            for spec in specs:
                for name in order:
                    answer = workers[name].ask(
                        {
                            "cmd": "run",
                            "workload": asdict(spec),
                            "ops": args.ops,
                            "seed": args.seed,
                        }
                    )
                    cell = cells[(spec.name, name)]
                    cell.per_round.append(answer["ops"] / answer["seconds"])
                    cell.mix = answer["mix"]
                    key = (spec.name, name)
                    seconds[key] = min(seconds.get(key, answer["seconds"]), answer["seconds"])
        floor_spec = next(s for s in specs if s.name == HASH_FLOOR_WORKLOAD)
        adds = cells[(floor_spec.name, engines[0])].mix["adds"]

        def ask_each(cmd: str) -> dict[str, dict[str, Any]]:
            """``cmd`` on the admission-heavy run's first requests, in every worker."""
            command = {"cmd": cmd, "workload": asdict(floor_spec), "count": adds, "seed": args.seed}
            return {name: w.ask(command) for name, w in workers.items()}

        requests_s = {name: reply["seconds"] for name, reply in ask_each("requests").items()}
        hashing = ask_each("hashing")
    finally:
        for w in workers.values():
            w.close()
    print_table(specs, engines, cells)
    print_scaling(specs, engines, cells)
    print_builds(specs[-1].num_blocks, engines, builds)
    print_request_floor(engines, seconds, requests_s, adds)
    print_hashing_floor(engines, requests_s, hashing)
    return 0


def print_request_floor(
    engines: list[str],
    seconds: dict[tuple[str, str], float],
    requests_s: dict[str, float],
    adds: int,
) -> None:
    """What building the admission-heavy run's requests (hashing their prompts) costs
    alone, next to the whole run, and the ratio to vLLM a manager costing nothing
    beside it would reach."""
    parts = []
    for name in engines:
        run_s = seconds[(HASH_FLOOR_WORKLOAD, name)]
        share = requests_s[name] / run_s
        parts.append(f"{ENGINE_TITLES[name]} {requests_s[name]:.3f} of {run_s:.3f} s ({share:.0%})")
    line = (
        f"{HASH_FLOOR_WORKLOAD}: its {adds} requests built alone (prompts hashed), best "
        f"round against the best run: " + ", ".join(parts)
    )
    if "vllm" in engines:
        vllm_s = seconds[(HASH_FLOOR_WORKLOAD, "vllm")]
        floors = [
            f"{ENGINE_TITLES[name]} {vllm_s / requests_s[name]:.1f}x"
            for name in engines
            if name != "vllm"
        ]
        line += "; a manager costing nothing beside them would reach " + ", ".join(floors)
    print(line)


def print_hashing_floor(
    engines: list[str], requests_s: dict[str, float], hashing: dict[str, dict[str, Any]]
) -> None:
    """Of building those requests, what the hash function and the serialization of
    its input cost alone: the floor of hashing them, vLLM's bytes being fixed."""
    parts = []
    for name in engines:
        done = hashing[name]
        c_calls = done["pickle"] + done["sha256"]
        parts.append(
            f"{ENGINE_TITLES[name]} {done['blocks']} blocks, pickle {done['pickle']:.3f} s "
            f"+ sha256 {done['sha256']:.3f} s = {c_calls / requests_s[name]:.0%} of its "
            f"{requests_s[name]:.3f} s"
        )
    print(
        f"{HASH_FLOOR_WORKLOAD}: the blocks those requests hash (kvservice's sources remember "
        "blocks they hashed: same parent, tokens and keys; the compiled build's C chain "
        "hashes every block, without either call), and the two C calls of each alone, "
        "best round: " + "; ".join(parts)
    )


def print_table(
    specs: list[WorkloadSpec], engines: list[str], cells: dict[tuple[str, str], Cell]
) -> None:
    head = f"{'workload':<16} {'blocks':>9}" + "".join(
        f" {ENGINE_TITLES[e] + ' ops/s':>14}" for e in engines
    )
    pairs = [
        (a, b)
        for a, b in (
            ("pure", "vllm"),
            ("compiled", "vllm"),
            ("compiled", "pure"),
            (BASELINE, "vllm"),
            ("compiled", BASELINE),
        )
        if a in engines and b in engines
    ]
    head += "".join(
        f" {ENGINE_TITLES[a] + '/' + ENGINE_TITLES[b]:>15} {'per round':>10}" for a, b in pairs
    )
    print(head)
    medians: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
    for spec in specs:
        row = f"{spec.name:<16} {spec.num_blocks:>9}"
        row += "".join(f" {cells[(spec.name, e)].best:>14.0f}" for e in engines)
        for a, b in pairs:
            ca, cb = cells[(spec.name, a)], cells[(spec.name, b)]
            medians[(a, b)].append(ca.best / cb.best)
            row += f" {ca.best / cb.best:>15.2f} {_ratio_range(ca, cb):>10}"
        print(row)
    row = f"{'median':<16} {'':>9}" + "".join(f" {'':>14}" for _ in engines)
    row += "".join(f" {statistics.median(medians[p]):>15.2f} {'':>10}" for p in pairs)
    print(row)
    for spec in specs:
        mixes = {e: cells[(spec.name, e)].mix for e in engines}
        first = mixes[engines[0]]
        if any(m != first for m in mixes.values()):
            print(
                f"DECISIONS DIFFER in {spec.name}: "
                + "; ".join(f"{e} {m}" for e, m in mixes.items())
            )
        else:
            print(
                f"  {spec.name}: "
                + ", ".join(f"{k} {v}" for k, v in first.items())
                + " (every engine)"
            )


def print_scaling(
    specs: list[WorkloadSpec], engines: list[str], cells: dict[tuple[str, str], Cell]
) -> None:
    small, big = specs[-2], specs[-1]
    print(
        f"cost per op on {big.num_blocks} blocks relative to {small.num_blocks} (same workload; "
        "the small pool also evicts; target for compiled: at most +10%): "
        + ", ".join(
            f"{ENGINE_TITLES[e]} {cells[(small.name, e)].best / cells[(big.name, e)].best - 1:+.1%}"
            for e in engines
        )
    )


def print_builds(num_blocks: int, engines: list[str], builds: dict[str, dict[str, float]]) -> None:
    print(
        f"building a {num_blocks}-block pool (target: under 0.5 s and 150 MB): "
        + "; ".join(
            f"{ENGINE_TITLES[e]} {b['seconds']:.3f} CPU s, +{b['rss_mib']:.0f} MiB resident, "
            f"{b['traced_mib']:.0f} MiB traced"
            for e, b in builds.items()
        )
    )


if __name__ == "__main__":
    sys.exit(main())
