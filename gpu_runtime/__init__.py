"""The co-located GPU runtime: owns the KV tensors, zeroes new blocks, applies
copy-on-write copies and runs paged attention. Built in a later issue; depends on
``kvservice.core`` (block ids, KV cache config), never the reverse."""
