"""``python -m ckptconv``: the same as the ``ckptconv`` command."""

from ckptconv.cli import main

main()
