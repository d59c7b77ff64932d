"""gemmactl: prepare and run Gemma models locally."""

__version__ = "0.1.0"
