"""trainlab.track."""
