"""PEFT adapters: merged into their base (``merge_lora``), taken out of training runs (``extract_lora``).

``reading/adapter_config.py`` parses ``adapter_config.json`` through one schema; here ``plan`` decides which
base tensor gets which part of an adapter, from names and shapes; ``arithmetic`` computes a merged tensor as
PEFT does, op by op (torch); ``merging`` makes the merge a step of ``convert``'s pipeline; ``extraction``
writes the adapter a training checkpoint holds as a PEFT adapter folder.
"""
