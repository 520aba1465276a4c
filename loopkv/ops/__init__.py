"""loopkv ops: the codec and the cell ops, each with its pure-PyTorch reference (also the CPU kernel)."""
