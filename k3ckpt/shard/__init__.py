"""``k3ckpt shard``: a checkpoint and a ``k3ckpt.placement`` plan in, per-rank files and
expert packs out.

* ``materialize``: the per-rank writer (``shard_checkpoint``), resumable.
* ``source``: the source model's experts as the writer reads them.
* ``packs`` / ``moet_pack``: the k3ckpt pack of verbatim records and vLLM-Moet's pack.
* ``dryrun``: what a run would write, without writing.
* ``verify`` / ``verify_convert``: re-check an output against its manifest and source.
"""
