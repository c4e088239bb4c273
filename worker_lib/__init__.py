"""Worker side of the THC toolkit: compression, wire format, transport and PyTorch integration."""

__version__ = "0.1.0"
