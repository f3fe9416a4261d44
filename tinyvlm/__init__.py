"""The embedded default model: a procedural scene world, its language, training and evaluation.

Not part of the engine: the engine only loads the weights this package produces
(`engine/models/tiny/`).
"""
