"""Prints the kernel libraries vLLM's CPU platform loads in this process, one per line."""

from vllm.platforms import current_platform

current_platform.import_kernels()
with open("/proc/self/maps") as maps:
    print("\n".join(sorted({line.split()[-1].rsplit("/", 1)[-1] for line in maps if "/vllm/_C" in line})))
