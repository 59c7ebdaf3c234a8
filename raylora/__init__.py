"""raylora: LoRA fine-tuning of large language models on Ray, from Ascend NPUs to a CPU laptop."""

__version__ = "0.1.0"
