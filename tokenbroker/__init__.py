"""tokenbroker: tokenization offloaded from the inference scheduler, over ZeroMQ."""

__version__ = "0.1.0"
