"""Storage backends on NIXL (NVIDIA's transfer library; the ``nixl`` extra).

* ``kind: nixl`` (``posix.py``): the file tier's folder, with NIXL's POSIX plugin moving pages
  between memory and files;
* ``kind: nixl-peer`` (``peer.py``): pages served from one process's registered memory and pulled
  by another over UCX, for prefill/decode disaggregation without a store in between.

``agent.py`` holds what both share: the import, registration, and transfers with a deadline.
NIXL is imported when a backend opens, never at import time.
"""
