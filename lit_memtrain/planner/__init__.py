"""lit-memtrain planner."""
