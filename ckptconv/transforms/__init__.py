"""Transforms: pure steps over a state dict's keys and dtypes.

``keys`` holds the key transforms and the ``Pipeline`` that composes them (``Cast`` among them);
``casts/`` holds the cast kernels, bit-exact with torch, one module per dtype family.
"""
