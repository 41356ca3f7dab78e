"""LoRA: low-rank adapters trained on the frozen native models and served by the engine (report §5.1)."""
