"""Write examples/data/arith.jsonl: one-digit arithmetic in words the reference tokenizer knows.

Every prompt is made of words of `r3operator.models.tokenizer` (no <unk>), and every answer is one digit:
that tokenizer splits numbers into digits and decodes them with spaces between ("42" comes back as "4 2"),
so one-digit answers keep the decoded completion and the answer comparable. Deterministic: running it
again writes the same bytes (tests/tasks/test_dataset_task.py checks the committed file).

    python scripts/make_arith_dataset.py [OUT]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "examples" / "data" / "arith.jsonl"
PER_KIND = 8
SEED = 0

Template = tuple[str, Callable[[int, int], int | None]]
# (prompt with {a} and {b}, answer or None when it is not one digit / not whole)
KINDS: dict[str, Template] = {
    "plus": ("what is {a} plus {b} ?", lambda a, b: a + b),
    "minus": ("what is {a} minus {b} ?", lambda a, b: a - b),
    "times": ("what is {a} times {b} ?", lambda a, b: a * b),
    "divided": ("what is {a} divided by {b} ?", lambda a, b: a // b if b and a % b == 0 else None),
    "double": ("what is double {a} ?", lambda a, b: 2 * a if b == 0 else None),
    "apples": ("Q : {a} apples and {b} apples . what is the total ?", lambda a, b: a + b),
}


def rows() -> Iterator[dict[str, str]]:
    rng = np.random.default_rng(SEED)
    for kind, (template, solve) in KINDS.items():
        candidates = [
            (a, b, answer)
            for a in range(10)
            for b in range(10)
            if (answer := solve(a, b)) is not None and 0 <= answer <= 9
        ]
        picks = sorted(rng.choice(len(candidates), size=min(PER_KIND, len(candidates)), replace=False).tolist())
        for n, pick in enumerate(picks):
            a, b, answer = candidates[pick]
            yield {"id": f"{kind}-{n}", "prompt": template.format(a=a, b=b), "answer": str(answer)}


def render() -> str:
    return "".join(json.dumps(row) + "\n" for row in rows())


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.write_text(render())
    print(f"wrote {out}")
