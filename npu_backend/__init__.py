"""Torch / Ascend NPU adapter for eaglepangu: the teacher forward and tree attention in torch.

Nothing here imports torch at package import time; import the submodules you need:

* :mod:`npu_backend.bridge`: JAX <-> torch arrays (zero-copy DLPack on CPU/CUDA).
* :mod:`npu_backend.device`: device detection and choice (npu > cuda > cpu).
* :mod:`npu_backend.attention`: ``tree_attention`` with ``npu_fused`` / ``sdpa`` / ``eager``.
* :mod:`npu_backend.kv_cache`: the torch KV cache (integer ``index_copy_`` commits).
* :mod:`npu_backend.llama_torch`: ``TorchLlama``, the teacher forward on the JAX parameters.
* :mod:`npu_backend.simulated`: a strict ``torch_npu`` stand-in for tests without a device.

Running on an Ascend host:

1. Install the CANN toolkit for the machine's driver and source its environment script, so
   that ``torch_npu`` can load its libraries.
2. ``pip install eaglepangu[npu]`` (torch plus torch_npu).
3. ``EAGLEPANGU_DEVICE=npu`` selects the NPU (``npu:1`` for another card); the default
   ``auto`` picks npu, then cuda, then cpu. Asking for ``npu`` on a host without one fails
   with a message naming what is missing: the package, the toolkit or the device.
4. ``EAGLEPANGU_MODE=performance`` (default) uses the fused attention kernel;
   ``EAGLEPANGU_MODE=reference`` keeps the eager path and the invariant checks on, for
   debugging a mismatch.
"""
