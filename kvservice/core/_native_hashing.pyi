"""Types of the C module ``_native_hashing.c`` (built with the compiled packages)."""

from collections.abc import MutableSequence

def sha256_pickle_chain(
    parent: bytes,
    token_ids: MutableSequence[int],
    start: int,
    num_blocks: int,
    block_size: int,
    /,
) -> list[bytes] | None: ...

# The same arguments and answers, with cbor2's bytes for pickle's.
sha256_cbor_chain = sha256_pickle_chain
