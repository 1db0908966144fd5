"""One module per architecture family; `hearth.model.registry.MODELS` names each class by its Hugging Face
architecture."""
