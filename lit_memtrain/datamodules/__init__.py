"""lit-memtrain datamodules."""
