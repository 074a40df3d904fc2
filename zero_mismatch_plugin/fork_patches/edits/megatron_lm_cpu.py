"""The edits of the Megatron-LM fork patch that lets megatron-core train on a CPU-only torch: the
fork form of the runtime patches in ``integrations/megatron/cpu_patches.py`` ("megatron-core on a
CPU" in ``zmrl patches list``).

Where the runtime form gives a module a ``torch`` whose ``"cuda"`` is the host, the fork names the
device through two helpers that ``megatron/core/utils.py`` exports (``current_device``,
``synchronize_device``, defined in ``_rank_utils.py``: the plugin's own functions, inserted verbatim);
with CUDA both are what the lines said before.
"""

from __future__ import annotations

from zero_mismatch_plugin.fork_patches.edits.edit import Edit, functions_before
from zero_mismatch_plugin.integrations.megatron.cpu_patches import (
    current_device,
    host_split_sizes,
    packed_as_one_row,
    packed_causal_mask,
    synchronize_device,
)

CORE = "megatron/core/"
UTILS = CORE + "utils.py"
RANK_UTILS = CORE + "_rank_utils.py"
SCHEDULES = CORE + "pipeline_parallel/schedules.py"
P2P = CORE + "pipeline_parallel/p2p_communication.py"
OPTIMIZER = CORE + "optimizer/optimizer.py"
CLIP_GRADS = CORE + "optimizer/clip_grads.py"
MAPPINGS = CORE + "tensor_parallel/mappings.py"
RANDOM = CORE + "tensor_parallel/random.py"
GRAD_BUFFER = CORE + "distributed/param_and_grad_buffer.py"
ROTARY = CORE + "models/common/embeddings/rotary_pos_embedding.py"
LANGUAGE_MODULE = CORE + "models/common/language_module/language_module.py"
DISPATCHER = CORE + "transformer/moe/token_dispatcher.py"
ROUTER = CORE + "transformer/moe/router.py"
MOE_UTILS = CORE + "transformer/moe/moe_utils.py"
ATTENTION = CORE + "transformer/dot_product_attention.py"
CHECKPOINT = CORE + "dist_checkpointing/strategies/"


def _importing_helpers(path: str, after: str, *helpers: str) -> Edit:
    """``path`` imports the device ``helpers`` it uses right after its line ``after``."""
    return Edit(path, old=after, new=after + f"from megatron.core.utils import {', '.join(helpers)}\n")


def _devices(path: str, count: int, old: str = "torch.cuda.current_device()") -> Edit:
    """Every ``old`` device of ``path`` (there are ``count``: ``torch.cuda.current_device()`` or a
    ``device="cuda"`` argument) becomes the helper's."""
    return Edit(path, old=old, new="device=current_device()" if old.startswith("device=") else "current_device()",
                count=count)


def _synchronizations(path: str, count: int) -> Edit:
    return Edit(path, old="torch.cuda.synchronize()", new="synchronize_device()", count=count)


MEGATRON_CPU_TRAINING = [
    # megatron/core/utils.py: the buffers and norms it allocates itself.
    Edit(UTILS, old="""\
                    device=torch.cuda.current_device(),
                    requires_grad=False,
""", new="""\
                    device=current_device(),
                    requires_grad=False,
"""),
    Edit(UTILS, old='l2_cuda = torch.tensor([float(l2_reduced)], dtype=torch.float, device="cuda")',
         new="l2_cuda = torch.tensor([float(l2_reduced)], dtype=torch.float, device=current_device())"),
    # Defined with the low-level helpers megatron.core.utils re-exports (the checkpoint modules
    # that use them are imported while megatron.core.utils itself is).
    functions_before(RANK_UTILS, "def safe_get_rank() -> int:\n", current_device, synchronize_device),
    Edit(UTILS, old="from megatron.core._rank_utils import log_single_rank\n",
         new="from megatron.core._rank_utils import current_device, log_single_rank, synchronize_device\n"),
    # Tensors allocated on "cuda" by name: the token count of the schedules, the pipeline's shapes
    # and received activations, the optimizers' scales and flags, the norm of gradient clipping,
    # the tensor-parallel gathers, the router's weight and counters, DDP's buffers, the rotary
    # frequencies, the checkpoint's flags.
    _importing_helpers(SCHEDULES, "from megatron.core import parallel_state\n", "current_device"),
    _devices(SCHEDULES, 3, old='device="cuda"'),
    _importing_helpers(P2P, "from megatron.core.utils import nvtx_decorator\n", "current_device", "synchronize_device"),
    _devices(P2P, 6),
    _synchronizations(P2P, 2),
    _importing_helpers(OPTIMIZER, "from ..utils import log_single_rank\n", "current_device"),
    _devices(OPTIMIZER, 4, old="device='cuda'"),
    _devices(OPTIMIZER, 1),
    _importing_helpers(CLIP_GRADS, "from ..utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor\n",
                       "current_device"),
    _devices(CLIP_GRADS, 5, old="device='cuda'"),
    _importing_helpers(MAPPINGS, "from megatron.core.utils import get_tensor_model_parallel_group_if_none, "
                                 "is_torch_min_version\n", "current_device"),
    _devices(MAPPINGS, 5),
    _importing_helpers(ROUTER, "from megatron.core.jit import jit_fuser\n", "current_device"),
    _devices(ROUTER, 6),
    _importing_helpers(GRAD_BUFFER, "from megatron.core.utils import log_single_rank\n", "current_device"),
    _devices(GRAD_BUFFER, 1, old='device="cuda"'),
    _devices(GRAD_BUFFER, 3),
    _importing_helpers(ROTARY, "from megatron.core.utils import deprecate_inference_params, internal_api\n",
                       "current_device"),
    _devices(ROTARY, 3),
    _importing_helpers(CHECKPOINT + "filesystem_async.py", "from torch.distributed.checkpoint import FileSystemWriter\n",
                       "synchronize_device"),
    _synchronizations(CHECKPOINT + "filesystem_async.py", 1),
    _importing_helpers(CHECKPOINT + "fully_parallel.py", "from megatron.core.utils import get_pg_rank, get_pg_size\n",
                       "synchronize_device"),
    _synchronizations(CHECKPOINT + "fully_parallel.py", 2),
    _importing_helpers(CHECKPOINT + "state_dict_saver.py", "from torch.distributed.checkpoint import CheckpointException\n",
                       "current_device"),
    _devices(CHECKPOINT + "state_dict_saver.py", 1, old="device='cuda'"),
    _devices(CHECKPOINT + "state_dict_saver.py", 1),
    _importing_helpers(CHECKPOINT + "async_utils.py", "from megatron.core.utils import log_single_rank\n",
                       "current_device", "synchronize_device"),
    _devices(CHECKPOINT + "async_utils.py", 2),
    _synchronizations(CHECKPOINT + "async_utils.py", 1),
    # The checks by CUDA type name: a host parameter is 'torch.FloatTensor', not
    # 'torch.cuda.FloatTensor'. Without CUDA the dtype is checked; with it, the type name as before.
    Edit(OPTIMIZER,
         old="if param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:",
         new="if param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'] or (\n"
             "                            not torch.cuda.is_available() and param.dtype in (torch.float16, torch.bfloat16)\n"
             "                        ):"),
    Edit(OPTIMIZER,
         old="elif param.type() == 'torch.cuda.FloatTensor':",
         new="elif param.type() == 'torch.cuda.FloatTensor' or (\n"
             "                            not torch.cuda.is_available() and param.dtype == torch.float32\n"
             "                        ):"),
    Edit(CLIP_GRADS,
         old="assert param.grad.type() == 'torch.cuda.FloatTensor'",
         new="assert param.grad.type() == 'torch.cuda.FloatTensor' or (\n"
             "                    not torch.cuda.is_available() and param.grad.dtype == torch.float32\n"
             "                )"),
    # The named RNG states are the host generator's on a CPU: it is what dropout and
    # initialization draw from there.
    Edit(RANDOM, old='''\
    # if not using cuda graphs, just use the builtin pytorch function
    if not graph_safe:
''', new='''\
    if not torch.cuda.is_available():
        return torch.get_rng_state()
    # if not using cuda graphs, just use the builtin pytorch function
    if not graph_safe:
'''),
    Edit(RANDOM, old='''\
    with a single change: the input state is not cloned. Cloning caused
    major performance issues for +4 GPU cases.
    """
''', new='''\
    with a single change: the input state is not cloned. Cloning caused
    major performance issues for +4 GPU cases.
    """
    if not torch.cuda.is_available():
        torch.set_rng_state(new_state)
        return
'''),
    Edit(RANDOM, old='''\
            # Get the current rng state.
            orig_rng_state = torch.cuda.get_rng_state()
            # Set the new state and store it.
            torch.cuda.manual_seed(seed)
            self.states_[name] = torch.cuda.get_rng_state()
''', new='''\
            # Get the current rng state.
            orig_rng_state = _get_cuda_rng_state()
            # Set the new state and store it.
            if torch.cuda.is_available():
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self.states_[name] = _get_cuda_rng_state()
'''),
    Edit(RANDOM, old='''\
            if not torch.all(cpu_rng_state == torch.get_rng_state()).item():
''', new='''\
            # (On a CPU the forked state is the host's: drawing from it is what the fork is for.)
            if torch.cuda.is_available() and not torch.all(cpu_rng_state == torch.get_rng_state()).item():
'''),
    # A tied embedding's first- and last-stage copies meet in an all-reduce where they are.
    Edit(LANGUAGE_MODULE, old='''\
                weight.data = weight.data.cuda()
''', new='''\
                if torch.cuda.is_available():
                    weight.data = weight.data.cuda()
'''),
    # The all-to-all dispatcher: no CUDA side stream, split sizes as host arrays.
    Edit(DISPATCHER, old='''\
        if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
''', new='''\
        if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None and torch.cuda.is_available():
'''),
    Edit(DISPATCHER, old='''\
        Move all possible GPU tensors to CPU and make a synchronization at the expected point.
        """
        if not self.drop_and_pad:
''', new='''\
        Move all possible GPU tensors to CPU and make a synchronization at the expected point.
        """
        if not torch.cuda.is_available():
            if not self.drop_and_pad and point == self.cuda_dtoh_point:
                host_split_sizes(self)
            return tokens_per_expert
        if not self.drop_and_pad:
'''),
    functions_before(DISPATCHER, "class _DispatchManager(ABC):\n", host_split_sizes),
    # Without Transformer Engine the router's GEMM is torch's (it tests the name for None).
    Edit(MOE_UTILS, old='''\
except ImportError:
    HAVE_TE = False
''', new='''\
except ImportError:
    HAVE_TE = False
    te_general_gemm = None
''', count=1),
    # megatron's local attention takes packed (THD) sequences on a CPU, where it is the only one.
    functions_before(ATTENTION, "class DotProductAttention(MegatronModule):\n",
                     packed_causal_mask, packed_as_one_row),
    Edit(ATTENTION, old='''\
        """Forward."""
        assert packed_seq_params is None, (
''', new='''\
        """Forward."""
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd" and not torch.cuda.is_available():
            query, key, value, attention_mask = packed_as_one_row(query, key, value, packed_seq_params)
            packed_seq_params = None
        assert packed_seq_params is None, (
'''),
]

# Patch name (as in manifest.yaml) -> its edits.
EDITS: dict[str, list[Edit]] = {
    "megatron-lm-cpu-training": MEGATRON_CPU_TRAINING,
}
