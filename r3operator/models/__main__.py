"""`python -m r3operator.models [tiny|small|gpu] [cache_dir]`: generate if needed, print the path."""

from __future__ import annotations

import sys
from pathlib import Path

from r3operator.models.reference import ensure_reference_model


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    name = args[0] if args else "tiny"
    cache_dir = Path(args[1]) if len(args) > 1 else None
    print(ensure_reference_model(name, cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
