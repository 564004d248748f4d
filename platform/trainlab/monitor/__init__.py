"""trainlab.monitor."""
