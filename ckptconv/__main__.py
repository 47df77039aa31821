"""``python -m ckptconv``: the same as the ``ckptconv`` command."""

from .cli import main

main()
