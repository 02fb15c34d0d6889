"""lit-memtrain planner: a training step's peak memory, simulated on the CPU with fake tensors.

- :mod:`~lit_memtrain.planner.simulate`: the stand-in device, fake models, ``measure_peak``, ``simulate_step``.
- :mod:`~lit_memtrain.planner.step`: one ``fit`` step through ``CausalLMModule`` (``simulate_fit_step``).
- :mod:`~lit_memtrain.planner.plan`: a configuration against a GPU budget, the longest length, the comparison.
- :mod:`~lit_memtrain.planner.command`: ``lit-memtrain plan``.

See docs/planner.md.
"""
