"""Writing: a state dict streamed to ``.pt``, safetensors, a sharded folder or a DCP folder, atomically.

``writer.save`` is the stage's entry point. Planning is apart from moving bytes, as in torch's DCP:
``naming`` (which format a destination gets), ``room`` (free space), ``shards`` and ``torch_zip``'s
``plan_storages`` plan; ``atomic`` (temporary files, publishing, locks), ``copying`` (the copy engines)
and ``files``/``folders`` (one file, a folder of them) write. ``write_policy`` says where ckptconv may
write and what it may replace; ``provenance`` is the metadata that travels with the weights.
"""
