"""The gRPC service (``kvservice serve``): ``app`` assembles and runs it, ``config``
and ``settings`` say what it serves.

What runs once per operation of a ``Step`` is compiled by mypyc with the core and the
request table, as one build (``kvservice.core.compiled``): ``step`` (decoding a Step,
the columnar batches), ``operations`` (the operations table), ``converters`` (the
protobuf conversions) and ``slice_clock`` (whether a slice of a Step's work is done,
asked once per entry). Imported compiled unless ``KVSERVICE_PURE_PYTHON=1``, and refused
when the build does not match the sources. Importing the package loads nothing else,
so importing a module of it loads only what that module needs.
"""

from kvservice.core.compiled import activate

# The modules mypyc leaves as sources (``kvservice.core.compiled`` reads this line; this
# file always stays one): everything that runs once per call, connection or process
# rather than once per operation (the servicer and its interceptors, sessions, the
# app, metrics, events, configuration), where compiling would add build time and
# constraints (mypyc's native classes, async generators) for no measured gain. ``turns``
# stays a source so that tests can hold a Step at a pause (``Slices.pause``).
NOT_COMPILED = (
    "app.py",
    "audit.py",
    "auth.py",
    "background.py",
    "binding.py",
    "caller.py",
    "config.py",
    "drain.py",
    "errors.py",
    "event_loop.py",
    "events.py",
    "forking.py",
    "idempotency.py",
    "interceptors.py",
    "log.py",
    "loop_watch.py",
    "metrics.py",
    "offload_tiers.py",
    "probes.py",
    "runtime.py",
    "servicer.py",
    "sessions.py",
    "settings.py",
    "step_socket.py",
    "tls.py",
    "turns.py",
)

COMPILED: bool = activate("server", __path__)
"""Whether this process runs the compiled Step path (False: the sources)."""
