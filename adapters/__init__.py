"""LoRA adapters: the registry of validated PEFT adapters on disk
(`adapters.registry`), and the device-side ops (`adapters.ops`)."""
