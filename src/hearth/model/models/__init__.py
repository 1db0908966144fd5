"""One module per architecture family; each registers its Hugging Face names with `hearth.model.registry`."""
