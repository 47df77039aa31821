"""Values: what a loaded checkpoint is made of, with no I/O and no torch.

``tensor`` (``TensorRef``, ``Storage``: where a tensor's bytes are, not the bytes) and ``standins``
(inert stand-ins for what a pickle names). Every other stage builds on these.
"""
