"""``hicache inspect``: look into a storage tier described by a config, from outside any cache.

* ``summary``: pages, bytes, namespaces (the config's own named by its model), page ages, capacity;
* ``verify [--repair]``: read every page, check its header and checksum (its MAC for the config's
  own pages when it has a ``tenant_key``), report the corrupt ones and, with ``--repair``, remove them;
* ``purge --namespace ... | --older-than 7d | --all``: remove pages, a dry run unless ``--yes``.

All three walk the tier through the backend's optional listing operation
(``StorageBackend.list_pages``); a backend that cannot list says so (``ListingUnsupportedError``).
What verification can and cannot tell is in ``tiers/storage/page_format.py`` ("inspection").
"""

from .purge import PurgeReport, purge
from .summary import Summary, summarize
from .verify import VerifyReport, verify
from .walk import list_all, parse_duration

__all__ = ["PurgeReport", "Summary", "VerifyReport", "list_all", "parse_duration", "purge", "summarize", "verify"]
