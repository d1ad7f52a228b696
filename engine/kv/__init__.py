"""The paged KV cache: layout arithmetic, the block pool and manager, the page store, conversion."""
