"""Reading: every checkpoint format, opened safely and lazily.

``detection`` tells a file's format from its content; ``formats/`` holds one reader per format;
``unpickling/`` is the pickle machine that never runs code (its security policy in
``pickle_policy``, its stand-ins and rebuilders); ``read_policy`` says which paths may be opened and
how; ``sources`` are where a storage's bytes are, ``streaming`` reads them (whole or in chunks, cast on
the way), ``integrity`` and ``checksums`` prove them; ``discovery`` finds the checkpoints under a folder.
"""
