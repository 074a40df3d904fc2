"""LoRA in the op layer: a frozen base plus a trainable PEFT adapter, with vLLM's LoRA arithmetic.

``names`` (targets, PEFT's tensor names), ``peft`` (adapter config, refusals, files, engine
arguments), ``targets`` (A/B pairs and shapes), ``fused_experts`` (3-D expert adapters),
``adapter`` (the trainable adapter), ``ops`` and ``vocab_ops`` (vLLM's LoRA layers as trainer ops).
See ``docs/lora.md``.
"""
