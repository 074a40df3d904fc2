"""The checkpoint architectures the aligned trainer forward supports (both faces: the
aligned model and the Megatron spec). Light on purpose: the CLI and the config checks read
it without importing torch, vLLM or megatron-core."""

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
