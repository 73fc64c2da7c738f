"""areno: a command-line GRPO/GSPO trainer for language models."""

__version__ = "0.1.0"
