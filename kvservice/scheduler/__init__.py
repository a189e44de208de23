"""The reference scheduler: vLLM's scheduling loop (``loop``) over a ``Backend``
(``backend``: the protocol and the in-process and unary remote backends; ``batched``:
``Step`` and ``StepStream``), and run traces that replay its allocator calls
(``trace``). Imports nothing itself: import the module you need."""
