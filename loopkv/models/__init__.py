"""Looped models: loopkv's clean-room Ouro and the small model loopkv ships."""
