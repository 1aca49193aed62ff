"""specheads: speculative-decoding drafters on a frozen Hugging Face target."""
__version__ = "0.1.0"
