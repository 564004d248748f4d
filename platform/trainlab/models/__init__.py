"""trainlab.models."""
