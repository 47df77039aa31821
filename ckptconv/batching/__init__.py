"""Batch: convert every checkpoint under a folder the same way, with a manifest.

``flow.batch`` is the whole flow; ``outputs`` names each item's output; ``executors`` convert them (in
this process, in ``worker`` processes that talk in ``frames``, or on Dask); ``manifest`` records each
result; ``report`` sums them up and owns the exit code.
"""
