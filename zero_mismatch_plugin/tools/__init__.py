"""The user's tools: the CLI, the mismatch checker, reports, the demo, config checks and recipes."""
