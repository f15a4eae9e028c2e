"""Write the shipped chat set (data/chat/chat_*.jsonl): templated questions and answers, in the four SFT formats,
and as preference pairs (chat_preference.jsonl: the answer chosen, another question's answer rejected).

    python data/chat/build_chat.py [OUTPUT_DIR]        # default: the directory of this script

Every answer is computed here: arithmetic, the Gregorian calendar (Python's datetime), unit conversions, and facts
read from the public-domain Shakespeare corpus shipped in data/corpus (scenes per play, where scenes are set, who
the characters are, from each play's list of persons). The same conversations are written in each format, so the
four files tokenise to the same samples. Deterministic: running it again rewrites the files byte for byte.
"""

from __future__ import annotations

import calendar
import datetime
import json
import os
import random
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "corpus", "shakespeare.jsonl")
SEED = 20240611
SYSTEM_PROMPTS = ("You are a concise assistant.", "Answer in one short sentence.")
ROMAN = {"I": 1, "II": 2, "III": 3, "IV": 4, "V": 5, "VI": 6, "VII": 7, "VIII": 8, "IX": 9, "X": 10}
ORDINAL = ["", "first", "second", "third", "fourth", "fifth"]


def _turns(*pairs: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(pairs)]


def arithmetic(rng: random.Random, n: int) -> list[list[dict]]:
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        kind = rng.choice(("plus", "minus", "times"))
        if kind == "plus":
            out.append(_turns(f"What is {a} + {b}?", f"{a} + {b} = {a + b}."))
        elif kind == "minus":
            a, b = max(a, b), min(a, b)
            out.append(_turns(f"What is {a} minus {b}?", f"{a} - {b} = {a - b}."))
        else:
            a, b = a % 13 + 2, b % 13 + 2
            out.append(_turns(f"Multiply {a} by {b}.", f"{a} x {b} = {a * b}."))
    return out


def follow_ups(rng: random.Random, n: int) -> list[list[dict]]:
    """Two-turn arithmetic: the second question refers to the first answer."""
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 12), rng.randint(2, 12) * 2
        product = a * b
        out.append(_turns(f"What is {a} times {b}?", f"{product}.", "And half of that?",
                          f"Half of {product} is {product // 2}."))
    return out


def calendar_facts(rng: random.Random, n: int) -> list[list[dict]]:
    out = []
    for _ in range(n):
        day = datetime.date(2000, 1, 1) + datetime.timedelta(days=rng.randint(0, 365 * 40))
        kind = rng.choice(("weekday", "month_days", "later"))
        name = f"{day.day} {calendar.month_name[day.month]} {day.year}"
        if kind == "weekday":
            out.append(_turns(f"What day of the week was {name}?", f"{name} was a {calendar.day_name[day.weekday()]}."))
        elif kind == "month_days":
            days = calendar.monthrange(day.year, day.month)[1]
            month = f"{calendar.month_name[day.month]} {day.year}"
            out.append(_turns(f"How many days are in {month}?", f"{month} has {days} days."))
        else:
            step = rng.randint(2, 60)
            later = day + datetime.timedelta(days=step)
            out.append(_turns(f"What date is {step} days after {name}?",
                              f"{step} days after {name} is {later.day} {calendar.month_name[later.month]} "
                              f"{later.year}."))
    return out


def _number(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def conversions(rng: random.Random, n: int) -> list[list[dict]]:
    units = (  # question unit, answer unit, factor (or None: temperature)
        ("kilometres", "miles", 0.621371), ("miles", "kilometres", 1.609344), ("kilograms", "pounds", 2.204623),
        ("pounds", "kilograms", 0.453592), ("hours", "minutes", 60.0), ("litres", "millilitres", 1000.0),
        ("metres", "feet", 3.280840), ("degrees Celsius", "degrees Fahrenheit", None),
    )
    out = []
    for _ in range(n):
        src, dst, factor = rng.choice(units)
        value = rng.randint(1, 120)
        result = value * 9 / 5 + 32 if factor is None else value * factor
        out.append(_turns(f"Convert {value} {src} to {dst}.", f"{value} {src} is about {_number(result)} {dst}."))
    return out


def shakespeare_facts(rng: random.Random, n_cast: int, n_settings: int) -> list[list[dict]]:
    with open(CORPUS, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    out, cast, settings = [], [], []
    for title in sorted({r["title"] for r in records}):
        scenes = [r for r in records if r["title"] == title and r["part"] > 0]
        out.append(_turns(f"How many scenes of {title} are in the shipped corpus?",
                          f"The corpus holds {len(scenes)} scenes of {title}."))
        (persons,) = [r["text"] for r in records if r["title"] == title and r["part"] == 0]
        for line in persons.splitlines():
            m = re.fullmatch(r"([A-Z][A-Za-z']+(?: [A-Z][A-Za-z']+)?), ([A-Z][^,]*?)\.", line.strip())
            if m:
                cast.append((title, m.group(1).title(), m.group(2)))
        act = 0
        for scene in scenes:
            lines = scene["text"].splitlines()
            for i, line in enumerate(lines):
                if m := re.fullmatch(r"(?:ACT|Act) ([IVX]+)\.", line.strip()):
                    act = ROMAN.get(m.group(1), 0)
                m = re.fullmatch(r"(?:SCENE|Scene) ([IVX]+)\.\s+(.+\.)", line.strip())
                ends = i + 1 == len(lines) or not lines[i + 1].strip()
                if m and ends and 0 < act < len(ORDINAL) and not m.group(2).startswith("The same"):
                    settings.append((title, act, ROMAN[m.group(1)], m.group(2)))
                    break
    for title, name, role in rng.sample(cast, min(n_cast, len(cast))):
        out.append(_turns(f"Who is {name} in {title}?", f"The persons of {title} list {name} as: {role}."))
    for title, act, scene, where in rng.sample(settings, min(n_settings, len(settings))):
        out.append(_turns(f"Where is scene {scene} of the {ORDINAL[act]} act of {title} set?",
                          f"Act {act}, scene {scene} of {title}: {where}"))
    return out


def conversations() -> list[list[dict]]:
    rng = random.Random(SEED)
    convs = (arithmetic(rng, 90) + follow_ups(rng, 30) + calendar_facts(rng, 60) + conversions(rng, 60)
             + shakespeare_facts(rng, 60, 60))
    rng.shuffle(convs)
    for conv in convs[::5]:  # every fifth conversation starts with a system prompt
        conv.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return convs


def as_messages(conv: list[dict]) -> dict:
    return {"messages": conv}


def as_sharegpt(conv: list[dict]) -> dict:
    system = [m["content"] for m in conv if m["role"] == "system"]
    turns = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
             for m in conv if m["role"] != "system"]
    return {"conversations": turns, **({"system": system[0]} if system else {})}


def _split(conv: list[dict]) -> tuple[str | None, list[dict]]:
    system = [m["content"] for m in conv if m["role"] == "system"]
    return (system[0] if system else None), [m for m in conv if m["role"] != "system"]


def as_alpaca(conv: list[dict]) -> dict:
    system, turns = _split(conv)
    history = [[turns[i]["content"], turns[i + 1]["content"]] for i in range(0, len(turns) - 2, 2)]
    record = {"instruction": turns[-2]["content"], "input": "", "output": turns[-1]["content"]}
    if history:
        record["history"] = history
    return {**record, **({"system": system} if system else {})}


def as_prompt_completion(conv: list[dict]) -> dict:
    system, turns = _split(conv)
    if len(turns) == 2:
        record = {"prompt": turns[0]["content"], "completion": turns[1]["content"]}
    else:  # TRL's conversational form: the last assistant turn is the completion
        record = {"prompt": turns[:-1], "completion": turns[-1:]}
    return {**record, **({"system": system} if system else {})}


WRITERS = {"messages": as_messages, "sharegpt": as_sharegpt, "alpaca": as_alpaca,
           "prompt_completion": as_prompt_completion}


def preference_pairs(convs: list[list[dict]]) -> list[dict]:
    """TRL's explicit-prompt preference pairs: every turn before the last answer is the prompt, the answer is
    chosen, and the answer of the conversation half the set away (to another question) is rejected."""
    pairs = []
    for i, conv in enumerate(convs):
        other = convs[(i + len(convs) // 2) % len(convs)][-1]
        pairs.append({"prompt": conv[:-1], "chosen": conv[-1:], "rejected": [other]})
    return pairs


def main(out_dir: str) -> None:
    convs = conversations()
    for name, writer in WRITERS.items():
        with open(os.path.join(out_dir, f"chat_{name}.jsonl"), "w", encoding="utf-8", newline="\n") as fh:
            for conv in convs:
                fh.write(json.dumps(writer(conv), ensure_ascii=False) + "\n")
    with open(os.path.join(out_dir, "chat_preference.jsonl"), "w", encoding="utf-8", newline="\n") as fh:
        for pair in preference_pairs(convs):
            fh.write(json.dumps(pair, ensure_ascii=False) + "\n")
    print(f"wrote {len(convs)} conversations in {len(WRITERS)} formats, and as preference pairs, to {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
