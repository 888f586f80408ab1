"""What every command knows about a checkpoint beyond its bytes, one layer above ``io``:

* ``qconfig``: the ``quantization_config`` block, read (which format holds which weight)
  and written (k3ckpt's groups, placed in config.json).
* ``side_files``: the files beside the weights (tokenizer, generation config, ...).
* ``identity``: what makes a source that source, for resume manifests.

Provenance itself (``io.origin.Origin``, ``ckpt.origin``) is set by whoever opens a
checkpoint, so it sits in ``io`` beside the reader.
"""
