"""The pickle machine that never runs code from the file.

``unpickler`` interprets the opcodes; ``pickle_policy`` decides what a global may be (the security
policy, apart from the machine that enforces it); ``rebuild`` holds ckptconv's own implementations of the
harmless globals a checkpoint calls (torch's tensor rebuilders become lazy tensors).
"""
