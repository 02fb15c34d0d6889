"""``python -m lit_memtrain.cli`` (and ``torchrun -m lit_memtrain.cli``): the ``lit-memtrain`` command."""

from lit_memtrain.cli import main

main()
