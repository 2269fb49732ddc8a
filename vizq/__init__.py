"""vizq: post-training quantization analysis for vision transformers."""
__version__ = "0.1.0"
