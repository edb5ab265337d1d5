"""Masked attention over SGLang's KV pool, shared by the CPU attention backend and the draft runner
(any device)."""
