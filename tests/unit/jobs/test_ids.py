"""Row ids: their hashes, which values are valid ids, and the compact IdSet."""

from __future__ import annotations

import pytest

from llm_annotator.jobs.ids import IdSet, hash_id, is_valid_id


def bitmap_bytes(ids: IdSet) -> int:
    """How many bytes the set's bitmap has, read from its repr."""
    return int(repr(ids).split("bitmap_bytes=")[1].split()[0])


def hashed(ids: IdSet) -> int:
    """How many ids the set keeps as hashes, read from its repr."""
    return int(repr(ids).split("hashed=")[1].rstrip(">"))


@pytest.mark.parametrize("bad", [True, 1.5, None, b"x", (1,)])
def test_hash_id_refuses_what_is_not_an_id(bad: object) -> None:
    """Only ints and strs are ids; a bool is not an int id."""
    with pytest.raises(TypeError):
        hash_id(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "valid"),
    [(0, True), (-5, True), (2**63 - 1, True), (2**63, False), (-(2**63) - 1, False),
     ("", False), ("row-1", True), (True, False), (1.0, False), (None, False),
     ("a\udcff", False), ("\ud800", False), ("é", True)],
)  # fmt: skip
def test_valid_ids_are_64_bit_ints_and_strs(value: object, valid: bool) -> None:
    """Stored ids are non-empty valid Unicode strs, or ints that fit a signed 64-bit
    column."""
    assert is_valid_id(value) is valid


def test_dense_positions_live_in_the_bitmap() -> None:
    """Row positions 0..n-1 take bits, not hashes, and are all found."""
    ids = IdSet()
    assert ids.update(range(100_000)) == 100_000
    assert hashed(ids) == 0
    assert 0 < bitmap_bytes(ids) <= 1 << 20
    assert all(i in ids for i in range(0, 100_000, 997))
    assert 100_000 not in ids
    assert len(ids) == 100_000


def test_strs_negative_and_far_ints_are_hashed() -> None:
    """Ids the bitmap cannot hold cheaply are kept as hashes and still found."""
    ids = IdSet()
    row_ids: list[int | str] = ["a", "b", -1, 10**15]
    for row_id in row_ids:
        assert ids.add(row_id) is True
    assert hashed(ids) == 4
    assert bitmap_bytes(ids) == 0
    assert {"a", "b", -1, 10**15} == {x for x in ["a", "b", -1, 10**15, "c", 7] if x in ids}


def test_int_and_its_decimal_string_are_different_ids() -> None:
    """Mixed ids: 7 and "7" are two ids, each found only as itself."""
    ids = IdSet()
    ids.add(7)
    assert "7" not in ids
    ids.add("7")
    assert 7 in ids
    assert "7" in ids
    assert len(ids) == 2


def test_adding_an_id_twice_counts_it_once() -> None:
    """add() says whether the id was new; len counts distinct ids."""
    ids = IdSet()
    assert ids.add("x") is True
    assert ids.add("x") is False
    assert ids.add(3) is True
    assert ids.add(3) is False
    assert ids.update(["x", "y", "y", 3, 4]) == 2
    assert len(ids) == 4


def test_recent_hashes_merge_into_the_sorted_array() -> None:
    """With a tiny merge threshold, ids stay found across many merges, and no others are."""
    ids = IdSet(merge_threshold=3)
    for i in range(500):
        ids.add(f"id-{i}")
    assert len(ids) == 500
    assert all(f"id-{i}" in ids for i in range(500))
    assert not any(f"other-{i}" in ids for i in range(500))
    assert ids.add("id-250") is False


def test_a_position_hashed_first_is_not_counted_again_when_the_bitmap_grows() -> None:
    """A far position is hashed; once the bitmap covers it, it is still one id."""
    ids = IdSet()
    far = 10**7 + 1  # in the same byte of the bitmap as far - 1
    assert ids.add(far) is True
    assert hashed(ids) == 1
    ids.update(range(200_000))
    assert ids.add(far - 1) is True  # the bitmap grows to cover both
    assert bitmap_bytes(ids) * 8 > far
    assert ids.add(far) is False
    assert far in ids
    assert len(ids) == 200_002


def test_a_million_ids_of_each_kind() -> None:
    """10^6 positions and 10^6 str ids go in and are found; hashes take ~8 bytes an id."""
    ids = IdSet()
    assert ids.update(range(1_000_000)) == 1_000_000
    assert ids.update(f"row-{i}" for i in range(1_000_000)) == 1_000_000
    assert len(ids) == 2_000_000
    assert all(f"row-{i}" in ids for i in range(0, 1_000_000, 9973))
    assert all(i in ids for i in range(0, 1_000_000, 9973))
    assert "row-1000000" not in ids
    assert 1_000_000 not in ids
    assert ids.nbytes < 9 * 1_000_000 + (1 << 20)


def test_contains_refuses_what_is_not_an_id() -> None:
    """Asking about a float is a type error, not a silent False."""
    ids = IdSet()
    ids.add("a")
    with pytest.raises(TypeError):
        _ = 1.5 in ids


def test_merge_threshold_must_be_positive() -> None:
    """A threshold of 0 cannot work and is refused."""
    with pytest.raises(ValueError, match="merge_threshold"):
        IdSet(merge_threshold=0)
