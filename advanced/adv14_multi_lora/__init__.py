"""Advanced lesson 14: many LoRA adapters over one base model, in one batch."""
