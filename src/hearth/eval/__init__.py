"""`hearth eval`: a configuration's quality against a reference configuration of the same model."""
