"""Frames in, results out: image files (`image_file`), video files and folders (`sources`,
`batch`: what `vlmstream video` runs; `resume`: where a `--resume` picks a file up), live
sources, a webcam (`webcam`), a network stream or a pipe (`stream`), each a session where the
latest frame wins (`sources.open_live`, `live`, `feed`: `vlmstream live` and the web UI), and
what is written of the results (`sinks`, `changes`, `recorder`).

Pipelines talk to the engine only through its public API.
"""
