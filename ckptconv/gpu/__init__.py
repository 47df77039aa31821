"""The GPU wing: lazy tensors read into torch tensors on the CPU or a GPU, at disk or PCIe speed.

``torch_tensors`` (``to_torch``, ``from_torch``) is the entry point; ``transfer`` runs the parallel
readers and pinned staging buffers, ``page_cache`` decides between buffered and direct reads, ``crc``
checks zip records on the GPU, ``cuda_driver`` makes the copies, ``devices`` says where tensors can go.
It uses the readers; no reader uses it.
"""
