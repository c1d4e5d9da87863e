"""Tables for scripts: tab-separated lines with a header, or JSON, when the output is not a terminal.

Rich renders a table to the terminal's width, but piped it assumes 80 columns and folds every cell;
`cut`, `awk` and `jq` want one record per line instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from localllm.printable import printable


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return printable(str(value).replace("\t", " ").replace("\n", " "))  # file names may hold escapes


def print_records(records: Sequence[Mapping[str, Any]], fmt: str = "tsv") -> None:
    """`records` (dicts, same keys in the same order; a later key only some have is added) as `fmt`."""
    if fmt == "json":
        print(json.dumps(list(records), indent=2, ensure_ascii=False))
        return
    columns = list(dict.fromkeys(key for record in records for key in record))
    print("\t".join(columns))
    for record in records:
        print("\t".join(_cell(record.get(column)) for column in columns))
