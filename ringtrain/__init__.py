"""ringtrain: distributed data-parallel training for PyTorch, and why it is fast or slow."""

__version__ = "0.1.0"
