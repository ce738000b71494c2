"""The algorithms room: what wins back accuracy that round-to-nearest loses, on top of every scheme
(GPTQ first). Each rounds through the one quantize entry with the scheme's own scale rule, so that the
checkpoint writer re-encodes its result exactly. It sits on the calibration room (the data the
algorithms see) and under the runtime layers, the producers and the readers.
"""
