"""docs/coming-from.md's tables are the importers' own mapping tables: the page and the code agree."""

from __future__ import annotations

from engine.importers import docs
from engine.importers.table import Key


def test_the_page_holds_exactly_the_tables_made_from_the_code():
    page = docs.PAGE.read_text()
    assert docs.BEGIN in page and docs.END in page
    generated = page[page.index(docs.BEGIN): page.index(docs.END) + len(docs.END)] + "\n"
    assert generated == docs.tables(), "docs/coming-from.md is stale: run `python -m engine.importers.docs`"


def test_every_row_of_every_table_is_on_the_page_and_a_changed_row_would_show():
    page = docs.PAGE.read_text()
    for _, mod in docs.TOOLS:
        for k in mod.TABLE:
            assert docs._row(k) in page, k.src
    changed = Key("network.linear", "lora.alpha")  # a wrong mapping: its row is not the page's
    assert docs._row(changed) not in page
