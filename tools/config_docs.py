"""The configuration reference (docs/configuration.md), generated from megaformer.config's declarations.

    python tools/config_docs.py            # print the table
    python tools/config_docs.py --check    # exit 1 if docs/configuration.md's table is out of date
    python tools/config_docs.py --write    # rewrite docs/configuration.md's table in place

The table sits between the ``<!-- config-keys:begin -->`` and ``<!-- config-keys:end -->`` markers
of the page; everything around them is written by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megaformer.config import describe_keys  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- config-keys:begin -->", "<!-- config-keys:end -->"


def table() -> str:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, tp, default, doc in describe_keys():
        rows.append(f"| `{key}` | {tp} | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(rows)


def updated(text: str) -> str:
    """``text`` with the table between the markers regenerated; ValueError if a marker is missing."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{PAGE}: expected one {BEGIN} followed by one {END}")
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    if "--check" in argv or "--write" in argv:
        text = PAGE.read_text()
        new = updated(text)
        if "--check" in argv:
            if new != text:
                print(
                    f"{PAGE.relative_to(ROOT)}: the config table is out of date: "
                    "run python tools/config_docs.py --write"
                )
                return 1
            return 0
        PAGE.write_text(new)
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
