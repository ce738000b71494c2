"""The calibration room: calibration data (texts -> token batches), the observers (what amax a static
scale is built from), the run (a forward pass with hooks, and when to stop), the layer-by-layer run for
models that do not fit in memory, and the attention routing through which the KV cache is observed.
It sits on the checkpoint room and under the runtime layers, the producers and the readers.
"""
