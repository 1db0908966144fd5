"""Driving ranks: the executor in the engine core, the rank processes, the step channel between them,
pipeline planning and micro-batches. Collectives and a rank's place are `hearth.parallel`'s."""
