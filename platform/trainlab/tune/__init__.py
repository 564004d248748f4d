"""trainlab.tune."""
