import pytest

from hearth.kv.allocator import OutOfPagesError, PageAllocator


def test_allocate_gives_distinct_pages_until_exhausted():
    allocator = PageAllocator(3)
    pages = {allocator.allocate() for _ in range(3)}
    assert pages == {0, 1, 2}
    with pytest.raises(OutOfPagesError):
        allocator.allocate()


def test_reference_counts_return_to_zero_and_page_is_reusable():
    allocator = PageAllocator(1)
    page = allocator.allocate()
    allocator.incref(page)
    assert allocator.decref(page) is False
    assert allocator.decref(page) is True
    assert allocator.ref_counts[page] == 0
    allocator.release(page)
    assert allocator.num_free_pages == 1


def test_generation_tag_changes_on_every_reuse():
    allocator = PageAllocator(1)
    tags = []
    for _ in range(3):
        page = allocator.allocate()
        tags.append(allocator.generations[page])
        allocator.decref(page)
        allocator.release(page)
    assert len(set(tags)) == 3


def test_over_release_is_caught():
    allocator = PageAllocator(1)
    page = allocator.allocate()
    allocator.decref(page)
    with pytest.raises(RuntimeError):
        allocator.decref(page)
