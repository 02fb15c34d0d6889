"""lit-memtrain strategies."""
