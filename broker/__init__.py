"""The trusted anonymizer service: ingress, pipeline, upstream client, stores (and the CLI)."""
