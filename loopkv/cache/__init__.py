"""LoopKVCache: the paged bit-plane cache, its storage and the attention/mask functions."""
