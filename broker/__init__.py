"""The trusted anonymizer service: ingress, pipeline, upstream client, stores (and the CLI)."""

__version__ = "0.1.0"
