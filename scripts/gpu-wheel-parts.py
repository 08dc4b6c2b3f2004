"""Repack the GPU wheel parts (`.whl/part-NN/`) so that no part exceeds a size limit.

Each device call carries one part plus the repository's working tree under a 64 MiB limit, so a part must leave
room for the tree. Byte-split pieces (`vllm.whl.part.NN`, `ray.whl.part.NN`, joined on the machine with
`cat name.whl.part.*`) that are too big are split again with a suffix that keeps that glob's order
(`….part.00` -> `….part.00.0`, `….part.00.1`); then every file goes into the first part with room (largest first).

    python3 scripts/gpu-wheel-parts.py .whl --max-mib 48
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

SPLITTABLE = (".whl.part.",)


def split_file(path: Path, limit: int) -> list[Path]:
    """`path` cut into pieces of at most `limit` bytes named `<path>.<i>`; the original is removed."""
    pieces = []
    with path.open("rb") as src:
        index = 0
        while chunk := src.read(limit):
            piece = path.with_name(f"{path.name}.{index}")
            piece.write_bytes(chunk)
            pieces.append(piece)
            index += 1
    path.unlink()
    return pieces


def repack(root: Path, limit: int) -> list[Path]:
    files: list[Path] = []
    for part in sorted(root.glob("part-*")):
        for f in sorted(part.iterdir()):
            if f.stat().st_size > limit:
                if not any(marker in f.name for marker in SPLITTABLE):
                    sys.exit(
                        f"{f}: {f.stat().st_size} bytes is over the {limit}-byte part limit and is not a "
                        f"byte-split piece; raise --max-mib or split it where it is built"
                    )
                files += split_file(f, limit)
            else:
                files.append(f)
    staging = root / ".repack"
    staging.mkdir()
    bins: list[list[Path]] = []
    sizes: list[int] = []
    for f in sorted(files, key=lambda f: f.stat().st_size, reverse=True):
        size = f.stat().st_size
        slot = next((i for i, used in enumerate(sizes) if used + size <= limit), None)
        if slot is None:
            bins.append([])
            sizes.append(0)
            slot = len(bins) - 1
        bins[slot].append(f)
        sizes[slot] += size
    for i, members in enumerate(bins):
        target = staging / f"part-{i:02d}"
        target.mkdir()
        for f in members:
            shutil.move(str(f), target / f.name)
    for part in root.glob("part-*"):
        shutil.rmtree(part)
    out = []
    for target in sorted(staging.iterdir()):
        out.append(Path(shutil.move(str(target), root / target.name)))
    staging.rmdir()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("--max-mib", type=int, default=48)
    args = parser.parse_args()
    for part in repack(args.root, args.max_mib * 2**20):
        print(f"{part}: {sum(f.stat().st_size for f in part.iterdir()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
