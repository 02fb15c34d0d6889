"""Training objectives as LightningModules (SFT's :class:`CausalLMModule`, :class:`DPOModule`, :class:`RewardModule`)
and the parts of a training step they share: the step's token count, the preference and reward losses, the
optimizer and schedule, the throughput meter, the setup probes, checkpoint loading."""
