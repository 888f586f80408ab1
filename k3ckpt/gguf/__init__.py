"""GGUF output: the container layout (``container``) and its streaming, atomic writer (``writer``).

GGUF files are read with the ``gguf`` package's reader, independent of this code.
"""
