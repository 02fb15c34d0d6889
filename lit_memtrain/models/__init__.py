"""Model building and model-specific code: presets, the builder (hub, local directory, preset; LoRA / QLoRA;
export), decoder-layer discovery, mixture-of-experts helpers and generation."""
