"""PEFT adapters: merged into their base (``merge_lora``), read and checked as data.

``config`` parses ``adapter_config.json`` through one schema; ``plan`` decides which base tensor gets which
part of an adapter, from names and shapes; ``arithmetic`` computes a merged tensor as PEFT does, op by op
(torch); ``merging`` makes the merge a step of ``convert``'s pipeline.
"""
