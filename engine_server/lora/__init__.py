"""LoRA adapters on a shared base model: PEFT folders read and checked against the model (`peft_format`), the
adapters an engine serves (`registry`), their weights stacked in slots on the device and applied per row
(`slots`)."""
