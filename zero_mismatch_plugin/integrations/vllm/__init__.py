"""vLLM: the general plugin and its CPU fixes, all runtime patches gated on the pinned release."""
