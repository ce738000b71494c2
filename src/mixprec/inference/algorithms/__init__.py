"""The algorithms room: what wins back accuracy that round-to-nearest loses, on top of every scheme:
GPTQ (gptq.py, gptq_pass.py; MoE experts: gptq_experts.py) rounds the weights; AWQ (awq.py) and SmoothQuant (smoothquant.py) fold
per-channel scales into the model (folds.py) before it is rounded, leaving an ordinary model. Each
rounds through the one quantize entry with the scheme's own scale rule, so that the checkpoint writer
re-encodes its result exactly. It sits on the calibration room (the data the algorithms see) and under
the runtime layers, the producers and the readers.
"""
