"""Write docs/interface.md from the code (kcloak.broker.interface_docs).

.venv/bin/python scripts/gen_interface_docs.py          # rewrite docs/interface.md
.venv/bin/python scripts/gen_interface_docs.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

from kcloak.broker.interface_docs import interface_markdown

TARGET = Path(__file__).resolve().parents[1] / "docs" / "interface.md"


def main(argv: list[str]) -> int:
    text = interface_markdown()
    if "--check" in argv:
        if TARGET.read_text(encoding="utf-8") != text:
            print(f"{TARGET.name} is out of date: run scripts/gen_interface_docs.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text, encoding="utf-8")
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
