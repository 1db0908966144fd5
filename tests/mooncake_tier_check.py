"""Run inside a private network namespace by test_kv_tiers_mooncake.py (the Mooncake master binds 0.0.0.0).

Two Mooncake Store clients (two servers' tiers) against one master: what one stores the other finds and
loads, a page of another layout is rejected, and an unknown key is not found. Prints "ok" on success.
"""

from __future__ import annotations

import sys

import torch

from hearth.kv.page_io import PageLayout
from hearth.kv.prefix_keys import page_keys, root_key
from hearth.kv.tiers import PageSpec
from hearth.kv.tiers.blob_auth import BlobMAC
from hearth.kv.tiers.mooncake_store import MooncakeTier


def main(url_a: str, url_b: str) -> None:
    spec = PageSpec("mha/float32/p4/h1x4/l2", PageLayout(2, 1, 4, 4, "mha", "float32"))
    keys = page_keys(root_key("m", spec.layout_tag), list(range(16)), 4)
    a, b = MooncakeTier(spec, url_a), MooncakeTier(spec, url_b)
    a.mac = b.mac = BlobMAC(b"mooncake check")  # what open_store sets from the deployment secret
    pages = [torch.full(spec.shape, float(i)) for i in range(3)]
    a.store(list(zip(keys[:3], pages)))
    assert b.lookup(keys) == 3, b.lookup(keys)
    loaded = b.load(keys)
    assert len(loaded) == 3 and all(torch.equal(x, y) for x, y in zip(loaded, pages)), loaded
    other = PageSpec("mha/bfloat16/p4/h1x4/l2", spec.layout)
    b.spec = other
    assert b.load(keys[:1]) == []  # a page of another layout is rejected by its header
    b.spec = spec
    other_tenant = page_keys(root_key("m", spec.layout_tag, "tenant-2"), list(range(16)), 4)
    assert b.lookup(other_tenant) == 0
    print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
