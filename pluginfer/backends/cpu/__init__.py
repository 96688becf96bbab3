"""The cpu backend: torch on the host, with C kernels compiled on first use.

Where things are: ``backend.py`` (the ``DeviceBackend``), ``ops.py`` (every op it implements, registered in
its kernel table, each beside its C file), ``build.py`` / ``library.py`` (compiling and loading the C
libraries, the AMX tile libraries' too), ``replay.py`` / ``step_replay.py`` (recording a
decode step and replaying it in one native call), the wrappers by op family (``layer_ops.py``, ``quant.py``,
``half_linear.py``, ``panels.py``, ``amx_half.py``, ``amx_quant.py``, ``onednn.py``, ``dense.py``) and the C
sources by op family in ``csrc/``.
"""
