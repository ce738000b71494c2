"""The checkpoint room: safetensors IO (headers, planned shards, streaming reads), the layouts a
checkpoint is written in (their configs and tensor names), the scales file, the Linear weights a
checkpoint holds, and the one publish sequence every producer runs. It knows no runtime layer and no
calibration: producers and readers above it build on it.
"""
