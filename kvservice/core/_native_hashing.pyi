"""Types of the C module ``_native_hashing.c`` (built with the compiled packages)."""

def sha256_pickle_chain(
    parent: bytes, token_ids: list[int], start: int, num_blocks: int, block_size: int, /
) -> list[bytes] | None: ...
