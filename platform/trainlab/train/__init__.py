"""The execution layer: runs what the config and plan say on Ray Train."""
