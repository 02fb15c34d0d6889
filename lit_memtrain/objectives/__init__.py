"""Training objectives as LightningModules (SFT's :class:`CausalLMModule`, :class:`DPOModule`) and the parts of a
training step they share: the batch contract, log-probabilities, the step's token count, the optimizer, the
throughput meter, checkpoint loading."""
