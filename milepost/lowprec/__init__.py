"""Low-precision formats and the precision contract (report 3.1, issue 23).

`elements` rounds to the element formats (E4M3, E2M1, UE8M0); `quantize` holds the one quantizer
that trainer, engine, checkpoint conversion and live weight export share (FP8 blockwise, MXFP8,
NVFP4); `contract` refuses the arrangements the report does not allow; `linear` emulates the
quantized GEMMs on devices without them.
"""
