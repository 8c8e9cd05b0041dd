"""Weight formats as data: how a tensor is stored, packed and checked, with no kernel and no model.

`u12`: the lossless 12-bit format (pack, unpack, escape tables, lanes, layouts, checksummed files).
Both the kernels that decode it and the runtime that serves it import it from here.
"""
