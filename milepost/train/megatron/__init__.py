"""The Megatron-core training backend (issue 28): model providers, HF <-> Megatron conversion, sizes.

megatron-core is an optional extra (`pip install 'milepost[megatron]'`); only `require_megatron`
and the modules that build models import it, so conversion and validation work without it.
"""
