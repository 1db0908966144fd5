"""Write an eval set of real English text present on the machine, for `hearth eval` on real weights: the
license texts under /usr/share/common-licenses (Apache, GPL, LGPL, MPL, GFDL, Artistic, BSD, CC0), cut
into pieces of about `--chars` characters at paragraph breaks. No tool prompts: the model the tables are
taken on (SmolLM2-135M-Instruct) has a chat template without tools.

    python scripts/make_real_text_eval_set.py --out /tmp/licenses-eval-set.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LICENSES = (
    "Apache-2.0",
    "GPL-3",
    "LGPL-2.1",
    "MPL-2.0",
    "GFDL-1.3",
    "Artistic",
    "BSD",
    "CC0-1.0",
)


def pieces(text: str, chars: int) -> list[str]:
    out, current = [], ""
    for paragraph in text.split("\n\n"):
        if current and len(current) + len(paragraph) > chars:
            out.append(current.strip())
            current = ""
        current += paragraph + "\n\n"
    if current.strip():
        out.append(current.strip())
    return [p for p in out if len(p) > chars // 4]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", default="/usr/share/common-licenses")
    parser.add_argument("--chars", type=int, default=2400, help="characters per text (~512 tokens)")
    parser.add_argument("--max-texts", type=int, default=24)
    args = parser.parse_args()
    texts: list[str] = []
    for name in LICENSES:
        path = Path(args.dir) / name
        if path.is_file():
            texts.extend(pieces(path.read_text(encoding="utf-8", errors="replace"), args.chars)[:4])
    texts = texts[: args.max_texts]
    Path(args.out).write_text(json.dumps({"texts": texts, "tool_prompts": []}) + "\n")
    print(f"{len(texts)} texts ({sum(map(len, texts))} chars) -> {args.out}")


if __name__ == "__main__":
    main()
