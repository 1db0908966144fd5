"""A rank's place among the others (TP/PP/EP groups, topology) and the collectives between them.

The bottom of the stack beside `ops`: no engine, model or KV knowledge. The processes that drive
ranks (executor, rank processes, step channel) are the engine's, in `hearth.engine.ranks`.
"""
