"""Frames in, results out: image files now; video files, webcams and network streams next.

Pipelines talk to the engine only through its public API.
"""
