"""Write the key tables of docs/configuration.md from the config schema (`--check`: exit 1 if they are stale).

    python scripts/config_docs.py            # rewrite the tables after adding or changing a key
    python scripts/config_docs.py --check    # what the test suite runs
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.config.key_docs import run_defaults, write_tables  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__.strip())
        return 0
    current = DOC.read_text()
    fresh = write_tables(current, run_defaults())
    if "--check" in argv:
        if fresh != current:
            print("docs/configuration.md: the key tables differ from the schema; run python scripts/config_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(fresh)
    print(f"wrote the key tables of {DOC.relative_to(DOC.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
