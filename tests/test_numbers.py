"""The benchmark tables in the README and docs/results.md are what their results files render to (#39 item 3, #54):
a number typed by hand, or a results file replaced without regenerating the table (``nox -s numbers``), fails here."""

from __future__ import annotations

import pytest

from tests.support import numbers


@pytest.mark.parametrize("name", sorted(numbers.TABLES))
def test_each_table_in_its_home_file_is_its_results_file_rendered(name):
    home = numbers.HOME[name]
    found = numbers.blocks((numbers.ROOT / home).read_text())
    assert name in found, f"{home} lacks the markers of the {name} table ({numbers.markers(name)})"
    assert found[name] == numbers.TABLES[name](), f"{home}'s {name} table is stale: run `nox -s numbers`"


def test_every_table_lives_in_one_file_only():
    for path in [numbers.ROOT / "README.md", *sorted((numbers.ROOT / "docs").glob("*.md"))]:
        rel = str(path.relative_to(numbers.ROOT))
        strays = {n for n in numbers.blocks(path.read_text()) if numbers.HOME[n] != rel}
        assert strays == set(), f"{rel} holds {strays}, whose home is elsewhere (numbers.HOME)"


def test_a_hand_typed_number_is_caught(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text((numbers.ROOT / numbers.HOME["fast-layer"]).read_text())
    numbers.update(doc)
    text = doc.read_text()
    assert {n: numbers.TABLES[n]() for n in numbers.blocks(text)} == numbers.blocks(text)
    edited = text.replace("| 11.92 / 10.89 ms |", "| 11.90 / 10.89 ms |", 1)  # one number typed by hand
    assert edited != text and numbers.blocks(edited)["fast-layer"] != numbers.fast_layer()
