"""One module per model architecture (`model.arch`), discovered by
`trainlab.models.registry`. Modules here must not import torch at module
level: import it inside `build()`."""
