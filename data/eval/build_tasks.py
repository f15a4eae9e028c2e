"""Build the lm-eval tasks shipped with the repository from the shipped corpus (data/corpus/shakespeare.jsonl):

- ``shakespeare_next_line.jsonl`` (multiple choice): a verse line; which of four lines of the same speech
  position follows it (the true next line and three lines drawn from other scenes);
- ``shakespeare_play.jsonl`` (multiple choice): a line; which of four plays it is from;
- ``shakespeare_continue.jsonl`` (generation): a line; the next line, generated up to the newline;
- ``shakespeare_passages.jsonl`` (rolling log-likelihood): passages of a few lines, for perplexity.

Each task has a ``validation`` file for few-shot examples and a ``test`` file for scoring (disjoint scenes).
Deterministic: running it again writes the same bytes. The YAML files in tasks/ describe the tasks to lm-eval.

    python data/eval/build_tasks.py
"""

from __future__ import annotations

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "corpus", "shakespeare.jsonl")
SIZES = {"validation": 40, "test": 300}


def _speech_lines(text: str) -> list[list[str]]:
    """Each speech's verse lines: runs of lines between blank lines, the speaker's name (the first line, ending
    in a full stop) and stage directions ([...]) left out; lines of 4 to 14 words."""
    speeches = []
    for block in text.split("\n\n"):
        lines = [line.strip() for line in block.split("\n") if line.strip()]
        if len(lines) < 2 or lines[0].startswith("["):
            continue
        verse = [line for line in lines[1:] if not line.startswith("[") and 4 <= len(line.split()) <= 14]
        if len(verse) >= 2:
            speeches.append(verse)
    return speeches


def _write(name: str, split: str, records: list[dict]) -> None:
    with open(os.path.join(HERE, f"{name}.{split}.jsonl"), "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    with open(CORPUS, encoding="utf-8") as fh:
        scenes = [json.loads(line) for line in fh if line.strip()]
    scenes = [s for s in scenes if s["part"] > 0]  # part 0: title page and cast
    titles = sorted({s["title"] for s in scenes})
    rng = random.Random(20261128)
    order = list(range(len(scenes)))
    rng.shuffle(order)
    halves = {"validation": order[: len(order) // 5], "test": order[len(order) // 5:]}
    every_line = [line for s in scenes for speech in _speech_lines(s["text"]) for line in speech]
    for split, indices in halves.items():
        pairs, lines, passages = [], [], []
        for i in indices:
            scene = scenes[i]
            for speech in _speech_lines(scene["text"]):
                pairs += [(speech[j], speech[j + 1]) for j in range(len(speech) - 1)]
                lines += [(line, scene["title"]) for line in speech]
                if len(speech) >= 3:
                    passages.append("\n".join(speech[:6]))
        n = SIZES[split]
        chosen = rng.sample(pairs, n)
        next_line = []
        for context, true in chosen:
            others = rng.sample([line for line in every_line if line != true], 3)
            choices = [*others]
            label = rng.randrange(4)
            choices.insert(label, true)
            next_line.append({"context": context, "choices": choices, "label": label})
        _write("shakespeare_next_line", split, next_line)
        play = []
        for line, title in rng.sample(lines, n):
            choices = rng.sample([t for t in titles if t != title], 3)
            label = rng.randrange(4)
            choices.insert(label, title)
            play.append({"line": line, "choices": choices, "label": label})
        _write("shakespeare_play", split, play)
        _write("shakespeare_continue", split, [{"context": c, "target": t} for c, t in rng.sample(pairs, n // 2)])
        _write("shakespeare_passages", split, [{"text": p} for p in rng.sample(passages, min(n // 3, len(passages)))])


if __name__ == "__main__":
    main()
