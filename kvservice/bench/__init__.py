"""``kvservice bench`` and ``kvservice demo``: the reference scheduler in-process and
over gRPC (unary, batched ``Step``, ``StepStream``), measured side by side, and a
short guided run against a server with the co-located runtime. Imports nothing
itself: import the module you need."""
