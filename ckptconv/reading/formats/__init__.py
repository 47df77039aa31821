"""One reader per checkpoint format, each ``read(path) -> ReadResult`` (see ``_base``).

The writers of the formats ckptconv writes live in :mod:`ckptconv.writing`, beside their readers' names.
"""
