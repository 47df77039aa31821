"""Selection: the model weights inside whatever a checkpoint holds.

``state_dicts`` says what counts as weights and walks the tree; ``weights`` finds the state dict in a
training checkpoint (``Selection``); ``paths`` resolves what ``--select`` names.
"""
