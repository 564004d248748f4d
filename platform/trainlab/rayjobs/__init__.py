"""trainlab.rayjobs."""
