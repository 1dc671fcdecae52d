"""Torch / Ascend NPU adapter for eaglepangu: the teacher forward and tree attention in torch.

Nothing here imports torch at package import time; import the submodules you need:

* :mod:`npu_backend.bridge`: JAX <-> torch arrays (zero-copy DLPack on CPU/CUDA).
* :mod:`npu_backend.device`: device detection and choice (npu > cuda > cpu).
* :mod:`npu_backend.attention`: ``tree_attention`` with ``npu_fused`` / ``sdpa`` / ``eager``.
* :mod:`npu_backend.kv_cache`: the torch KV cache (integer ``index_copy_`` commits).
* :mod:`npu_backend.llama_torch`: ``TorchLlama``, the teacher forward on the JAX parameters.
* :mod:`npu_backend.simulated`: a strict ``torch_npu`` stand-in for tests without a device.
* :mod:`npu_backend.runner`: ``generate_torch``, speculative decoding with the torch teacher
  (drafting, tree building and acceptance stay in JAX; one host-driven round at a time).
* :mod:`npu_backend.branches`: branches mode, the tree verified as a batch of causal chains.

Running on an Ascend host:

1. Install the CANN toolkit for the machine's driver and source its environment script, so
   that ``torch_npu`` can load its libraries.
2. ``pip install eaglepangu[npu]`` (torch plus torch_npu).
3. ``EAGLEPANGU_DEVICE=npu`` selects the NPU (``npu:1`` for another card); the default
   ``auto`` picks npu, then cuda, then cpu. Asking for ``npu`` on a host without one fails
   with a message naming what is missing: the package, the toolkit or the device.
4. ``EAGLEPANGU_MODE=performance`` (default) uses the fused attention kernel;
   ``EAGLEPANGU_MODE=reference`` keeps the eager path and the invariant checks on (tree
   invariants, range-checked index lookups), for debugging a mismatch.
5. Generate with the teacher on the NPU::

       from npu_backend.device import select_device
       from npu_backend.llama_torch import TorchLlama
       from npu_backend.runner import generate_torch

       model = TorchLlama(config, params, device=select_device(), dtype=torch.float16)
       result = generate_torch(model, NGramDrafter(), prompt_ids, SpecConfig(),
                               mode="tree")  # or mode="branches"

   ``mode="tree"`` verifies the whole tree in one forward with a tree mask; it needs a
   fused kernel that takes a full mask (``sparse_mode=0``), which ``npu_fusion_attention``
   does. ``mode="branches"`` verifies one causal chain per leaf as a batch, for stacks whose
   kernels only take causal masks; it returns the same tokens at the cost of more verified
   tokens per round (see :mod:`npu_backend.branches`). The benchmark
   ``python bench/adapter.py`` compares the adapter with the JAX engine on the host.
"""
