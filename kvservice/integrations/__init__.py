"""Adapters that let other serving engines allocate their KV cache through kvservice."""
