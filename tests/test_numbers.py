"""The README's benchmark tables are what their results files render to (#39 item 3): a number typed by hand, or a
results file replaced without regenerating the table (``nox -s numbers``), fails here."""

from __future__ import annotations

import pytest

from tests.support import numbers

README = (numbers.ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(numbers.TABLES))
def test_the_readme_table_is_its_results_file_rendered(name):
    found = numbers.blocks(README)
    assert name in found, f"README.md lacks the markers of the {name} table ({numbers.markers(name)})"
    assert found[name] == numbers.TABLES[name](), f"README's {name} table is stale: run `nox -s numbers`"


def test_a_hand_typed_number_is_caught(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    numbers.update(readme)
    text = readme.read_text()
    assert numbers.blocks(text) == {n: numbers.TABLES[n]() for n in numbers.TABLES}
    edited = text.replace("| 11.92 / 10.89 ms |", "| 11.90 / 10.89 ms |", 1)  # one number typed by hand
    assert edited != text and numbers.blocks(edited)["fast-layer"] != numbers.fast_layer()
