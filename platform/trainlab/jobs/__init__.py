"""trainlab.jobs."""
