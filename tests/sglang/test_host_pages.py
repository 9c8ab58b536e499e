"""The backend reads and writes exactly the memory SGLang names for zero-copy backends: for every host
layout, each page's pieces are the regions ``get_page_buffer_meta`` reports, and their bytes in order
are SGLang's flat page (``get_data_page(flat=True)``). (The order differs from the meta's for MHA
``layer_first``, which lists each layer's K and V in turn; the flat page, and so the stored page, has
every layer's K first: what makes the zero-copy and the copy paths store the same bytes.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.integrations.sglang.host_pages import HostPages, pages_of

from .harness import LAYOUTS, MLA_LAYOUTS, Shape, fill, pools

pytestmark = pytest.mark.usefixtures("sglang_rank")

CASES = [("mha", layout) for layout in LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]


@pytest.mark.parametrize(("attention", "layout"), CASES, ids=[f"{a}-{lay}" for a, lay in CASES])
def test_pieces_are_the_regions_sglang_names(attention: str, layout: str) -> None:
    _, host = pools(layout, Shape(mla=attention == "mla"))
    pages = HostPages(host, attention=attention)
    ps = host.page_size
    slots = host.alloc(3 * ps)
    fill(host, slots, seed=1)
    for start in slots[::ps].tolist():
        page = start // ps
        ptrs, sizes = host.get_page_buffer_meta(torch.arange(start, start + ps))
        assert sorted(pages.piece_addresses(page)) == sorted(zip(ptrs, sizes, strict=True))
        joined = np.concatenate([np.asarray(p) for p in pages.page_pieces()[page]])
        assert joined.tobytes() == host.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
    assert pages.page_bytes == host.get_dummy_flat_data_page().nbytes


def test_host_indices_must_be_whole_pages() -> None:
    assert pages_of(torch.arange(16, 32), 8, 2) == [2, 3]
    assert pages_of(torch.tensor([*range(40, 48), *range(8, 16)]), 8, 2) == [5, 1]
    assert pages_of(torch.arange(4, 20), 8, 2) is None  # not from a page start
    assert pages_of(torch.tensor([*range(8, 15), 3]), 8, 1) is None  # not consecutive
    assert pages_of(torch.arange(0, 8), 8, 2) is None  # too few for the keys
    assert pages_of(torch.arange(0, 0), 8, 0) == []
