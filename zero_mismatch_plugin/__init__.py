"""zero_mismatch_plugin: REINFORCE Zero and FlashREINFORCE for verl, and a trainer forward
that computes, bit for bit, the logprob vLLM recorded when it sampled.

Importing this package is cheap on purpose: verl imports the entry point in every process.
"""

__version__ = "0.1.0"
