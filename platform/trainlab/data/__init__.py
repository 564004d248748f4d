"""trainlab.data."""
