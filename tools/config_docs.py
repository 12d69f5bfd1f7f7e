"""Print the config-key reference (Markdown) generated from megaformer.config's declarations.

    python tools/config_docs.py            # print the table
    python tools/config_docs.py --check    # exit 1 if README.md's table is out of date
    python tools/config_docs.py --write    # rewrite README.md's table in place
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megaformer.config import describe_keys  # noqa: E402

BEGIN, END = "<!-- config-keys:begin -->", "<!-- config-keys:end -->"


def table() -> str:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, tp, default, doc in describe_keys():
        rows.append(f"| `{key}` | {tp} | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(rows)


def main() -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    updated = f"{head}{BEGIN}\n{table()}\n{END}{tail}"
    if "--check" in sys.argv:
        if updated != text:
            print("README.md config table is out of date: run python tools/config_docs.py --write")
            return 1
        return 0
    if "--write" in sys.argv:
        readme.write_text(updated)
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
