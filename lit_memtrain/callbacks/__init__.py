"""lit-memtrain callbacks."""
