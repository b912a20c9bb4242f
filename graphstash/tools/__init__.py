"""The tools around the library: the ``graphstash`` command (:mod:`.cli`), the demo, the
memory command and the benchmarks (:mod:`.bench`).

The library never imports this package; it imports the library's public API only.
"""
